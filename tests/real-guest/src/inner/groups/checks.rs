//! Checks on what a real guest reported about itself.

/// Warning-level kernel messages that mean something went wrong in the
/// guest (every message at error level or worse does too).
const BAD: &[&str] = &[
    "not listed by BIOS",
    "WARNING:",
    "BUG:",
    "Oops",
    "Call Trace",
    "soft lockup",
    "hung_task",
    "rcu_preempt detected stalls",
    "rcu: INFO",
    "unstable",
    "i8042: Can't read CTR",
    "probe of i8042 failed",
    "MTRRs disabled",
    "Kernel panic",
];

/// Messages let through: artefacts of the nested setup, and one of pci=off.
///
/// * QEMU's software SVM does not intercept XSETBV, so the outer VM's KVM
///   never learns the guest's XCR0 and reports a CPUID XSAVE size that does
///   not match, and the guest kernel warns `XSAVE consistency problem` with
///   a stack trace up to `---[ end trace`. Hardware KVM does not do that.
/// * The clocksource watchdog compares the TSC against the guest's clock
///   while every guest exit is emulated instruction by instruction, and may
///   find the skew too large and mark the TSC unstable. The guest's clock is
///   kvm-clock (checked separately); a kvm-clock marked unstable still fails.
const TSC_UNSTABLE: &str = "Marking clocksource 'tsc' as unstable";
/// The vmm has no PCI and the command line says `pci=off`, yet Debian's
/// kernel (built with PCI) still looks for a config-space access method
/// and reports, at error level, that there is none. Nothing is wrong.
const NO_PCI: &str = "PCI: Fatal: No config space access function found";

/// The kernel messages (from `RG-DMESG:` lines, `<level>` first) that
/// report a problem: any at error level or worse (0-3), and warnings
/// that match [`BAD`].
pub fn bad_kernel_messages(lines: &[String]) -> Vec<String> {
    let mut bad = Vec::new();
    let mut in_xsave_warning = false;
    for l in lines {
        let Some((_, msg)) = l.split_once("RG-DMESG: ") else {
            continue;
        };
        if msg.contains("XSAVE consistency problem") {
            in_xsave_warning = true;
            continue;
        }
        if in_xsave_warning {
            if msg.contains("end trace") {
                in_xsave_warning = false;
            }
            continue;
        }
        if msg.contains(TSC_UNSTABLE) || msg.contains(NO_PCI) {
            continue;
        }
        let level = msg
            .strip_prefix('<')
            .and_then(|m| m.split_once('>'))
            .and_then(|(n, _)| n.parse::<u8>().ok())
            .unwrap_or(4);
        if level <= 3 || BAD.iter().any(|b| msg.contains(b)) {
            bad.push(msg.to_string());
        }
    }
    bad
}

/// The value of `RG-FACT <key> <value>`.
pub fn fact(lines: &[String], key: &str) -> Option<String> {
    let prefix = format!("RG-FACT {key} ");
    lines
        .iter()
        .find_map(|l| l.split_once(&prefix).map(|(_, v)| v.trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_xsave_artefact_is_let_through_and_nothing_else() {
        let l = lines(&[
            "RG-DMESG: <4>[0.1] x86/fpu: XSAVE consistency problem: size 2696 != kernel_size 576",
            "RG-DMESG: <4>[0.1] WARNING: CPU: 0 PID: 0 at arch/x86/kernel/fpu/xstate.c:761",
            "RG-DMESG: <4>[0.1] Call Trace:",
            "RG-DMESG: <4>[0.1] ---[ end trace 0000000000000000 ]---",
            "RG-DMESG: <3>[0.5] i8042: Can't read CTR while initializing i8042",
            "RG-DMESG: <4>[13.4] clocksource: timekeeping watchdog on CPU0: Marking clocksource 'tsc' as unstable because the skew is too large:",
            "RG-DMESG: <4>[13.5] clocksource: Marking clocksource 'kvm-clock' as unstable",
            "RG-DMESG: <3>[1.5] PCI: Fatal: No config space access function found",
            "RG-KLOG: [0.6] WARNING: only in a fact line",
            "RG-DMESG: <4>[0.7] CPUID[0d, 00]: eax=00000207 ebx=00000240",
            "RG-DMESG: <3>[0.8] ACPI BIOS Error (bug): A valid RSDP was not found",
        ]);
        assert_eq!(
            bad_kernel_messages(&l),
            [
                "<3>[0.5] i8042: Can't read CTR while initializing i8042",
                "<4>[13.5] clocksource: Marking clocksource 'kvm-clock' as unstable",
                "<3>[0.8] ACPI BIOS Error (bug): A valid RSDP was not found",
            ]
        );
    }

    #[test]
    fn facts_are_found_by_key() {
        let l = lines(&["junk", "RG-FACT nproc 2", "RG-FACT cmdline a b c"]);
        assert_eq!(fact(&l, "nproc").as_deref(), Some("2"));
        assert_eq!(fact(&l, "cmdline").as_deref(), Some("a b c"));
        assert_eq!(fact(&l, "clocksource"), None);
    }
}
