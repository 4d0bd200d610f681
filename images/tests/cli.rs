//! The `images` command's errors for bad input: each names the problem and
//! what to do, and comes before any long step starts.

mod common;

use common::images;

fn stderr_of(args: &[&str]) -> String {
    let (out, _) = images(args);
    assert!(!out.status.success(), "images {args:?} should fail");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // Refused before any step started: a step's progress lines all begin
    // with "[images <step>".
    assert!(
        !stderr.contains("[images "),
        "the error came after a step: {stderr}"
    );
    stderr
}

#[test]
fn a_malformed_config_fragment_is_refused_before_any_download() {
    let dir = tempfile::tempdir().unwrap();
    let frag = dir.path().join("bad.config");
    std::fs::write(&frag, "CONFIG_64BIT=y\nthis is not an option\n").unwrap();
    let cache = dir.path().join("cache");
    let err = stderr_of(&[
        "--cache-dir",
        cache.to_str().unwrap(),
        "kernel",
        "--check-config-only",
        "--config",
        frag.to_str().unwrap(),
    ]);
    assert!(
        err.contains("bad.config:2: expected CONFIG_NAME=VALUE"),
        "{err}"
    );
    assert!(
        !cache.join("downloads").exists(),
        "it downloaded before checking"
    );
}

#[test]
fn a_dynamically_linked_guest_init_is_refused_with_the_build_command() {
    let dir = tempfile::tempdir().unwrap();
    let err = stderr_of(&[
        "--cache-dir",
        dir.path().to_str().unwrap(),
        "rootfs",
        "--guest-init",
        "/bin/sh",
    ]);
    if err.contains("debootstrap (package debootstrap)") {
        println!("tool check came first on this host: {err}");
        return;
    }
    assert!(err.contains("dynamically linked"), "{err}");
    assert!(err.contains("target-feature=+crt-static"), "{err}");
}

#[test]
fn golden_names_a_missing_kernel_and_a_missing_vmm() {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs.ext4");
    std::fs::write(&rootfs, b"").unwrap();
    let out = dir.path().join("golden");
    let err = stderr_of(&[
        "golden",
        "--kernel",
        "/nonexistent/vmlinux",
        "--rootfs",
        rootfs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--vmm",
        "/bin/true",
    ]);
    assert!(err.contains("/nonexistent/vmlinux: No such file"), "{err}");
    let err = stderr_of(&[
        "golden",
        "--kernel",
        rootfs.to_str().unwrap(),
        "--rootfs",
        rootfs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--vmm",
        "/nonexistent/vmm",
    ]);
    assert!(
        err.contains("/nonexistent/vmm: no vmm binary here"),
        "{err}"
    );
    assert!(
        !out.exists(),
        "nothing is written before the inputs check out"
    );
}
