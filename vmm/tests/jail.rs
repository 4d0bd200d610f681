//! `vmm jail`, checked from outside through /proc: the jailed vmm has its own
//! mount, PID, IPC and UTS namespaces, the jail directory as its root, the
//! unprivileged uid/gid, the resource limit and the cgroup limits asked for.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

fn ns(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn find_jailed_vmm(jailer: u32) -> String {
    let start = Instant::now();
    loop {
        let children = std::fs::read_to_string(format!("/proc/{jailer}/task/{jailer}/children"))
            .unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next() {
            return pid.to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the jailed vmm never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_jailed_vmm_is_confined_as_asked() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: vmm jail needs root (namespaces, device nodes, cgroups)");
        return;
    }
    let cgroup_root = Path::new("/sys/fs/cgroup");
    let v2 = cgroup_root.join("cgroup.controllers").exists();
    if !v2 && !cgroup_root.join("cpu/cgroup.procs").exists() {
        println!("skipped: no cgroup v2 or v1 cpu/memory hierarchy at /sys/fs/cgroup");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let id = format!("test-{}", std::process::id());
    let g = guest("counter");
    let kernel_bind = format!("{}:/kernel:ro", g.display());
    let child = vmm()
        .args(["jail", "--id", &id, "--root", root.to_str().unwrap()])
        .args(["--uid", "65534", "--gid", "65534", "--bind", &kernel_bind])
        .args([
            "--cpu-max",
            "50000/100000",
            "--memory-max",
            "512M",
            "--nofile",
            "256",
        ])
        .args(["--", "run", "--kernel", "/kernel", "--serial", "none"])
        .args(["--control-socket", "/run/ctl.sock"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = find_jailed_vmm(child.id());
    let mut ctl = Control::connect(&root.join("run/ctl.sock"));
    assert_eq!(ctl.send_raw(r#"{"op":"status"}"#)["state"], "running");

    for kind in ["mnt", "pid", "ipc", "uts"] {
        assert_ne!(
            ns(&pid, kind),
            ns("self", kind),
            "{kind} namespace is shared"
        );
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status.contains("Uid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
    assert!(
        status.contains("Gid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
    assert!(status.contains("Seccomp:\t2"), "{status}");
    let jail_root = std::fs::metadata(format!("/proc/{pid}/root/")).unwrap();
    let expected = std::fs::metadata(&root).unwrap();
    assert_eq!(
        (jail_root.dev(), jail_root.ino()),
        (expected.dev(), expected.ino())
    );
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    assert!(
        limits.lines().any(|l| l.starts_with("Max open files")
            && l.split_whitespace().filter(|w| *w == "256").count() == 2),
        "{limits}"
    );
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(cgroups.contains(&format!("/agentvm/{id}")), "{cgroups}");
    if v2 {
        let dir = cgroup_root.join("agentvm").join(&id);
        assert_eq!(
            std::fs::read_to_string(dir.join("cpu.max")).unwrap().trim(),
            "50000 100000"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.max"))
                .unwrap()
                .trim(),
            (512u64 << 20).to_string()
        );
    } else {
        let cpu = cgroup_root.join("cpu/agentvm").join(&id);
        let mem = cgroup_root.join("memory/agentvm").join(&id);
        assert_eq!(
            std::fs::read_to_string(cpu.join("cpu.cfs_quota_us"))
                .unwrap()
                .trim(),
            "50000"
        );
        assert_eq!(
            std::fs::read_to_string(mem.join("memory.limit_in_bytes"))
                .unwrap()
                .trim(),
            (512u64 << 20).to_string()
        );
    }

    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn jail_options_are_checked_before_anything_is_created() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let r = root.to_str().unwrap();
    for (args, expect) in [
        (
            vec!["--id", "bad id", "--root", r, "--uid", "1", "--gid", "1"],
            "invalid jail id",
        ),
        (
            vec!["--id", "x", "--root", r, "--uid", "0", "--gid", "1"],
            "must not run as uid or gid 0",
        ),
        (
            vec![
                "--id", "x", "--root", r, "--uid", "1", "--gid", "1", "--device", "sda",
            ],
            "unknown device \"sda\"",
        ),
        (
            vec![
                "--id", "x", "--root", r, "--uid", "1", "--gid", "1", "--bind", "/a:rel",
            ],
            "invalid bind",
        ),
        (
            vec![
                "--id",
                "x",
                "--root",
                r,
                "--uid",
                "1",
                "--gid",
                "1",
                "--cpu-max",
                "half",
            ],
            "invalid CPU limit",
        ),
    ] {
        let mut full = vec!["jail"];
        full.extend(args);
        full.extend(["--", "run", "--kernel", "/kernel"]);
        let out = run_vmm(&full);
        assert_eq!(out.status.code(), Some(2), "{full:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expect), "{full:?}: {}", stderr(&out));
        assert!(!root.exists(), "{full:?} created the jail before refusing");
    }
}
