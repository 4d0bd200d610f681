//! The devices behind the ACPI tables: the sleep/reset registers the FADT
//! names, the Generic Event Device (GED) that delivers ACPI notifications
//! through an interrupt, and the VM generation ID in guest memory.
//!
//! | what | where |
//! | --- | --- |
//! | sleep control / sleep status / reset registers | ports `0x600` / `0x601` / `0x602` |
//! | GED event register (read clears) | port `0x604` |
//! | GED interrupt | GSI 3 (COM2's ISA line; this machine has no COM2) |
//! | VM generation ID | guest memory, `ACPI_VMGENID_START` (0xe0040) |

pub mod ged;
pub mod persist;
pub mod power;
pub mod vmgenid;

use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;

use self::ged::{Ged, EVENT_VMGENID_CHANGED, GED_PORT_LEN};
use self::power::{PowerDevice, PowerHandler, POWER_PORT_LEN};
use self::vmgenid::{VmGenId, VmGenIdError, VMGENID_LEN};
use crate::devices::bus::{Bus, BusError};
use crate::devices::irq::IrqLine;
use crate::memory::GuestMemoryMmap;

/// First port of the sleep/reset registers.
pub const POWER_PORT_BASE: u16 = 0x600;
/// The GED's event register.
pub const GED_PORT: u16 = 0x604;
/// The GED's interrupt.
pub const GED_GSI: u32 = 3;

/// Errors setting up or driving the ACPI devices.
#[derive(Debug, thiserror::Error)]
pub enum AcpiDeviceError {
    /// The GED's eventfd could not be created.
    #[error("cannot create the ACPI event interrupt: {0}")]
    Eventfd(#[source] std::io::Error),
    /// KVM refused the GED's irqfd.
    #[error("cannot register the ACPI event interrupt (GSI {gsi}) with KVM: {source}")]
    Irqfd {
        /// The GSI.
        gsi: u32,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The devices could not be placed on the port-I/O bus.
    #[error("cannot place the ACPI devices on the port-I/O bus: {0}")]
    Bus(#[from] BusError),
    /// The generation ID could not be placed or written.
    #[error(transparent)]
    VmGenId(#[from] VmGenIdError),
    /// The guest could not be notified.
    #[error("cannot raise the ACPI event interrupt: {0}")]
    Notify(#[source] std::io::Error),
    /// A snapshot's ACPI state is impossible.
    #[error("invalid ACPI state in snapshot: {0}")]
    InvalidState(String),
}

/// The ACPI devices of one VM (a clone shares the same devices).
#[derive(Clone)]
pub struct AcpiDevices {
    power: Arc<Mutex<PowerDevice>>,
    ged: Arc<Mutex<Ged>>,
    ged_gsi: u32,
    vmgenid: VmGenId,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl AcpiDevices {
    /// Devices for a booting VM: the generation ID at `vmgenid_addr` (not
    /// yet written), no pending events, power requests to `on_request`.
    pub fn new(
        vmgenid_addr: u64,
        mem: &GuestMemoryMmap,
        on_request: PowerHandler,
    ) -> Result<Self, AcpiDeviceError> {
        Self::build(vmgenid_addr, GED_GSI, 0, mem, on_request)
    }

    fn build(
        vmgenid_addr: u64,
        ged_gsi: u32,
        pending: u8,
        mem: &GuestMemoryMmap,
        on_request: PowerHandler,
    ) -> Result<Self, AcpiDeviceError> {
        let irq = IrqLine::new(ged_gsi).map_err(AcpiDeviceError::Eventfd)?;
        Ok(AcpiDevices {
            power: Arc::new(Mutex::new(PowerDevice::new(on_request))),
            ged: Arc::new(Mutex::new(Ged::new(irq, pending))),
            ged_gsi,
            vmgenid: VmGenId::at(vmgenid_addr, mem)?,
        })
    }

    /// Registers the GED's interrupt with KVM and puts the registers on `io`.
    pub fn attach(&self, vm: &VmFd, io: &mut Bus) -> Result<(), AcpiDeviceError> {
        let ged = locked(&self.ged);
        vm.register_irqfd(ged.irq().eventfd(), self.ged_gsi)
            .map_err(|source| AcpiDeviceError::Irqfd {
                gsi: self.ged_gsi,
                source,
            })?;
        drop(ged);
        io.insert(
            self.power.clone(),
            u64::from(POWER_PORT_BASE),
            POWER_PORT_LEN,
        )?;
        io.insert(self.ged.clone(), u64::from(GED_PORT), GED_PORT_LEN)?;
        Ok(())
    }

    /// Writes the boot-time generation ID (no notification: nothing in the
    /// guest has read an older one).
    pub fn write_first_generation(
        &self,
        mem: &GuestMemoryMmap,
    ) -> Result<[u8; VMGENID_LEN], AcpiDeviceError> {
        Ok(self.vmgenid.write_new(mem)?)
    }

    /// Writes a fresh generation ID and notifies the guest through the GED.
    /// Call for a restored VM once the vCPUs' LAPIC state is in place (so
    /// the interrupt reaches a restored LAPIC) and before they first run
    /// guest code.
    pub fn announce_new_generation(
        &self,
        mem: &GuestMemoryMmap,
    ) -> Result<[u8; VMGENID_LEN], AcpiDeviceError> {
        let id = self.vmgenid.write_new(mem)?;
        locked(&self.ged)
            .notify(EVENT_VMGENID_CHANGED)
            .map_err(AcpiDeviceError::Notify)?;
        Ok(id)
    }

    /// Where the generation ID lives.
    pub fn vmgenid(&self) -> VmGenId {
        self.vmgenid
    }
}
