//! KVM integration tests for virtio-fs against hostile vhost-user
//! backends, written here: one that closes the connection at once, one that
//! answers with garbage, one that never answers, and a socket nobody listens
//! on. Each must make `vmm run` fail, naming the socket, within the vmm's
//! 10 s reply limit; a hang fails the test. (The tests against a real
//! virtiofsd are in virtio_fs.rs.)

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use common::*;

/// The tag every test's share has.
const TAG: &str = "share";

/// How a fake backend misbehaves while the vmm sets it up.
#[derive(Debug, Clone, Copy)]
enum Hostile {
    /// Closes the connection right after accepting it.
    Close,
    /// Answers the first message with random bytes, then keeps the
    /// connection open.
    Garbage,
    /// Reads what it is sent and never answers.
    Silent,
}

/// A fake vhost-user backend listening at `path`, misbehaving as `kind`.
/// It reports "accepted" and, for Garbage, "answered" on the returned
/// channel; it holds its connection until the returned sender is dropped.
fn hostile_backend(path: &Path, kind: Hostile) -> (mpsc::Receiver<&'static str>, mpsc::Sender<()>) {
    let listener = UnixListener::bind(path).unwrap();
    let (events, events_rx) = mpsc::channel();
    let (done, done_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let _ = events.send("accepted");
        match kind {
            Hostile::Close => return,
            Hostile::Garbage => {
                // A vhost-user message: a 12-byte header (request, flags,
                // payload size) and the payload.
                let mut header = [0u8; 12];
                if conn.read_exact(&mut header).is_err() {
                    return;
                }
                let size = u32::from_le_bytes(header[8..12].try_into().unwrap());
                let mut payload = vec![0u8; size as usize];
                if conn.read_exact(&mut payload).is_err() {
                    return;
                }
                let mut garbage = [0u8; 256];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut r| r.read_exact(&mut garbage))
                    .unwrap();
                let _ = conn.write_all(&garbage);
                let _ = events.send("answered");
            }
            Hostile::Silent => {
                // Drain whatever comes, never writing, until the vmm hangs up.
                let mut sink = conn.try_clone().unwrap();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while matches!(sink.read(&mut buf), Ok(n) if n > 0) {}
                });
            }
        }
        // Keep the connection open until the test is done with it.
        let _ = done_rx.recv();
        drop(conn);
    });
    (events_rx, done)
}

/// `vmm run` with the fake backend `kind` fails, naming the socket, and
/// does not hang.
fn setup_fails_against(kind: Hostile) {
    let t = tempfile::tempdir().unwrap();
    let socket = t.path().join("hostile.sock");
    let (events, done) = hostile_backend(&socket, kind);
    let g = guest("virtio_fs");
    let arg = format!("{TAG}:{}", socket.display());
    let child = spawn_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--mem-mib",
        "64",
        "--serial",
        "stdout",
        "--fs",
        &arg,
    ]);
    // The vmm gives up on a backend within about 10 s; 30 s is a hang.
    let out = wait_with_deadline(child, Duration::from_secs(30));
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "{kind:?}: the vmm ran against a hostile backend:\n{}\n{err}",
        stdout(&out)
    );
    assert!(
        err.contains(&socket.display().to_string()),
        "{kind:?}: the error does not name {}: {err}",
        socket.display()
    );
    assert!(!err.contains("panicked"), "{kind:?}: {err}");
    let seen: Vec<&str> = events.try_iter().collect();
    assert_eq!(
        seen.first(),
        Some(&"accepted"),
        "{kind:?}: the vmm never connected"
    );
    if let Hostile::Garbage = kind {
        assert_eq!(
            seen.get(1),
            Some(&"answered"),
            "{kind:?}: the vmm sent nothing"
        );
    }
    drop(done);
}

#[test]
fn a_backend_that_closes_at_once_fails_the_start() {
    setup_fails_against(Hostile::Close);
}

#[test]
fn a_backend_that_answers_garbage_fails_the_start() {
    setup_fails_against(Hostile::Garbage);
}

#[test]
fn a_backend_that_never_answers_fails_the_start() {
    setup_fails_against(Hostile::Silent);
}

#[test]
fn a_socket_nobody_listens_on_fails_the_start() {
    let t = tempfile::tempdir().unwrap();
    let socket = t.path().join("nobody.sock");
    let g = guest("virtio_fs");
    let arg = format!("{TAG}:{}", socket.display());
    let out = wait_with_deadline(
        spawn_vmm(&[
            "run",
            "--kernel",
            g.to_str().unwrap(),
            "--serial",
            "stdout",
            "--fs",
            &arg,
        ]),
        Duration::from_secs(30),
    );
    let err = stderr(&out);
    assert!(!out.status.success(), "{}\n{err}", stdout(&out));
    assert!(err.contains(&socket.display().to_string()), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
