//! Builds each test guest into an ELF64 image in OUT_DIR with the C compiler
//! the `cc` crate finds: freestanding, general registers only, linked at 1 MiB.

use std::path::PathBuf;
use std::process::Command;

const GUESTS: &[&str] = &[
    "hello",
    "counter",
    "report",
    "triplefault",
    "flood",
    "sequence",
    "dirtier",
    "virtio_blk",
    "virtio_rng",
    "virtio_net",
    "net_hostile",
    "net_perf",
    "virtio_hostile",
    "virtio_vsock",
    "virtio_fs",
    "i8042_probe",
    "serial_fifo",
    "serial_irq",
    "acpi",
    "clone_rng",
];

const FLAGS: &[&str] = &[
    "-ffreestanding",
    "-nostdlib",
    "-static",
    "-no-pie",
    "-fno-pic",
    "-mgeneral-regs-only",
    "-mno-red-zone",
    "-fno-stack-protector",
    "-fcf-protection=none",
    "-fno-asynchronous-unwind-tables",
    "-fno-tree-loop-distribute-patterns",
    "-fno-builtin",
    "-O2",
    "-Wall",
    "-Werror",
    "-Wl,--build-id=none",
    "-Wl,-z,noexecstack",
    "-Wl,--no-warn-rwx-segments",
];

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let src = PathBuf::from("guests");
    println!("cargo:rerun-if-changed=guests");
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .opt_level(2)
        .get_compiler();
    for guest in GUESTS {
        let elf = out.join(format!("{guest}.elf"));
        let status = Command::new(compiler.path())
            .args(FLAGS)
            .arg("-T")
            .arg(src.join("link.ld"))
            .arg("-I")
            .arg(&src)
            .arg(src.join("start.S"))
            .arg(src.join(format!("{guest}.c")))
            .arg("-o")
            .arg(&elf)
            .status()
            .unwrap_or_else(|e| panic!("cannot run the C compiler {:?}: {e}", compiler.path()));
        assert!(status.success(), "building test guest {guest} failed");
    }
}
