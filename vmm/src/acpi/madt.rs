//! The MADT (ACPI 6.5, section 5.2.12): one Processor Local APIC per vCPU,
//! the IOAPIC, and the local APICs' NMI line.
//!
//! No Interrupt Source Override is needed: KVM's default GSI routing (which
//! the VMM keeps) wires ISA IRQ n to IOAPIC pin n, the in-kernel PIT raises
//! GSI 0, and a hardware-reduced platform has no SCI, so the identity mapping
//! Linux assumes without overrides is the real one. The MP table in the EBDA
//! says the same (IRQ n -> pin n).
//!
//! The header is written through `acpi_tables::sdt::Sdt` rather than the
//! crate's `MADT` type, which has no way to set the PCAT_COMPAT flag (the
//! in-kernel irqchip does have the two 8259 PICs).

use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
use acpi_tables::sdt::Sdt;
use acpi_tables::Aml;

use super::{OEM_ID, OEM_REVISION};
use crate::arch::x86_64::layout::{APIC_START, IOAPIC_START};

/// MADT revision for ACPI 6.x.
const MADT_REVISION: u8 = 5;
/// Header length: the common 36 bytes, the local APIC address and the flags.
const MADT_HEADER_LEN: u32 = 44;
/// Offset of the local interrupt controller address.
const LOCAL_APIC_ADDRESS_OFFSET: usize = 36;
/// Offset of the flags.
const FLAGS_OFFSET: usize = 40;
/// Flags: PCAT_COMPAT, the machine also has dual 8259 PICs.
const PCAT_COMPAT: u32 = 1;
/// Local APIC NMI structure (type 4, 6 bytes): every processor (UID 0xff),
/// flags 0 (bus-conforming polarity and trigger), LINT1.
const LOCAL_APIC_NMI_ALL_LINT1: [u8; 6] = [4, 6, 0xff, 0, 0, 1];

/// The IOAPIC's ID: the one after the last vCPU's APIC ID, as in the MP table.
pub(super) fn ioapic_id(vcpus: u8) -> u8 {
    vcpus
}

/// The MADT bytes for `vcpus` vCPUs (APIC ID = vCPU index = processor UID).
pub(super) fn build(vcpus: u8) -> Vec<u8> {
    let mut body = Vec::with_capacity(usize::from(vcpus) * 8 + 12 + 6);
    for cpu in 0..vcpus {
        ProcessorLocalApic::new(cpu, cpu, EnabledStatus::Enabled).to_aml_bytes(&mut body);
    }
    // The IOAPIC sits below 4 GiB (a layout constant), so the cast is exact.
    IoApic::new(ioapic_id(vcpus), IOAPIC_START as u32, 0).to_aml_bytes(&mut body);
    body.extend_from_slice(&LOCAL_APIC_NMI_ALL_LINT1);

    let mut madt = Sdt::new(
        *b"APIC",
        MADT_HEADER_LEN,
        MADT_REVISION,
        OEM_ID,
        *b"AGVMAPIC",
        OEM_REVISION,
    );
    // The local APIC sits below 4 GiB (a layout constant), so the cast is exact.
    madt.write_u32(LOCAL_APIC_ADDRESS_OFFSET, APIC_START as u32);
    madt.write_u32(FLAGS_OFFSET, PCAT_COMPAT);
    madt.append_slice(&body);
    madt.as_slice().to_vec()
}
