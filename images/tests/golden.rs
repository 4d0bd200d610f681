//! The golden-snapshot step against a stand-in vmm (tests/fixtures/
//! fake_vmm.py) that speaks the real vmm's vsock and control-socket
//! protocols: the step waits for guest-init's Hello over `CONNECT 1024`,
//! pauses, takes a full snapshot into the output directory, stops the VM,
//! writes the manifest, and a second run is a cache hit. (The real guest is
//! the `guest-init-direct` scenario of tests/real-guest.)

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{file_identity, images, images_env, printed_dir};
use images::manifest::Manifest;

fn fake_vmm() -> Option<PathBuf> {
    if Command::new("python3").arg("--version").output().is_err() {
        println!("skipped: python3 (the fake vmm's interpreter) is not installed");
        return None;
    }
    Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_vmm.py"))
}

#[test]
fn snapshots_once_guest_init_answers_and_caches_the_result() {
    let Some(vmm) = fake_vmm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    let rootfs = dir.path().join("rootfs.ext4");
    std::fs::write(&kernel, b"kernel").unwrap();
    std::fs::write(&rootfs, vec![7u8; 8192]).unwrap();
    let out = dir.path().join("golden");
    let args = [
        "golden",
        "--kernel",
        kernel.to_str().unwrap(),
        "--rootfs",
        rootfs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--vmm",
        vmm.to_str().unwrap(),
        "--boot-timeout-s",
        "30",
    ];
    let (first, _) = images(&args);
    assert!(first.status.success());
    assert_eq!(printed_dir(&first), out);
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(stderr.contains("guest-init ready after"), "{stderr}");

    let console = std::fs::read_to_string(out.join("console.log")).unwrap();
    assert!(console.contains("root=/dev/vda"), "{console}");
    assert!(console.contains("hello answered"), "{console}");
    assert!(console.contains("stopped"), "{console}");
    // The guest's own disk copy lives beside the snapshot.
    assert_eq!(
        std::fs::read(out.join("rootfs.ext4")).unwrap(),
        vec![7u8; 8192]
    );

    let manifest = Manifest::load(&out.join("manifest.json")).unwrap();
    assert_eq!(manifest.kind, "golden");
    let names: Vec<&str> = manifest.outputs.iter().map(|o| o.path.as_str()).collect();
    assert_eq!(
        names,
        [
            "rootfs.ext4",
            "snapshot/state",
            "snapshot/memory",
            "snapshot/manifest"
        ]
    );
    assert_eq!(
        manifest.inputs.0["kernel_sha256"],
        images::hash::file_sha256(&kernel).unwrap()
    );

    // The second run is a cache hit: no guest booted, the snapshot is the
    // very file the first run wrote.
    let memory_before = file_identity(&out.join("snapshot/memory"));
    let (second, _) = images(&args);
    assert!(second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("cached:"), "{stderr}");
    assert!(!stderr.contains("guest-init ready after"), "{stderr}");
    assert_eq!(file_identity(&out.join("snapshot/memory")), memory_before);
    assert_eq!(
        Manifest::load(&out.join("manifest.json")).unwrap(),
        manifest
    );

    // A new kernel is a new input: the snapshot is taken again.
    std::fs::write(&kernel, b"kernel 2").unwrap();
    let (third, _) = images(&args);
    assert!(third.status.success());
    assert!(!String::from_utf8_lossy(&third.stderr).contains("cached:"));
    let rebuilt = Manifest::load(&out.join("manifest.json")).unwrap();
    assert_ne!(rebuilt.input_hash, manifest.input_hash);
}

#[test]
fn a_guest_that_never_answers_is_reported_with_the_console() {
    let Some(vmm) = fake_vmm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"kernel").unwrap();
    let out = dir.path().join("golden");
    let (res, _) = images_env(
        &[
            "golden",
            "--kernel",
            kernel.to_str().unwrap(),
            "--rootfs",
            kernel.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--vmm",
            vmm.to_str().unwrap(),
            "--boot-timeout-s",
            "2",
        ],
        &[("FAKE_VMM_BOOT_S", "600")],
    );
    assert!(!res.status.success());
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(
        stderr.contains("did not answer on vsock port 700"),
        "{stderr}"
    );
    assert!(
        stderr.contains("fake vmm: booting"),
        "console tail missing: {stderr}"
    );
    assert!(!out.join("manifest.json").exists());
}
