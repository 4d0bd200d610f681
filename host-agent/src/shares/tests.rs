//! The share model's checks, merge and stored form.

use super::*;

fn req(tag: &str, host: &str, ro: bool, mount: &str) -> pb::Share {
    pb::Share {
        tag: tag.into(),
        host_path: host.into(),
        read_only: ro,
        mount_path: mount.into(),
    }
}

fn share(tag: &str, host: &str, ro: bool, mount: &str) -> Share {
    Share {
        tag: tag.into(),
        host_path: host.into(),
        read_only: ro,
        mount_path: mount.into(),
    }
}

fn invalid(r: Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn request_shares_are_checked_naming_the_field() {
    let ok = check_request(
        "shares",
        &[
            req("cargo", "/srv/cache/cargo", true, ""),
            req("data", "/srv/data", false, "/data"),
        ],
    )
    .unwrap();
    assert_eq!(ok[0], share("cargo", "/srv/cache/cargo", true, ""));
    assert_eq!(ok[1].mount_path, "/data");
    let bad = |s: pb::Share| invalid(check_request("shares", &[req("x", "/a", true, ""), s]));
    assert!(bad(req("", "/a", true, "")).starts_with("shares[1].tag \"\""));
    assert!(bad(req("a b", "/a", true, "")).contains("1 to 36 bytes"));
    assert!(bad(req(&"t".repeat(37), "/a", true, "")).starts_with("shares[1].tag"));
    assert_eq!(
        bad(req("x", "/b", true, "")),
        "shares[1].tag \"x\" is also shares[0]'s: each tag names one share"
    );
    assert!(bad(req("y", "", true, "")).starts_with("shares[1].host_path is required"));
    for (mount, says) in [
        ("relative", "must be an absolute path"),
        ("/mnt/../etc", "without '.' or '..'"),
        ("/mnt/./x", "without '.' or '..'"),
        ("/", "root file system"),
        ("//", "root file system"),
        ("/proc", "lies in /proc"),
        ("/sys/kernel", "lies in /sys"),
        ("/dev/shm", "lies in /dev"),
    ] {
        let m = bad(req("y", "/a", true, mount));
        assert!(m.starts_with("shares[1].mount_path"), "{mount}: {m}");
        assert!(m.contains(says), "{mount}: {m}");
    }
    // Names that only start like a reserved tree are fine.
    assert!(check_mount_path("f", "/device").is_ok());
    assert!(check_mount_path("f", "/system/x").is_ok());
    let many: Vec<pb::Share> = (0..=MAX_SHARES)
        .map(|i| req(&format!("t{i}"), "/a", true, ""))
        .collect();
    assert!(invalid(check_request("shares", &many)).contains("at most 8"));
}

#[test]
fn a_sessions_share_replaces_the_images_of_its_tag_and_others_follow() {
    let image = vec![
        share("cargo", "/srv/cargo", true, "/mnt/cargo"),
        share("npm", "/srv/npm", true, "/home/agent/.npm"),
    ];
    let session = vec![
        share("extra", "/srv/extra", false, ""),
        share("npm", "/srv/other-npm", false, ""),
        share("cargo", "/srv/cargo-2", true, "/opt/cargo"),
    ];
    let merged = merge(&image, &session).unwrap();
    assert_eq!(
        merged,
        vec![
            share("cargo", "/srv/cargo-2", true, "/opt/cargo"),
            // No mount path given: the image's stays.
            share("npm", "/srv/other-npm", false, "/home/agent/.npm"),
            share("extra", "/srv/extra", false, "/mnt/extra"),
        ]
    );
    // The image's tags come first, in its order: restorable from its golden
    // snapshot only while nothing is added.
    assert!(!same_devices(&merged, &image));
    let replaced = merge(&image, &session[1..]).unwrap();
    assert!(same_devices(&replaced, &image));
    assert_eq!(merge(&image, &[]).unwrap(), image);
    assert!(same_devices(&[], &[]));
    let clash = invalid(merge(&image, &[share("x", "/srv/x", true, "/mnt/cargo/")]));
    assert_eq!(
        clash,
        "shares: \"cargo\" and \"x\" are both mounted on /mnt/cargo/; give one another mount_path"
    );
    let lots: Vec<Share> = (0..MAX_SHARES)
        .map(|i| share(&format!("s{i}"), "/a", true, ""))
        .collect();
    assert!(invalid(merge(&image, &lots)).contains("make 10 shares; at most 8"));
}

#[test]
fn host_paths_resolve_under_the_roots_or_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("caches");
    std::fs::create_dir_all(root.join("cargo")).unwrap();
    std::fs::write(root.join("file"), b"x").unwrap();
    std::os::unix::fs::symlink(root.join("cargo"), root.join("link")).unwrap();
    std::os::unix::fs::symlink(t.path(), root.join("out")).unwrap();
    let roots = PathRoots::new(ROOTS_SETTING, ROOTS_FLAG, std::slice::from_ref(&root)).unwrap();
    let real = std::fs::canonicalize(root.join("cargo")).unwrap();
    let mut ok = vec![share(
        "c",
        &root.join("link").display().to_string(),
        true,
        "",
    )];
    resolve(Some(&roots), "shares", &mut ok).unwrap();
    assert_eq!(ok[0].host_path, real.display().to_string());
    let one = |p: PathBuf| vec![share("c", &p.display().to_string(), true, "")];
    let err = resolve(Some(&roots), "shares", &mut one(root.join("out"))).unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    assert!(err.to_string().contains("allowed_share_roots"), "{err}");
    for missing in [root.join("file"), root.join("absent")] {
        let e = invalid(resolve(Some(&roots), "shares", &mut one(missing)));
        assert!(e.starts_with("shares[0].host_path"), "{e}");
    }
    // No roots: shares are refused, naming the setting; none asked is fine.
    let err = resolve(None, "shares", &mut one(root.join("cargo"))).unwrap_err();
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err:?}");
    assert!(err.to_string().contains("allowed_share_roots"), "{err}");
    assert!(err.to_string().contains("--allowed-share-root"), "{err}");
    assert!(resolve(None, "shares", &mut []).is_ok());
}

#[test]
fn shares_are_stored_and_read_back() {
    let s = vec![share("cargo", "/srv/cargo", true, "/mnt/cargo")];
    let stored = encode(&s);
    assert_eq!(decode(&stored).unwrap(), s);
    assert_eq!(encode(&[]), "");
    assert_eq!(decode("").unwrap(), vec![]);
    assert!(matches!(decode("{"), Err(Error::Corrupt(_))));
    assert!(decode_or_none("[1]", "test").is_empty());
    assert_eq!(to_pb(&stored, "test")[0].mount_path, "/mnt/cargo");
    let m = s[0].to_mount();
    assert_eq!(
        (m.tag.as_str(), m.path.as_str(), m.read_only),
        ("cargo", "/mnt/cargo", true)
    );
}
