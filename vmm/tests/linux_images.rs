//! Loads (does not run) Debian's real linux-image-cloud-amd64 kernel, as a
//! bzImage and as the ELF vmlinux inside it, and checks the entry point, the
//! zero page / PVH start info, the command line and the e820 placement.
//!
//! The images come from `scripts/fetch-debian-kernel.sh` (run by .ci/run);
//! set VMM_DEBIAN_KERNEL_DIR to use another directory. Without them each test
//! prints that it was skipped and why.

use std::path::PathBuf;

use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use vm_memory::{Bytes, GuestAddress};
use vmm::arch::x86_64::layout::{CMDLINE_START, PVH_INFO_START, ZERO_PAGE_START};
use vmm::arch::x86_64::loader::{self, BootEntry, KernelFormat, LoaderError};
use vmm::memory::{ram_ranges, GuestMemoryMmap};

fn image(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("VMM_DEBIAN_KERNEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debian-kernel")
        });
    let path = dir.join(name);
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "skipped: {} is missing; run scripts/fetch-debian-kernel.sh (CI does) to test real Linux images",
            path.display()
        );
        None
    }
}

fn memory(mib: u64) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&ram_ranges(mib << 20)).unwrap()
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

#[test]
fn bzimage_loads_with_64bit_entry_and_a_complete_zero_page() {
    let Some(path) = image("bzImage") else { return };
    let file = std::fs::read(&path).unwrap();
    let mem = memory(256);
    let kernel = loader::load_kernel(&mem, &path).unwrap();
    assert_eq!(kernel.format, KernelFormat::BzImage);
    let hdr = kernel.setup_header.expect("setup header");
    assert!(hdr.version >= 0x020c, "boot protocol {:#x}", {
        hdr.version
    });
    // Protected-mode kernel at code32_start (1 MiB); 64-bit entry 0x200 past it.
    assert_eq!({ hdr.code32_start }, 0x10_0000);
    assert_eq!(kernel.entry, BootEntry::Linux64(GuestAddress(0x10_0200)));
    let setup_size = (usize::from(file[0x1f1]) + 1) * 512;
    let mut loaded = vec![0u8; 4096];
    mem.read_slice(&mut loaded, GuestAddress(0x10_0000))
        .unwrap();
    assert_eq!(loaded, file[setup_size..setup_size + 4096]);
    assert_eq!(
        kernel.kernel_end,
        0x10_0000 + (file.len() - setup_size) as u64
    );

    let limit = loader::cmdline_limit(&kernel);
    assert_eq!(limit, hdr.cmdline_size as usize);
    let text = "console=ttyS0 reboot=k panic=1";
    let cmdline = loader::build_cmdline(text, limit).unwrap();
    let initrd_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(initrd_file.path(), vec![0xa5u8; 3 * 4096 + 10]).unwrap();
    let initrd = loader::load_initrd(&mem, initrd_file.path(), &kernel).unwrap();
    assert_eq!(initrd.addr % 4096, 0);
    assert!(initrd.addr >= kernel.kernel_end);
    assert!(initrd.addr + initrd.size <= 256 << 20);
    loader::write_boot_params(&mem, &kernel, &cmdline, Some(initrd), Some(0xe_0000)).unwrap();

    let mut zp = vec![0u8; 4096];
    mem.read_slice(&mut zp, GuestAddress(ZERO_PAGE_START))
        .unwrap();
    // The setup header is the image's own (from offset 0x1f1), with the loader fields set.
    assert_eq!(u16_at(&zp, 0x1fe), 0xaa55);
    assert_eq!(u32_at(&zp, 0x202), 0x5372_6448);
    assert_eq!(u16_at(&zp, 0x206), u16_at(&file, 0x206));
    assert_eq!(zp[0x210], 0xff, "type_of_loader");
    assert_eq!(u32_at(&zp, 0x228), CMDLINE_START as u32);
    assert_eq!(u32_at(&zp, 0x238), text.len() as u32);
    assert_eq!(u32_at(&zp, 0x218), initrd.addr as u32, "ramdisk_image");
    assert_eq!(u32_at(&zp, 0x21c), initrd.size as u32, "ramdisk_size");
    assert_eq!(u64_at(&zp, 0x70), 0xe_0000, "acpi_rsdp_addr");
    let mut cl = vec![0u8; text.len() + 1];
    mem.read_slice(&mut cl, GuestAddress(CMDLINE_START))
        .unwrap();
    assert_eq!(&cl[..text.len()], text.as_bytes());
    assert_eq!(cl[text.len()], 0);
    // e820: base memory, the reserved legacy hole, then RAM from 1 MiB to the end.
    assert_eq!(zp[0x1e8], 3);
    let e820: Vec<(u64, u64, u32)> = (0..3)
        .map(|i| {
            let o = 0x2d0 + 20 * i;
            (u64_at(&zp, o), u64_at(&zp, o + 8), u32_at(&zp, o + 16))
        })
        .collect();
    assert_eq!(
        e820,
        vec![
            (0, 0x9fc00, 1),
            (0x9fc00, 0x60400, 2),
            (0x10_0000, (256 << 20) - 0x10_0000, 1)
        ]
    );
    // The kernel image lies inside the RAM entry.
    assert!(kernel.kernel_end <= e820[2].0 + e820[2].1);
}

#[test]
fn vmlinux_loads_with_its_pvh_entry_and_start_info() {
    let Some(path) = image("vmlinux") else { return };
    let file = std::fs::read(&path).unwrap();
    let mem = memory(512);
    let kernel = loader::load_kernel(&mem, &path).unwrap();
    assert_eq!(kernel.format, KernelFormat::Elf);
    let BootEntry::Pvh(entry) = kernel.entry else {
        panic!(
            "Debian's kernel has CONFIG_PVH=y, so its PVH note must be used: {:?}",
            kernel.entry
        )
    };
    // First PT_LOAD segment: its bytes are at its physical address.
    let phoff = u64_at(&file, 0x20) as usize;
    let phnum = u16_at(&file, 0x38) as usize;
    let load = (0..phnum)
        .map(|i| phoff + i * 56)
        .find(|&o| u32_at(&file, o) == 1)
        .unwrap();
    let (offset, paddr) = (u64_at(&file, load + 8), u64_at(&file, load + 24));
    assert_eq!(paddr, 0x100_0000, "CONFIG_PHYSICAL_START");
    let mut loaded = vec![0u8; 4096];
    mem.read_slice(&mut loaded, GuestAddress(paddr)).unwrap();
    assert_eq!(loaded, file[offset as usize..offset as usize + 4096]);
    assert!(
        entry.0 >= paddr && entry.0 < kernel.kernel_end,
        "entry {entry:?}"
    );
    assert!(entry.0 < 1 << 32, "PVH entry is 32-bit");

    let cmdline = loader::build_cmdline("console=ttyS0", loader::cmdline_limit(&kernel)).unwrap();
    loader::write_boot_params(&mem, &kernel, &cmdline, None, Some(0xe_0000)).unwrap();
    let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
    assert_eq!({ info.magic }, 0x336e_c578);
    assert_eq!({ info.version }, 1);
    assert_eq!({ info.cmdline_paddr }, CMDLINE_START);
    assert_eq!({ info.nr_modules }, 0);
    assert_eq!({ info.rsdp_paddr }, 0xe_0000);
    assert_eq!({ info.memmap_entries }, 3);
    let last: hvm_memmap_table_entry = mem
        .read_obj(GuestAddress(info.memmap_paddr + 2 * 24))
        .unwrap();
    assert_eq!(
        ({ last.addr }, { last.size }, { last.type_ }),
        (0x10_0000, (512 << 20) - 0x10_0000, 1)
    );
    assert!(kernel.kernel_end <= 512 << 20);
}

#[test]
fn real_kernels_that_do_not_fit_are_refused() {
    let Some(bz) = image("bzImage") else { return };
    let err = loader::load_kernel(&memory(8), &bz).unwrap_err();
    assert!(matches!(err, LoaderError::DoesNotFit { .. }), "{err}");
    let Some(elf) = image("vmlinux") else { return };
    let err = loader::load_kernel(&memory(32), &elf).unwrap_err();
    assert!(
        err.to_string()
            .contains("does not fit in guest memory of 32 MiB"),
        "{err}"
    );
}
