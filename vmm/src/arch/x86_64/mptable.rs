//! The Intel MultiProcessor Specification 1.4 table, which tells a guest
//! without ACPI how many CPUs it has and how ISA interrupts reach the IOAPIC.
//!
//! Written here rather than taken from a crate: no maintained rust-vmm crate
//! provides it, and it is a few fixed-size records. The table is built as a
//! byte buffer with explicit little-endian fields, so no struct layout or
//! `unsafe` is involved.

use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_START, EBDA_START, IOAPIC_START};
use crate::memory::GuestMemoryMmap;

const MPF_SIGNATURE: &[u8; 4] = b"_MP_";
const MPC_SIGNATURE: &[u8; 4] = b"PCMP";
const MPC_SPEC_REV: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const ISA_IRQS: u8 = 24;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IOINTSRC: u8 = 3;
const ENTRY_LINTSRC: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// Family 6 signature with the FPU and APIC feature flags.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;
/// Largest vCPU count the VMM supports: the MP table must fit in the 1 KiB EBDA.
pub const MAX_CPUS: u8 = 32;

/// Errors writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    /// More vCPUs than an MP table can name.
    #[error("the MP table can describe at most {MAX_CPUS} vCPUs (it must fit in the 1 KiB EBDA), {0} were asked for")]
    TooManyCpus(u8),
    /// The table did not fit in guest memory.
    #[error("cannot write the MP table into guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b)))
}

/// Builds the MP floating pointer and configuration table for `cpus` vCPUs,
/// to be placed at `base`. Returns the bytes to write there.
pub fn build(cpus: u8, base: u64) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus;
    let config_addr = base + 16;

    let mut entries = Vec::new();
    for cpu in 0..cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0u8; 8]);
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    for irq in 0..ISA_IRQS {
        entries.extend_from_slice(&[ENTRY_IOINTSRC, INT_TYPE_INT, 0, 0, 0, irq, ioapic_id, irq]);
    }
    // LINT0 receives ExtINT from the PIC, LINT1 NMI, on every local APIC.
    entries.extend_from_slice(&[ENTRY_LINTSRC, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[ENTRY_LINTSRC, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    let entry_count = u16::from(cpus) + 2 + 1 + u16::from(ISA_IRQS) + 1;

    let mut header = Vec::with_capacity(44);
    header.extend_from_slice(MPC_SIGNATURE);
    let table_len = (44 + entries.len()) as u16;
    header.extend_from_slice(&table_len.to_le_bytes());
    header.push(MPC_SPEC_REV);
    header.push(0); // checksum, filled below
    header.extend_from_slice(b"AGENTVM ");
    header.extend_from_slice(b"MICROVM     ");
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    header.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    header.extend_from_slice(&entry_count.to_le_bytes());
    header.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    header.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    let mut config = header;
    config.extend_from_slice(&entries);
    config[7] = checksum(&config);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(MPF_SIGNATURE);
    floating.extend_from_slice(&(config_addr as u32).to_le_bytes());
    floating.extend_from_slice(&[1, MPC_SPEC_REV, 0, 0, 0, 0, 0, 0]);
    floating[10] = checksum(&floating);

    floating.extend_from_slice(&config);
    Ok(floating)
}

/// Writes the MP table for `cpus` vCPUs at the start of the EBDA.
pub fn write(mem: &GuestMemoryMmap, cpus: u8) -> Result<(), MpTableError> {
    let table = build(cpus, EBDA_START)?;
    mem.write_slice(&table, GuestAddress(EBDA_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_counts_hold() {
        let t = build(4, EBDA_START).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let config = &t[16..];
        assert_eq!(&config[0..4], b"PCMP");
        let len = u16::from_le_bytes([config[4], config[5]]) as usize;
        assert_eq!(len, config.len());
        assert_eq!(config.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let count = u16::from_le_bytes([config[34], config[35]]);
        assert_eq!(count, 4 + 1 + 1 + 24 + 2);
        let physptr = u32::from_le_bytes([t[4], t[5], t[6], t[7]]);
        assert_eq!(u64::from(physptr), EBDA_START + 16);
    }

    #[test]
    fn zero_or_too_many_cpus_are_refused() {
        assert!(build(0, EBDA_START).is_err());
        assert!(build(MAX_CPUS + 1, EBDA_START).is_err());
    }

    #[test]
    fn fits_in_the_ebda() {
        let t = build(MAX_CPUS, EBDA_START).unwrap();
        assert!(EBDA_START + t.len() as u64 <= 0xa0000);
    }
}
