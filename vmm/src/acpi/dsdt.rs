//! The DSDT's AML: the `\_S5_` sleep state Linux needs to power off, COM1,
//! the keyboard controller, every virtio-mmio device, the VM generation ID
//! device and the Generic Event Device that notifies it.
//!
//! ```text
//! Name (\_S5, Package (4) { 5, 0, 0, 0 })
//! Device (\_SB.COM1) { _HID PNP0501, _UID 0, _CRS { IO 0x3f8/8, Interrupt 4 } }
//! Device (\_SB.PS2K) { _HID PNP0303, _CRS { IO 0x60/1, IO 0x64/1, Interrupt 1 } }
//! Device (\_SB.Vnnn) { _HID "LNRO0005", _UID n, _CCA 1,
//!                      _CRS { Memory32Fixed (addr, 4 KiB), Interrupt gsi } }
//! Device (\_SB.VGEN) { _HID "VMGENCTR", _CID "VM_Gen_Counter", _DDN "VM_Gen_Counter",
//!                      Method (ADDR) { Return (Package (2) { low, high }) } }
//! Device (\_SB.GED_) { _HID "ACPI0013", _UID 0, _CRS { Interrupt ged_gsi },
//!                      OperationRegion (GDST, SystemIO, 0x604, 1) Field { GDAT, 8 }
//!                      Method (_EVT, 1, Serialized) {
//!                          Local0 = GDAT; Local1 = Local0 & 1
//!                          If (Local1 == 1) { Notify (\_SB.VGEN, 0x80) } } }
//! ```
//!
//! Every other name here is a four-character constant (acpi_tables' `Path`
//! and `EISAName` assert their shape), so building the AML cannot fail.
//!
//! Interrupts use the extended descriptor (edge-triggered, active high,
//! exclusive), which is what the irqfds deliver; Linux then takes trigger
//! and polarity from `_CRS` rather than from ISA defaults.

use acpi_tables::sdt::Sdt;
use acpi_tables::{aml, Aml};

use super::{MachineDescription, VirtioDescription, COM1_GSI, OEM_ID, OEM_REVISION};
use crate::devices::acpi::ged::EVENT_VMGENID_CHANGED;
use crate::devices::acpi::power::S5_SLEEP_TYPE;
use crate::devices::acpi::GED_PORT;
use crate::devices::legacy::i8042::KBD_IRQ;
use crate::devices::legacy::serial::{COM1_PORT_BASE, COM1_PORT_LEN};
use crate::devices::virtio::mmio::MMIO_WINDOW;

/// DSDT revision 2: AML integers are 64 bits wide.
const DSDT_REVISION: u8 = 2;
/// Device Check notification value the VMGenID spec uses for a new ID.
const NOTIFY_VMGENID: u8 = 0x80;

/// An edge-triggered, active-high, exclusive interrupt consumed by a device.
fn edge_interrupt(gsi: u32) -> aml::Interrupt {
    aml::Interrupt::new(true, true, false, false, gsi)
}

fn sleep_states(sink: &mut Vec<u8>) {
    // SLP_TYPa, SLP_TYPb, two reserved bytes.
    let package = aml::Package::new(vec![&S5_SLEEP_TYPE, &0u8, &0u8, &0u8]);
    aml::Name::new("\\_S5_".into(), &package).to_aml_bytes(sink);
}

fn serial(sink: &mut Vec<u8>) {
    // COM1's ports are a layout constant below 64 KiB and its length 8.
    let io = aml::IO::new(
        COM1_PORT_BASE as u16,
        COM1_PORT_BASE as u16,
        1,
        COM1_PORT_LEN as u8,
    );
    let irq = edge_interrupt(COM1_GSI);
    let crs = aml::ResourceTemplate::new(vec![&io, &irq]);
    aml::Device::new(
        "\\_SB_.COM1".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new("_CRS".into(), &crs),
        ],
    )
    .to_aml_bytes(sink);
}

/// The i8042's keyboard interface. Without it, Linux probes the controller
/// at its fixed ports (the FADT says an 8042 is present) but then asks for
/// ISA IRQ 1, which an ACPI machine without legacy PICs does not map, and
/// the probe fails with EINVAL (seen with Debian's kernels). Described
/// here, the keyboard gets its interrupt through `_CRS` like every other
/// device. The AUX port is left out, so Linux does not use it.
fn keyboard_controller(sink: &mut Vec<u8>) {
    let data = aml::IO::new(0x60, 0x60, 1, 1);
    let command = aml::IO::new(0x64, 0x64, 1, 1);
    let irq = edge_interrupt(KBD_IRQ);
    let crs = aml::ResourceTemplate::new(vec![&data, &command, &irq]);
    aml::Device::new(
        "\\_SB_.PS2K".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0303")),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new("_CRS".into(), &crs),
        ],
    )
    .to_aml_bytes(sink);
}

fn virtio(index: usize, device: &VirtioDescription, sink: &mut Vec<u8>) {
    // `check` has made sure the window lies below 4 GiB.
    let mem = aml::Memory32Fixed::new(true, device.addr as u32, MMIO_WINDOW as u32);
    let irq = edge_interrupt(device.gsi);
    let crs = aml::ResourceTemplate::new(vec![&mem, &irq]);
    let uid = index as u64;
    // `check` caps the devices at MAX_VIRTIO_DEVICES (24), so the name has
    // four characters, which acpi_tables' Path asserts.
    let name = format!("\\_SB_.V{index:03}");
    aml::Device::new(
        name.as_str().into(),
        vec![
            &aml::Name::new("_HID".into(), &"LNRO0005"),
            &aml::Name::new("_UID".into(), &uid),
            // Cache-coherent DMA.
            &aml::Name::new("_CCA".into(), &aml::ONE),
            &aml::Name::new("_CRS".into(), &crs),
        ],
    )
    .to_aml_bytes(sink);
}

fn vmgenid(addr: u64, sink: &mut Vec<u8>) {
    // Linux's vmgenid driver wants a package of two integers: the low and
    // the high 32 bits of the ID's guest-physical address.
    let low = addr & 0xffff_ffff;
    let high = addr >> 32;
    let address = aml::Package::new(vec![&low, &high]);
    let ret = aml::Return::new(&address);
    aml::Device::new(
        "\\_SB_.VGEN".into(),
        vec![
            &aml::Name::new("_HID".into(), &"VMGENCTR"),
            &aml::Name::new("_CID".into(), &"VM_Gen_Counter"),
            &aml::Name::new("_DDN".into(), &"VM_Gen_Counter"),
            &aml::Method::new("ADDR".into(), 0, false, vec![&ret]),
        ],
    )
    .to_aml_bytes(sink);
}

fn generic_event_device(gsi: u32, sink: &mut Vec<u8>) {
    let irq = edge_interrupt(gsi);
    let crs = aml::ResourceTemplate::new(vec![&irq]);
    let port = GED_PORT;
    let region = aml::OpRegion::new(
        "GDST".into(),
        aml::OpRegionSpace::SystemIO,
        &port,
        &aml::ONE,
    );
    let field = aml::Field::new(
        "GDST".into(),
        aml::FieldAccessType::Byte,
        aml::FieldLockRule::NoLock,
        aml::FieldUpdateRule::WriteAsZeroes,
        vec![aml::FieldEntry::Named(*b"GDAT", 8)],
    );
    let gdat = aml::Path::new("GDAT");
    let vgen = aml::Path::new("\\_SB_.VGEN");
    let read = aml::Store::new(&aml::Local(0), &gdat);
    let vmgenid_bit = aml::And::new(&aml::Local(1), &aml::Local(0), &EVENT_VMGENID_CHANGED);
    let notify = aml::Notify::new(&vgen, &NOTIFY_VMGENID);
    let vmgenid_fired = aml::Equal::new(&aml::Local(1), &EVENT_VMGENID_CHANGED);
    let on_vmgenid = aml::If::new(&vmgenid_fired, vec![&notify]);
    let evt = aml::Method::new(
        "_EVT".into(),
        1,
        true,
        vec![&read, &vmgenid_bit, &on_vmgenid],
    );
    aml::Device::new(
        "\\_SB_.GED_".into(),
        vec![
            &aml::Name::new("_HID".into(), &"ACPI0013"),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new("_CRS".into(), &crs),
            &region,
            &field,
            &evt,
        ],
    )
    .to_aml_bytes(sink);
}

/// The DSDT bytes for `desc`.
pub(super) fn build(desc: &MachineDescription) -> Vec<u8> {
    let mut body = Vec::with_capacity(256 + desc.virtio.len() * 64);
    sleep_states(&mut body);
    serial(&mut body);
    keyboard_controller(&mut body);
    for (index, device) in desc.virtio.iter().enumerate() {
        virtio(index, device, &mut body);
    }
    vmgenid(desc.vmgenid_addr, &mut body);
    generic_event_device(desc.ged_gsi, &mut body);
    let mut dsdt = Sdt::new(
        *b"DSDT",
        36,
        DSDT_REVISION,
        OEM_ID,
        *b"AGVMDSDT",
        OEM_REVISION,
    );
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}
