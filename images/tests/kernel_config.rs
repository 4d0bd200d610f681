//! The kernel config check against Debian's real linux-source-6.12: the
//! checked-in fragment survives `olddefconfig`, a second run is a cache hit,
//! and a fragment whose dependency is missing is refused by name.
//!
//! Skipped, with the reason printed, only when apt cannot provide the
//! source package. The kernel itself is not compiled here (that takes
//! hours on two cores); see images/README.md.

mod common;

use common::{file_identity, images, printed_dir, shared_cache};
use images::manifest::Manifest;

/// The linux-source version apt offers, or None after printing why the
/// test is skipped.
fn source_available() -> Option<String> {
    match images::debian::candidate_version(images::kernel::DEFAULT_SOURCE_PACKAGE) {
        Ok(v) => Some(v),
        Err(e) => {
            println!(
                "skipped: {} cannot be fetched here: {e}",
                images::kernel::DEFAULT_SOURCE_PACKAGE
            );
            None
        }
    }
}

#[test]
fn checked_in_config_survives_olddefconfig_and_is_cached() {
    let Some(version) = source_available() else {
        return;
    };
    let cache = shared_cache();
    let cache = cache.to_str().unwrap();
    let (first, _) = images(&["--cache-dir", cache, "kernel", "--check-config-only"]);
    assert!(first.status.success(), "config check failed");
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(
        stderr.contains("required options survived olddefconfig") || stderr.contains("cached:"),
        "{stderr}"
    );
    let dir = printed_dir(&first);
    let manifest = Manifest::load(&dir.join("manifest.json")).unwrap();
    assert_eq!(manifest.kind, "kernel-config");
    assert_eq!(manifest.inputs.0["source_version"], version);
    assert_eq!(manifest.packages["linux-source-6.12"], version);
    let config = std::fs::read_to_string(dir.join("config")).unwrap();
    for line in [
        "CONFIG_PVH=y",
        "CONFIG_KVM_GUEST=y",
        "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES=y",
        "CONFIG_VIRTIO_VSOCKETS=y",
        "CONFIG_EXT4_FS=y",
        "CONFIG_NF_TABLES_INET=y",
        "CONFIG_VMGENID=y",
        "CONFIG_ACPI=y",
        "CONFIG_PNPACPI=y",
        "# CONFIG_MODULES is not set",
    ] {
        assert!(
            config.lines().any(|l| l == line),
            "{line} missing from .config"
        );
    }

    // The second run is a cache hit: the config and manifest are the very
    // files the first left, and olddefconfig did not run again.
    let before = (
        file_identity(&dir.join("config")),
        file_identity(&dir.join("manifest.json")),
    );
    let (second, _) = images(&["--cache-dir", cache, "kernel", "--check-config-only"]);
    assert!(second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("cached:"), "{stderr}");
    assert!(!stderr.contains("make allnoconfig"), "{stderr}");
    assert_eq!(
        (
            file_identity(&dir.join("config")),
            file_identity(&dir.join("manifest.json")),
        ),
        before
    );
    assert_eq!(printed_dir(&second), dir);
    assert_eq!(
        Manifest::load(&dir.join("manifest.json")).unwrap(),
        manifest
    );
}

#[test]
fn an_option_whose_dependency_is_missing_is_named() {
    if source_available().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let fragment = dir.path().join("broken.config");
    let good = std::fs::read_to_string(images::kernel::default_fragment()).unwrap();
    // nf_tables' inet family depends on IPv6: drop IPv6 and it cannot survive.
    let broken = good.replace("CONFIG_IPV6=y", "# CONFIG_IPV6 is not set");
    assert_ne!(good, broken);
    std::fs::write(&fragment, broken).unwrap();
    let cache = shared_cache();
    let (out, _) = images(&[
        "--cache-dir",
        cache.to_str().unwrap(),
        "kernel",
        "--check-config-only",
        "--config",
        fragment.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("did not survive olddefconfig"), "{stderr}");
    assert!(
        stderr.contains("CONFIG_NF_TABLES_INET (wanted y, got not set)"),
        "{stderr}"
    );
}
