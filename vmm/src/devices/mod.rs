//! Devices the guest reaches through port I/O and MMIO, and the bus that
//! routes vCPU exits to them.

pub mod acpi;
pub mod bus;
pub mod irq;
pub mod legacy;
pub mod virtio;
