//! The FADT (ACPI 6.5, section 5.2.9) of a hardware-reduced platform: no
//! PM1 blocks, no SCI, no FACS; power-off and reset go through the sleep
//! control and reset registers of `devices::acpi::power`, on port I/O.

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};

use super::{to_bytes, OEM_ID, OEM_REVISION};
use crate::devices::acpi::power::{
    RESET_OFFSET, RESET_VALUE, SLEEP_CONTROL_OFFSET, SLEEP_STATUS_OFFSET,
};
use crate::devices::acpi::POWER_PORT_BASE;

/// IA-PC boot architecture flags (FADT offset 109, ACPI 6.5 table 5.11).
/// 8042: the i8042 the VMM emulates is there (Linux probes it as without ACPI).
const IAPC_8042: u16 = 1 << 1;
/// VGA Not Present.
const IAPC_NO_VGA: u16 = 1 << 2;
/// CMOS RTC Not Present: this machine has no RTC at ports 0x70/0x71.
const IAPC_NO_CMOS_RTC: u16 = 1 << 5;
/// The FADT's hypervisor vendor identity.
const HYPERVISOR_VENDOR: [u8; 8] = *b"AGENTVM ";

/// A one-byte register at `port`.
fn io_byte(port: u64) -> GAS {
    GAS::new(AddressSpace::SystemIo, 8, 0, AccessSize::ByteAccess, port)
}

/// The FADT bytes, pointing at the DSDT at `dsdt_addr`.
pub(super) fn build(dsdt_addr: u64) -> Vec<u8> {
    let base = u64::from(POWER_PORT_BASE);
    let mut fadt = FADTBuilder::new(OEM_ID, *b"AGVMFACP", OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        // No fixed power or sleep button.
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.reset_reg = io_byte(base + RESET_OFFSET);
    fadt.reset_value = RESET_VALUE;
    fadt.sleep_control_reg = io_byte(base + SLEEP_CONTROL_OFFSET);
    fadt.sleep_status_reg = io_byte(base + SLEEP_STATUS_OFFSET);
    fadt.iapc_boot_arch = (IAPC_8042 | IAPC_NO_VGA | IAPC_NO_CMOS_RTC).into();
    fadt.hypervisor_vendor_identity = u64::from_le_bytes(HYPERVISOR_VENDOR).into();
    to_bytes(&fadt.finalize())
}
