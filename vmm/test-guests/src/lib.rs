//! Paths of the test guests built from `guests/` by build.rs: tiny
//! freestanding x86_64 ELF images for exercising the vmm under KVM.
//!
//! * `hello`: prints one line and resets through the i8042.
//! * `counter`: counts in memory forever, printing `count=N` every
//!   `interval=N` increments (command line); with `halt_after=K` it prints
//!   `counter: idle` after its K-th count and stops in a HLT loop instead.
//! * `report`: prints the zero page, command line, e820 map, CPUID identity
//!   and MP table it was given, then resets.
//! * `triplefault`: loads an empty IDT and faults.
//! * `flood`: writes to the serial port as fast as it can, forever.
//! * `sequence`: writes lines of a..z to the serial port, one OUT per byte, forever.
//! * `virtio_blk`: reads, writes, flushes and gets the ID of the first virtio-blk disk;
//!   `bulk=N` then reads 1 KiB N more times, `hold=1` spins at the end instead of resetting.
//! * `virtio_rng`: reads 64 random bytes twice from virtio-rng.
//! * `virtio_net`: sends one frame through virtio-net, optionally waits for one;
//!   `tx_count=N` then sends it N more times, `hold=1` spins at the end instead of resetting.
//! * `net_hostile`: sends through virtio-net the raw frames a hostile guest kernel
//!   could use against its VM's host-side network rules (forged sources, denied
//!   destinations, ARP claims, an IPv6 router advertisement, DHCP, IP options,
//!   fragments), each UDP one tagged `hostile:<name>`, and last one legitimate
//!   datagram; addresses and the gateway's MAC come from the command line
//!   (see the source); `hold=1` spins at the end instead of resetting.
//! * `net_perf`: moves frames through virtio-net as fast as the rings allow, for
//!   perf's network scenarios (runs under the vmm and under Firecracker):
//!   `mode=tx` sends `count=N` frames of `size=S` bytes, `mode=rx` counts N
//!   received frames and acknowledges every 64, `mode=echo` sends every
//!   received frame back (see the source for the frame format).
//! * `virtio_vsock`: connects to a host port and accepts a host-initiated connection over virtio-vsock.
//! * `virtio_fs`: speaks FUSE to the first virtio-fs device: INIT, then LOOKUP,
//!   OPEN, READ and RELEASE of `file=NAME` (default `hello.txt`) and a CREATE
//!   of `new.txt`; `loop=1` then repeats the read rounds forever, printing
//!   `fs.round=N ...` each, and resets on the first error reply.
//! * `virtio_hostile`: a misbehaving virtio-blk driver (bad sizes, buffers, chains).
//! * `i8042_probe`: runs Linux's i8042 probe sequence by polling and reports what it read.
//! * `serial_fifo`: resets the UART's receive FIFO once input arrived, then echoes the next line.
//! * `serial_irq`: prints a line with the UART's interrupts off, then takes the
//!   THR-empty interrupt through the IOAPIC and reports whether a THR write
//!   raised it with no other exit after the write.
//! * `acpi`: walks the ACPI tables from the RSDP, checks their checksums and
//!   contents, and reports them; with `action=1` powers off through the FADT's
//!   sleep control register, `action=2` resets through its reset register,
//!   `action=3` prints the VM generation ID whenever it changes.
//! * `clone_rng`: seeds a generator at boot and keeps it only in memory; each
//!   time the VM generation ID changes (a restore) prints the generator's next
//!   outputs alone (the same in every restore of a snapshot) and with the new
//!   ID mixed in (different in each).

use std::path::PathBuf;

/// Names of all test guests.
pub const ALL: &[&str] = &[
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

/// Path of the ELF image of test guest `name`, or `None` for an unknown name.
pub fn path(name: &str) -> Option<PathBuf> {
    ALL.contains(&name)
        .then(|| PathBuf::from(env!("OUT_DIR")).join(format!("{name}.elf")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_guest_is_an_elf64_image() {
        for name in super::ALL {
            let bytes = std::fs::read(super::path(name).unwrap()).unwrap();
            assert_eq!(&bytes[..4], b"\x7fELF", "{name}");
            assert_eq!(bytes[4], 2, "{name} is 64-bit");
        }
        assert!(super::path("nope").is_none());
    }
}
