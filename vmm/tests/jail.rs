//! `vmm jail`, checked from outside through /proc: the jailed vmm has its own
//! mount, PID, IPC and UTS namespaces, the jail directory as its root, the
//! unprivileged uid/gid, the resource limit and the cgroup limits asked for;
//! a host tap moved into its network namespace carries the guest's frame and
//! comes back afterwards; a jailed restore serves memory through userfaultfd.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::counter::*;
use common::*;

fn ns(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// The jailer's child in a PID namespace of its own: the vmm (the jailer
/// also forks, briefly, the intermediate of the VM's detached keeper).
fn find_jailed_vmm(jailer: u32) -> String {
    let start = Instant::now();
    let jailer_ns = ns(&jailer.to_string(), "pid");
    loop {
        let children = std::fs::read_to_string(format!("/proc/{jailer}/task/{jailer}/children"))
            .unwrap_or_default();
        let jailed = children.split_whitespace().find(|pid| {
            std::fs::read_link(format!("/proc/{pid}/ns/pid"))
                .is_ok_and(|l| l.to_string_lossy() != jailer_ns)
        });
        if let Some(pid) = jailed {
            return pid.to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the jailed vmm never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A jailed vmm as uid/gid 65534 rooted at `root`, with `bind`
/// (`HOST:/JAIL[:ro]`), the jail options `opts`, and `vmm_args` for the vmm
/// inside (its control socket is /run/ctl.sock in the jail).
fn jailed(
    id: &str,
    root: &Path,
    bind: &str,
    opts: &[&str],
    vmm_args: &[&str],
) -> std::process::Child {
    vmm()
        .args(["jail", "--id", id, "--root", root.to_str().unwrap()])
        .args(["--uid", "65534", "--gid", "65534", "--bind", bind])
        .args(opts)
        .arg("--")
        .args(vmm_args)
        .args(["--control-socket", "/run/ctl.sock"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until `path` holds `text`.
fn wait_for_text(path: &Path, text: &str) -> String {
    let start = Instant::now();
    loop {
        let got = std::fs::read_to_string(path).unwrap_or_default();
        if got.contains(text) {
            return got;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} never showed {text:?}: {got:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_jailed_vmm_is_confined_as_asked() {
    if !jail_supported() {
        return;
    }
    let cgroup_root = Path::new("/sys/fs/cgroup");
    let v2 = cgroup_root.join("cgroup.controllers").exists();
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let id = format!("test-{}", std::process::id());
    let g = guest("counter");
    let kernel_bind = format!("{}:/kernel:ro", g.display());
    let child = jailed(
        &id,
        &root,
        &kernel_bind,
        &[
            "--cpu-max",
            "50000/100000",
            "--memory-max",
            "512M",
            "--nofile",
            "256",
        ],
        &["run", "--kernel", "/kernel", "--serial", "none"],
    );
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
    let status = wait_main_thread_filtered(&pid);
    assert!(
        status.contains("Uid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
    assert!(
        status.contains("Gid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
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

    // The VM's keeper was forked by the jailer outside the namespaces: the
    // vmm holds the socket it was given and forked none of its own.
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let fd = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"AGENTVM_VM_KEEPER_FD="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .expect("the jailer passed a keeper socket");
    let target = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap();
    assert!(
        target.to_string_lossy().starts_with("socket:"),
        "{target:?}"
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap(),
        "",
        "the jailed vmm forked a keeper inside its namespace"
    );

    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("keeper"), "{}", stderr(&out));
}

#[test]
fn a_jailed_vmm_dies_with_its_jailer() {
    if !jail_supported() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let id = format!("die-{}", std::process::id());
    let kernel_bind = format!("{}:/kernel:ro", guest("counter").display());
    let mut child = jailed(
        &id,
        &root,
        &kernel_bind,
        &[],
        &["run", "--kernel", "/kernel", "--serial", "none"],
    );
    let pid = find_jailed_vmm(child.id());
    let mut ctl = Control::connect(&root.join("run/ctl.sock"));
    assert_eq!(ctl.send_raw(r#"{"op":"status"}"#)["state"], "running");
    // SIGKILL cannot be forwarded; the vmm's parent-death signal takes it down.
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the jailed vmm outlived its SIGKILLed jailer"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Tries a TCP connection to `addr` from inside the network namespace of
/// process `pid` (on a fresh thread: setns changes only the calling thread).
fn connect_from_netns_of(pid: &str, addr: std::net::SocketAddr) -> std::io::Result<()> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: setns on an open namespace fd; it changes only this thread.
        assert_eq!(
            unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
            0
        );
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map(drop)
    })
    .join()
    .unwrap()
}

#[test]
fn a_jailed_vmm_has_its_own_network_namespace_and_cannot_reach_host_loopback() {
    if !jail_supported() {
        return;
    }
    // A host service on loopback, as host-agent's gRPC port is.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let id = format!("netns-{}", std::process::id());
    let kernel_bind = format!("{}:/kernel:ro", guest("counter").display());
    // No network option at all: the namespace is the default.
    let child = jailed(
        &id,
        &root,
        &kernel_bind,
        &[],
        &["run", "--kernel", "/kernel", "--serial", "none"],
    );
    let pid = find_jailed_vmm(child.id());
    let ctl = Control::connect(&root.join("run/ctl.sock"));
    assert_ne!(
        ns(&pid, "net"),
        ns("self", "net"),
        "the jailed vmm shares the host's network namespace"
    );
    // The test's own namespace reaches the service...
    connect_from_netns_of("self", addr).expect("the host reaches its own loopback service");
    // ...the jail's does not: its loopback is its own, and nothing else is there.
    let err = connect_from_netns_of(&pid, addr)
        .expect_err("the jailed vmm's namespace reached a host loopback port");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let links: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(links, vec!["lo"], "{dev}");
    stop(ctl, child);
}

/// A host tap for a test, removed on drop wherever it ended up.
struct HostTap(String);

impl Drop for HostTap {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .output();
    }
}

/// A jailed vmm running the virtio-net test guest on `tap` (jail options
/// `opts`), once the guest has sent its frame: the jailed vmm's pid and its
/// control connection.
fn jailed_net_guest(
    id: &str,
    root: &Path,
    opts: &[&str],
    net: &str,
) -> (std::process::Child, String, Control) {
    let kernel_bind = format!("{}:/kernel:ro", guest("virtio_net").display());
    let child = jailed(
        id,
        root,
        &kernel_bind,
        opts,
        &[
            "run",
            "--kernel",
            "/kernel",
            "--net",
            net,
            "--serial",
            "file:/run/serial.log",
            "--cmdline",
            "console=ttyS0 rx_spins=4000000000",
        ],
    );
    let pid = find_jailed_vmm(child.id());
    let ctl = Control::connect(&root.join("run/ctl.sock"));
    let log = wait_for_text(&root.join("run/serial.log"), "net: sent");
    assert!(log.contains("net.tx_used="), "{log}");
    (child, pid, ctl)
}

/// Packets `tap` received in the network namespace of process `pid`.
fn tap_rx_packets(pid: &str, tap: &str) -> u64 {
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let line = dev
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{tap}:")))
        .unwrap_or_else(|| panic!("{tap} is not in the namespace of {pid}: {dev}"));
    line.split(':')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_host_tap_moves_into_the_jails_network_namespace_and_back() {
    if !jail_supported() {
        return;
    }
    if !Path::new("/dev/net/tun").exists() {
        println!("skipped: /dev/net/tun is missing");
        return;
    }
    let tap = HostTap(format!("jt{}", std::process::id() % 100_000));
    vmm::devices::virtio::net::tap::make_persistent(&tap.0, None, None).unwrap();
    let on_host = Path::new("/sys/class/net").join(&tap.0);
    assert!(on_host.exists());

    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let id = format!("tap-{}", std::process::id());
    let net = format!("{},mac=02:11:22:33:44:55", tap.0);
    let (child, pid, mut ctl) = jailed_net_guest(&id, &root, &["--tap", &tap.0], &net);

    assert_ne!(
        ns(&pid, "net"),
        ns("self", "net"),
        "net namespace is shared"
    );
    assert!(
        !on_host.exists(),
        "the tap is still in the host's namespace"
    );
    // The jailed vmm (uid 65534) attached to the tap by name...
    let attached = std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .any(|info| info.contains(&format!("iff:\t{}", tap.0)));
    assert!(attached, "the jailed vmm has no fd on {}", tap.0);
    // ...and the guest's frame arrived on it, inside the jail's namespace.
    assert!(tap_rx_packets(&pid, &tap.0) >= 1);
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    assert!(dev.contains("lo:"), "{dev}");

    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(on_host.exists(), "the tap did not come back to the host");
}

/// A network namespace for a test, removed on drop.
struct TestNetns(String);

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .output();
    }
}

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_jailed_vmm_joins_the_network_namespace_it_is_given_and_serves_its_tap() {
    if !jail_supported() {
        return;
    }
    if !Path::new("/dev/net/tun").exists() {
        println!("skipped: /dev/net/tun is missing");
        return;
    }
    // As host-agent makes a VM's network: a namespace holding a tap owned by
    // the jail's uid.
    let netns = TestNetns(format!("jn{}", std::process::id()));
    let _ = std::process::Command::new("ip")
        .args(["netns", "del", &netns.0])
        .output();
    ip(&["netns", "add", &netns.0]);
    ip(&[
        "-n", &netns.0, "tuntap", "add", "dev", "tap0", "mode", "tap", "user", "65534", "group",
        "65534",
    ]);
    ip(&["-n", &netns.0, "link", "set", "tap0", "up"]);
    let netns_path = format!("/run/netns/{}", netns.0);

    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let id = format!("join-{}", std::process::id());
    let (child, pid, mut ctl) = jailed_net_guest(
        &id,
        &root,
        &[
            "--netns-path",
            &netns_path,
            "--device",
            "kvm",
            "--device",
            "urandom",
            "--device",
            "tun",
        ],
        "tap0,mac=02:11:22:33:44:56",
    );
    // The vmm's namespace is the one given, not a new one.
    let given = std::fs::metadata(&netns_path).unwrap().ino();
    assert_eq!(ns(&pid, "net"), format!("net:[{given}]"));
    // The guest's frame arrived on the given namespace's tap.
    assert!(tap_rx_packets(&pid, "tap0") >= 1);
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // The host's own namespace (this test's) is refused.
    let host_ns = format!("/proc/{}/ns/net", std::process::id());
    let refused = vmm()
        .args([
            "jail",
            "--id",
            "hostns",
            "--root",
            t.path().join("r2").to_str().unwrap(),
        ])
        .args(["--uid", "65534", "--gid", "65534", "--netns-path", &host_ns])
        .args(["--", "run", "--kernel", "/kernel"])
        .output()
        .unwrap();
    assert_ne!(refused.status.code(), Some(0));
    assert!(
        stderr(&refused).contains("host's own network namespace"),
        "{}",
        stderr(&refused)
    );
    // The namespace and its tap outlive the VM: they are the caller's.
    let after = std::process::Command::new("ip")
        .args(["-n", &netns.0, "-o", "link"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&after.stdout).contains("tap0"));
}

#[test]
fn a_jailed_restore_serves_memory_through_userfaultfd() {
    if !jail_supported() {
        return;
    }
    if !Path::new("/dev/userfaultfd").exists() {
        println!("skipped: the host has no /dev/userfaultfd (Linux 6.1+)");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (snap, last) = counter_snapshot(t.path());
    let root = t.path().join("root");
    let id = format!("uffd-{}", std::process::id());
    let snap_bind = format!("{}:/snap:ro", snap.display());
    let child = jailed(
        &id,
        &root,
        &snap_bind,
        &[
            "--device",
            "kvm",
            "--device",
            "urandom",
            "--device",
            "userfaultfd",
        ],
        &[
            "restore",
            "--snapshot",
            "/snap",
            "--memory-backend",
            "uffd",
            "--serial",
            "file:/run/serial.log",
        ],
    );
    let pid = find_jailed_vmm(child.id());
    let ctl = Control::connect(&root.join("run/ctl.sock"));
    let after = wait_for_counts(&root.join("run/serial.log"), 2);
    assert_continues(after[0], last);

    let status = wait_main_thread_filtered(&pid);
    assert!(
        status.contains("Uid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
    let uffd = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .any(|target| target.to_string_lossy().contains("userfaultfd"));
    assert!(uffd, "the jailed vmm holds no userfaultfd");
    stop(ctl, child);
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
        (
            vec![
                "--id", "x", "--root", r, "--uid", "1", "--gid", "1", "--tap", "a/b",
            ],
            "invalid tap name",
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
