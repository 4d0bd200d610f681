//! Tests of the `vmm` command line: what vmm-api builds parses here into the values it was built from.

use super::*;
use clap::Parser;
use vmm_api::command::{
    Bind, Devices, DiskSpec, JailSpec, NetSpec, RestoreSpec, RunSpec, Serial, VsockSpec,
};
use vmm_api::rate_limit::RateLimit;

fn devices() -> Devices {
    let mut limited = DiskSpec::ro("/d/ro.img");
    limited.limits.bandwidth = Some(RateLimit {
        size: 4 << 20,
        burst: 1 << 20,
        refill_ms: 250,
    });
    limited.limits.ops = Some(RateLimit::per_second(100));
    let mut net = NetSpec::with_mac("tap0", "02:00:00:00:00:01").unwrap();
    net.limits.rx.bandwidth = Some(RateLimit::per_second(1 << 20));
    net.limits.tx.ops = Some(RateLimit {
        size: 10,
        burst: 0,
        refill_ms: 10,
    });
    Devices {
        serial: Serial::File("/run/serial.log".into()),
        control_socket: Some("/run/control.sock".into()),
        disks: vec![DiskSpec::rw("/d/root.ext4"), limited],
        vsock: Some(VsockSpec {
            cid: 3,
            uds: "/run/v.sock".into(),
        }),
        net: Some(net),
        rng: true,
        fs: vec![vmm_api::command::FsSpec::new("cache", "/run/fs.sock").unwrap()],
        memory: Some("shared-hugepages".into()),
    }
}

/// The devices the vmm parses from the options are the ones built.
fn assert_devices_parse_as_built(disks: &[String], net: Option<&str>, fs: &[String]) {
    let built = devices();
    let parsed = DeviceConfig::parse(disks, None, net, false, fs).unwrap();
    assert_eq!(parsed.fs.len(), built.fs.len());
    for (p, b) in parsed.fs.iter().zip(&built.fs) {
        assert_eq!(
            (&p.tag, &p.socket, p.queues),
            (&b.tag, &b.socket, b.queues.unwrap_or(1))
        );
    }
    assert_eq!(parsed.disks.len(), built.disks.len());
    for (p, b) in parsed.disks.iter().zip(&built.disks) {
        assert_eq!(
            (&p.path, p.read_only, p.limits),
            (&b.path, b.read_only, b.limits)
        );
    }
    let (p, b) = (parsed.net.unwrap(), built.net.unwrap());
    assert_eq!((p.tap, p.mac, p.limits), (b.tap, b.mac, b.limits));
}

fn parse(args: Vec<String>) -> Cli {
    let line = args.join(" ");
    Cli::try_parse_from(std::iter::once("vmm".to_string()).chain(args))
        .unwrap_or_else(|e| panic!("vmm rejects the line vmm-api builds: {line}: {e}"))
}

/// The command lines every caller builds with vmm-api parse here, into the
/// values they were built from: flags cannot drift between the two.
#[test]
fn vmm_api_command_lines_parse_as_built() {
    let mut run = RunSpec::new("/k/vmlinux");
    run.globals.log_max_bytes = Some(8192);
    run.globals.log_json = true;
    run.globals.log_level = Some("info".into());
    run.initrd = Some("/k/initrd".into());
    run.cmdline = Some("console=ttyS0 panic=1".into());
    run.mem_mib = 256;
    run.vcpus = 2;
    run.acpi = Some(false);
    run.devices = devices();
    let cli = parse(run.args());
    assert_eq!(cli.log_max_bytes, "8192");
    assert!(matches!(cli.log_format, LogFormat::Json));
    let Command::Run(a) = cli.command else {
        panic!("not run")
    };
    assert_eq!(
        a.kernel.as_deref(),
        Some(std::path::Path::new("/k/vmlinux"))
    );
    assert_eq!(a.cmdline.as_deref(), Some("console=ttyS0 panic=1"));
    assert_eq!((a.mem_mib, a.vcpus), (Some(256), Some(2)));
    assert_eq!(
        a.disk,
        [
            "/d/root.ext4",
            "/d/ro.img,ro,bw=4194304/250+1048576,iops=100"
        ]
    );
    assert_devices_parse_as_built(&a.disk, a.net.as_deref(), &a.fs);
    assert_eq!(a.vsock.as_deref(), Some("3:/run/v.sock"));
    assert_eq!(a.serial.as_deref(), Some("file:/run/serial.log"));
    assert_eq!(a.acpi.as_deref(), Some("off"));
    assert!(a.rng);

    let mut restore = RestoreSpec::new("/s/golden");
    restore.paused = true;
    restore.memory_backend = Some("uffd".into());
    restore.devices = devices();
    let jail = JailSpec {
        id: "vm1".into(),
        root: "/v/jail".into(),
        uid: 2_000_000_001,
        gid: 2_000_000_002,
        binds: vec![Bind {
            host: "/s/golden".into(),
            jail: "/golden".into(),
            read_only: true,
        }],
        taps: vec!["tap1".into()],
        devices: vec!["kvm".into(), "userfaultfd".into()],
        memory_max_mib: Some(300),
        cpu_max: Some((150_000, 100_000)),
        netns: Some("/run/netns/agentvm-vm1".into()),
    };
    let Command::Jail(j) = parse(jail.wrap(restore.args())).command else {
        panic!("not jail")
    };
    assert_eq!((j.uid, j.gid), (2_000_000_001, 2_000_000_002));
    assert_eq!(j.binds, ["/s/golden:/golden:ro"]);
    assert_eq!(j.taps, ["tap1"]);
    assert_eq!(
        j.netns_path.as_deref(),
        Some(std::path::Path::new("/run/netns/agentvm-vm1"))
    );
    assert_eq!(j.devices, ["kvm", "userfaultfd"]);
    assert_eq!(j.memory_max.as_deref(), Some("300M"));
    assert_eq!(
        j.cpu_max.as_deref().map(vmm::jail::cgroup::parse_cpu_max),
        Some(Ok((150_000, 100_000)))
    );
    let Command::Restore(r) = parse(j.vmm_args).command else {
        panic!("the jailed command is not restore")
    };
    assert_eq!(
        r.snapshot.as_deref(),
        Some(std::path::Path::new("/s/golden"))
    );
    assert!(!r.standby);
    assert_eq!(r.memory_backend, "uffd");
    assert!(r.paused && r.rng);
    assert_eq!(r.disk.len(), 2);
    assert_eq!(
        r.net.as_deref(),
        Some("tap0,mac=02:00:00:00:00:01,rx_bw=1048576,tx_ops=10/10")
    );
    assert_devices_parse_as_built(&r.disk, r.net.as_deref(), &r.fs);

    let mut standby = vmm_api::StandbySpec::new(2, "/run/standby.sock");
    standby.memory_backend = Some("uffd".into());
    standby.mem_mib = Some(512);
    standby.devices.disks = vec![DiskSpec::rw("/d/root.ext4")];
    let Command::Restore(s) = parse(standby.args()).command else {
        panic!("not restore")
    };
    assert!(s.standby && !s.paused);
    assert_eq!((s.snapshot, s.vcpus, s.mem_mib), (None, Some(2), Some(512)));
    assert_eq!(s.memory_backend, "uffd");
    assert_eq!(
        s.control_socket.as_deref(),
        Some(std::path::Path::new("/run/standby.sock"))
    );
    assert_eq!(s.disk, ["/d/root.ext4"]);
}
