//! Authorization: clients identified by bearer token (or certificate, see
//! tls.rs) with scopes; sessions owned by their creator and invisible to
//! other non-admin clients; unauthenticated calls refused unless the
//! operator allows local ones; host paths only under the configured roots.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use proto::hostagent as pb;
use proto::hostagent::{
    approvals_client::ApprovalsClient, events_client::EventsClient, exec_client::ExecClient,
    images_client::ImagesClient, node_client::NodeClient, sessions_client::SessionsClient,
    usage_client::UsageClient,
};
use sha2::{Digest, Sha256};
use tonic::transport::Channel;
use tonic::{Code, Request};

const ADMIN: &str = "admin-token-0123456789";
const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789";
const READER: &str = "reader-token-0123456789";

fn sha(t: &str) -> String {
    hex::encode(Sha256::digest(t.as_bytes()))
}

/// A clients file with an admin, two `sessions` clients and a reader.
fn clients_file(dir: &Path) -> PathBuf {
    let p = dir.join("clients");
    std::fs::write(
        &p,
        format!(
            "# name scopes credential\n\
             ops    admin    sha256:{}\n\
             alice  sessions sha256:{}\n\
             bob    sessions sha256:{}\n\
             dash   read     sha256:{}\n",
            sha(ADMIN),
            sha(ALICE),
            sha(BOB),
            sha(READER)
        ),
    )
    .unwrap();
    p
}

/// The directory of the counter test guest (an image root for the tests).
fn kernel_dir() -> String {
    Path::new(&counter_kernel())
        .parent()
        .unwrap()
        .display()
        .to_string()
}

/// Calls with `token` (or none).
fn req<T>(token: Option<&str>, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

/// Calls as bob.
fn bob<T>(msg: T) -> Request<T> {
    req(Some(BOB), msg)
}

fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(e) => {
            assert!(!e.message().is_empty(), "{e:?} has no message");
            e.code()
        }
    }
}

struct Node {
    agent: Agent,
    _files: tempfile::TempDir,
}

/// host-agent with the clients file, the counter guest's directory as image
/// root, and no unauthenticated access.
fn start(extra: &[&str]) -> Node {
    let files = tempfile::tempdir().unwrap();
    let clients = clients_file(files.path()).display().to_string();
    let kdir = kernel_dir();
    let mut args = vec!["--clients-file", &clients, "--allowed-image-root", &kdir];
    args.extend_from_slice(extra);
    Node {
        agent: Agent::start(&args),
        _files: files,
    }
}

impl Node {
    async fn ch(&self) -> Channel {
        self.agent.channel().await
    }

    /// Registers the counter guest and builds its golden snapshot (as admin).
    async fn counter_image(&self) {
        let mut im = ImagesClient::new(self.ch().await);
        im.register_image(req(
            Some(ADMIN),
            pb::RegisterImageRequest {
                image_id: "counter".into(),
                kernel_path: counter_kernel(),
                cmdline: "interval=100000000".into(),
                mem_mib: 32,
                vcpus: 1,
                ..Default::default()
            },
        ))
        .await
        .expect("admin registers");
        im.build_golden_snapshot(req(
            Some(ADMIN),
            pb::BuildGoldenSnapshotRequest {
                image_id: "counter".into(),
                settle_ms: 50,
                ..Default::default()
            },
        ))
        .await
        .expect("admin builds");
    }

    async fn create(&self, token: &str, key: &str) -> Result<pb::Session, tonic::Status> {
        SessionsClient::new(self.ch().await)
            .create_session(req(
                Some(token),
                pb::CreateSessionRequest {
                    image_id: "counter".into(),
                    idempotency_key: key.into(),
                    ..Default::default()
                },
            ))
            .await
            .map(|r| r.into_inner())
    }

    async fn list(&self, token: &str) -> Vec<pb::Session> {
        SessionsClient::new(self.ch().await)
            .list_sessions(req(Some(token), pb::ListSessionsRequest::default()))
            .await
            .expect("list sessions")
            .into_inner()
            .sessions
    }
}

fn call(id: &str) -> pb::SessionCall {
    pb::SessionCall {
        session_id: id.into(),
        idempotency_key: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_scope_allows_its_calls_and_refuses_the_others() {
    let node = start(&[]);
    let ch = node.ch().await;
    let mut im = ImagesClient::new(ch.clone());
    let register = |token| {
        req(
            Some(token),
            pb::RegisterImageRequest {
                image_id: "c2".into(),
                kernel_path: counter_kernel(),
                ..Default::default()
            },
        )
    };
    // Images are admin's: sessions and read clients may only look.
    assert_eq!(
        code(im.register_image(register(READER)).await),
        Code::PermissionDenied
    );
    assert_eq!(
        code(im.register_image(register(ALICE)).await),
        Code::PermissionDenied
    );
    assert_eq!(code(im.register_image(register(ADMIN)).await), Code::Ok);
    for token in [READER, ALICE, ADMIN] {
        assert_eq!(
            code(
                im.list_images(req(Some(token), pb::ListImagesRequest {}))
                    .await
            ),
            Code::Ok,
            "{token} lists images"
        );
    }
    let delete = |token| {
        req(
            Some(token),
            pb::DeleteImageRequest {
                image_id: "c2".into(),
                idempotency_key: String::new(),
            },
        )
    };
    assert_eq!(
        code(im.delete_image(delete(ALICE)).await),
        Code::PermissionDenied
    );
    assert_eq!(code(im.delete_image(delete(ADMIN)).await), Code::Ok);

    node.counter_image().await;
    // read: no sessions of its own to make; lists, node and usage are fine.
    let err = node.create(READER, "").await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("sessions"), "{err:?}");
    assert!(node.list(READER).await.is_empty());
    let mut nd = NodeClient::new(ch.clone());
    assert_eq!(
        code(
            nd.get_version(req(Some(READER), pb::GetVersionRequest {}))
                .await
        ),
        Code::Ok
    );
    let mut us = UsageClient::new(ch.clone());
    assert_eq!(
        code(
            us.list_usage(req(Some(READER), pb::ListUsageRequest::default()))
                .await
        ),
        Code::Ok
    );

    // sessions: create, pause, resume, stop its own.
    let s = node.create(ALICE, "").await.expect("alice creates");
    let mut se = SessionsClient::new(ch.clone());
    assert_eq!(
        code(
            se.pause_session(req(
                Some(READER),
                proto::hostagent::PauseSessionRequest::from(call(&s.session_id))
            ))
            .await
        ),
        Code::PermissionDenied,
        "read may not pause"
    );
    assert_eq!(
        code(
            se.pause_session(req(
                Some(ALICE),
                proto::hostagent::PauseSessionRequest::from(call(&s.session_id))
            ))
            .await
        ),
        Code::Ok
    );
    assert_eq!(
        code(
            se.resume_session(req(Some(ALICE), call(&s.session_id)))
                .await
        ),
        Code::Ok
    );
    // admin acts on anyone's session.
    assert_eq!(
        code(se.stop_session(req(Some(ADMIN), call(&s.session_id))).await),
        Code::Ok
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_client_gets_not_found_for_a_session_it_does_not_own() {
    let node = start(&[]);
    node.counter_image().await;
    let a = node.create(ALICE, "same-key").await.expect("alice creates");
    let id = a.session_id.clone();
    let ch = node.ch().await;
    let mut se = SessionsClient::new(ch.clone());

    // Bob's answers are those for a session that does not exist.
    for (what, c) in [
        (
            "get",
            code(
                se.get_session(bob(pb::SessionRef {
                    session_id: id.clone(),
                }))
                .await,
            ),
        ),
        (
            "pause",
            code(
                se.pause_session(bob(proto::hostagent::PauseSessionRequest::from(call(&id))))
                    .await,
            ),
        ),
        ("resume", code(se.resume_session(bob(call(&id))).await)),
        ("snapshot", code(se.snapshot_session(bob(call(&id))).await)),
        ("stop", code(se.stop_session(bob(call(&id))).await)),
        ("delete", code(se.delete_session(bob(call(&id))).await)),
        (
            "restore",
            code(
                se.restore_session(bob(pb::RestoreSessionRequest {
                    session_id: id.clone(),
                    snapshot_dir: "/x".into(),
                    idempotency_key: String::new(),
                }))
                .await,
            ),
        ),
        (
            "list asks",
            code(
                ApprovalsClient::new(ch.clone())
                    .list_asks(bob(pb::ListAsksRequest {
                        session_id: id.clone(),
                    }))
                    .await,
            ),
        ),
        (
            "list audit",
            code(
                ApprovalsClient::new(ch.clone())
                    .list_audit(bob(pb::ListAuditRequest {
                        session_id: id.clone(),
                        since_guest_seq: 0,
                    }))
                    .await,
            ),
        ),
        (
            "answer",
            code(
                ApprovalsClient::new(ch.clone())
                    .answer(bob(pb::AnswerRequest {
                        session_id: id.clone(),
                        execution_id: a.execution_id.clone(),
                        ask_id: "x".into(),
                        reply: pb::Reply::Once as i32,
                    }))
                    .await,
            ),
        ),
        (
            "exec",
            code(
                ExecClient::new(ch.clone())
                    .exec(bob(tokio_stream::iter(vec![pb::ExecRequest {
                        kind: Some(pb::exec_request::Kind::Start(pb::ExecStart {
                            session_id: id.clone(),
                            execution_id: a.execution_id.clone(),
                            argv: vec!["true".into()],
                            ..Default::default()
                        })),
                    }])))
                    .await,
            ),
        ),
    ] {
        assert_eq!(c, Code::NotFound, "bob's {what} on alice's session");
    }

    // Lists: bob sees nothing of alice's session, not even its execution id.
    let listed = format!("{:?}", node.list(BOB).await);
    assert!(
        !listed.contains(&id) && !listed.contains(&a.execution_id),
        "bob's list: {listed}"
    );
    let mine = node.list(ALICE).await;
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].session_id, id);
    assert!(node.list(ADMIN).await.iter().any(|s| s.session_id == id));

    // Bob's own session, made with the same idempotency key, is a new one.
    let b = node.create(BOB, "same-key").await.expect("bob creates");
    assert_ne!(b.session_id, id, "the key is per client");
    let bobs = node.list(BOB).await;
    assert_eq!(bobs.len(), 1);
    assert_eq!(bobs[0].session_id, b.session_id);

    // Events and usage are filtered by owner too.
    let mut ev = EventsClient::new(ch.clone())
        .watch(bob(pb::WatchRequest::default()))
        .await
        .expect("bob watches")
        .into_inner();
    // Bob's own session has at least PENDING→RESTORING→READY→RUNNING.
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let e = tokio::time::timeout(Duration::from_secs(60), ev.message())
            .await
            .expect("event in time")
            .expect("stream ok")
            .expect("stream open");
        seen.push(e);
    }
    assert!(
        seen.iter().all(|e| e.session_id == b.session_id),
        "bob sees only his events: {seen:?}"
    );
    // Alice's usage: wait for her first record, then ask as bob.
    loop {
        let hers = UsageClient::new(ch.clone())
            .list_usage(req(
                Some(ALICE),
                pb::ListUsageRequest {
                    session_id: id.clone(),
                    ..Default::default()
                },
            ))
            .await
            .unwrap()
            .into_inner()
            .records;
        if !hers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let theirs = UsageClient::new(ch.clone())
        .list_usage(bob(pb::ListUsageRequest::default()))
        .await
        .unwrap()
        .into_inner()
        .records;
    assert!(
        theirs.iter().all(|u| u.session_id == b.session_id),
        "bob's usage holds only his records: {theirs:?}"
    );
    let all = UsageClient::new(ch.clone())
        .list_usage(req(Some(ADMIN), pb::ListUsageRequest::default()))
        .await
        .unwrap()
        .into_inner()
        .records;
    assert!(
        all.iter().any(|u| u.session_id == id),
        "admin sees all usage"
    );

    // Alice still controls her session.
    assert_eq!(
        code(se.stop_session(req(Some(ALICE), call(&id))).await),
        Code::Ok
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_credentials_are_unauthenticated_unless_allowed() {
    let node = start(&[]);
    let mut nd = NodeClient::new(node.ch().await);
    for (token, what) in [
        (None, "no token"),
        (Some("not-a-listed-token"), "wrong token"),
    ] {
        let err = nd
            .get_version(req(token, pb::GetVersionRequest {}))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{what}: {err:?}");
        assert!(!err.message().contains("not-a-listed"), "{err:?}");
    }
    // The health check stays open for probes.
    let mut health = tonic_health::pb::health_client::HealthClient::new(node.ch().await);
    health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health without credentials");

    // The operator allows local calls without credentials: they are admin.
    let open = start(&["--allow-unauthenticated-local"]);
    let mut im = ImagesClient::new(open.ch().await);
    im.register_image(pb::RegisterImageRequest {
        image_id: "c".into(),
        kernel_path: counter_kernel(),
        ..Default::default()
    })
    .await
    .expect("local admin registers");
    // A presented token must still be valid.
    let err = im
        .list_images(req(Some("not-a-listed-token"), pb::ListImagesRequest {}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_paths_outside_the_roots_are_refused() {
    let files = tempfile::tempdir().unwrap();
    let root = files.path().join("images");
    let repos = files.path().join("repos");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(repos.join("project/.git")).unwrap();
    std::fs::create_dir_all(files.path().join("elsewhere/.git")).unwrap();
    std::fs::write(files.path().join("secret"), b"host secret").unwrap();
    std::fs::copy(counter_kernel(), root.join("counter.elf")).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", root.join("shadow")).unwrap();
    std::os::unix::fs::symlink(files.path().join("secret"), root.join("secret-link")).unwrap();
    std::os::unix::fs::symlink(files.path().join("elsewhere"), repos.join("link")).unwrap();
    let (r, rr) = (root.display().to_string(), repos.display().to_string());
    let agent = Agent::start(&["--allowed-image-root", &r, "--allowed-repository-root", &rr]);
    let kernel = root.join("counter.elf").display().to_string();
    let mut im = agent.images().await;
    let register = |id: &str, rootfs: String| pb::RegisterImageRequest {
        image_id: id.into(),
        kernel_path: kernel.clone(),
        rootfs_path: rootfs,
        ..Default::default()
    };
    let s = |p: PathBuf| p.display().to_string();
    for (i, rootfs) in [
        "/etc/shadow".to_string(),
        s(root.join("shadow")),
        s(root.join("secret-link")),
        s(root.join("../secret")),
        format!("{r}/../../{}", files.path().join("secret").display()),
    ]
    .into_iter()
    .enumerate()
    {
        let err = im
            .register_image(register(&format!("bad{i}"), rootfs.clone()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{rootfs}: {err:?}");
        assert!(
            err.message().contains("allowed_image_roots"),
            "{rootfs}: the message names the setting: {err:?}"
        );
    }
    let err = im
        .register_image(pb::RegisterImageRequest {
            image_id: "badkernel".into(),
            kernel_path: counter_kernel(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Code::PermissionDenied,
        "kernel outside: {err:?}"
    );

    // Inside the root: accepted and stored as resolved.
    let via = s(root.join("./sub/../counter.elf"));
    std::fs::create_dir(root.join("sub")).unwrap();
    let img = im
        .register_image(pb::RegisterImageRequest {
            image_id: "counter".into(),
            kernel_path: via,
            cmdline: "interval=100000000".into(),
            mem_mib: 32,
            ..Default::default()
        })
        .await
        .expect("a kernel inside the root")
        .into_inner();
    let canon_root = std::fs::canonicalize(&root).unwrap();
    assert_eq!(
        img.kernel_path,
        canon_root.join("counter.elf").display().to_string()
    );

    // Repositories: only under the repository roots, links resolved first.
    let mut se = agent.sessions().await;
    for repo in [
        s(files.path().join("elsewhere")),
        s(repos.join("link")),
        s(repos.join("../elsewhere")),
        "/".to_string(),
    ] {
        let err = se
            .create_session(pb::CreateSessionRequest {
                image_id: "counter".into(),
                repository_path: repo.clone(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{repo}: {err:?}");
        assert!(
            err.message().contains("allowed_repository_roots"),
            "{err:?}"
        );
    }
    // One inside passes the root check (and then needs a golden snapshot).
    let err = se
        .create_session(pb::CreateSessionRequest {
            image_id: "counter".into(),
            repository_path: s(repos.join("project")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_image_files_must_lie_in_the_state_directory() {
    let agent = Agent::start(&["--no-test-defaults", "--allow-unauthenticated-local"]);
    let mut im = agent.images().await;
    let err = im
        .register_image(pb::RegisterImageRequest {
            image_id: "c".into(),
            kernel_path: counter_kernel(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let default_root = agent.state_dir().join("image-files");
    std::fs::copy(counter_kernel(), default_root.join("counter.elf")).unwrap();
    im.register_image(pb::RegisterImageRequest {
        image_id: "c".into(),
        kernel_path: default_root.join("counter.elf").display().to_string(),
        ..Default::default()
    })
    .await
    .expect("a kernel in <state>/image-files");
    // The database itself is in the state directory but not in a root.
    let err = im
        .register_image(pb::RegisterImageRequest {
            image_id: "db".into(),
            kernel_path: counter_kernel(),
            rootfs_path: agent
                .state_dir()
                .join("host-agent.db")
                .display()
                .to_string(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_sends_its_token_file() {
    let node = start(&[]);
    let tok = node._files.path().join("token");
    std::fs::write(&tok, format!("{READER}\n")).unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
            .arg("--addr")
            .arg(&node.agent.addr)
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&["images", "list"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Unauthenticated"),
        "{out:?}"
    );
    let t = tok.display().to_string();
    let out = cli(&["--token-file", &t, "images", "list"]);
    assert!(out.status.success(), "{out:?}");
    let out = cli(&["--token-file", &t, "images", "delete", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("PermissionDenied"),
        "{err}"
    );
    assert!(!err.contains(READER), "the token is never printed: {err}");
}
