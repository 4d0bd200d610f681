//! Request validation (every bad field gets InvalidArgument or NotFound with
//! a message, never a panic or a hang), health, reflection, node, exec and
//! approvals refusals for sessions without guest-init.

mod common;

use std::time::Duration;

use common::*;
use proto::hostagent as pb;
use tonic::Code;

fn expect(code: Code, r: Result<impl std::fmt::Debug, tonic::Status>, what: &str) {
    match r {
        Ok(v) => panic!("{what}: expected {code:?}, got {v:?}"),
        Err(e) => {
            assert_eq!(e.code(), code, "{what}: {e:?}");
            assert!(!e.message().is_empty(), "{what}: empty message");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_a_message() {
    let agent = Agent::start(&[]);
    let mut im = agent.images().await;
    let kernel = counter_kernel();
    let reg = |f: &dyn Fn(&mut pb::RegisterImageRequest)| {
        let mut r = pb::RegisterImageRequest {
            image_id: "ok".into(),
            kernel_path: kernel.clone(),
            ..Default::default()
        };
        f(&mut r);
        r
    };
    let cases: Vec<(&str, pb::RegisterImageRequest)> = vec![
        ("empty id", reg(&|r| r.image_id.clear())),
        ("long id", reg(&|r| r.image_id = "x".repeat(65))),
        ("bad id chars", reg(&|r| r.image_id = "a/b".into())),
        ("dot id", reg(&|r| r.image_id = "..".into())),
        ("no kernel", reg(&|r| r.kernel_path.clear())),
        (
            "relative kernel",
            reg(&|r| r.kernel_path = "vmlinux".into()),
        ),
        (
            "missing kernel",
            reg(&|r| r.kernel_path = "/nonexistent/vmlinux".into()),
        ),
        (
            "long kernel",
            reg(&|r| r.kernel_path = format!("/{}", "a".repeat(5000))),
        ),
        (
            "missing rootfs",
            reg(&|r| r.rootfs_path = "/nonexistent/rootfs".into()),
        ),
        (
            "missing initrd",
            reg(&|r| r.initrd_path = "/nonexistent/initrd.gz".into()),
        ),
        (
            "relative initrd",
            reg(&|r| r.initrd_path = "initrd.gz".into()),
        ),
        ("long cmdline", reg(&|r| r.cmdline = "a".repeat(3000))),
        ("newline cmdline", reg(&|r| r.cmdline = "a\nb".into())),
        ("too much memory", reg(&|r| r.mem_mib = 1 << 20)),
        ("too many vcpus", reg(&|r| r.vcpus = 1000)),
        ("long key", reg(&|r| r.idempotency_key = "k".repeat(129))),
        ("key with space", reg(&|r| r.idempotency_key = "a b".into())),
    ];
    for (what, req) in cases {
        expect(Code::InvalidArgument, im.register_image(req).await, what);
    }
    expect(
        Code::NotFound,
        im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "nope".into(),
            ..Default::default()
        })
        .await,
        "build unknown image",
    );
    expect(
        Code::InvalidArgument,
        im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "nope".into(),
            settle_ms: 100_000,
            ..Default::default()
        })
        .await,
        "settle out of range",
    );
    expect(
        Code::NotFound,
        im.get_image(pb::GetImageRequest {
            image_id: "nope".into(),
        })
        .await,
        "get unknown image",
    );
    expect(
        Code::NotFound,
        im.delete_image(pb::DeleteImageRequest {
            image_id: "nope".into(),
            idempotency_key: String::new(),
        })
        .await,
        "delete unknown image",
    );
    // Registered twice.
    im.register_image(reg(&|_| {})).await.unwrap();
    expect(
        Code::AlreadyExists,
        im.register_image(reg(&|_| {})).await,
        "twice",
    );
    // No golden snapshot yet.
    let mut se = agent.sessions().await;
    expect(
        Code::FailedPrecondition,
        se.create_session(pb::CreateSessionRequest {
            image_id: "ok".into(),
            ..Default::default()
        })
        .await,
        "create without golden snapshot",
    );

    let create = |f: &dyn Fn(&mut pb::CreateSessionRequest)| {
        let mut r = pb::CreateSessionRequest {
            image_id: "ok".into(),
            ..Default::default()
        };
        f(&mut r);
        r
    };
    let cases: Vec<(&str, Code, pb::CreateSessionRequest)> = vec![
        (
            "empty image",
            Code::InvalidArgument,
            create(&|r| r.image_id.clear()),
        ),
        (
            "unknown image",
            Code::NotFound,
            create(&|r| r.image_id = "nope".into()),
        ),
        (
            "ttl out of range",
            Code::InvalidArgument,
            create(&|r| {
                r.limits = Some(pb::Limits {
                    ttl_seconds: u64::MAX,
                    idle_timeout_seconds: 0,
                })
            }),
        ),
        (
            "idle out of range",
            Code::InvalidArgument,
            create(&|r| {
                r.limits = Some(pb::Limits {
                    ttl_seconds: 0,
                    idle_timeout_seconds: 1 << 40,
                })
            }),
        ),
        (
            "too many labels",
            Code::InvalidArgument,
            create(&|r| r.labels = (0..17).map(|i| (i.to_string(), String::new())).collect()),
        ),
        (
            "empty label key",
            Code::InvalidArgument,
            create(&|r| r.labels = [(String::new(), "v".into())].into()),
        ),
        (
            "long label value",
            Code::InvalidArgument,
            create(&|r| r.labels = [("k".into(), "v".repeat(300))].into()),
        ),
        (
            "long key",
            Code::InvalidArgument,
            create(&|r| r.idempotency_key = "k".repeat(200)),
        ),
    ];
    for (what, code, req) in cases {
        expect(code, se.create_session(req).await, what);
    }

    let call = |id: &str| pb::SessionCall {
        session_id: id.into(),
        idempotency_key: String::new(),
    };
    for (id, code) in [
        ("", Code::InvalidArgument),
        (&"x".repeat(100) as &str, Code::InvalidArgument),
        ("no-such-session", Code::NotFound),
    ] {
        expect(
            code,
            se.get_session(pb::SessionRef {
                session_id: id.into(),
            })
            .await,
            "get",
        );
        expect(
            code,
            se.pause_session(proto::hostagent::PauseSessionRequest::from(call(id)))
                .await,
            "pause",
        );
        expect(code, se.resume_session(call(id)).await, "resume");
        expect(code, se.snapshot_session(call(id)).await, "snapshot");
        expect(code, se.stop_session(call(id)).await, "stop");
        expect(code, se.delete_session(call(id)).await, "delete");
    }
    expect(
        Code::InvalidArgument,
        se.list_sessions(pb::ListSessionsRequest {
            states: vec![99],
            ..Default::default()
        })
        .await,
        "list with bad state",
    );

    let mut us = agent.usage().await;
    expect(
        Code::InvalidArgument,
        us.list_usage(pb::ListUsageRequest {
            since_time: -1,
            ..Default::default()
        })
        .await,
        "negative since_time",
    );
    expect(
        Code::InvalidArgument,
        us.list_usage(pb::ListUsageRequest {
            limit: 20_000,
            ..Default::default()
        })
        .await,
        "limit out of range",
    );

    let mut ap = proto::hostagent::approvals_client::ApprovalsClient::new(agent.channel().await);
    expect(
        Code::NotFound,
        ap.list_asks(pb::ListAsksRequest {
            session_id: "nope".into(),
        })
        .await,
        "asks of unknown session",
    );
    expect(
        Code::InvalidArgument,
        ap.answer(pb::AnswerRequest {
            session_id: "nope".into(),
            execution_id: "e".into(),
            ask_id: "a".into(),
            reply: 0,
        })
        .await,
        "unspecified reply",
    );
    expect(
        Code::NotFound,
        ap.answer(pb::AnswerRequest {
            session_id: "nope".into(),
            execution_id: "e".into(),
            ask_id: "a".into(),
            reply: pb::Reply::Once as i32,
        })
        .await,
        "answer for unknown session",
    );
    expect(
        Code::NotFound,
        ap.list_audit(pb::ListAuditRequest {
            session_id: "nope".into(),
            since_guest_seq: 0,
        })
        .await,
        "audit of unknown session",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_checks_execution_id_and_guest_init() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    let mut ex = proto::hostagent::exec_client::ExecClient::new(agent.channel().await);
    let start = |exec: &str, argv: Vec<String>| {
        tokio_stream::iter(vec![pb::ExecRequest {
            kind: Some(pb::exec_request::Kind::Start(pb::ExecStart {
                session_id: s.session_id.clone(),
                execution_id: exec.into(),
                argv,
                ..Default::default()
            })),
        }])
    };
    let argv = vec!["true".to_string()];
    expect(
        Code::FailedPrecondition,
        ex.exec(start("stale", argv.clone())).await,
        "stale execution id",
    );
    expect(
        Code::InvalidArgument,
        ex.exec(start("", argv.clone())).await,
        "empty execution id",
    );
    expect(
        Code::InvalidArgument,
        ex.exec(start(&s.execution_id, vec![])).await,
        "empty argv",
    );
    expect(
        Code::FailedPrecondition,
        ex.exec(start(&s.execution_id, argv)).await,
        "no guest-init",
    );
    expect(
        Code::InvalidArgument,
        ex.exec(tokio_stream::iter(vec![pb::ExecRequest {
            kind: Some(pb::exec_request::Kind::Stdin(b"x".to_vec())),
        }]))
        .await,
        "stdin before start",
    );
    expect(
        Code::InvalidArgument,
        ex.exec(tokio_stream::iter(Vec::<pb::ExecRequest>::new()))
            .await,
        "empty stream",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reflection_node_and_metrics() {
    let metrics_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let maddr = format!("127.0.0.1:{metrics_port}");
    let agent = Agent::start(&["--metrics-listen", &maddr]);
    let ch = agent.channel().await;

    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    for svc in ["", "hostagent.v1.Sessions", "hostagent.v1.Events"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: svc.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{svc}"
        );
    }

    use tonic_reflection::pb::v1::{
        server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        ServerReflectionRequest,
    };
    let mut refl = ServerReflectionClient::new(ch.clone());
    let mut resp = refl
        .server_reflection_info(tokio_stream::iter(vec![ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        }]))
        .await
        .unwrap()
        .into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer {msg:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in [
        "hostagent.v1.Images",
        "hostagent.v1.Sessions",
        "hostagent.v1.Exec",
        "hostagent.v1.Approvals",
        "hostagent.v1.Files",
        "hostagent.v1.Schedules",
        "hostagent.v1.Events",
        "hostagent.v1.Usage",
        "hostagent.v1.Node",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }

    agent.counter_image("counter").await;
    agent.create("counter", "").await;
    let mut node = agent.node().await;
    let cap = node
        .get_capacity(pb::GetCapacityRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.sessions_live, 1);
    assert_eq!(cap.memory_mib_used, 32);
    assert_eq!(cap.vcpus_used, 1);
    let v = node
        .get_version(pb::GetVersionRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!v.version.is_empty());

    // Prometheus text over HTTP.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(&maddr).await.unwrap();
    sock.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_string(&mut body))
        .await
        .unwrap()
        .unwrap();
    assert!(
        body.contains("hostagent_sessions{state=\"RUNNING\"} 1"),
        "{body}"
    );
    assert!(body.contains("hostagent_restore_seconds_count 1"), "{body}");
    assert!(body.contains("hostagent_api_errors_total"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_and_missing_vmm() {
    // Settings from a config file apply; with a missing vmm the golden
    // build fails with a message naming the binary, and the image stays
    // without a snapshot.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "state_dir": dir.path().join("state"),
            "max_sessions": 3,
            "usage_interval_ms": 500,
        })
        .to_string(),
    )
    .unwrap();
    let agent = Agent::start(&[
        "--config",
        &cfg.display().to_string(),
        "--vmm",
        "/nonexistent/vmm",
    ]);
    let cap = agent
        .node()
        .await
        .get_capacity(pb::GetCapacityRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.sessions_max, 3, "config file applied");
    let mut im = agent.images().await;
    im.register_image(pb::RegisterImageRequest {
        image_id: "c".into(),
        kernel_path: counter_kernel(),
        ..Default::default()
    })
    .await
    .unwrap();
    let err = im
        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "c".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("/nonexistent/vmm"), "{err:?}");
    let img = im
        .get_image(pb::GetImageRequest {
            image_id: "c".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(img.golden_snapshot_dir.is_empty());

    // An unknown config field is refused at start.
    std::fs::write(&cfg, r#"{"no_such_field": 1}"#).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_field"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_in_use_cannot_be_deleted() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    let mut im = agent.images().await;
    let del = || pb::DeleteImageRequest {
        image_id: "counter".into(),
        idempotency_key: String::new(),
    };
    expect(
        Code::FailedPrecondition,
        im.delete_image(del()).await,
        "image in use",
    );
    agent
        .sessions()
        .await
        .stop_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap();
    im.delete_image(del()).await.unwrap();
    expect(
        Code::NotFound,
        im.get_image(pb::GetImageRequest {
            image_id: "counter".into(),
        })
        .await,
        "deleted image",
    );
    assert!(!agent.state_dir().join("images/counter").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_with_an_initrd_boots_its_golden_snapshot_with_it() {
    let agent = Agent::start(&[]);
    let initrd = agent.dir.path().join("initrd.cpio.gz");
    std::fs::write(&initrd, vec![0x5a; 64 << 10]).unwrap();
    let mut im = agent.images().await;
    let reg = im
        .register_image(pb::RegisterImageRequest {
            image_id: "with-initrd".into(),
            kernel_path: counter_kernel(),
            initrd_path: initrd.display().to_string(),
            cmdline: "interval=100000000".into(),
            mem_mib: 32,
            ..Default::default()
        })
        .await
        .expect("register with an initrd")
        .into_inner();
    assert_eq!(reg.initrd_path, initrd.display().to_string());
    let built = im
        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "with-initrd".into(),
            settle_ms: 50,
            ..Default::default()
        })
        .await
        .expect("golden snapshot of an image with an initrd")
        .into_inner();
    assert!(!built.golden_snapshot_dir.is_empty());
    assert_eq!(built.initrd_path, initrd.display().to_string());
    let s = agent.create("with-initrd", "").await;
    assert_eq!(s.state, S::Running as i32);
}
