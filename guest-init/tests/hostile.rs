//! Hostile input on the channel: each case is a clear error and the agent
//! stays up to serve what comes next.

mod common;

use common::*;
use proto::framing::encode_frame;
use proto::guest::{
    error::Code, guest_message::Kind as Out, host_message::Kind as In, Hello, HostMessage,
    RepoChunk, StartSession,
};

const SMALL: usize = 4096;

fn start_msg(size: u64) -> In {
    In::StartSession(StartSession {
        session_id: "s1".into(),
        agent: "coder".into(),
        base_ref: "main".into(),
        bundle_size: size,
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversize_frames_are_errors_and_the_connection_goes_on() {
    let h = Harness::start_with(Options {
        max_frame: SMALL,
        ..Default::default()
    })
    .await;
    let mut c = h.connect().await;
    // A payload that is not a HostMessage (truncated field).
    c.send_raw(&[0, 0, 0, 3, 0x22, 100, 1]).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Malformed as i32, "{msg}");
    // An empty frame: no message kind.
    c.send_raw(&[0, 0, 0, 0]).await;
    assert_eq!(c.expect_error().await.0, Code::Malformed as i32);
    // Oversize: declared beyond the maximum; the payload is skipped unread.
    let mut big = ((SMALL + 10) as u32).to_be_bytes().to_vec();
    big.extend(vec![0xAB; SMALL + 10]);
    c.send_raw(&big).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Oversize as i32);
    assert!(msg.contains("exceeds the maximum of 4096 bytes"), "{msg}");
    // Invalid UTF-8 in a string field is malformed too.
    c.send_raw(&[0, 0, 0, 4, 0x0a, 2, 0x08, 1]).await; // hello{protocol_version: 1}
    let _ = c
        .expect(|m| matches!(m, Out::Hello(_) | Out::Error(_)).then_some(()))
        .await;
    c.send_raw(&[0, 0, 0, 6, 0x12, 4, 0x12, 2, 0xff, 0xfe])
        .await; // start_session{session_id: invalid utf-8}
    assert_eq!(c.expect_error().await.0, Code::Malformed as i32);
    // Still in sync and serving.
    c.send(start_msg(0)).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::InvalidArgument as i32);
    assert!(msg.contains("bundle_size 0"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_comes_first_and_an_unknown_version_is_refused() {
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.send(start_msg(10)).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Protocol as i32);
    assert!(msg.contains("send Hello"), "{msg}");
    c.send(In::Hello(Hello {
        protocol_version: 99,
        software: "future".into(),
    }))
    .await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::UnsupportedVersion as i32);
    assert!(
        msg.contains("version 99") && msg.contains("speaks 1"),
        "{msg}"
    );
    assert!(
        c.recv().await.is_none(),
        "the connection is closed after a version mismatch"
    );
    // The agent is still up for the next connection.
    let mut c = h.connect().await;
    c.hello().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_that_are_not_utf8_or_escape_the_workspace_are_refused() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "free", "main").await;
    std::os::unix::fs::symlink("/etc", h.workspace.join("etc-link")).unwrap();
    for (i, (cwd, needle)) in [
        (&b"\xff\xfe"[..], "not valid UTF-8"),
        (b"../..", "escapes the workspace"),
        (b"/etc", "escapes the workspace"),
        (b"etc-link", "escapes the workspace"),
        (b"nonexistent", "cannot be used as a directory"),
    ]
    .iter()
    .enumerate()
    {
        let id = format!("p{i}");
        let mut e = exec_msg(&id, "t", &["pwd"]);
        e.cwd = cwd.to_vec();
        c.exec(e).await;
        let r = c.finish(&id, None).await;
        let (code, msg) = r
            .error
            .clone()
            .unwrap_or_else(|| panic!("{cwd:?} was accepted: {r:?}"));
        assert_eq!(code, Code::InvalidArgument as i32);
        assert!(msg.contains(needle), "{msg}");
    }
    // Other bad Execs.
    c.exec(exec_msg("", "t", &["pwd"])).await;
    assert_eq!(c.expect_error().await.0, Code::InvalidArgument as i32);
    let r = c.run("empty", &[]).await;
    assert!(r.error.unwrap().1.contains("empty command"));
    assert_eq!(c.run("dup", &["true"]).await.code(), Some(0));
    let r = c.run("dup", &["true"]).await;
    assert!(r.error.unwrap().1.contains("already used"));
    // And the session still works.
    assert_eq!(c.run("ok", &["echo", "fine"]).await.stdout(), "fine\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_source_that_fails_midway_leaves_the_agent_ready_for_a_retry() {
    let repo = Repo::new();
    let bundle = repo.bundle();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;

    // Truncated: fewer bytes than declared.
    c.send(start_msg(bundle.len() as u64)).await;
    c.send(In::RepoChunk(RepoChunk {
        data: bundle[..bundle.len() / 2].to_vec(),
        last: true,
    }))
    .await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Repository as i32);
    assert!(msg.contains("truncated"), "{msg}");

    // More bytes than declared.
    c.send(start_msg(10)).await;
    c.send(In::RepoChunk(RepoChunk {
        data: vec![0; 11],
        last: false,
    }))
    .await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Repository as i32);
    assert!(msg.contains("larger than the declared"), "{msg}");

    // Right size, corrupt content: git refuses it.
    let mut corrupt = bundle.clone();
    let n = corrupt.len();
    for b in &mut corrupt[n / 2..] {
        *b ^= 0x5a;
    }
    c.send(start_msg(n as u64)).await;
    c.send(In::RepoChunk(RepoChunk {
        data: corrupt,
        last: true,
    }))
    .await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Repository as i32);
    assert!(
        msg.contains("session not started") && msg.contains("git"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_dir(&h.workspace).unwrap().count(),
        0,
        "workspace left dirty"
    );

    // A chunk with no session being started.
    c.send(In::RepoChunk(RepoChunk {
        data: vec![1],
        last: true,
    }))
    .await;
    assert_eq!(c.expect_error().await.0, Code::Protocol as i32);

    // The connection drops in the middle of a transfer. (One connection is
    // served at a time, so close the first.)
    drop(c);
    let mut c2 = h.connect().await;
    c2.hello().await;
    c2.send(start_msg(bundle.len() as u64)).await;
    c2.send(In::RepoChunk(RepoChunk {
        data: bundle[..100].to_vec(),
        last: false,
    }))
    .await;
    drop(c2);

    // A good bundle now works on the next connection.
    let mut c3 = h.connect().await;
    c3.hello().await;
    let r = c3
        .start_session(&SessionSpec::new("s1", "coder", "main"), &bundle)
        .await;
    assert!(matches!(r, Out::Ready(_)), "{r:?}");
    assert_eq!(c3.run("e", &["echo", "up"]).await.stdout(), "up\n");
}

#[test]
fn frames_from_the_host_side_round_trip() {
    // The client in these tests encodes frames with the same crate the host uses.
    let f = encode_frame(
        &HostMessage {
            kind: Some(start_msg(1)),
        },
        SMALL,
    )
    .unwrap();
    assert_eq!(
        u32::from_be_bytes([f[0], f[1], f[2], f[3]]) as usize,
        f.len() - 4
    );
}
