//! What a vCPU looked like when the guest failed at the CPU level (triple
//! fault, KVM internal error, failed entry): one line of registers for the
//! log, so that a crash seen once (a rare guest or emulation fault) can be
//! told apart afterwards without a debugger attached.

use std::fmt::Write;

use kvm_bindings::{kvm_regs, kvm_sregs, kvm_vcpu_events};
use kvm_ioctls::VcpuFd;

/// The most data words KVM reports with an internal error (`kvm_run.internal.data`).
const INTERNAL_DATA_MAX: usize = 16;

/// Where an x86 CPU starts after a reset: `rip` and the code segment's base.
const RESET_RIP: u64 = 0xfff0;
const RESET_CS_BASE: u64 = 0xffff_0000;

/// Said after a state that is the CPU's reset state: KVM on AMD (SVM)
/// reinitialises a vCPU when it intercepts a shutdown (the triple fault), so
/// what is read afterwards is not the state at the fault. Without this a
/// reader takes `rip=0xfff0` for where the guest died.
const RESET_STATE_NOTE: &str = " (the reset state: KVM on AMD reinitialises a vCPU \
     at a triple fault, so the state at the fault itself is lost; the console \
     is what is left of it)";

/// Reads the vCPU's registers and pending events and describes them; a
/// register set KVM would not give is named as missing rather than failing
/// the report.
pub fn state(fd: &VcpuFd) -> String {
    let regs = fd.get_regs().ok();
    let sregs = fd.get_sregs().ok();
    let events = fd.get_vcpu_events().ok();
    describe(regs.as_ref(), sregs.as_ref(), events.as_ref())
}

/// The data words of the last KVM_EXIT_INTERNAL_ERROR (for an emulation
/// failure, the instruction bytes and the faulting address), as hex.
pub fn internal_error_data(fd: &mut VcpuFd) -> String {
    // SAFETY: called only right after KVM_RUN returned
    // KVM_EXIT_INTERNAL_ERROR, so `internal` is the active union member.
    let internal = unsafe { fd.get_kvm_run().__bindgen_anon_1.internal };
    // `ndata` comes from the kernel; bound it by the array it indexes.
    let n = usize::try_from(internal.ndata)
        .unwrap_or(usize::MAX)
        .min(INTERNAL_DATA_MAX)
        .min(internal.data.len());
    internal.data[..n]
        .iter()
        .map(|w| format!("{w:#x}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// One line: instruction and stack pointers, flags, control registers,
/// EFER, the code segment, the descriptor tables, general registers, and
/// any exception KVM had pending or injected.
pub fn describe(
    regs: Option<&kvm_regs>,
    sregs: Option<&kvm_sregs>,
    events: Option<&kvm_vcpu_events>,
) -> String {
    let mut out = String::new();
    match regs {
        Some(r) => {
            // Writing to a String cannot fail.
            let _ = write!(
                out,
                "rip={:#x} rsp={:#x} rflags={:#x} rax={:#x} rbx={:#x} rcx={:#x} \
                 rdx={:#x} rsi={:#x} rdi={:#x} rbp={:#x}",
                r.rip, r.rsp, r.rflags, r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rbp
            );
        }
        None => out.push_str("registers unavailable"),
    }
    match sregs {
        Some(s) => {
            let _ = write!(
                out,
                " cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x} \
                 cs={:#x}(base {:#x}, {}) ss={:#x} gdt={:#x}+{:#x} idt={:#x}+{:#x}",
                s.cr0,
                s.cr2,
                s.cr3,
                s.cr4,
                s.efer,
                s.cs.selector,
                s.cs.base,
                if s.cs.l != 0 { "64-bit" } else { "legacy" },
                s.ss.selector,
                s.gdt.base,
                s.gdt.limit,
                s.idt.base,
                s.idt.limit,
            );
        }
        None => out.push_str(" system registers unavailable"),
    }
    if let (Some(r), Some(s)) = (regs, sregs) {
        if r.rip == RESET_RIP && s.cs.base == RESET_CS_BASE {
            out.push_str(RESET_STATE_NOTE);
        }
    }
    if let Some(e) = events {
        let x = &e.exception;
        if x.injected != 0 || x.pending != 0 {
            let _ = write!(
                out,
                " exception {} {}",
                x.nr,
                if x.injected != 0 {
                    "injected"
                } else {
                    "pending"
                }
            );
            if x.has_error_code != 0 {
                let _ = write!(out, " (error code {:#x})", x.error_code);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_register_set_is_described_or_named_missing() {
        let regs = kvm_regs {
            rip: 0x10_0123,
            rsp: 0x8ff0,
            rflags: 0x2,
            ..Default::default()
        };
        let mut sregs = kvm_sregs {
            cr0: 0x8000_0011,
            cr3: 0x9000,
            efer: 0x500,
            ..Default::default()
        };
        sregs.cs.selector = 0x10;
        sregs.cs.l = 1;
        sregs.idt.limit = 0;
        sregs.gdt.base = 0x500;
        sregs.gdt.limit = 0x1f;
        let mut events = kvm_vcpu_events::default();
        events.exception.injected = 1;
        events.exception.nr = 13;
        events.exception.has_error_code = 1;
        events.exception.error_code = 0x1a;

        let line = describe(Some(&regs), Some(&sregs), Some(&events));
        for part in [
            "rip=0x100123",
            "rsp=0x8ff0",
            "cr0=0x80000011",
            "cr3=0x9000",
            "efer=0x500",
            "cs=0x10(base 0x0, 64-bit)",
            "gdt=0x500+0x1f",
            "idt=0x0+0x0",
            "exception 13 injected (error code 0x1a)",
        ] {
            assert!(line.contains(part), "{part:?} missing from {line}");
        }
        assert!(!line.contains('\n'), "one line: {line}");

        let quiet = kvm_vcpu_events::default();
        let none = describe(None, None, Some(&quiet));
        assert_eq!(none, "registers unavailable system registers unavailable");
        assert!(!line.contains("reset state"), "{line}");
    }

    #[test]
    fn a_vcpu_read_back_in_its_reset_state_is_said_to_be_one() {
        // What the vmm read after a real guest's triple fault under nested
        // SVM: rip=0xfff0, cs base 0xffff0000, cr0 with only ET.
        let regs = kvm_regs {
            rip: RESET_RIP,
            rflags: 0x2,
            rdx: 0x663,
            ..Default::default()
        };
        let mut sregs = kvm_sregs {
            cr0: 0x10,
            ..Default::default()
        };
        sregs.cs.selector = 0xf000;
        sregs.cs.base = RESET_CS_BASE;
        let line = describe(Some(&regs), Some(&sregs), None);
        assert!(line.contains("rip=0xfff0"), "{line}");
        assert!(
            line.ends_with(RESET_STATE_NOTE) && line.contains("state at the fault itself is lost"),
            "{line}"
        );
        // The same rip in another segment is a guest's own code.
        sregs.cs.base = 0x1_0000;
        let line = describe(Some(&regs), Some(&sregs), None);
        assert!(!line.contains("reset state"), "{line}");
    }
}
