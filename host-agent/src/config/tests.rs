//! The configuration's defaults, checks and file format.

use super::*;

#[test]
fn uid_ranges_parse_and_are_checked() {
    let r: UidRange = "100000-165535".parse().unwrap();
    assert_eq!((r.first, r.last, r.len()), (100000, 165535, 65536));
    assert!(r.contains(100000) && r.contains(165535) && !r.contains(165536));
    assert_eq!(r.to_string(), "100000-165535");
    for bad in ["0-10", "10-5", "5", "a-b", "1-4294967295", ""] {
        assert!(bad.parse::<UidRange>().is_err(), "{bad}");
    }
}

#[test]
fn jailing_is_the_default_and_needs_root_or_no_jail() {
    let cfg = Config::default();
    assert!(cfg.jailed());
    assert!(cfg.check_privileges(0).is_ok());
    let err = cfg.check_privileges(1000).unwrap_err().to_string();
    assert!(err.contains("--no-jail"), "{err}");
    let dev = Config {
        no_jail: true,
        ..Config::default()
    };
    assert!(dev.check_privileges(1000).is_ok());
}

#[test]
fn the_idle_pause_and_snapshot_quota_read_from_the_file() {
    let cfg: Config =
        serde_json::from_str(r#"{"idle_pause": "disk", "snapshot_quota_mib": 64}"#).unwrap();
    assert_eq!(
        (cfg.idle_pause, cfg.snapshot_quota_mib),
        (IdlePause::Disk, 64)
    );
    let cfg: Config = serde_json::from_str("{}").unwrap();
    assert_eq!(
        (cfg.idle_pause, cfg.snapshot_quota_mib),
        (IdlePause::Memory, 0)
    );
    let err = serde_json::from_str::<Config>(r#"{"idle_pause": "swap"}"#).unwrap_err();
    assert!(err.to_string().contains("unknown variant"), "{err}");
}

#[test]
fn the_overcommit_ratio_and_ask_timeout_are_checked() {
    let cfg: Config =
        serde_json::from_str(r#"{"memory_overcommit_ratio": 1.5, "ask_timeout_seconds": 60}"#)
            .unwrap();
    assert!(cfg.validate().is_ok());
    assert_eq!(
        (cfg.memory_overcommit_ratio, cfg.ask_timeout_seconds),
        (1.5, 60)
    );
    for bad in [
        r#"{"memory_overcommit_ratio": 0.05}"#,
        r#"{"memory_overcommit_ratio": 101}"#,
        r#"{"ask_timeout_seconds": 0}"#,
        r#"{"ask_timeout_seconds": 86401}"#,
    ] {
        let cfg: Config = serde_json::from_str(bad).unwrap();
        let e = cfg.validate().unwrap_err().to_string();
        let field = bad.split('"').nth(1).unwrap();
        assert!(e.contains(field), "{bad}: {e}");
    }
}

#[test]
fn the_config_file_says_no_jail_and_the_range() {
    let cfg: Config = serde_json::from_str(
        r#"{"no_jail": true, "jail": {"uid_range": "300000-300009"}, "logs": {"max_file_bytes": 65536}}"#,
    )
    .unwrap();
    assert!(!cfg.jailed());
    assert_eq!(cfg.jail.uid_range.len(), 10);
    assert_eq!(cfg.jail.memory_overhead_mib, 256);
    assert_eq!(cfg.logs.max_file_bytes, 65536);
    assert!(serde_json::from_str::<Config>(r#"{"jail": {"uid_range": "0-9"}}"#).is_err());
}

#[test]
fn the_secrets_dir_must_be_a_directory() {
    let t = tempfile::tempdir().unwrap();
    let file = t.path().join("f");
    std::fs::write(&file, "x").unwrap();
    let with = |d: &Path| Config {
        secrets_dir: Some(d.to_path_buf()),
        ..Config::default()
    };
    assert!(with(t.path()).validate().is_ok());
    for bad in [file, t.path().join("missing")] {
        let e = with(&bad).validate().unwrap_err().to_string();
        assert!(
            e.contains("secrets_dir") && e.contains("is not a directory"),
            "{e}"
        );
    }
    let cfg: Config = serde_json::from_str(r#"{"secrets_dir": "/run/credentials/x"}"#).unwrap();
    assert_eq!(cfg.secrets_dir, Some(PathBuf::from("/run/credentials/x")));
}

#[test]
fn the_network_pool_is_one_ipv4_block_and_maybe_one_ipv6_block() {
    let net = |json: &str| serde_json::from_str::<NetworkConfig>(json).unwrap();
    let one = net(r#"{"pool": "10.9.0.0/16"}"#).node_settings().unwrap();
    assert_eq!((one.pool.as_str(), one.pool6), ("10.9.0.0/16", None));
    let both = net(r#"{"pool": ["fd00:9::/112", "10.9.0.0/16"]}"#)
        .node_settings()
        .unwrap();
    assert_eq!(both.pool, "10.9.0.0/16");
    assert_eq!(both.pool6.as_deref(), Some("fd00:9::/112"));
    for bad in [
        r#"{"pool": ["fd00:9::/112"]}"#,
        r#"{"pool": ["10.9.0.0/16", "10.8.0.0/16"]}"#,
        r#"{"pool": ["10.9.0.0/16", "fd00:9::/112", "fd00:8::/112"]}"#,
    ] {
        let e = net(bad).node_settings().unwrap_err().to_string();
        assert!(e.contains("network.pool"), "{bad}: {e}");
    }
    assert_eq!(
        NetworkConfig::default().node_settings().unwrap().pool6,
        None
    );
}

#[test]
fn schedule_settings_come_from_the_file_with_their_defaults() {
    let cfg = Config::default();
    assert_eq!(
        (cfg.webhook_listen, cfg.schedule_retry_window_seconds),
        (None, 600)
    );
    let cfg: Config = serde_json::from_str(
        r#"{"webhook_listen": "0.0.0.0:7071", "schedule_retry_window_seconds": 30}"#,
    )
    .unwrap();
    assert_eq!(cfg.webhook_listen, Some("0.0.0.0:7071".parse().unwrap()));
    assert_eq!(cfg.schedule_retry_window_seconds, 30);
}

#[test]
fn share_settings_come_from_the_file_with_their_defaults() {
    use crate::shares::VirtiofsCache;
    let cfg = Config::default();
    assert!(
        cfg.allowed_share_roots.is_empty(),
        "no shares unless allowed"
    );
    assert_eq!(
        (cfg.virtiofsd_path.as_deref(), cfg.virtiofs_cache),
        (None, VirtiofsCache::Auto)
    );
    let cfg: Config = serde_json::from_str(
        r#"{"allowed_share_roots": ["/srv/caches"], "virtiofsd_path": "/opt/virtiofsd",
            "virtiofs_cache": "metadata"}"#,
    )
    .unwrap();
    assert_eq!(cfg.allowed_share_roots, vec![PathBuf::from("/srv/caches")]);
    assert_eq!(cfg.virtiofs_cache, VirtiofsCache::Metadata);
    assert!(cfg.validate().is_ok());
    if std::env::var_os(crate::shares::virtiofsd::ENV_VIRTIOFSD).is_none() {
        assert_eq!(cfg.virtiofsd(), PathBuf::from("/opt/virtiofsd"));
    }
    for mode in ["auto", "always", "never", "metadata"] {
        let cfg: Config =
            serde_json::from_str(&format!(r#"{{"virtiofs_cache": "{mode}"}}"#)).unwrap();
        assert_eq!(cfg.virtiofs_cache.as_str(), mode);
    }
    let err = serde_json::from_str::<Config>(r#"{"virtiofs_cache": "sometimes"}"#).unwrap_err();
    assert!(err.to_string().contains("unknown variant"), "{err}");
    let relative: Config = serde_json::from_str(r#"{"allowed_share_roots": ["caches"]}"#).unwrap();
    let err = relative.validate().unwrap_err().to_string();
    assert!(err.contains("allowed_share_roots"), "{err}");
}
