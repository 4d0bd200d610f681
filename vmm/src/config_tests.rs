//! Tests of `config`: parsing of files, flags and device forms, and the
//! defaults.

use super::*;

#[test]
fn fs_devices_parse_and_bad_ones_are_named() {
    let f: FsConfig = "cache:/run/fs.sock".parse().unwrap();
    assert_eq!((f.tag.as_str(), f.queues), ("cache", 1));
    assert_eq!(f.socket, PathBuf::from("/run/fs.sock"));
    let f: FsConfig = "a.b-c_d:/x:y.sock,queues=4".parse().unwrap();
    assert_eq!((f.socket, f.queues), (PathBuf::from("/x:y.sock"), 4));
    for bad in [
        "",
        ":/s",
        "cache",
        "cache:",
        "ca che:/s",
        "cache:/s,queues=0",
        "cache:/s,queues=17",
        "cache:/s,queues=x",
        &format!("{}:/s", "t".repeat(37)),
    ] {
        let err = bad.parse::<FsConfig>().unwrap_err().to_string();
        assert!(err.contains("TAG:SOCKET"), "{bad:?}: {err}");
    }
    let dup = DeviceConfig::parse(&[], None, None, false, &["a:/1".into(), "a:/2".into()]);
    assert!(matches!(dup, Err(ConfigError::FsDuplicateTag(t)) if t == "a"));
}

#[test]
fn fs_devices_make_memory_shared_and_refuse_private() {
    let with_fs = DeviceConfig::parse(&[], None, None, false, &["a:/1".into()]).unwrap();
    assert_eq!(with_fs.memory_mode(None).unwrap(), MemoryMode::Shared);
    assert_eq!(
        with_fs
            .memory_mode(Some(MemoryMode::SharedHugepages))
            .unwrap(),
        MemoryMode::SharedHugepages
    );
    assert!(matches!(
        with_fs.memory_mode(Some(MemoryMode::Private)),
        Err(ConfigError::FsNeedsShared)
    ));
    let none = DeviceConfig::default();
    assert_eq!(none.memory_mode(None).unwrap(), MemoryMode::Private);
    assert_eq!(
        none.memory_mode(Some(MemoryMode::Shared)).unwrap(),
        MemoryMode::Shared
    );
}

#[test]
fn virtio_device_forms_parse() {
    let d: DiskConfig = "/img,ro".parse().unwrap();
    assert_eq!(
        d,
        DiskConfig {
            path: "/img".into(),
            read_only: true,
            limits: IoLimit::default(),
        }
    );
    assert!(!"/img".parse::<DiskConfig>().unwrap().read_only);
    assert!(",ro".parse::<DiskConfig>().is_err());
    assert!("/a,b".parse::<DiskConfig>().is_err());

    let v: VsockConfig = "3:/tmp/v.sock".parse().unwrap();
    assert_eq!(v.cid, 3);
    assert_eq!(v.uds_path, PathBuf::from("/tmp/v.sock"));
    assert!("2:/x".parse::<VsockConfig>().is_err());
    assert!("x:/x".parse::<VsockConfig>().is_err());
    assert!("3:".parse::<VsockConfig>().is_err());

    let n: NetConfig = "tap0,mac=02:00:00:00:00:01".parse().unwrap();
    assert_eq!(n.tap, "tap0");
    assert_eq!(n.mac, Some([2, 0, 0, 0, 0, 1]));
    assert_eq!("tap1".parse::<NetConfig>().unwrap().mac, None);
    assert!("tap0,mac=02:00".parse::<NetConfig>().is_err());
    assert!("a-name-longer-than-15".parse::<NetConfig>().is_err());
    assert!("tap0,speed=1".parse::<NetConfig>().is_err());

    let file: ConfigFile = serde_json::from_str(
        r#"{"kernel":"/k","disk":["/a","/b,ro"],"vsock":"3:/v","net":"tap0","rng":true}"#,
    )
    .unwrap();
    let cfg = VmConfig::try_from(file).unwrap();
    assert_eq!(cfg.devices.disks.len(), 2);
    assert!(cfg.devices.disks[1].read_only);
    assert!(cfg.devices.rng);
    assert_eq!(cfg.devices.vsock.unwrap().cid, 3);
}

#[test]
fn rate_limits_parse_in_device_options_and_errors_name_the_field() {
    let d: DiskConfig = "/img,bw=8M/500+1M,iops=200".parse().unwrap();
    let bw = d.limits.bandwidth.unwrap();
    assert_eq!((bw.size, bw.refill_ms, bw.burst), (8 << 20, 500, 1 << 20));
    assert_eq!(d.limits.ops.unwrap().size, 200);
    assert!(!d.read_only);
    let n: NetConfig = "tap0,rx_bw=1M,tx_ops=100/10".parse().unwrap();
    assert_eq!(n.limits.rx.bandwidth.unwrap().size, 1 << 20);
    assert_eq!(n.limits.tx.ops.unwrap().refill_ms, 10);
    assert!(n.limits.rx.ops.is_none() && n.limits.tx.bandwidth.is_none());

    let e = "/img,bw=lots"
        .parse::<DiskConfig>()
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("invalid disk \"/img,bw=lots\": invalid bw \"lots\""),
        "{e}"
    );
    assert!(e.contains("BYTES[/MS][+BURST]"), "{e}");
    let e = "tap0,rx_ops=0"
        .parse::<NetConfig>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("invalid rx_ops \"0\": expected COUNT"), "{e}");
    let e = "tap0,tx_rate=1"
        .parse::<NetConfig>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field \"tx_rate=1\""), "{e}");

    // The config file takes the same text.
    let file: ConfigFile =
        serde_json::from_str(r#"{"kernel":"/k","disk":["/a,iops=10"],"net":"tap0,tx_bw=64K"}"#)
            .unwrap();
    let cfg = VmConfig::try_from(file).unwrap();
    assert_eq!(cfg.devices.disks[0].limits.ops.unwrap().size, 10);
    assert_eq!(
        cfg.devices.net.unwrap().limits.tx.bandwidth.unwrap().size,
        64 << 10
    );
}

#[test]
fn serial_forms_parse() {
    assert_eq!(
        "stdout".parse::<SerialConfig>().unwrap(),
        SerialConfig::Stdout
    );
    assert_eq!("none".parse::<SerialConfig>().unwrap(), SerialConfig::None);
    assert_eq!(
        "file:/tmp/x".parse::<SerialConfig>().unwrap(),
        SerialConfig::File("/tmp/x".into())
    );
    assert!("file:".parse::<SerialConfig>().is_err());
    assert!("tty".parse::<SerialConfig>().is_err());
}

#[test]
fn flags_override_the_file_and_defaults_fill_the_rest() {
    let file: ConfigFile =
        serde_json::from_str(r#"{"kernel":"/k","mem_mib":512,"vcpus":2}"#).unwrap();
    let flags = ConfigFile {
        mem_mib: Some(64),
        ..Default::default()
    };
    let cfg = VmConfig::try_from(file.overridden_by(flags)).unwrap();
    assert_eq!(cfg.kernel, PathBuf::from("/k"));
    assert_eq!(cfg.mem_mib, 64);
    assert_eq!(cfg.vcpus, 2);
    assert_eq!(cfg.cmdline, DEFAULT_CMDLINE);
    assert_eq!(cfg.serial, SerialConfig::Stdout);
    assert!(cfg.acpi, "ACPI is on by default");
    let off: ConfigFile = serde_json::from_str(r#"{"kernel":"/k","acpi":false}"#).unwrap();
    assert!(!VmConfig::try_from(off).unwrap().acpi);
    assert!(parse_acpi("on").unwrap());
    assert!(!parse_acpi("off").unwrap());
    assert!(cfg.pit, "a PIT by default");
    let legacy: ConfigFile = serde_json::from_str(r#"{"kernel":"/k","acpi":false}"#).unwrap();
    assert!(
        VmConfig::try_from(legacy).unwrap().pit,
        "a PIT without ACPI (the legacy PC's Linux needs it)"
    );
    let off: ConfigFile = serde_json::from_str(r#"{"kernel":"/k","pit":false}"#).unwrap();
    assert!(!VmConfig::try_from(off).unwrap().pit);
    assert!(parse_pit("on").unwrap());
    assert_eq!(
        parse_pit("1").unwrap_err().to_string(),
        "invalid PIT setting \"1\": expected on or off"
    );
    assert_eq!(
        parse_acpi("yes").unwrap_err().to_string(),
        "invalid ACPI setting \"yes\": expected on or off"
    );
}

#[test]
fn bad_values_are_refused() {
    assert!(matches!(
        VmConfig::try_from(ConfigFile::default()),
        Err(ConfigError::NoKernel)
    ));
    let zero = ConfigFile {
        kernel: Some("/k".into()),
        vcpus: Some(0),
        ..Default::default()
    };
    assert!(matches!(
        VmConfig::try_from(zero),
        Err(ConfigError::VcpuCount(0))
    ));
    let many = ConfigFile {
        kernel: Some("/k".into()),
        vcpus: Some(300),
        ..Default::default()
    };
    assert!(matches!(
        VmConfig::try_from(many),
        Err(ConfigError::VcpuCount(300))
    ));
    assert!(serde_json::from_str::<ConfigFile>(r#"{"kernal":"/k"}"#).is_err());
    let disks = ConfigFile {
        kernel: Some("/k".into()),
        disk: Some((0..MAX_DEVICES).map(|i| format!("/d{i}")).collect()),
        rng: Some(true),
        ..Default::default()
    };
    let err = VmConfig::try_from(disks).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{} virtio devices configured: at most {MAX_DEVICES} fit (one IOAPIC interrupt line each)",
            MAX_DEVICES + 1
        )
    );
}

#[test]
fn the_cpuid_cache_defaults_to_run_and_none_turns_it_off() {
    let parse = |json: &str| VmConfig::try_from(serde_json::from_str::<ConfigFile>(json).unwrap());
    assert_eq!(
        parse(r#"{"kernel":"/k"}"#).unwrap().cpuid_cache,
        Some(PathBuf::from("/run/agentvm/kvm-supported-cpuid"))
    );
    assert_eq!(
        parse(r#"{"kernel":"/k","cpuid_cache":"none"}"#)
            .unwrap()
            .cpuid_cache,
        None
    );
    let file: ConfigFile = serde_json::from_str(r#"{"kernel":"/k","cpuid_cache":"/a"}"#).unwrap();
    let flags = ConfigFile {
        cpuid_cache: Some("/b".into()),
        ..Default::default()
    };
    let cfg = VmConfig::try_from(file.overridden_by(flags)).unwrap();
    assert_eq!(cfg.cpuid_cache, Some(PathBuf::from("/b")));
    assert_eq!(
        parse(r#"{"kernel":"/k","cpuid_cache":""}"#)
            .unwrap_err()
            .to_string(),
        "invalid CPUID cache setting \"\": expected a file path or none"
    );
}
