//! The root filesystem build: a real debootstrap from the Debian registry,
//! guest-init built static and installed as /sbin/init, the agent user, a
//! valid ext4 image (checked with e2fsck and debugfs, without mounting, and
//! mounted read-only when the host allows loop devices), the manifest's
//! package versions, and a second run that is a cache hit.
//!
//! Needs root (debootstrap) and the network; without root it says so and
//! passes. The first run takes a few minutes (guest-init build,
//! debootstrap); later runs reuse the cached Debian base. Set
//! `IMAGES_TEST_GUEST_INIT` to a prebuilt static guest-init to skip its build.

mod common;

use std::path::Path;
use std::process::Command;

use common::{file_identity, images, is_root, printed_dir, sh, shared_cache};
use images::manifest::Manifest;

fn debugfs(image: &Path, request: &str) -> String {
    let (ok, text) = sh(Command::new("debugfs").arg("-R").arg(request).arg(image));
    assert!(ok, "debugfs -R '{request}': {text}");
    text
}

#[test]
fn builds_a_bootable_root_filesystem_and_caches_it() {
    if !is_root() {
        println!("skipped: building the root filesystem runs debootstrap, which needs root");
        return;
    }
    let cache = shared_cache();
    let cache = cache.to_str().unwrap();
    // guest-init: a prebuilt static one, or an unoptimised build (minutes
    // faster to compile than the release build images ship).
    let prebuilt = std::env::var("IMAGES_TEST_GUEST_INIT").ok();
    let mut args = vec!["--cache-dir", cache, "rootfs", "--size-mib", "1024"];
    match &prebuilt {
        Some(p) => args.extend(["--guest-init", p.as_str()]),
        None => args.extend(["--guest-init-profile", "dev"]),
    }
    let (out, _) = images(&args);
    assert!(out.status.success(), "rootfs build failed");
    let dir = printed_dir(&out);
    let image = dir.join("rootfs.ext4");
    let manifest = Manifest::load(&dir.join("manifest.json")).unwrap();
    assert_eq!(manifest.kind, "rootfs");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 1024 << 20);

    // A valid ext4 file system.
    let (ok, text) = sh(Command::new("e2fsck").arg("-fn").arg(&image));
    assert!(ok, "e2fsck: {text}");
    let (_, text) = sh(Command::new("file").arg("-L").arg(&image));
    assert!(text.contains("ext4 filesystem"), "{text}");

    // guest-init is /sbin/init (through the merged-/usr link), static, and
    // the very binary the manifest names.
    let sbin = debugfs(&image, "stat /sbin");
    let init_path = if sbin.contains("Type: symlink") {
        "/usr/sbin/init"
    } else {
        "/sbin/init"
    };
    let stat = debugfs(&image, &format!("stat {init_path}"));
    assert!(
        stat.contains("Type: regular") && stat.contains("Mode:  0755"),
        "{stat}"
    );
    let work = tempfile::tempdir().unwrap();
    let init = work.path().join("init");
    debugfs(&image, &format!("dump {init_path} {}", init.display()));
    assert!(
        images::elf::is_static(&init).unwrap(),
        "/sbin/init is not static"
    );
    let (_, file) = sh(Command::new("file").arg(&init));
    assert!(file.contains("static"), "file says: {file}");
    let (_, ldd) = sh(Command::new("ldd").arg(&init));
    assert!(
        ldd.contains("not a dynamic executable") || ldd.contains("statically linked"),
        "ldd: {ldd}"
    );
    assert_eq!(
        images::hash::file_sha256(&init).unwrap(),
        manifest.inputs.0["guest_init_sha256"]
    );

    // The agent user and its home.
    let passwd = debugfs(&image, "cat /etc/passwd");
    assert!(
        passwd
            .lines()
            .any(|l| l.starts_with("agent:x:1000:1000:") && l.ends_with(":/home/agent:/bin/bash")),
        "{passwd}"
    );
    let shadow = debugfs(&image, "cat /etc/shadow");
    assert!(
        shadow.lines().any(|l| l.starts_with("agent:!:")),
        "agent's password is not locked"
    );
    let home = debugfs(&image, "stat /home/agent");
    assert!(
        home.contains("User:  1000") && home.contains("Group:  1000"),
        "{home}"
    );

    // The packages the guest needs, present and recorded with versions.
    for bin in [
        "/usr/bin/git",
        "/usr/bin/bash",
        "/usr/bin/ls",
        "/usr/sbin/nft",
    ] {
        let s = debugfs(&image, &format!("stat {bin}"));
        assert!(s.contains("Type: regular"), "{bin}: {s}");
    }
    // guest-init runs nft without a PATH: glibc then looks in /usr/bin.
    let nft_link = debugfs(&image, "stat /usr/bin/nft");
    assert!(nft_link.contains("Type: symlink"), "{nft_link}");
    let certs = debugfs(&image, "stat /etc/ssl/certs/ca-certificates.crt");
    assert!(certs.contains("Type: regular"), "{certs}");
    for p in ["git", "bash", "coreutils", "ca-certificates", "nftables"] {
        let v = manifest
            .packages
            .get(p)
            .unwrap_or_else(|| panic!("{p} not in the manifest"));
        assert!(!v.is_empty());
    }

    mount_read_only(&image);

    // A second run does nothing: the same directory, the same manifest, the
    // very image file left untouched, and no Debian base or image step run.
    // (How long it takes is perf's business, never a test's: under load the
    // inputs' hashing, an incremental guest-init build, can take minutes.)
    let before = file_identity(&image);
    let (again, _) = images(&args);
    assert!(again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("cached:"), "{stderr}");
    assert!(!stderr.contains("debootstrap"), "{stderr}");
    assert_eq!(printed_dir(&again), dir);
    assert_eq!(
        Manifest::load(&dir.join("manifest.json")).unwrap(),
        manifest
    );
    assert_eq!(
        file_identity(&image),
        before,
        "the cached run rewrote the image"
    );
}

/// Mounts the image read-only through a loop device and looks inside; says
/// so and moves on where the host has no loop devices (containers).
fn mount_read_only(image: &Path) {
    let mnt = tempfile::tempdir().unwrap();
    let (ok, text) = sh(Command::new("mount")
        .args(["-o", "loop,ro", "-t", "ext4"])
        .arg(image)
        .arg(mnt.path()));
    if !ok {
        println!(
            "mount check skipped: this host cannot loop-mount ({})",
            text.trim()
        );
        return;
    }
    let init_ok = mnt.path().join("sbin/init").is_file();
    let passwd = std::fs::read_to_string(mnt.path().join("etc/passwd")).unwrap_or_default();
    let (umount_ok, utext) = sh(Command::new("umount").arg(mnt.path()));
    assert!(umount_ok, "umount: {utext}");
    assert!(init_ok, "/sbin/init missing in the mounted image");
    assert!(passwd.contains("agent:x:1000:1000:"));
}
