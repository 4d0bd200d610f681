//! VM-wide KVM state for snapshots: the PIT (when the VM has one), the
//! kvmclock and the in-kernel irqchip (both PICs and the IOAPIC).

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

/// VM-wide state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmState {
    /// The i8254 PIT; all zero for a VM without one (`MachineState::pit`).
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
    /// Master 8259.
    pub pic_master: kvm_irqchip,
    /// Slave 8259.
    pub pic_slave: kvm_irqchip,
    /// IOAPIC.
    pub ioapic: kvm_irqchip,
}

/// Errors saving or restoring VM state.
#[derive(Debug, thiserror::Error)]
#[error("{what} failed: {source}")]
pub struct VmStateError {
    what: &'static str,
    #[source]
    source: kvm_ioctls::Error,
}

fn err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmStateError {
    move |source| VmStateError { what, source }
}

fn get_chip(fd: &VmFd, chip_id: u32, what: &'static str) -> Result<kvm_irqchip, VmStateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    fd.get_irqchip(&mut chip).map_err(err(what))?;
    Ok(chip)
}

/// Saves the VM-wide state of a paused VM (with its PIT's when `pit`).
pub fn save(fd: &VmFd, pit: bool) -> Result<VmState, VmStateError> {
    Ok(VmState {
        pit: match pit {
            true => fd.get_pit2().map_err(err("KVM_GET_PIT2"))?,
            false => kvm_pit_state2::default(),
        },
        clock: fd.get_clock().map_err(err("KVM_GET_CLOCK"))?,
        pic_master: get_chip(fd, KVM_IRQCHIP_PIC_MASTER, "KVM_GET_IRQCHIP (PIC master)")?,
        pic_slave: get_chip(fd, KVM_IRQCHIP_PIC_SLAVE, "KVM_GET_IRQCHIP (PIC slave)")?,
        ioapic: get_chip(fd, KVM_IRQCHIP_IOAPIC, "KVM_GET_IRQCHIP (IOAPIC)")?,
    })
}

/// Restores VM-wide state into a VM created with the same irqchip, and
/// with a PIT exactly when `pit`.
pub fn restore(fd: &VmFd, state: &VmState, pit: bool) -> Result<(), VmStateError> {
    if pit {
        fd.set_pit2(&state.pit).map_err(err("KVM_SET_PIT2"))?;
    }
    // kvmclock goes back exactly as saved: flags 0, never KVM_CLOCK_REALTIME
    // (with it, KVM would move the clock on by the host's wall-clock time
    // since the save). The guest's CLOCK_MONOTONIC and CLOCK_BOOTTIME thus
    // continue from the snapshot, without the time it spent paused or on
    // disk, as after a suspend: timers armed on them do not all expire at
    // once on restore. CLOCK_REALTIME is stepped to the host's by guest-init
    // (StartSession/ResumeSession host_time_unix_ns). The vmm's README,
    // "Clocks across a restore"; tests/restore_clock.rs checks it.
    let clock = kvm_clock_data {
        flags: 0,
        ..state.clock
    };
    fd.set_clock(&clock).map_err(err("KVM_SET_CLOCK"))?;
    // The chip ids come from the file: force them to the slot each is restored into.
    for (chip, id, what) in [
        (
            &state.pic_master,
            KVM_IRQCHIP_PIC_MASTER,
            "KVM_SET_IRQCHIP (PIC master)",
        ),
        (
            &state.pic_slave,
            KVM_IRQCHIP_PIC_SLAVE,
            "KVM_SET_IRQCHIP (PIC slave)",
        ),
        (
            &state.ioapic,
            KVM_IRQCHIP_IOAPIC,
            "KVM_SET_IRQCHIP (IOAPIC)",
        ),
    ] {
        let chip = kvm_irqchip {
            chip_id: id,
            ..*chip
        };
        fd.set_irqchip(&chip).map_err(err(what))?;
    }
    Ok(())
}
