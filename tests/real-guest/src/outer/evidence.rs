//! What the harness knows when it gives up on an outer VM, and whether that
//! names the outer machine as the cause.
//!
//! An outer VM can fail for its own reasons (QEMU's software emulation of
//! SVM, its 9p share), and then the group is retried in a fresh one. But a
//! product that wedges or exhausts the outer VM (an out-of-memory panic
//! caused by the vmm or host-agent, a freeze, QEMU exiting) looks the same
//! from outside. So each infrastructure failure carries its evidence, and
//! scenarios that never got a healthy outer VM are a product failure unless
//! every failure's evidence names the outer machine: the outer kernel's own
//! panic (read on its own console, never from what a scenario relays) or a
//! livelock signature the runner recognised, with the outer VM's memory and
//! CPU state recorded at that moment.

use std::fmt;

/// The outer kernel's own panic line (on its console, `ttyS0`).
const PANIC: &str = "Kernel panic - not syncing";

/// Panic messages that say memory ran out: processes in the outer VM, the
/// product's among them, can cause that.
const OUT_OF_MEMORY: &[&str] = &[
    "Out of memory",
    "out of memory",
    "System is deadlocked on memory",
];

/// What a line of the outer kernel's console says about its health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelSign {
    /// The outer kernel panicked for a reason of its own.
    Panic(String),
    /// The outer kernel panicked because memory ran out.
    OutOfMemory(String),
}

/// Reads a line of the outer kernel's console (never a runner line).
pub fn kernel_sign(line: &str) -> Option<KernelSign> {
    let at = line.find(PANIC)?;
    let text = line[at..].trim().to_string();
    if OUT_OF_MEMORY.iter().any(|m| text.contains(m)) {
        Some(KernelSign::OutOfMemory(text))
    } else {
        Some(KernelSign::Panic(text))
    }
}

/// The figures of L1's latest heartbeat
/// (`L1-HEARTBEAT <uptime> mem_avail_kib=<n> load=<1m>,<5m>,<15m>`).
#[derive(Debug, Clone, PartialEq)]
pub struct Heartbeat {
    /// L1's uptime, seconds.
    pub uptime: f64,
    /// MemAvailable, KiB.
    pub mem_avail_kib: Option<u64>,
    /// The load averages.
    pub load: Option<String>,
}

/// Parses a heartbeat line; `None` for any other line.
pub fn heartbeat(line: &str) -> Option<Heartbeat> {
    let rest = line.split_once("L1-HEARTBEAT ")?.1;
    let mut words = rest.split_whitespace();
    let uptime = words.next()?.parse().ok()?;
    let mut hb = Heartbeat {
        uptime,
        mem_avail_kib: None,
        load: None,
    };
    for w in words {
        if let Some(v) = w.strip_prefix("mem_avail_kib=") {
            hb.mem_avail_kib = v.parse().ok();
        } else if let Some(v) = w.strip_prefix("load=") {
            hb.load = Some(v.replace(',', " "));
        }
    }
    Some(hb)
}

impl fmt::Display for Heartbeat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "L1 up {:.0} s", self.uptime)?;
        if let Some(kib) = self.mem_avail_kib {
            write!(f, ", {} MiB available", kib / 1024)?;
        }
        if let Some(l) = &self.load {
            write!(f, ", load {l}")?;
        }
        Ok(())
    }
}

/// One infrastructure failure: why the harness gave up on an outer VM (or
/// on a scenario in it), what in it names the outer machine, and the outer
/// VM's state recorded then.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Infra {
    /// What happened, for the summary.
    pub why: String,
    /// The evidence that the outer machine failed, not the product: the
    /// outer kernel's own panic, or a livelock or stall signature the
    /// runner recognised. `None` when nothing names it.
    pub signature: Option<String>,
    /// The outer VM's memory and CPU state when it was given up, as
    /// recorded (a summary and where the whole of it is).
    pub state: Option<String>,
}

impl Infra {
    /// A failure with no evidence naming the outer machine.
    pub fn unattributed(why: impl Into<String>) -> Infra {
        Infra {
            why: why.into(),
            ..Infra::default()
        }
    }

    /// A failure whose evidence (`signature`) names the outer machine.
    pub fn named(why: impl Into<String>, signature: impl Into<String>) -> Infra {
        Infra {
            why: why.into(),
            signature: Some(signature.into()),
            state: None,
        }
    }

    /// A failure read from the outer kernel's console line `sign`.
    pub fn from_kernel(sign: KernelSign) -> Infra {
        match sign {
            KernelSign::Panic(text) => Infra::named(format!("its kernel panicked: {text}"), text),
            KernelSign::OutOfMemory(text) => Infra::unattributed(format!(
                "its kernel ran out of memory: {text} (the product's processes may have \
                 exhausted it)"
            )),
        }
    }

    /// Whether the evidence names the outer machine: a signature, with the
    /// outer VM's state recorded.
    pub fn names_outer_machine(&self) -> bool {
        self.signature.is_some() && self.state.is_some()
    }

    /// One line for the summary.
    pub fn describe(&self) -> String {
        let mut s = self.why.clone();
        match (&self.signature, &self.state) {
            (Some(_), Some(st)) => s.push_str(&format!(" [names the outer machine; state: {st}]")),
            (Some(_), None) => {
                s.push_str(" [a sign of the outer machine, but its state could not be recorded]")
            }
            (None, Some(st)) => {
                s.push_str(&format!(" [nothing names the outer machine; state: {st}]"))
            }
            (None, None) => s.push_str(" [nothing names the outer machine; no state recorded]"),
        }
        s
    }
}

/// What became of scenarios no healthy outer VM ran, given every
/// infrastructure failure of their group: `Ok` (not run, the outer
/// machine's fault) when each failure names the outer machine, else `Err`
/// with the failures that do not (then they fail).
pub fn unrun_verdict(failures: &[Infra]) -> Result<(), Vec<&Infra>> {
    let unnamed: Vec<&Infra> = failures
        .iter()
        .filter(|f| !f.names_outer_machine())
        .collect();
    if unnamed.is_empty() && !failures.is_empty() {
        Ok(())
    } else {
        Err(unnamed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outer_kernel_s_panic_is_told_from_running_out_of_memory() {
        let own = "[  812.100231] Kernel panic - not syncing: Fatal exception in interrupt";
        assert_eq!(
            kernel_sign(own),
            Some(KernelSign::Panic(
                "Kernel panic - not syncing: Fatal exception in interrupt".into()
            ))
        );
        let oom = "[  90.1] Kernel panic - not syncing: System is deadlocked on memory";
        assert!(matches!(kernel_sign(oom), Some(KernelSign::OutOfMemory(_))));
        let oom2 = "Kernel panic - not syncing: Out of memory and no killable processes...";
        let infra = Infra::from_kernel(kernel_sign(oom2).unwrap());
        assert!(infra.signature.is_none(), "{infra:?}");
        assert_eq!(kernel_sign("[ 1.0] virtio_net virtio1 eth0: link up"), None);
    }

    #[test]
    fn heartbeats_carry_memory_and_load() {
        let hb =
            heartbeat("L1-HEARTBEAT 120.55 mem_avail_kib=3145728 load=1.50,0.80,0.30").unwrap();
        assert_eq!(hb.mem_avail_kib, Some(3_145_728));
        assert_eq!(
            hb.to_string(),
            "L1 up 121 s, 3072 MiB available, load 1.50 0.80 0.30"
        );
        // An older init's heartbeat has the uptime only.
        assert_eq!(heartbeat("L1-HEARTBEAT 12.0").unwrap().mem_avail_kib, None);
        assert_eq!(heartbeat("RGH START x"), None);
    }

    #[test]
    fn unrun_scenarios_are_the_outer_machine_s_only_when_every_failure_names_it() {
        let mut panic =
            Infra::from_kernel(KernelSign::Panic("Kernel panic - not syncing: x".into()));
        // A signature without the state recorded does not yet name it.
        assert!(!panic.names_outer_machine());
        panic.state = Some("L1 up 300 s, 12 MiB available".into());
        assert!(panic.names_outer_machine());
        assert_eq!(unrun_verdict(&[panic.clone(), panic.clone()]), Ok(()));
        let mut freeze = Infra::unattributed("the outer VM froze: no heartbeat for 150 s");
        freeze.state = Some("registers recorded".into());
        let failures = [panic.clone(), freeze.clone(), panic];
        assert_eq!(unrun_verdict(&failures), Err(vec![&freeze]));
        // No failure at all explains nothing.
        assert!(unrun_verdict(&[]).is_err());
    }
}
