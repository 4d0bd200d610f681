use std::collections::HashMap;

use super::*;

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn refs(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

/// The message of the error `SessionEnv::from_request` gives.
fn refused(
    env: &[(&str, &str)],
    secrets: &[(&str, &str)],
    r: &[&str],
    dir: Option<&Path>,
) -> SessionEnvError {
    SessionEnv::from_request(map(env), map(secrets), refs(r), dir).unwrap_err()
}

#[test]
fn bad_names_values_and_sizes_are_invalid_and_name_the_field() {
    let cases: Vec<(SessionEnvError, &str)> = vec![
        (
            refused(&[("PATH", "/x")], &[], &[], None),
            "env: the name \"PATH\"",
        ),
        (
            refused(&[("A B", "x")], &[], &[], None),
            "not a variable name",
        ),
        (
            refused(&[("A", "x\0y")], &[], &[], None),
            "env[\"A\"]: the value holds a NUL",
        ),
        (
            refused(&[], &[("LD_PRELOAD", "x")], &[], None),
            "secrets: the name \"LD_PRELOAD\"",
        ),
        (
            refused(&[], &[("T", "")], &[], None),
            "secrets[\"T\"]: the value is empty",
        ),
        (
            refused(&[], &[("T", "a\0")], &[], None),
            "secrets[\"T\"]: the value holds a NUL",
        ),
        (
            refused(&[("T", "x")], &[("T", "y")], &[], None),
            "secrets[\"T\"]: the name is in env too",
        ),
        (
            refused(&[], &[], &["../etc/passwd"], None),
            "secret_refs: the name \"../etc/passwd\"",
        ),
        (
            refused(&[], &[], &["a/b"], None),
            "secret_refs: the name \"a/b\"",
        ),
        (
            refused(&[], &[], &["T", "T"], None),
            "secret_refs: \"T\" is given twice",
        ),
        (
            refused(&[], &[("T", "v")], &["T"], None),
            "secret_refs: \"T\" is in secrets too",
        ),
        (
            refused(&[], &[], &["GUEST_INIT_TURN"], None),
            "set by guest-init",
        ),
    ];
    for (e, needle) in cases {
        assert!(matches!(e, SessionEnvError::Invalid { .. }), "{e}");
        assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
        assert_eq!(Error::from(e).code(), tonic::Code::InvalidArgument);
    }
    let big = "v".repeat(MAX_SECRET_BYTES + 1);
    let e = refused(&[], &[("T", &big)], &[], None).to_string();
    assert!(
        e.starts_with("secrets[\"T\"]: the value is 65537 bytes"),
        "{e}"
    );
    assert!(!e.contains("vvvv"), "a value is never in a message: {e}");
    let many: Vec<(String, String)> = (0..=MAX_SECRETS)
        .map(|i| (format!("S{i}"), "v".into()))
        .collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert!(refused(&[], &many, &[], None)
        .to_string()
        .contains("at most 64"));
    let long = "e".repeat(MAX_ENV_VALUE_BYTES + 1);
    assert!(refused(&[("E", &long)], &[], &[], None)
        .to_string()
        .starts_with("env[\"E\"]: the value is"));
    // In all, secrets are bounded too (17 of 64 KiB each pass one by one).
    let value = "s".repeat(MAX_SECRET_BYTES);
    let names: Vec<String> = (0..17).map(|i| format!("S{i}")).collect();
    let all: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), value.as_str())).collect();
    assert!(refused(&[], &all, &[], None)
        .to_string()
        .contains("at most 1048576"));
}

#[test]
fn refs_are_read_from_the_secrets_dir_only_as_plain_files() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    std::fs::write(dir.join("NPM_TOKEN"), "npm-0c1d\n").unwrap();
    std::fs::write(dir.join("CRLF"), "crlf-value\r\n").unwrap();
    std::fs::write(t.path().join("elsewhere"), "outside").unwrap();
    std::os::unix::fs::symlink(dir.join("elsewhere"), dir.join("LINKED")).unwrap();
    std::fs::create_dir(dir.join("ADIR")).unwrap();
    std::fs::write(dir.join("EMPTY"), "\n").unwrap();
    std::fs::write(dir.join("BIG"), vec![b'x'; MAX_SECRET_BYTES + 3]).unwrap();
    std::fs::write(dir.join("BINARY"), [0xff, 0xfe]).unwrap();

    let s = SessionEnv::from_request(
        map(&[("GREETING", "hello")]),
        map(&[("GITHUB_TOKEN", "gh-77aa")]),
        refs(&["NPM_TOKEN", "CRLF"]),
        Some(dir),
    )
    .unwrap();
    let (names, values) = s.granted(&refs(&["NPM_TOKEN", "CRLF", "GITHUB_TOKEN"]));
    assert_eq!(names, ["CRLF", "GITHUB_TOKEN", "NPM_TOKEN"]);
    assert_eq!(values["NPM_TOKEN"], "npm-0c1d");
    assert_eq!(values["CRLF"], "crlf-value");
    assert_eq!(values["GITHUB_TOKEN"], "gh-77aa");

    for (name, needle, code) in [
        (
            "MISSING",
            "is not a file in the node's secrets_dir",
            tonic::Code::FailedPrecondition,
        ),
        (
            "LINKED",
            "is a symbolic link",
            tonic::Code::FailedPrecondition,
        ),
        (
            "ADIR",
            "is not a regular file",
            tonic::Code::FailedPrecondition,
        ),
        ("EMPTY", "is empty", tonic::Code::FailedPrecondition),
        (
            "BIG",
            "is larger than 65536 bytes",
            tonic::Code::FailedPrecondition,
        ),
        ("BINARY", "is not UTF-8", tonic::Code::FailedPrecondition),
    ] {
        let e = refused(&[], &[], &[name], Some(dir));
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("secret_refs: {name:?}")), "{msg}");
        assert!(msg.contains(needle), "{msg} lacks {needle:?}");
        assert!(!msg.contains("outside"), "{msg}");
        assert_eq!(Error::from(e).code(), code, "{name}");
    }
    let e = refused(&[], &[], &["NPM_TOKEN"], None);
    assert!(matches!(e, SessionEnvError::NoSecretsDir), "{e}");
    assert!(e.to_string().contains("secrets_dir"), "{e}");
}

#[test]
fn only_granted_secrets_leave_and_debug_shows_names() {
    let s = SessionEnv::from_request(
        map(&[]),
        map(&[("A", "value-a-91"), ("B", "value-b-92")]),
        vec![],
        None,
    )
    .unwrap();
    let (names, values) = s.granted(&refs(&["B", "C"]));
    assert_eq!(names, ["B"]);
    assert_eq!(values.len(), 1);
    assert_eq!(values["B"], "value-b-92");
    assert_eq!(s.granted(&[]).0, Vec::<String>::new());
    let debug = format!("{s:?}");
    assert!(
        debug.contains("\"A\"") && debug.contains("\"B\""),
        "{debug}"
    );
    assert!(!debug.contains("value-"), "{debug}");
}

#[test]
fn the_fingerprint_is_keyed_and_covers_env_secrets_and_ref_names() {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("R"), "first").unwrap();
    let key = fingerprint::Key::fixed(7);
    let make = |env: &[(&str, &str)], secrets: &[(&str, &str)], r: &[&str]| {
        SessionEnv::from_request(map(env), map(secrets), refs(r), Some(t.path()))
            .unwrap()
            .fingerprint(&key)
    };
    assert_eq!(make(&[], &[], &[]), "", "no env, no secrets: nothing added");
    let base = make(&[("E", "1")], &[("S", "secret-5d")], &["R"]);
    assert_eq!(base.len(), 64);
    assert!(!base.contains("secret-5d"));
    assert_eq!(base, make(&[("E", "1")], &[("S", "secret-5d")], &["R"]));
    assert_ne!(base, make(&[("E", "2")], &[("S", "secret-5d")], &["R"]));
    assert_ne!(base, make(&[("E", "1")], &[("S", "secret-5e")], &["R"]));
    assert_ne!(base, make(&[("E", "1")], &[("S", "secret-5d")], &[]));
    // A ref is named, not read, by the fingerprint: a retry after the file
    // changed is the same request.
    std::fs::write(t.path().join("R"), "second").unwrap();
    assert_eq!(base, make(&[("E", "1")], &[("S", "secret-5d")], &["R"]));
    let other = SessionEnv::from_request(
        map(&[("E", "1")]),
        map(&[("S", "secret-5d")]),
        refs(&["R"]),
        Some(t.path()),
    )
    .unwrap()
    .fingerprint(&fingerprint::Key::fixed(8));
    assert_ne!(base, other, "another node's key gives another digest");
}
