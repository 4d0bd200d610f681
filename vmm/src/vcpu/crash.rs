//! What a vCPU looked like when the guest failed at the CPU level (triple
//! fault, KVM internal error, failed entry): one line for the log, so that
//! a crash seen once (a rare guest or emulation fault) can be told apart
//! afterwards without a debugger attached. Besides the registers and the
//! pending events it gives the vCPU's last exits and how many it made since
//! the vmm wrote its state, which tells a fault on state the vmm wrote (a
//! restore or SMP bring-up bug) from one the guest ran into.

use std::fmt::Write;

use kvm_bindings::{kvm_lapic_state, kvm_regs, kvm_sregs, kvm_vcpu_events};
use kvm_ioctls::VcpuFd;

use super::exit_log::ExitLog;

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

/// Said when the failure came before the vCPU made a single exit since the
/// vmm wrote its state. Test harnesses grep for this phrase (it fails a run
/// whose crash came from state the vmm wrote): keep it as it is.
pub const FIRST_ENTRY_NOTE: &str = "on the first entry after the vmm wrote its state";

/// The LAPIC's Interrupt Request and In-Service registers: eight 32-bit
/// registers each, 16 bytes apart, in `kvm_lapic_state.regs`.
const LAPIC_IRR: usize = 0x200;
const LAPIC_ISR: usize = 0x100;
const LAPIC_VECTOR_REG_STRIDE: usize = 0x10;
const LAPIC_VECTOR_REGS: usize = 8;

/// What the crash report reads back from a vCPU; each part KVM would not
/// give is `None`, and named as missing in the report.
#[derive(Default)]
pub struct Readings {
    /// KVM_GET_REGS.
    pub regs: Option<kvm_regs>,
    /// KVM_GET_SREGS.
    pub sregs: Option<kvm_sregs>,
    /// KVM_GET_VCPU_EVENTS.
    pub events: Option<kvm_vcpu_events>,
    /// KVM_GET_LAPIC (fails without an in-kernel LAPIC).
    pub lapic: Option<kvm_lapic_state>,
}

/// Reads what the report needs from the vCPU, keeping what KVM gives.
pub fn read(fd: &VcpuFd) -> Readings {
    Readings {
        regs: fd.get_regs().ok(),
        sregs: fd.get_sregs().ok(),
        events: fd.get_vcpu_events().ok(),
        lapic: fd.get_lapic().ok(),
    }
}

/// Reads the vCPU's registers, pending events and LAPIC and describes them
/// with its last exits; a part KVM would not give is named as missing
/// rather than failing the report.
pub fn state(fd: &VcpuFd, exits: &ExitLog) -> String {
    describe(&read(fd), exits)
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
/// EFER, the code segment, the descriptor tables, general registers, any
/// exception KVM had pending or injected; then, `; `-separated, the
/// interrupt and NMI state, the LAPIC's pending and in-service vectors, the
/// last exits oldest first, and the exits since the vmm wrote the state
/// (with [`FIRST_ENTRY_NOTE`] when there were none).
pub fn describe(readings: &Readings, exits: &ExitLog) -> String {
    let mut out = String::new();
    registers(&mut out, readings.regs.as_ref(), readings.sregs.as_ref());
    events(&mut out, readings.events.as_ref());
    lapic(&mut out, readings.lapic.as_ref());
    history(&mut out, exits);
    out
}

/// The general and system registers, and the reset-state note.
fn registers(out: &mut String, regs: Option<&kvm_regs>, sregs: Option<&kvm_sregs>) {
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
}

/// The exception, interrupt and NMI KVM had pending or injected.
fn events(out: &mut String, events: Option<&kvm_vcpu_events>) {
    let Some(e) = events else {
        out.push_str("; interrupt, nmi: unavailable (KVM_GET_VCPU_EVENTS failed)");
        return;
    };
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
    let i = &e.interrupt;
    if i.injected != 0 {
        let _ = write!(out, "; interrupt: {:#x} injected", i.nr);
        if i.soft != 0 {
            out.push_str(" (soft)");
        }
    } else {
        out.push_str("; interrupt: none");
    }
    if i.shadow != 0 {
        let _ = write!(out, ", interrupt shadow {:#x}", i.shadow);
    }
    let n = &e.nmi;
    let nmi: Vec<&str> = [
        (n.injected, "injected"),
        (n.pending, "pending"),
        (n.masked, "masked"),
    ]
    .into_iter()
    .filter(|(set, _)| *set != 0)
    .map(|(_, name)| name)
    .collect();
    if nmi.is_empty() {
        out.push_str("; nmi: none");
    } else {
        let _ = write!(out, "; nmi: {}", nmi.join(", "));
    }
}

/// Whether the LAPIC holds requested (IRR) and in-service (ISR) vectors:
/// the highest of each, and how many.
fn lapic(out: &mut String, lapic: Option<&kvm_lapic_state>) {
    let Some(l) = lapic else {
        out.push_str("; lapic: unavailable (KVM_GET_LAPIC failed)");
        return;
    };
    out.push_str("; lapic: irr ");
    vectors(out, &vector_bits(l, LAPIC_IRR));
    out.push_str(", isr ");
    vectors(out, &vector_bits(l, LAPIC_ISR));
}

/// The 256 bits of the LAPIC vector register set at `base`, as eight
/// words (vector `v` is bit `v % 32` of word `v / 32`).
fn vector_bits(lapic: &kvm_lapic_state, base: usize) -> [u32; LAPIC_VECTOR_REGS] {
    let mut words = [0u32; LAPIC_VECTOR_REGS];
    for (i, word) in words.iter_mut().enumerate() {
        let at = base + i * LAPIC_VECTOR_REG_STRIDE;
        let mut bytes = [0u8; 4];
        for (b, r) in bytes.iter_mut().zip(&lapic.regs[at..at + 4]) {
            *b = r.to_ne_bytes()[0];
        }
        *word = u32::from_le_bytes(bytes);
    }
    words
}

/// `empty`, or the highest vector set and how many are.
fn vectors(out: &mut String, words: &[u32; LAPIC_VECTOR_REGS]) {
    let count: u32 = words.iter().map(|w| w.count_ones()).sum();
    let highest = words
        .iter()
        .enumerate()
        .rev()
        .find(|(_, w)| **w != 0)
        .map(|(i, w)| i * 32 + (31 - w.leading_zeros() as usize));
    match highest {
        Some(v) => {
            let _ = write!(out, "{v:#x} (highest of {count})");
        }
        None => out.push_str("empty"),
    }
}

/// The last exits, oldest first, and how many since the vmm wrote the state.
fn history(out: &mut String, exits: &ExitLog) {
    out.push_str("; last exits: ");
    let mut any = false;
    for exit in exits.recent() {
        if any {
            out.push_str(", ");
        }
        any = true;
        let _ = write!(out, "{exit}");
    }
    if !any {
        out.push_str("none");
    }
    let count = exits.count();
    let _ = write!(out, "; exits since the vmm set this vCPU's state: {count}");
    if count == 0 {
        let _ = write!(out, " (the failure came {FIRST_ENTRY_NOTE})");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vcpu::exit_log::{Exit, KEPT};

    /// Registers and system registers of a 64-bit guest.
    fn long_mode() -> (kvm_regs, kvm_sregs) {
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
        (regs, sregs)
    }

    /// A log of `n` port writes to 0, 1, ...
    fn exits(n: u16) -> ExitLog {
        let mut log = ExitLog::new();
        for port in 0..n {
            log.record(Exit::IoOut(port));
        }
        log
    }

    /// Sets `vector` in the LAPIC vector register set at `base`.
    fn set_vector(lapic: &mut kvm_lapic_state, base: usize, vector: usize) {
        let at = base + (vector / 32) * LAPIC_VECTOR_REG_STRIDE + (vector % 32) / 8;
        let byte = lapic.regs[at].to_ne_bytes()[0] | (1 << (vector % 8));
        lapic.regs[at] = std::os::raw::c_char::from_ne_bytes([byte]);
    }

    #[test]
    fn every_register_set_is_described_or_named_missing() {
        let (regs, sregs) = long_mode();
        let mut events = kvm_vcpu_events::default();
        events.exception.injected = 1;
        events.exception.nr = 13;
        events.exception.has_error_code = 1;
        events.exception.error_code = 0x1a;
        let readings = Readings {
            regs: Some(regs),
            sregs: Some(sregs),
            events: Some(events),
            lapic: Some(kvm_lapic_state::default()),
        };

        let line = describe(&readings, &exits(3));
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
        assert!(!line.contains("reset state"), "{line}");

        let none = describe(&Readings::default(), &exits(3));
        assert_eq!(
            none,
            "registers unavailable system registers unavailable\
             ; interrupt, nmi: unavailable (KVM_GET_VCPU_EVENTS failed)\
             ; lapic: unavailable (KVM_GET_LAPIC failed)\
             ; last exits: io_out 0x0, io_out 0x1, io_out 0x2\
             ; exits since the vmm set this vCPU's state: 3"
        );
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
        let mut readings = Readings {
            regs: Some(regs),
            sregs: Some(sregs),
            ..Default::default()
        };
        // The note stays with the first-entry note and with the exit count.
        for log in [exits(0), exits(5)] {
            let line = describe(&readings, &log);
            assert!(line.contains("rip=0xfff0"), "{line}");
            assert!(line.contains(RESET_STATE_NOTE), "{line}");
            assert!(line.contains("state at the fault itself is lost"), "{line}");
            let count = format!("exits since the vmm set this vCPU's state: {}", log.count());
            assert!(line.contains(&count), "{line}");
        }
        // The same rip in another segment is a guest's own code.
        if let Some(s) = readings.sregs.as_mut() {
            s.cs.base = 0x1_0000;
        }
        let line = describe(&readings, &exits(0));
        assert!(!line.contains("reset state"), "{line}");
    }

    #[test]
    fn the_last_exits_are_described_oldest_first() {
        let mut log = ExitLog::new();
        log.record(Exit::IoOut(0x3f8));
        log.record(Exit::MmioWrite(0xd000_0000));
        log.record(Exit::Hlt);
        let line = describe(&Readings::default(), &log);
        assert!(
            line.contains(
                "; last exits: io_out 0x3f8, mmio_write 0xd0000000, hlt\
                 ; exits since the vmm set this vCPU's state: 3"
            ),
            "{line}"
        );

        // Past the ring's size: the last KEPT, oldest first, and the count
        // of all of them.
        let total = KEPT as u16 + 4;
        let line = describe(&Readings::default(), &exits(total));
        let listed: Vec<String> = (4..total).map(|p| format!("io_out {p:#x}")).collect();
        let expected = format!("; last exits: {};", listed.join(", "));
        assert!(line.contains(&expected), "{expected:?} missing from {line}");
        assert!(!line.contains("io_out 0x3,"), "{line}");
        assert!(
            line.contains(&format!(
                "exits since the vmm set this vCPU's state: {total}"
            )),
            "{line}"
        );
    }

    #[test]
    fn a_failure_before_any_exit_is_said_to_be_on_the_first_entry() {
        let first = describe(&Readings::default(), &ExitLog::new());
        assert!(first.contains("; last exits: none;"), "{first}");
        assert!(
            first.ends_with(
                "exits since the vmm set this vCPU's state: 0 \
                 (the failure came on the first entry after the vmm wrote its state)"
            ),
            "{first}"
        );
        // The exact phrase the test harnesses look for.
        assert!(
            first.contains("on the first entry after the vmm wrote its state"),
            "{first}"
        );
        for n in [1, KEPT as u16 + 1] {
            let later = describe(&Readings::default(), &exits(n));
            assert!(
                later.ends_with(&format!("exits since the vmm set this vCPU's state: {n}")),
                "{later}"
            );
            assert!(!later.contains(FIRST_ENTRY_NOTE), "{later}");
        }
    }

    #[test]
    fn pending_interrupts_nmis_and_lapic_vectors_are_described() {
        let mut events = kvm_vcpu_events::default();
        events.interrupt.injected = 1;
        events.interrupt.nr = 0x30;
        events.interrupt.shadow = 1;
        events.nmi.pending = 1;
        events.nmi.masked = 1;
        let mut lapic = kvm_lapic_state::default();
        for v in [0x31, 0xec, 0x20] {
            set_vector(&mut lapic, LAPIC_IRR, v);
        }
        set_vector(&mut lapic, LAPIC_ISR, 0xef);
        let readings = Readings {
            events: Some(events),
            lapic: Some(lapic),
            ..Default::default()
        };
        let line = describe(&readings, &exits(1));
        assert!(
            line.contains(
                "; interrupt: 0x30 injected, interrupt shadow 0x1\
                 ; nmi: pending, masked\
                 ; lapic: irr 0xec (highest of 3), isr 0xef (highest of 1)"
            ),
            "{line}"
        );

        let quiet = Readings {
            events: Some(kvm_vcpu_events::default()),
            lapic: Some(kvm_lapic_state::default()),
            ..Default::default()
        };
        let line = describe(&quiet, &exits(1));
        assert!(
            line.contains("; interrupt: none; nmi: none; lapic: irr empty, isr empty;"),
            "{line}"
        );
    }

    #[test]
    fn an_unreadable_lapic_or_event_set_is_named() {
        let readings = Readings {
            events: Some(kvm_vcpu_events::default()),
            lapic: None,
            ..Default::default()
        };
        let line = describe(&readings, &exits(2));
        assert!(
            line.contains("; lapic: unavailable (KVM_GET_LAPIC failed)"),
            "{line}"
        );
        assert!(line.contains("; interrupt: none; nmi: none"), "{line}");
        // The rest of the report is still there.
        assert!(
            line.contains("; last exits: io_out 0x0, io_out 0x1;"),
            "{line}"
        );

        let readings = Readings {
            lapic: Some(kvm_lapic_state::default()),
            ..Default::default()
        };
        let line = describe(&readings, &exits(2));
        assert!(
            line.contains("; interrupt, nmi: unavailable (KVM_GET_VCPU_EVENTS failed)"),
            "{line}"
        );
        assert!(line.contains("; lapic: irr empty"), "{line}");
    }
}
