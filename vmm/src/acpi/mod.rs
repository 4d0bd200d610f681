//! ACPI tables that describe the machine to the guest kernel: RSDP, XSDT,
//! a hardware-reduced FADT, the MADT and a DSDT, built with rust-vmm's
//! `acpi_tables` crate and written into the legacy BIOS area, which the e820
//! map reports reserved (see `arch::x86_64::layout`):
//!
//! | address | content |
//! | --- | --- |
//! | `0xe0000` | RSDP (36 bytes, 16-byte aligned so a scan of 0xe0000..0xfffff finds it) |
//! | `0xe0040` | VM generation ID (16 bytes, written by `devices::acpi`) |
//! | `0xe0080` | DSDT, FADT, MADT, XSDT, each 8-byte aligned |
//!
//! The kernel is also told the RSDP's address: `acpi_rsdp_addr` in the zero
//! page and `rsdp_paddr` in the PVH start info. No PCI is described (no MCFG).

mod dsdt;
mod fadt;
mod madt;
#[cfg(test)]
mod tests;

use acpi_tables::rsdp::Rsdp;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress};

use crate::arch::x86_64::layout::{
    ACPI_AREA_END, ACPI_AREA_START, ACPI_RSDP_START, ACPI_TABLES_START, ACPI_VMGENID_START,
    HIMEM_START,
};
use crate::memory::GuestMemoryMmap;

/// OEM ID in every table header.
const OEM_ID: [u8; 6] = *b"AGNTVM";
/// OEM revision in every table header.
const OEM_REVISION: u32 = 1;
/// Bytes of an ACPI 2.0+ RSDP.
const RSDP_LEN: u64 = 36;
/// Bytes of the VM generation ID.
const VMGENID_LEN: u64 = 16;

// The area lies above the EBDA and its MP table (which end at 0xa0000) and
// below 1 MiB, and its parts do not overlap.
const _: () = {
    assert!(ACPI_AREA_START >= 0xa_0000 && ACPI_AREA_END <= HIMEM_START);
    assert!(ACPI_RSDP_START % 16 == 0 && ACPI_RSDP_START + RSDP_LEN <= ACPI_VMGENID_START);
    assert!(ACPI_VMGENID_START % 8 == 0);
    assert!(ACPI_VMGENID_START + VMGENID_LEN <= ACPI_TABLES_START);
};

/// Tables after the first start on this alignment.
const TABLE_ALIGN: u64 = 8;
/// Most vCPUs the MADT can describe: processor and APIC IDs are one byte,
/// and the IOAPIC takes the ID after the last vCPU's.
pub const MAX_VCPUS: u8 = 254;
/// Highest GSI the IOAPIC has (24 pins).
pub const LAST_GSI: u32 = 23;
/// Most virtio devices the DSDT describes: each needs its own IOAPIC pin
/// (and its `Vnnn` name stays four characters).
pub const MAX_VIRTIO_DEVICES: usize = LAST_GSI as usize + 1;
/// COM1's interrupt (ISA IRQ 4).
const COM1_GSI: u32 = 4;

/// One virtio-mmio device as the DSDT describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioDescription {
    /// Base of its 4 KiB MMIO window.
    pub addr: u64,
    /// Its interrupt.
    pub gsi: u32,
}

/// What the tables describe.
#[derive(Debug, Clone)]
pub struct MachineDescription<'a> {
    /// vCPUs, one local APIC each (APIC ID = vCPU index).
    pub vcpus: u8,
    /// The virtio-mmio devices, in slot order.
    pub virtio: &'a [VirtioDescription],
    /// Guest-physical address of the VM generation ID.
    pub vmgenid_addr: u64,
    /// The Generic Event Device's interrupt.
    pub ged_gsi: u32,
}

/// Why the tables cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// More vCPUs than the MADT can name.
    #[error("{requested} vCPUs cannot be described in the ACPI MADT: at most {MAX_VCPUS} (one-byte APIC IDs)")]
    TooManyVcpus {
        /// Requested.
        requested: u8,
    },
    /// More virtio devices than the DSDT names (one GSI each).
    #[error("{count} virtio devices cannot be described in the ACPI DSDT: at most {MAX_VIRTIO_DEVICES}, one IOAPIC pin each")]
    TooManyDevices {
        /// Devices asked for.
        count: usize,
    },
    /// A device the DSDT cannot describe.
    #[error("virtio device at {addr:#x} with GSI {gsi} cannot be described in the ACPI DSDT: its 4 KiB window must lie below 4 GiB and its GSI be one of the IOAPIC's pins 0..={LAST_GSI} that COM1 ({COM1_GSI}) and the event device do not use")]
    Device {
        /// MMIO base.
        addr: u64,
        /// GSI.
        gsi: u32,
    },
    /// The tables outgrew the ACPI area.
    #[error("the ACPI tables need {needed} bytes from {start:#x}, past the end of the ACPI area at {ACPI_AREA_END:#x}")]
    TooLarge {
        /// Bytes needed from `start`.
        needed: u64,
        /// Where the tables start.
        start: u64,
    },
    /// Guest memory could not be written.
    #[error("cannot write the ACPI tables into guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

/// Built tables, ready to be written into guest memory.
#[derive(Debug, Clone)]
pub struct AcpiTables {
    rsdp: Vec<u8>,
    /// `(guest address, signature, bytes)` in address order.
    tables: Vec<(u64, [u8; 4], Vec<u8>)>,
}

impl AcpiTables {
    /// Where the RSDP goes; the zero page and PVH start info point here.
    pub fn rsdp_addr(&self) -> u64 {
        ACPI_RSDP_START
    }

    /// Bytes from the first table to the end of the last.
    pub fn tables_len(&self) -> u64 {
        self.tables
            .last()
            .map(|(addr, _, bytes)| addr + bytes.len() as u64 - ACPI_TABLES_START)
            .unwrap_or(0)
    }

    /// The table with `signature` and its address (the DSDT is found as `DSDT`).
    pub fn table(&self, signature: &[u8; 4]) -> Option<(u64, &[u8])> {
        self.tables
            .iter()
            .find(|(_, sig, _)| sig == signature)
            .map(|(addr, _, bytes)| (*addr, bytes.as_slice()))
    }

    /// The RSDP's bytes.
    pub fn rsdp(&self) -> &[u8] {
        &self.rsdp
    }

    /// Writes the RSDP and every table into `mem`.
    pub fn write(&self, mem: &GuestMemoryMmap) -> Result<(), AcpiError> {
        mem.write_slice(&self.rsdp, GuestAddress(ACPI_RSDP_START))?;
        for (addr, _, bytes) in &self.tables {
            mem.write_slice(bytes, GuestAddress(*addr))?;
        }
        Ok(())
    }
}

fn check(desc: &MachineDescription) -> Result<(), AcpiError> {
    if desc.vcpus > MAX_VCPUS {
        return Err(AcpiError::TooManyVcpus {
            requested: desc.vcpus,
        });
    }
    if desc.virtio.len() > MAX_VIRTIO_DEVICES {
        return Err(AcpiError::TooManyDevices {
            count: desc.virtio.len(),
        });
    }
    let window = crate::devices::virtio::mmio::MMIO_WINDOW;
    for d in desc.virtio {
        let below_4g = d.addr.checked_add(window).is_some_and(|end| end <= 1 << 32);
        let gsi_free = d.gsi <= LAST_GSI
            && ![
                COM1_GSI,
                desc.ged_gsi,
                crate::devices::legacy::i8042::KBD_IRQ,
                crate::devices::legacy::i8042::AUX_IRQ,
            ]
            .contains(&d.gsi);
        if !below_4g || !gsi_free {
            return Err(AcpiError::Device {
                addr: d.addr,
                gsi: d.gsi,
            });
        }
    }
    Ok(())
}

fn align_up(addr: u64) -> u64 {
    addr.div_ceil(TABLE_ALIGN) * TABLE_ALIGN
}

/// Builds every table for `desc`; nothing is written yet.
pub fn build(desc: &MachineDescription) -> Result<AcpiTables, AcpiError> {
    check(desc)?;
    let mut tables: Vec<(u64, [u8; 4], Vec<u8>)> = Vec::with_capacity(4);
    let mut next = ACPI_TABLES_START;
    let mut place = |signature: [u8; 4], bytes: Vec<u8>| -> u64 {
        let addr = next;
        next = align_up(addr + bytes.len() as u64);
        tables.push((addr, signature, bytes));
        addr
    };
    let dsdt_addr = place(*b"DSDT", dsdt::build(desc));
    let fadt_addr = place(*b"FACP", fadt::build(dsdt_addr));
    let madt_addr = place(*b"APIC", madt::build(desc.vcpus));
    let mut xsdt = XSDT::new(OEM_ID, *b"AGVMXSDT", OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt_addr = place(*b"XSDT", to_bytes(&xsdt));
    if next > ACPI_AREA_END {
        return Err(AcpiError::TooLarge {
            needed: next - ACPI_TABLES_START,
            start: ACPI_TABLES_START,
        });
    }
    Ok(AcpiTables {
        rsdp: to_bytes(&Rsdp::new(OEM_ID, xsdt_addr)),
        tables,
    })
}

/// Serialises a table.
fn to_bytes(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}
