//! `host-agent demo` (the root README's first command, through
//! `scripts/demo`): it starts its own daemon, runs a session through every
//! step, prints the events and usage as they arrive and a summary, and
//! leaves no process or state directory behind.

mod common;

use std::process::Command;

use common::*;

#[test]
fn the_demo_runs_a_session_through_every_step_and_cleans_up() {
    let out = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["demo", "--step-seconds", "1", "--kernel"])
        .arg(counter_kernel())
        .arg("--vmm")
        .arg(vmm_path())
        .output()
        .expect("running host-agent demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {text}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every lifecycle step arrived as an event, in order.
    let transitions = [
        "NONE -> PENDING",
        "PENDING -> RESTORING",
        "RESTORING -> READY",
        "READY -> RUNNING",
        "RUNNING -> PAUSED",
        "PAUSED -> RUNNING",
        "RUNNING -> STOPPING",
        "STOPPING -> STOPPED",
    ];
    let mut at = 0;
    for t in transitions {
        let found = text[at..]
            .find(t)
            .unwrap_or_else(|| panic!("no event {t:?} after byte {at}:\n{text}"));
        at += found;
    }
    assert!(text.contains("(final)"), "the final usage record: {text}");
    assert!(text.contains("pages written"), "the snapshot: {text}");
    let billed: f64 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("billed"))
        .and_then(|v| v.trim().strip_suffix(" s"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no billed seconds in the summary:\n{text}"));
    assert!(billed > 0.0, "{text}");
    assert!(
        text.contains("final state") && text.contains("STOPPED"),
        "{text}"
    );
    // Its temporary state directory is gone.
    let state = text
        .lines()
        .find_map(|l| l.split("its log: ").nth(1))
        .and_then(|log| {
            std::path::Path::new(log.trim())
                .parent()
                .map(|p| p.to_path_buf())
        })
        .unwrap_or_else(|| panic!("no state directory named:\n{text}"));
    assert!(!state.exists(), "{} left behind", state.display());
}
