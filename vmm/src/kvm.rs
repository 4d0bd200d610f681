//! The KVM handle: opens /dev/kvm, checks the API version and every
//! capability this VMM relies on, so a host that lacks one fails early with
//! the capability's name instead of failing later in an obscure ioctl.

use kvm_ioctls::{Cap, Kvm};

/// The only stable KVM API version.
const KVM_API_VERSION: i32 = 12;

/// Capabilities the VMM needs, with the name an operator can look up.
const REQUIRED_CAPS: &[(Cap, &str)] = &[
    (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
    (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
    (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
    (Cap::SetIdentityMapAddr, "KVM_CAP_SET_IDENTITY_MAP_ADDR"),
    (Cap::Pit2, "KVM_CAP_PIT2"),
    (Cap::PitState2, "KVM_CAP_PIT_STATE2"),
    (Cap::Irqfd, "KVM_CAP_IRQFD"),
    (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
    (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
    (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
    (Cap::MpState, "KVM_CAP_MP_STATE"),
    (Cap::VcpuEvents, "KVM_CAP_VCPU_EVENTS"),
    (Cap::Debugregs, "KVM_CAP_DEBUGREGS"),
    (Cap::AdjustClock, "KVM_CAP_ADJUST_CLOCK"),
];

/// Errors opening or probing KVM.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// /dev/kvm could not be opened.
    #[error(
        "cannot open /dev/kvm: {0} (is the kvm module loaded and do you have access to /dev/kvm?)"
    )]
    Open(#[source] kvm_ioctls::Error),
    /// The kernel speaks another KVM API version.
    #[error("KVM API version {found} is not supported (need {KVM_API_VERSION})")]
    ApiVersion {
        /// The version the kernel reported.
        found: i32,
    },
    /// A capability the VMM relies on is missing.
    #[error("the host's KVM lacks the required capability {0}")]
    MissingCapability(&'static str),
}

/// An open, checked KVM system handle.
pub struct KvmHandle {
    kvm: Kvm,
}

impl KvmHandle {
    /// Opens /dev/kvm and checks the API version and required capabilities.
    pub fn open() -> Result<Self, KvmError> {
        let kvm = Kvm::new().map_err(KvmError::Open)?;
        let found = kvm.get_api_version();
        if found != KVM_API_VERSION {
            return Err(KvmError::ApiVersion { found });
        }
        check_capabilities(|cap| kvm.check_extension(cap))?;
        Ok(KvmHandle { kvm })
    }

    /// The underlying kvm-ioctls handle.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The largest number of vCPUs KVM allows in one VM.
    pub fn max_vcpus(&self) -> usize {
        self.kvm.get_max_vcpus()
    }
}

/// Checks every required capability with `has`, naming the first one missing.
fn check_capabilities(has: impl Fn(Cap) -> bool) -> Result<(), KvmError> {
    for (cap, name) in REQUIRED_CAPS {
        if !has(*cap) {
            return Err(KvmError::MissingCapability(name));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_capability_is_named() {
        let err = check_capabilities(|cap| cap != Cap::Pit2).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the host's KVM lacks the required capability KVM_CAP_PIT2"
        );
        assert!(check_capabilities(|_| true).is_ok());
    }
}
