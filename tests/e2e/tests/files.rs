//! The Files service against guest-init run as a host process (see
//! `guest_init.rs`): every operation, paths that escape the workspace
//! refused, bad input INVALID_ARGUMENT naming the field, the mutations in
//! the audit log, a watch seeing changes, and 1 GiB up and down compared by
//! SHA-256.

use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::files_client::FilesClient;
use sha2::{Digest, Sha256};
use test_harness::agent::Agent;
use tonic::transport::Channel;
use tonic::Code;

mod common;

use common::*;

const T: Duration = Duration::from_secs(60);

struct Files {
    cl: FilesClient<Channel>,
    s: pb::Session,
    ws: std::path::PathBuf,
}

impl Files {
    async fn write(
        &mut self,
        path: &str,
        mode: pb::WriteMode,
        data: Vec<Vec<u8>>,
    ) -> Result<pb::WriteFileResponse, tonic::Status> {
        let mut msgs = vec![pb::WriteFileRequest {
            kind: Some(pb::write_file_request::Kind::Start(pb::WriteFileStart {
                session_id: self.s.session_id.clone(),
                execution_id: self.s.execution_id.clone(),
                path: path.into(),
                mode: mode as i32,
                permissions: 0,
            })),
        }];
        msgs.extend(data.into_iter().map(|d| pb::WriteFileRequest {
            kind: Some(pb::write_file_request::Kind::Data(d)),
        }));
        tokio::time::timeout(T, self.cl.write(tokio_stream::iter(msgs)))
            .await
            .expect("write in time")
            .map(|r| r.into_inner())
    }

    async fn read(
        &mut self,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<u8>, tonic::Status> {
        let mut st = self
            .cl
            .read(pb::ReadFileRequest {
                session_id: self.s.session_id.clone(),
                execution_id: self.s.execution_id.clone(),
                path: path.into(),
                offset,
                length,
            })
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = tokio::time::timeout(T, st.message())
            .await
            .expect("read in time")?
        {
            out.extend(m.data);
        }
        Ok(out)
    }

    async fn stat(&mut self, path: &str) -> Result<pb::FileInfo, tonic::Status> {
        self.cl
            .stat(pb::StatFileRequest {
                session_id: self.s.session_id.clone(),
                execution_id: self.s.execution_id.clone(),
                path: path.into(),
            })
            .await
            .map(|r| r.into_inner())
    }

    async fn list(&mut self, path: &str, depth: u32) -> Result<Vec<String>, tonic::Status> {
        let mut st = self
            .cl
            .list(pb::ListFilesRequest {
                session_id: self.s.session_id.clone(),
                execution_id: self.s.execution_id.clone(),
                path: path.into(),
                depth,
            })
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = tokio::time::timeout(T, st.message())
            .await
            .expect("list in time")?
        {
            out.extend(m.entries.into_iter().map(|e| e.path));
        }
        Ok(out)
    }
}

async fn setup() -> (Guest, Agent, Files) {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = guest_init_session(&agent, &guest).await;
    let cl = FilesClient::new(agent.channel().await)
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(8 << 20);
    let ws = guest.repo().with_file_name("workspace");
    (guest, agent, Files { cl, s, ws })
}

fn assert_invalid<T: std::fmt::Debug>(r: Result<T, tonic::Status>, field: &str) {
    let e = r.expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().starts_with(field)
            || e.message().contains(&format!("{field}:"))
            || e.message().contains(&format!("{field} ")),
        "{field}: {e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_with_paths_kept_inside_and_audited() {
    let (_guest, agent, mut f) = setup().await;
    let (sid, eid) = (f.s.session_id.clone(), f.s.execution_id.clone());

    // Write (create, then append, then truncate), stat, read ranges.
    let w = f
        .write(
            "notes/a.txt",
            pb::WriteMode::Create,
            vec![b"hello ".to_vec()],
        )
        .await;
    assert_eq!(w.unwrap_err().code(), Code::NotFound, "no parent yet");
    let dir =
        f.cl.make_dir(pb::MakeDirRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            path: "notes/deep".into(),
            parents: true,
            permissions: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dir.kind, pb::file_info::Kind::Directory as i32);
    assert_eq!(dir.path, "notes/deep");
    let w = f
        .write(
            "notes/a.txt",
            pb::WriteMode::Create,
            vec![b"hello ".to_vec()],
        )
        .await
        .unwrap();
    assert_eq!(w.bytes_written, 6);
    assert_eq!(w.info.unwrap().permissions, 0o644);
    // Done as the agent: the file belongs to the workspace's owner (the
    // agent's uid when guest-init runs as root), and a directory only this
    // test's user may write to is refused.
    {
        use std::os::unix::fs::MetadataExt;
        let agent_uid = std::fs::metadata(&f.ws).unwrap().uid();
        assert_eq!(
            std::fs::metadata(f.ws.join("notes/a.txt")).unwrap().uid(),
            agent_uid
        );
        let me = std::fs::metadata(f.ws.with_file_name("repo"))
            .unwrap()
            .uid();
        if me != agent_uid {
            std::fs::create_dir(f.ws.join("mine")).unwrap();
            let denied = f
                .write("mine/x", pb::WriteMode::Create, vec![b"x".to_vec()])
                .await;
            assert_eq!(denied.unwrap_err().code(), Code::PermissionDenied);
            std::fs::remove_dir(f.ws.join("mine")).unwrap();
        }
    }
    let again = f
        .write("notes/a.txt", pb::WriteMode::Create, vec![b"x".to_vec()])
        .await;
    assert_eq!(again.unwrap_err().code(), Code::AlreadyExists);
    f.write(
        "notes/a.txt",
        pb::WriteMode::Append,
        vec![b"world".to_vec(), vec![], b"!".to_vec()],
    )
    .await
    .unwrap();
    assert_eq!(f.read("notes/a.txt", 0, 0).await.unwrap(), b"hello world!");
    assert_eq!(f.read("notes/a.txt", 6, 5).await.unwrap(), b"world");
    assert_eq!(f.read("notes/a.txt", 100, 0).await.unwrap(), b"");
    assert_eq!(
        std::fs::read(f.ws.join("notes/a.txt")).unwrap(),
        b"hello world!"
    );
    f.write(
        "notes/a.txt",
        pb::WriteMode::Truncate,
        vec![b"new".to_vec()],
    )
    .await
    .unwrap();
    assert_eq!(
        f.read("/notes/../notes/a.txt", 0, 0)
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument,
        "absolute outside"
    );
    let abs = f.ws.join("notes/a.txt").display().to_string();
    assert_eq!(f.read(&abs, 0, 0).await.unwrap(), b"new", "absolute inside");
    let st = f.stat("notes/a.txt").await.unwrap();
    assert_eq!((st.kind, st.size), (pb::file_info::Kind::File as i32, 3));
    assert_eq!(
        f.read("notes", 0, 0).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    assert_eq!(f.stat("nope").await.unwrap_err().code(), Code::NotFound);

    // List, one level and recursive.
    assert_eq!(
        f.list("notes", 1).await.unwrap(),
        vec!["notes/a.txt", "notes/deep"]
    );
    let all = f.list(".", 3).await.unwrap();
    assert!(
        all.contains(&"notes/deep".to_string()) && all.contains(&"README.md".to_string()),
        "{all:?}"
    );

    // Rename, without and with overwrite; remove.
    let r =
        f.cl.rename(pb::RenameFileRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            from: "notes/a.txt".into(),
            to: "notes/deep/b.txt".into(),
            overwrite: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.path, "notes/deep/b.txt");
    f.write("c.txt", pb::WriteMode::Create, vec![b"c".to_vec()])
        .await
        .unwrap();
    let clash =
        f.cl.rename(pb::RenameFileRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            from: "c.txt".into(),
            to: "notes/deep/b.txt".into(),
            overwrite: false,
        })
        .await;
    assert_eq!(clash.unwrap_err().code(), Code::AlreadyExists);
    let not_empty =
        f.cl.remove(pb::RemoveFileRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            path: "notes".into(),
            recursive: false,
        })
        .await;
    assert_eq!(not_empty.unwrap_err().code(), Code::FailedPrecondition);
    let removed =
        f.cl.remove(pb::RemoveFileRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            path: "notes".into(),
            recursive: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(removed.removed, 3, "notes, deep, b.txt");
    assert!(!f.ws.join("notes").exists());

    // Escapes: `..`, absolute elsewhere, a link pointing out, a parent
    // swapped for a link pointing out.
    let outside = f.ws.with_file_name("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"s").unwrap();
    std::os::unix::fs::symlink(&outside, f.ws.join("out")).unwrap();
    std::os::unix::fs::symlink("../outside/secret", f.ws.join("rel-out")).unwrap();
    assert_invalid(f.read("../outside/secret", 0, 0).await, "path");
    assert_invalid(
        f.read(&outside.join("secret").display().to_string(), 0, 0)
            .await,
        "path",
    );
    assert_invalid(f.read("out/secret", 0, 0).await, "path");
    assert_invalid(f.read("rel-out", 0, 0).await, "path");
    assert_invalid(
        f.write("out/new", pb::WriteMode::Create, vec![b"x".to_vec()])
            .await,
        "path",
    );
    std::fs::create_dir(f.ws.join("swap")).unwrap();
    std::fs::remove_dir(f.ws.join("swap")).unwrap();
    std::os::unix::fs::symlink(&outside, f.ws.join("swap")).unwrap();
    assert_invalid(
        f.write("swap/secret", pb::WriteMode::Truncate, vec![b"x".to_vec()])
            .await,
        "path",
    );
    let rm =
        f.cl.remove(pb::RemoveFileRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            path: "out/secret".into(),
            recursive: false,
        })
        .await;
    assert_invalid(rm, "path");
    assert_eq!(
        std::fs::read(outside.join("secret")).unwrap(),
        b"s",
        "untouched"
    );
    // Removing the link removes the link only.
    f.cl.remove(pb::RemoveFileRequest {
        session_id: sid.clone(),
        execution_id: eid.clone(),
        path: "out".into(),
        recursive: true,
    })
    .await
    .unwrap();
    assert!(outside.join("secret").exists());

    // Bad input names the field.
    assert_invalid(f.stat("").await, "path");
    assert_invalid(f.stat("a\0b").await, "path");
    assert_invalid(f.list(".", 65).await, "depth");
    assert_invalid(
        f.write("x", pb::WriteMode::Unspecified, vec![]).await,
        "mode",
    );
    let bad_perm =
        f.cl.make_dir(pb::MakeDirRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            path: "d".into(),
            parents: false,
            permissions: 0o4755,
        })
        .await;
    assert_invalid(bad_perm, "permissions");
    let bad_rename =
        f.cl.rename(pb::RenameFileRequest {
            session_id: sid.clone(),
            execution_id: eid.clone(),
            from: "c.txt".into(),
            to: "../x".into(),
            overwrite: false,
        })
        .await;
    assert_invalid(bad_rename, "to");
    let stale =
        f.cl.stat(pb::StatFileRequest {
            session_id: sid.clone(),
            execution_id: "stale".into(),
            path: ".".into(),
        })
        .await;
    assert_eq!(stale.unwrap_err().code(), Code::FailedPrecondition);
    let no_start =
        f.cl.write(tokio_stream::iter(vec![pb::WriteFileRequest {
            kind: Some(pb::write_file_request::Kind::Data(b"x".to_vec())),
        }]))
        .await;
    assert_invalid(no_start, "start");

    // The audit log holds the mutations with paths and sizes, never contents.
    let audit = host_audit(&agent, &f.s).await;
    let actions: Vec<serde_json::Value> = audit
        .iter()
        .map(|a| serde_json::from_str(&a.json).unwrap())
        .collect();
    let has = |action: &str, resource: &str, result: &str| {
        actions.iter().any(|a| {
            a["action"] == action
                && a["resource"] == resource
                && a["result"].as_str().unwrap_or("").contains(result)
        })
    };
    assert!(has("file.mkdir", "notes/deep", "created"), "{actions:#?}");
    assert!(has("file.write", "notes/a.txt", "create: wrote 6 bytes"));
    assert!(has("file.write", "notes/a.txt", "append: wrote 6 bytes"));
    assert!(has(
        "file.rename",
        "notes/a.txt -> notes/deep/b.txt",
        "renamed"
    ));
    assert!(has("file.remove", "notes", "removed 3 entries"));
    assert!(has("file.write", "swap/secret", "failed"));
    assert!(
        !audit.iter().any(|a| a.json.contains("hello")),
        "no contents in the audit"
    );
}

async fn next(w: &mut tonic::Streaming<pb::FileChange>) -> pb::FileChange {
    tokio::time::timeout(T, w.message())
        .await
        .expect("a change in time")
        .expect("no stream error")
        .expect("stream open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sees_changes_and_ends_with_its_client() {
    let (_guest, _agent, mut f) = setup().await;
    let mut w =
        f.cl.watch(pb::WatchFilesRequest {
            session_id: f.s.session_id.clone(),
            execution_id: f.s.execution_id.clone(),
            path: ".".into(),
            recursive: true,
        })
        .await
        .unwrap()
        .into_inner();
    let first = next(&mut w).await;
    assert_eq!(first.kind, pb::file_change::Kind::Watching as i32);
    f.cl.make_dir(pb::MakeDirRequest {
        session_id: f.s.session_id.clone(),
        execution_id: f.s.execution_id.clone(),
        path: "w".into(),
        parents: false,
        permissions: 0,
    })
    .await
    .unwrap();
    let c = next(&mut w).await;
    assert_eq!(
        (c.kind, c.path.as_str(), c.is_dir),
        (pb::file_change::Kind::Created as i32, "w", true)
    );
    // A file in the new directory: watched too. Written in place (append),
    // it is created then modified.
    f.write("w/f", pb::WriteMode::Append, vec![b"x".to_vec()])
        .await
        .unwrap();
    let c = next(&mut w).await;
    assert_eq!(
        (c.kind, c.path.as_str()),
        (pb::file_change::Kind::Created as i32, "w/f")
    );
    let c = next(&mut w).await;
    assert_eq!(
        (c.kind, c.path.as_str()),
        (pb::file_change::Kind::Modified as i32, "w/f")
    );
    f.cl.rename(pb::RenameFileRequest {
        session_id: f.s.session_id.clone(),
        execution_id: f.s.execution_id.clone(),
        from: "w/f".into(),
        to: "w/g".into(),
        overwrite: false,
    })
    .await
    .unwrap();
    let c = next(&mut w).await;
    assert_eq!(
        (c.kind, c.path.as_str(), c.to.as_str()),
        (pb::file_change::Kind::Renamed as i32, "w/f", "w/g")
    );
    // Dropping the stream frees its slot: 16 more calls can be open at once.
    drop(w);
    let mut open = Vec::new();
    for _ in 0..16 {
        let mut cl = f.cl.clone();
        let (sid, eid) = (f.s.session_id.clone(), f.s.execution_id.clone());
        open.push(tokio::spawn(async move {
            cl.watch(pb::WatchFilesRequest {
                session_id: sid,
                execution_id: eid,
                path: ".".into(),
                recursive: false,
            })
            .await
            .map(|r| r.into_inner())
        }));
    }
    let mut streams = Vec::new();
    for h in open {
        let mut s = h
            .await
            .unwrap()
            .expect("a watch slot (the dropped one was freed)");
        let first = tokio::time::timeout(T, s.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(first.kind, pb::file_change::Kind::Watching as i32);
        streams.push(s);
    }
    let over = f.stat(".").await;
    assert_eq!(over.unwrap_err().code(), Code::ResourceExhausted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_up_and_down_by_hash() {
    let (_guest, _agent, mut f) = setup().await;
    // Under the server's 4 MiB message limit.
    const PIECE: usize = 2 << 20;
    const N: usize = 512; // 1 GiB
                          // Pseudo-random bytes made once; each piece differs in its first 8.
    let base: Vec<u8> = {
        let mut h = Sha256::new();
        h.update(b"files e2e");
        let seed = h.finalize();
        (0..PIECE).map(|j| seed[j % 32] ^ (j >> 5) as u8).collect()
    };
    let piece = |i: usize| -> Vec<u8> {
        let mut p = base.clone();
        p[..8].copy_from_slice(&(i as u64).to_le_bytes());
        p
    };
    let mut want = Sha256::new();
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tx.send(pb::WriteFileRequest {
        kind: Some(pb::write_file_request::Kind::Start(pb::WriteFileStart {
            session_id: f.s.session_id.clone(),
            execution_id: f.s.execution_id.clone(),
            path: "big.bin".into(),
            mode: pb::WriteMode::Create as i32,
            permissions: 0o600,
        })),
    })
    .await
    .unwrap();
    let mut cl = f.cl.clone();
    let up = tokio::spawn(async move {
        cl.write(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    for i in 0..N {
        let p = piece(i);
        want.update(&p);
        let sent = tx
            .send(pb::WriteFileRequest {
                kind: Some(pb::write_file_request::Kind::Data(p)),
            })
            .await;
        // The call ended early: its status (below) says why.
        if sent.is_err() {
            break;
        }
    }
    drop(tx);
    let up = tokio::time::timeout(Duration::from_secs(300), up)
        .await
        .expect("upload in time")
        .unwrap()
        .unwrap()
        .into_inner();
    assert_eq!(up.bytes_written, (N * PIECE) as u64);
    assert_eq!(up.info.unwrap().permissions, 0o600);
    let want = hex::encode(want.finalize());

    let mut st =
        f.cl.read(pb::ReadFileRequest {
            session_id: f.s.session_id.clone(),
            execution_id: f.s.execution_id.clone(),
            path: "big.bin".into(),
            offset: 0,
            length: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut got = Sha256::new();
    let mut n = 0usize;
    while let Some(m) = tokio::time::timeout(T, st.message())
        .await
        .expect("download in time")
        .unwrap()
    {
        n += m.data.len();
        got.update(&m.data);
    }
    assert_eq!(n, N * PIECE);
    assert_eq!(hex::encode(got.finalize()), want);
}

/// `host-agent files ...` with `args`, its stdin `input`: (success, stdout, stderr).
fn cli(agent: &Agent, args: &[&str], input: &[u8]) -> (bool, Vec<u8>, String) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(test_harness::bin::host_agent_path())
        .args(["--addr", &agent.addr, "files"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("host-agent runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_puts_gets_lists_moves_and_removes() {
    let (_guest, agent, f) = setup().await;
    let sid = f.s.session_id.as_str();
    let run = |args: &[&str], input: &[u8]| {
        let (ok, out, err) = cli(&agent, args, input);
        assert!(ok, "files {args:?}: {err}");
        (out, err)
    };
    let (_, err) = run(&["mkdir", "-p", sid, "cli/sub"], b"");
    assert!(err.is_empty(), "{err}");
    let (_, err) = run(&["put", sid, "cli/sub/a.txt"], b"from stdin\n");
    assert!(err.contains("wrote 11 bytes"), "{err}");
    let local = f.ws.with_file_name("local.txt");
    std::fs::write(&local, b"from a file").unwrap();
    run(
        &[
            "put",
            sid,
            "cli/b.txt",
            "--from",
            &local.display().to_string(),
            "--permissions",
            "600",
        ],
        b"",
    );
    let (out, _) = run(&["get", sid, "cli/sub/a.txt"], b"");
    assert_eq!(out, b"from stdin\n");
    let to = f.ws.with_file_name("got.txt");
    run(
        &["get", sid, "cli/b.txt", "--to", &to.display().to_string()],
        b"",
    );
    assert_eq!(std::fs::read(&to).unwrap(), b"from a file");
    let (out, _) = run(&["--output", "json", "ls", sid, "cli", "--depth", "2"], b"");
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let paths: Vec<&str> = rows.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["cli/b.txt", "cli/sub", "cli/sub/a.txt"]);
    assert_eq!(rows[0]["permissions"], "600");
    run(&["mv", sid, "cli/b.txt", "cli/c.txt"], b"");
    let (out, _) = run(&["stat", sid, "cli/c.txt"], b"");
    assert!(String::from_utf8_lossy(&out).contains("cli/c.txt"));
    let (_, err) = run(&["rm", "-r", sid, "cli"], b"");
    assert!(err.contains("removed 4 entries"), "{err}");
    let (ok, _, err) = cli(&agent, &["get", sid, "../etc/passwd"], b"");
    assert!(
        !ok && err.contains("InvalidArgument") && err.contains("path"),
        "{err}"
    );
}
