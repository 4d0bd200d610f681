//! vCPU state for snapshots, saved and restored in the order KVM requires:
//! CPUID first; then MP_STATE, REGS, SREGS, XSAVE, XCRS, DEBUGREGS, LAPIC
//! (after SREGS, before MSRs, since APIC base lives in an MSR KVM also
//! derives from SREGS), MSRs with TSC_DEADLINE after TSC, and VCPU_EVENTS last.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

use crate::arch::x86_64::msr;

/// MSR_IA32_TSC_DEADLINE: must be restored after MSR_IA32_TSC.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// Most MSRs saved per vCPU; bounds untrusted state.
pub const MAX_SAVED_MSRS: usize = 512;

/// Everything KVM holds for one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    /// vCPU index (APIC id).
    pub index: u8,
    /// CPUID as set at boot.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// Run state (runnable, halted, waiting for SIPI...).
    pub mp_state: kvm_mp_state,
    /// General registers.
    pub regs: kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Local APIC registers.
    pub lapic: kvm_lapic_state,
    /// MSRs, TSC_DEADLINE last.
    pub msrs: Vec<kvm_msr_entry>,
    /// Pending exceptions, interrupts, NMIs.
    pub vcpu_events: kvm_vcpu_events,
    /// TSC frequency of the host the state was taken on, if KVM reports it.
    pub tsc_khz: Option<u32>,
}

/// Errors saving or restoring vCPU state.
#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    /// A state ioctl failed.
    #[error("vCPU {index}: {what} failed: {source}")]
    Ioctl {
        /// vCPU index.
        index: u8,
        /// The ioctl.
        what: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM accepted fewer MSRs than saved.
    #[error("vCPU {index}: KVM refused MSR {msr:#x} from the snapshot")]
    MsrRefused {
        /// vCPU index.
        index: u8,
        /// The refused MSR.
        msr: u32,
    },
    /// The state holds values outside what this VMM produces.
    #[error("vCPU {index}: invalid snapshot state: {reason}")]
    Invalid {
        /// vCPU index.
        index: u8,
        /// What is wrong.
        reason: String,
    },
}

fn ioctl(index: u8, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuStateError {
    move |source| VcpuStateError::Ioctl {
        index,
        what,
        source,
    }
}

/// The MSRs a snapshot saves: every MSR KVM lists as saveable
/// (KVM_GET_MSR_INDEX_LIST) and the MTRRs, which KVM emulates but does not
/// list. Any that a vCPU refuses to read are skipped at save time.
pub fn msrs_to_save(kvm: &Kvm) -> Result<Vec<u32>, kvm_ioctls::Error> {
    let mut indices = kvm.get_msr_index_list()?.as_slice().to_vec();
    for msr in msr::mtrr_msrs() {
        if !indices.contains(&msr) {
            indices.push(msr);
        }
    }
    Ok(indices)
}

/// Orders MSRs for restore: by index, with TSC_DEADLINE moved after everything else.
pub fn order_msrs(msrs: &mut [kvm_msr_entry]) {
    msrs.sort_by_key(|m| (m.index == MSR_IA32_TSC_DEADLINE, m.index));
}

/// kvmclock's wall-clock MSRs (old and new numbering). Writing one is not
/// state but a request: KVM writes the current wall-clock time into the
/// guest page it names, at once. Linux writes it whenever it reads the wall
/// clock (at boot and resume), so the value has no use after a restore, and
/// replaying it would change guest memory before the guest runs.
const MSR_KVM_WALL_CLOCK: u32 = 0x11;
const MSR_KVM_WALL_CLOCK_NEW: u32 = 0x4b56_4d00;

/// The saved MSRs to give back to KVM, in restore order: all but the
/// wall-clock requests, so a restored VM's memory is the snapshot's until
/// it runs.
pub fn msrs_to_restore(saved: &[kvm_msr_entry]) -> Vec<kvm_msr_entry> {
    let mut msrs: Vec<kvm_msr_entry> = saved
        .iter()
        .filter(|m| m.index != MSR_KVM_WALL_CLOCK && m.index != MSR_KVM_WALL_CLOCK_NEW)
        .copied()
        .collect();
    order_msrs(&mut msrs);
    msrs
}

/// Reads every MSR in `indices` that KVM lets us read, skipping ones it refuses.
fn read_msrs(
    fd: &VcpuFd,
    index: u8,
    indices: &[u32],
) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest: Vec<u32> = indices.to_vec();
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&i| kvm_msr_entry {
                index: i,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|e| VcpuStateError::Invalid {
            index,
            reason: format!("MSR list: {e:?}"),
        })?;
        let n = fd
            .get_msrs(&mut msrs)
            .map_err(ioctl(index, "KVM_GET_MSRS"))?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        // KVM stops at the first MSR it cannot read: skip it and carry on.
        rest.drain(..(n + 1).min(rest.len()));
    }
    Ok(out)
}

/// Saves the state of a paused vCPU.
pub fn save(fd: &VcpuFd, index: u8, msr_indices: &[u32]) -> Result<VcpuState, VcpuStateError> {
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl(index, "KVM_GET_CPUID2"))?
        .as_slice()
        .to_vec();
    let mp_state = fd
        .get_mp_state()
        .map_err(ioctl(index, "KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(ioctl(index, "KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(ioctl(index, "KVM_GET_SREGS"))?;
    let xsave = fd.get_xsave().map_err(ioctl(index, "KVM_GET_XSAVE"))?;
    let xcrs = fd.get_xcrs().map_err(ioctl(index, "KVM_GET_XCRS"))?;
    let debugregs = fd
        .get_debug_regs()
        .map_err(ioctl(index, "KVM_GET_DEBUGREGS"))?;
    let lapic = fd.get_lapic().map_err(ioctl(index, "KVM_GET_LAPIC"))?;
    let mut msrs = read_msrs(fd, index, msr_indices)?;
    order_msrs(&mut msrs);
    let vcpu_events = fd
        .get_vcpu_events()
        .map_err(ioctl(index, "KVM_GET_VCPU_EVENTS"))?;
    let tsc_khz = fd.get_tsc_khz().ok();
    Ok(VcpuState {
        index,
        cpuid,
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        msrs,
        vcpu_events,
        tsc_khz,
    })
}

/// Checks the bounds of untrusted state before any of it reaches KVM.
pub fn validate(state: &VcpuState) -> Result<(), VcpuStateError> {
    let invalid = |reason: String| VcpuStateError::Invalid {
        index: state.index,
        reason,
    };
    if state.cpuid.is_empty() || state.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
        return Err(invalid(format!(
            "{} CPUID entries (1 to {KVM_MAX_CPUID_ENTRIES} expected)",
            state.cpuid.len()
        )));
    }
    if state.msrs.len() > MAX_SAVED_MSRS {
        return Err(invalid(format!(
            "{} MSRs (at most {MAX_SAVED_MSRS} expected)",
            state.msrs.len()
        )));
    }
    Ok(())
}

/// Restores `state` into a freshly created vCPU, in KVM's required order.
pub fn restore(fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuStateError> {
    validate(state)?;
    let index = state.index;
    let cpuid = CpuId::from_entries(&state.cpuid).map_err(|e| VcpuStateError::Invalid {
        index,
        reason: format!("CPUID: {e:?}"),
    })?;
    fd.set_cpuid2(&cpuid)
        .map_err(ioctl(index, "KVM_SET_CPUID2"))?;
    if let Some(khz) = state.tsc_khz {
        match fd.get_tsc_khz() {
            Ok(host) if host != khz => {
                if let Err(e) = fd.set_tsc_khz(khz) {
                    tracing::warn!(
                        vcpu = index,
                        snapshot_khz = khz,
                        host_khz = host,
                        error = %e,
                        "cannot set the snapshot's TSC frequency; guest time may drift"
                    );
                }
            }
            _ => {}
        }
    }
    fd.set_mp_state(state.mp_state)
        .map_err(ioctl(index, "KVM_SET_MP_STATE"))?;
    fd.set_regs(&state.regs)
        .map_err(ioctl(index, "KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs)
        .map_err(ioctl(index, "KVM_SET_SREGS"))?;
    // SAFETY: `state.xsave` is a complete kvm_xsave (4 KiB legacy layout) that KVM_GET_XSAVE
    // produced; KVM validates its contents and rejects bad feature bits.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(ioctl(index, "KVM_SET_XSAVE"))?;
    fd.set_xcrs(&state.xcrs)
        .map_err(ioctl(index, "KVM_SET_XCRS"))?;
    fd.set_debug_regs(&state.debugregs)
        .map_err(ioctl(index, "KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&state.lapic)
        .map_err(ioctl(index, "KVM_SET_LAPIC"))?;
    let msrs = msrs_to_restore(&state.msrs);
    let kvm_msrs = Msrs::from_entries(&msrs).map_err(|e| VcpuStateError::Invalid {
        index,
        reason: format!("MSR list: {e:?}"),
    })?;
    let set = fd
        .set_msrs(&kvm_msrs)
        .map_err(ioctl(index, "KVM_SET_MSRS"))?;
    if set < msrs.len() {
        return Err(VcpuStateError::MsrRefused {
            index,
            msr: msrs[set].index,
        });
    }
    fd.set_vcpu_events(&state.vcpu_events)
        .map_err(ioctl(index, "KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tsc_deadline_goes_last_and_the_rest_by_index() {
        let mut msrs: Vec<kvm_msr_entry> = [0x6e0, 0xc000_0080, 0x10, 0x174]
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        order_msrs(&mut msrs);
        let order: Vec<u32> = msrs.iter().map(|m| m.index).collect();
        assert_eq!(order, vec![0x10, 0x174, 0xc000_0080, 0x6e0]);
    }

    #[test]
    fn the_wall_clock_requests_are_not_replayed_on_restore() {
        // Replaying them made KVM rewrite the guest's pvclock_wall_clock
        // page during restore (seen with a real Linux guest: one 12-byte
        // change, so memory_checksum never matched the snapshot's).
        let saved: Vec<kvm_msr_entry> = [0x4b56_4d01, 0x11, 0x6e0, 0x4b56_4d00, 0x10]
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                data: 0x1000,
                ..Default::default()
            })
            .collect();
        let order: Vec<u32> = msrs_to_restore(&saved).iter().map(|m| m.index).collect();
        assert_eq!(order, vec![0x10, 0x4b56_4d01, 0x6e0]);
    }
}
