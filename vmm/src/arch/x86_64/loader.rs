//! Kernel loading with linux-loader (ELF vmlinux, with or without a PVH note,
//! and bzImage), the initrd, the command line, and the boot parameters
//! (Linux zero page or PVH start info) the chosen entry expects.

use std::fs::File;
use std::path::{Path, PathBuf};

use linux_loader::cmdline::{Cmdline, Error as CmdlineError};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::{
    self, load_cmdline, BzImage, Elf, KernelLoader, KernelLoaderResult, PvhBootCapability,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::e820;
use super::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, INITRD_ALIGN, PVH_INFO_START, PVH_MEMMAP_START,
    ZERO_PAGE_START,
};
use crate::memory::{low_ram_end, GuestMemoryMmap};

const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
const BZIMAGE_HEADER_MAGIC: u32 = 0x5372_6448; // "HdrS"
const BZIMAGE_HEADER_OFFSET: u64 = 0x202;
/// Boot protocol 2.12 added `xloadflags` and so the 64-bit entry we use.
const MIN_BOOT_PROTOCOL: u16 = 0x020c;
const XLF_KERNEL_64: u16 = 1;
/// The 64-bit entry of a bzImage is 0x200 past the protected-mode kernel's start.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
const PVH_START_MAGIC: u32 = 0x336e_c578;

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootEntry {
    /// Linux 64-bit boot protocol: long mode, identity paging, RSI = zero page.
    Linux64(GuestAddress),
    /// PVH: 32-bit protected mode without paging, EBX = `hvm_start_info`.
    Pvh(GuestAddress),
}

impl BootEntry {
    /// The guest-physical entry address.
    pub fn addr(&self) -> GuestAddress {
        match self {
            BootEntry::Linux64(a) | BootEntry::Pvh(a) => *a,
        }
    }
}

/// The kind of image that was loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFormat {
    /// An ELF vmlinux.
    Elf,
    /// A bzImage.
    BzImage,
}

/// A kernel placed in guest memory.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// Image kind.
    pub format: KernelFormat,
    /// Where the vCPU starts.
    pub entry: BootEntry,
    /// First guest address past the kernel image.
    pub kernel_end: u64,
    /// The bzImage setup header, to become the zero page's `hdr`.
    pub setup_header: Option<setup_header>,
}

/// An initrd placed in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadedInitrd {
    /// Guest-physical start.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
}

/// Errors loading a kernel, an initrd or the boot parameters.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    /// The kernel file cannot be opened or read.
    #[error("cannot read kernel {path}: {source}")]
    KernelUnreadable {
        /// The kernel path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is neither an ELF nor a bzImage.
    #[error("{0} is not a kernel: it is neither an ELF vmlinux nor a bzImage")]
    NotAKernel(PathBuf),
    /// The bzImage is too old for the 64-bit entry.
    #[error("bzImage {path} uses boot protocol {major}.{minor:02}; 2.12 or newer with a 64-bit entry is required")]
    OldBootProtocol {
        /// The kernel path.
        path: PathBuf,
        /// Boot protocol major version.
        major: u16,
        /// Boot protocol minor version.
        minor: u16,
    },
    /// The bzImage has no 64-bit entry point.
    #[error("bzImage {0} has no 64-bit entry point (XLF_KERNEL_64 is not set)")]
    No64BitEntry(PathBuf),
    /// The kernel does not fit in guest memory.
    #[error("kernel {path} does not fit in guest memory of {mem_mib} MiB (or the image is truncated): {detail}")]
    DoesNotFit {
        /// The kernel path.
        path: PathBuf,
        /// Guest memory size.
        mem_mib: u64,
        /// What linux-loader reported.
        detail: String,
    },
    /// linux-loader refused the image.
    #[error("cannot load kernel {path}: {source}")]
    Invalid {
        /// The kernel path.
        path: PathBuf,
        /// linux-loader's error.
        #[source]
        source: loader::Error,
    },
    /// The initrd file cannot be read.
    #[error("cannot read initrd {path}: {source}")]
    InitrdUnreadable {
        /// The initrd path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The initrd does not fit between the kernel and the end of low RAM.
    #[error("initrd {path} ({size} bytes) does not fit in guest memory above the kernel")]
    InitrdDoesNotFit {
        /// The initrd path.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// The command line is longer than the boot protocol allows.
    #[error("kernel command line is {len} bytes; the boot protocol allows at most {max}")]
    CmdlineTooLong {
        /// Its length without the NUL.
        len: usize,
        /// The longest allowed, without the NUL.
        max: usize,
    },
    /// The command line contains characters the kernel cannot take.
    #[error("invalid kernel command line: {0}")]
    CmdlineInvalid(CmdlineError),
    /// Writing boot structures into guest memory failed.
    #[error("cannot write boot parameters into guest memory: {0}")]
    BootParams(String),
}

fn read_magic(file: &mut File) -> std::io::Result<([u8; 4], Option<u32>)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut magic = [0u8; 4];
    let n = file.read(&mut magic)?;
    if n < 4 {
        return Ok(([0; 4], None));
    }
    let mut hdrs = [0u8; 4];
    file.seek(SeekFrom::Start(BZIMAGE_HEADER_OFFSET))?;
    let hdr_magic = match file.read_exact(&mut hdrs) {
        Ok(()) => Some(u32::from_le_bytes(hdrs)),
        Err(_) => None,
    };
    file.seek(SeekFrom::Start(0))?;
    Ok((magic, hdr_magic))
}

/// Loads the kernel at `path` into `mem`, choosing the loader by the file's magic.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, LoaderError> {
    let unreadable = |source| LoaderError::KernelUnreadable {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(unreadable)?;
    let (magic, hdr_magic) = read_magic(&mut file).map_err(unreadable)?;
    let mem_mib = mem
        .iter()
        .map(vm_memory::GuestMemoryRegion::len)
        .sum::<u64>()
        >> 20;
    let map_err = |e: loader::Error| classify_load_error(path, mem_mib, e);

    if &magic == ELF_MAGIC {
        let result: KernelLoaderResult =
            Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))).map_err(map_err)?;
        let entry = match result.pvh_boot_cap {
            PvhBootCapability::PvhEntryPresent(addr) => BootEntry::Pvh(addr),
            _ => BootEntry::Linux64(result.kernel_load),
        };
        return Ok(LoadedKernel {
            format: KernelFormat::Elf,
            entry,
            kernel_end: result.kernel_end,
            setup_header: None,
        });
    }
    if hdr_magic == Some(BZIMAGE_HEADER_MAGIC) {
        let result = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
            .map_err(map_err)?;
        let hdr = result
            .setup_header
            .ok_or_else(|| LoaderError::NotAKernel(path.into()))?;
        let version = hdr.version;
        if version < MIN_BOOT_PROTOCOL {
            return Err(LoaderError::OldBootProtocol {
                path: path.into(),
                major: version >> 8,
                minor: version & 0xff,
            });
        }
        if hdr.xloadflags & XLF_KERNEL_64 == 0 {
            return Err(LoaderError::No64BitEntry(path.into()));
        }
        return Ok(LoadedKernel {
            format: KernelFormat::BzImage,
            entry: BootEntry::Linux64(GuestAddress(
                result.kernel_load.0 + BZIMAGE_64BIT_ENTRY_OFFSET,
            )),
            kernel_end: result.kernel_end,
            setup_header: Some(hdr),
        });
    }
    Err(LoaderError::NotAKernel(path.into()))
}

fn classify_load_error(path: &Path, mem_mib: u64, e: loader::Error) -> LoaderError {
    use linux_loader::loader::bzimage::Error as BzError;
    use linux_loader::loader::elf::Error as ElfError;
    match e {
        loader::Error::Elf(ElfError::ReadKernelImage)
        | loader::Error::Bzimage(BzError::ReadBzImageCompressedKernel)
        | loader::Error::MemoryOverflow => LoaderError::DoesNotFit {
            path: path.into(),
            mem_mib,
            detail: e.to_string(),
        },
        loader::Error::Bzimage(BzError::InvalidBzImage) => LoaderError::NotAKernel(path.into()),
        source => LoaderError::Invalid {
            path: path.into(),
            source,
        },
    }
}

/// The longest command line (without NUL) the kernel accepts.
pub fn cmdline_limit(kernel: &LoadedKernel) -> usize {
    match kernel.setup_header {
        // cmdline_size exists from boot protocol 2.06; 2.12 is required above.
        Some(hdr) if hdr.cmdline_size > 0 => hdr.cmdline_size as usize,
        _ => CMDLINE_MAX_SIZE - 1,
    }
}

/// Builds the command line, refusing one longer than `max` bytes.
pub fn build_cmdline(text: &str, max: usize) -> Result<Cmdline, LoaderError> {
    if text.len() > max {
        return Err(LoaderError::CmdlineTooLong {
            len: text.len(),
            max,
        });
    }
    let mut cmdline = Cmdline::new(max + 1).map_err(LoaderError::CmdlineInvalid)?;
    if !text.trim().is_empty() {
        cmdline.insert_str(text).map_err(|e| match e {
            CmdlineError::TooLarge => LoaderError::CmdlineTooLong {
                len: text.len(),
                max,
            },
            other => LoaderError::CmdlineInvalid(other),
        })?;
    }
    Ok(cmdline)
}

/// Loads the initrd at the top of low RAM, page-aligned and above the kernel.
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel: &LoadedKernel,
) -> Result<LoadedInitrd, LoaderError> {
    let data = std::fs::read(path).map_err(|source| LoaderError::InitrdUnreadable {
        path: path.into(),
        source,
    })?;
    let size = data.len() as u64;
    let does_not_fit = || LoaderError::InitrdDoesNotFit {
        path: path.into(),
        size,
    };
    let mut top = low_ram_end(mem);
    if let Some(hdr) = kernel.setup_header {
        top = top.min(u64::from(hdr.initrd_addr_max) + 1);
    }
    let addr = top.checked_sub(size).ok_or_else(does_not_fit)? & !(INITRD_ALIGN - 1);
    if addr < kernel.kernel_end {
        return Err(does_not_fit());
    }
    mem.write_slice(&data, GuestAddress(addr))
        .map_err(|_| does_not_fit())?;
    Ok(LoadedInitrd { addr, size })
}

/// Writes the command line and the boot parameters the kernel's entry
/// expects. `rsdp` is the ACPI RSDP's address, when the VM has ACPI tables:
/// it goes into the zero page's `acpi_rsdp_addr` or the PVH start info's
/// `rsdp_paddr`.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    kernel: &LoadedKernel,
    cmdline: &Cmdline,
    initrd: Option<LoadedInitrd>,
    rsdp: Option<u64>,
) -> Result<(), LoaderError> {
    let err = |e: &dyn std::fmt::Display| LoaderError::BootParams(e.to_string());
    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline).map_err(|e| err(&e))?;
    let cmdline_len = cmdline.as_cstring().map_err(|e| err(&e))?.as_bytes().len() as u32;
    let map = e820::entries(mem);
    match kernel.entry {
        BootEntry::Linux64(_) => {
            let mut params = zero_page(kernel, cmdline_len, initrd, &map).map_err(|e| err(&e))?;
            params.acpi_rsdp_addr = rsdp.unwrap_or(0);
            LinuxBootConfigurator::write_bootparams(
                &BootParams::new(&params, GuestAddress(ZERO_PAGE_START)),
                mem,
            )
            .map_err(|e| err(&e))
        }
        BootEntry::Pvh(_) => {
            let memmap: Vec<hvm_memmap_table_entry> = map
                .iter()
                .map(|e| hvm_memmap_table_entry {
                    addr: e.addr,
                    size: e.size,
                    type_: e.kind,
                    reserved: 0,
                })
                .collect();
            let modlist_addr = PVH_MEMMAP_START
                + (memmap.len() * std::mem::size_of::<hvm_memmap_table_entry>()) as u64;
            let mut start_info = hvm_start_info {
                magic: PVH_START_MAGIC,
                version: 1,
                cmdline_paddr: CMDLINE_START,
                memmap_paddr: PVH_MEMMAP_START,
                memmap_entries: memmap.len() as u32,
                rsdp_paddr: rsdp.unwrap_or(0),
                ..Default::default()
            };
            if initrd.is_some() {
                start_info.nr_modules = 1;
                start_info.modlist_paddr = modlist_addr;
            }
            let mut params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
            params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
            if let Some(initrd) = initrd {
                let module = hvm_modlist_entry {
                    paddr: initrd.addr,
                    size: initrd.size,
                    ..Default::default()
                };
                params.set_modules(&[module], GuestAddress(modlist_addr));
            }
            PvhBootConfigurator::write_bootparams(&params, mem).map_err(|e| err(&e))
        }
    }
}

/// Builds the Linux zero page: the bzImage's own setup header (or a minimal one
/// for an ELF), the command line, the initrd and the e820 map.
fn zero_page(
    kernel: &LoadedKernel,
    cmdline_len: u32,
    initrd: Option<LoadedInitrd>,
    map: &[e820::E820Entry],
) -> Result<boot_params, String> {
    let mut params = boot_params::default();
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    } else {
        params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
        params.hdr.header = BZIMAGE_HEADER_MAGIC;
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len;
    if let Some(initrd) = initrd {
        params.hdr.ramdisk_image = initrd.addr as u32;
        params.hdr.ramdisk_size = initrd.size as u32;
    }
    if map.len() > params.e820_table.len() {
        return Err(format!(
            "{} e820 entries do not fit in the zero page",
            map.len()
        ));
    }
    for (slot, e) in params.e820_table.iter_mut().zip(map) {
        slot.addr = e.addr;
        slot.size = e.size;
        slot.r#type = e.kind;
    }
    params.e820_entries = map.len() as u8;
    Ok(params)
}

/// Reads back the zero page (used by tests and diagnostics).
pub fn read_zero_page(mem: &GuestMemoryMmap) -> Result<boot_params, vm_memory::GuestMemoryError> {
    mem.read_obj(GuestAddress(ZERO_PAGE_START))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_command_lines_are_refused_with_both_lengths() {
        let long = "a".repeat(3000);
        let err = build_cmdline(&long, 2047).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kernel command line is 3000 bytes; the boot protocol allows at most 2047"
        );
        assert!(build_cmdline("console=ttyS0 reboot=k", 2047).is_ok());
        assert!(build_cmdline("", 2047).is_ok());
    }

    #[test]
    fn non_printable_command_lines_are_refused() {
        assert!(matches!(
            build_cmdline("a\u{1}b", 100),
            Err(LoaderError::CmdlineInvalid(_))
        ));
    }
}
