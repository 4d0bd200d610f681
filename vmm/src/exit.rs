//! Why a VM ended, and the process exit code each reason maps to.
//!
//! Exit codes are part of the CLI's documented interface (see the README):
//! `0` for a guest reset or poweroff (i8042, ACPI or a KVM system event) and
//! for a requested stop, `1` for a guest or VM failure, `2` for bad usage or
//! bad input.

use std::fmt;

/// Process exit code: the VM ended cleanly.
pub const EXIT_OK: i32 = 0;
/// Process exit code: the guest or the VM failed.
pub const EXIT_VM_FAILURE: i32 = 1;
/// Process exit code: bad usage or bad input (configuration, kernel image).
pub const EXIT_BAD_INPUT: i32 = 2;

/// The reason a running VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest asked for a reset through the i8042 controller (0xFE to port 0x64).
    GuestReset,
    /// The guest asked KVM to power off or reset through a system event.
    GuestPoweroff,
    /// The guest powered off through the ACPI sleep control register (S5).
    AcpiPoweroff,
    /// The guest reset through the ACPI reset register.
    AcpiReset,
    /// A stop was requested through the control socket.
    StopRequested,
    /// The vCPU executed HLT with nothing left to wake it (KVM_EXIT_HLT).
    GuestHalted { vcpu: usize },
    /// The vCPU triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault { vcpu: usize },
    /// KVM could not emulate something (KVM_EXIT_INTERNAL_ERROR) and names a suberror.
    KvmInternalError { vcpu: usize, suberror: u32 },
    /// KVM refused to enter the guest (KVM_EXIT_FAIL_ENTRY).
    FailEntry { vcpu: usize, reason: u64 },
    /// A KVM_RUN ioctl or another VMM operation failed.
    VmmError {
        vcpu: Option<usize>,
        message: String,
    },
}

impl ExitReason {
    /// The process exit code this reason maps to.
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitReason::GuestReset
            | ExitReason::GuestPoweroff
            | ExitReason::AcpiPoweroff
            | ExitReason::AcpiReset
            | ExitReason::StopRequested
            | ExitReason::GuestHalted { .. } => EXIT_OK,
            _ => EXIT_VM_FAILURE,
        }
    }

    /// A stable machine-readable name for the reason (used in logs and control responses).
    pub fn name(&self) -> &'static str {
        match self {
            ExitReason::GuestReset => "guest_reset",
            ExitReason::GuestPoweroff => "guest_poweroff",
            ExitReason::AcpiPoweroff => "acpi_poweroff",
            ExitReason::AcpiReset => "acpi_reset",
            ExitReason::StopRequested => "stop_requested",
            ExitReason::GuestHalted { .. } => "guest_halted",
            ExitReason::TripleFault { .. } => "triple_fault",
            ExitReason::KvmInternalError { .. } => "kvm_internal_error",
            ExitReason::FailEntry { .. } => "fail_entry",
            ExitReason::VmmError { .. } => "vmm_error",
        }
    }
}

/// Names for KVM_INTERNAL_ERROR suberrors (include/uapi/linux/kvm.h).
fn suberror_name(suberror: u32) -> &'static str {
    match suberror {
        1 => "emulation failure",
        2 => "simultaneous exception",
        3 => "delivery event",
        4 => "unexpected exit reason",
        _ => "unknown suberror",
    }
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitReason::GuestReset => write!(f, "guest reset through the i8042 controller"),
            ExitReason::GuestPoweroff => write!(f, "guest powered off"),
            ExitReason::AcpiPoweroff => write!(
                f,
                "guest powered off through the ACPI sleep control register (S5)"
            ),
            ExitReason::AcpiReset => write!(f, "guest reset through the ACPI reset register"),
            ExitReason::StopRequested => write!(f, "stop requested on the control socket"),
            ExitReason::GuestHalted { vcpu } => write!(f, "vCPU {vcpu} halted"),
            ExitReason::TripleFault { vcpu } => write!(f, "vCPU {vcpu} triple-faulted"),
            ExitReason::KvmInternalError { vcpu, suberror } => write!(
                f,
                "KVM internal error on vCPU {vcpu}: suberror {suberror} ({})",
                suberror_name(*suberror)
            ),
            ExitReason::FailEntry { vcpu, reason } => write!(
                f,
                "KVM failed to enter the guest on vCPU {vcpu}: hardware reason {reason:#x}"
            ),
            ExitReason::VmmError {
                vcpu: Some(v),
                message,
            } => write!(f, "VMM error on vCPU {v}: {message}"),
            ExitReason::VmmError {
                vcpu: None,
                message,
            } => write!(f, "VMM error: {message}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_reasons_map_to_zero_and_failures_to_one() {
        assert_eq!(ExitReason::GuestReset.exit_code(), 0);
        assert_eq!(ExitReason::GuestPoweroff.exit_code(), 0);
        assert_eq!(ExitReason::AcpiPoweroff.exit_code(), 0);
        assert_eq!(ExitReason::AcpiReset.exit_code(), 0);
        assert_eq!(ExitReason::StopRequested.exit_code(), 0);
        assert_eq!(ExitReason::TripleFault { vcpu: 0 }.exit_code(), 1);
        let internal = ExitReason::KvmInternalError {
            vcpu: 1,
            suberror: 1,
        };
        assert_eq!(internal.exit_code(), 1);
        assert_eq!(
            internal.to_string(),
            "KVM internal error on vCPU 1: suberror 1 (emulation failure)"
        );
    }
}
