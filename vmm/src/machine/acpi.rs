//! ACPI for a machine being built: the tables written at boot (timed, for
//! the cold-boot breakdown) and the power requests the ACPI registers turn
//! into VM exits.

use std::sync::Arc;
use std::time::Instant;

use crate::acpi::{self, AcpiError, MachineDescription, VirtioDescription};
use crate::arch::x86_64::layout::ACPI_VMGENID_START;
use crate::devices::acpi::power::{PowerHandler, PowerRequest};
use crate::devices::acpi::GED_GSI;
use crate::devices::virtio::setup::PlannedDevice;
use crate::exit::ExitReason;
use crate::memory::GuestMemoryMmap;
use crate::vcpu::coordinator::Coordinator;

/// Builds the tables for `vcpus` and `virtio` and writes them into `mem`;
/// returns the RSDP's address. Logs the time taken (target `vmm::acpi`,
/// field `build_us`), which `perf cold-boot` reports.
pub(super) fn write_tables(
    mem: &GuestMemoryMmap,
    vcpus: u8,
    virtio: &[PlannedDevice],
) -> Result<u64, AcpiError> {
    let started = Instant::now();
    let devices: Vec<VirtioDescription> = virtio
        .iter()
        .map(|d| VirtioDescription {
            addr: d.addr,
            gsi: d.gsi,
        })
        .collect();
    let tables = acpi::build(&MachineDescription {
        vcpus,
        virtio: &devices,
        vmgenid_addr: ACPI_VMGENID_START,
        ged_gsi: GED_GSI,
    })?;
    tables.write(mem)?;
    // Microseconds, to 0.1 µs.
    let build_us = (started.elapsed().as_nanos() / 100) as f64 / 10.0;
    tracing::info!(
        target: "vmm::acpi",
        build_us,
        bytes = tables.tables_len(),
        rsdp = tables.rsdp_addr(),
        "ACPI tables written"
    );
    Ok(tables.rsdp_addr())
}

/// Ends the VM cleanly when the guest powers off or resets through ACPI.
pub(super) fn power_handler(coordinator: &Arc<Coordinator>) -> PowerHandler {
    let coordinator = coordinator.clone();
    Arc::new(move |request| {
        coordinator.request_exit(match request {
            PowerRequest::Poweroff => ExitReason::AcpiPoweroff,
            PowerRequest::Reset => ExitReason::AcpiReset,
        })
    })
}
