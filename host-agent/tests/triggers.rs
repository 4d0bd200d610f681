//! Webhook triggers over HTTP: a signed delivery starts a run whose
//! command finds the request body in the workspace; a bad signature, an
//! old timestamp, a replayed delivery id, missing headers and an unknown
//! trigger are refused (401, 401, 409, 400, 404) and every delivery but
//! the unknown trigger's is kept (ListTriggerDeliveries); a WAKE_UP
//! trigger resumes a paused session, runs the command in it and pauses it
//! again. The guest is the stand-in of tests/common/fake_guest.rs.

mod common;

use std::time::Duration;

use common::fake_guest::FakeGuest;
use common::*;
use host_agent::schedules::triggers::signature;
use proto::hostagent as pb;
use proto::hostagent::schedules_client::SchedulesClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// POSTs `body` to `path` with `headers`; returns the status and body.
async fn post(port: u16, path: &str, headers: &[(&str, String)], body: &[u8]) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the webhook listener");
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (status, body)
}

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// The three headers of a delivery signed with `secret`.
fn signed(secret: &str, ts: i64, delivery: &str, body: &[u8]) -> Vec<(&'static str, String)> {
    vec![
        ("x-agentvm-timestamp", ts.to_string()),
        ("x-agentvm-delivery", delivery.to_string()),
        (
            "x-hub-signature-256",
            signature(secret, &ts.to_string(), delivery, body),
        ),
    ]
}

async fn run_of(c: &mut SchedulesClient<Channel>, trigger: &str, id: u64) -> pb::ScheduleRun {
    for _ in 0..300 {
        let runs = c
            .list_runs(pb::ListRunsRequest {
                trigger_id: trigger.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .runs;
        if let Some(r) = runs.into_iter().find(|r| r.run_id == id) {
            if r.state == pb::RunState::Succeeded as i32 || r.state == pb::RunState::Failed as i32 {
                return r;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("run {id} of {trigger} did not end");
}

/// host-agent with the stand-in guest, its image "gi", a webhook listener
/// on `port`, and a repository.
struct Node {
    agent: Agent,
    guest: FakeGuest,
    port: u16,
    repo: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

async fn node() -> Node {
    let guest = FakeGuest::start();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let agent = Agent::start(&[
        "--guest-vsock-uds",
        &guest.sock(),
        "--no-vsock-device",
        "--webhook-listen",
        &listen,
    ]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    Node {
        agent,
        guest,
        port,
        repo,
        _dir: dir,
    }
}

fn run_id(answer: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(answer).expect("a JSON answer");
    v["run_id"].as_u64().unwrap_or_else(|| panic!("{answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_deliveries_run_and_bad_ones_are_refused_and_kept() {
    let Node {
        agent,
        guest,
        port,
        repo,
        _dir,
    } = node().await;
    let mut c = SchedulesClient::new(agent.channel().await);

    let t = c
        .create_trigger(pb::CreateTriggerRequest {
            trigger: Some(pb::Trigger {
                trigger_id: "report-hook".into(),
                session: Some(pb::CreateSessionRequest {
                    image_id: "gi".into(),
                    repository_path: repo.display().to_string(),
                    agent: "good".into(),
                    base_ref: "main".into(),
                    ..Default::default()
                }),
                run: vec![
                    "sh".into(),
                    "-c".into(),
                    "cat \"$AGENTVM_TRIGGER_BODY\"".into(),
                ],
                enabled: true,
                ..Default::default()
            }),
        })
        .await
        .expect("create trigger")
        .into_inner();
    assert_eq!(t.secret.len(), 64, "{t:?}");
    assert_eq!(t.path, "/triggers/report-hook");
    // The secret is shown once.
    let again = c
        .get_trigger(pb::TriggerRef {
            trigger_id: "report-hook".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(again.secret.is_empty(), "{again:?}");
    let secret = t.secret.clone();
    let path = t.path.clone();
    let body = br#"{"week": 48, "team": "data"}"#;

    // A good delivery: 202 with its run, which runs with the body at hand.
    let ts = now_s();
    let (status, answer) = post(port, &path, &signed(&secret, ts, "d-1", body), body).await;
    assert_eq!(status, 202, "{answer}");
    let id = run_id(&answer);
    let r = run_of(&mut c, "report-hook", id).await;
    assert_eq!(r.state, pb::RunState::Succeeded as i32, "{r:?}");
    assert_eq!(
        (r.cause.as_str(), r.key.as_str()),
        ("trigger", "trigger:report-hook:d-1")
    );
    let written =
        guest.seen.files.lock().unwrap()[&(r.session_id.clone(), ".trigger-body".into())].clone();
    assert_eq!(written, body);
    let execs = guest.seen.execs.lock().unwrap().clone();
    let (_, e) = execs
        .iter()
        .find(|(s, _)| *s == r.session_id)
        .expect("the command ran in the run's session");
    assert_eq!(e.env["AGENTVM_DELIVERY"], "d-1");
    assert_eq!(e.env["AGENTVM_TRIGGER_BODY"], ".trigger-body");

    // The same delivery again: a replay.
    let (status, answer) = post(port, &path, &signed(&secret, ts, "d-1", body), body).await;
    assert_eq!(status, 409, "{answer}");
    // Signed with another secret, or the body changed under the signature.
    let (status, _) = post(port, &path, &signed("wrong", ts, "d-2", body), body).await;
    assert_eq!(status, 401);
    let (status, _) = post(port, &path, &signed(&secret, ts, "d-3", body), b"{}").await;
    assert_eq!(status, 401);
    // Signed, but ten minutes old.
    let (status, answer) = post(port, &path, &signed(&secret, ts - 600, "d-4", body), body).await;
    assert_eq!(status, 401, "{answer}");
    assert!(answer.contains("stale_timestamp"), "{answer}");
    // No headers; no such trigger.
    let (status, _) = post(port, &path, &[], body).await;
    assert_eq!(status, 400);
    let (status, _) = post(
        port,
        "/triggers/nope",
        &signed(&secret, ts, "d-5", body),
        body,
    )
    .await;
    assert_eq!(status, 404);
    // Too large.
    let big = vec![b'x'; (1 << 20) + 1];
    let (status, _) = post(port, &path, &signed(&secret, ts, "d-6", &big), &big).await;
    assert_eq!(status, 413);

    // Every delivery to the trigger is kept, newest first, none of them
    // starting a run but the first.
    let kept = c
        .list_trigger_deliveries(pb::ListTriggerDeliveriesRequest {
            trigger_id: "report-hook".into(),
            page_size: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .deliveries;
    let outcomes: Vec<(&str, u32, &str)> = kept
        .iter()
        .map(|d| (d.outcome.as_str(), d.http_status, d.delivery_id.as_str()))
        .collect();
    assert_eq!(
        outcomes,
        [
            ("too_large", 413, "d-6"),
            ("bad_request", 400, ""),
            ("stale_timestamp", 401, "d-4"),
            ("bad_signature", 401, "d-3"),
            ("bad_signature", 401, "d-2"),
            ("replayed", 409, "d-1"),
            ("accepted", 202, "d-1"),
        ],
        "{kept:#?}"
    );
    assert_eq!(kept.last().unwrap().run_id, id);
    assert!(kept.iter().all(|d| d.remote.starts_with("127.0.0.1:")));
    let runs = c
        .list_runs(pb::ListRunsRequest {
            trigger_id: "report-hook".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(runs.len(), 1, "{runs:#?}");

    // A disabled trigger takes nothing; a deleted one is not found.
    c.delete_trigger(pb::TriggerRef {
        trigger_id: "report-hook".into(),
    })
    .await
    .unwrap();
    let (status, _) = post(port, &path, &signed(&secret, now_s(), "d-7", body), body).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_trigger_resumes_a_paused_session_and_pauses_it_again() {
    let Node {
        agent,
        guest,
        port,
        repo,
        _dir,
    } = node().await;
    let s = agent.guest_session(&repo, "good", "main").await.unwrap();
    let mut sessions = agent.sessions().await;
    sessions
        .pause_session(pb::PauseSessionRequest {
            session_id: s.session_id.clone(),
            ..Default::default()
        })
        .await
        .expect("pause");
    let mut c = SchedulesClient::new(agent.channel().await);
    let t = c
        .create_trigger(pb::CreateTriggerRequest {
            trigger: Some(pb::Trigger {
                trigger_id: "wake".into(),
                kind: pb::TriggerKind::WakeUp as i32,
                session_id: s.session_id.clone(),
                run: vec!["./pull-numbers".into()],
                enabled: true,
                ..Default::default()
            }),
        })
        .await
        .expect("create wake-up trigger")
        .into_inner();
    let body = b"numbers are in";
    let (status, answer) = post(
        port,
        &t.path,
        &signed(&t.secret, now_s(), "w-1", body),
        body,
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    let r = run_of(&mut c, "wake", run_id(&answer)).await;
    assert_eq!(r.state, pb::RunState::Succeeded as i32, "{r:?}");
    assert_eq!(
        (r.cause.as_str(), r.session_id.as_str()),
        ("wake_up", s.session_id.as_str())
    );
    assert_eq!(
        guest.seen.files.lock().unwrap()[&(s.session_id.clone(), ".trigger-body".into())],
        body
    );
    let execs = guest.seen.execs.lock().unwrap().clone();
    assert!(execs
        .iter()
        .any(|(sid, e)| *sid == s.session_id && e.argv == ["./pull-numbers"]));
    // Put back as it was found: paused, under the same session.
    let after = agent.wait_state(&s.session_id, S::Paused).await;
    assert_eq!(after.reason, "wake_up_done", "{after:?}");

    // A wake-up trigger of a stopped session records a failed run.
    agent.stop(&s.session_id).await;
    let (status, answer) = post(
        port,
        &t.path,
        &signed(&t.secret, now_s(), "w-2", body),
        body,
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    let r = run_of(&mut c, "wake", run_id(&answer)).await;
    assert_eq!(
        (r.state, r.reason.as_str()),
        (pb::RunState::Failed as i32, "session_not_paused"),
        "{r:?}"
    );

    // Bad trigger requests are INVALID_ARGUMENT naming the field.
    for (bad, field) in [
        (
            pb::Trigger {
                kind: pb::TriggerKind::WakeUp as i32,
                run: vec!["x".into()],
                ..Default::default()
            },
            "session_id",
        ),
        (
            pb::Trigger {
                kind: pb::TriggerKind::WakeUp as i32,
                session_id: s.session_id.clone(),
                ..Default::default()
            },
            "run",
        ),
        (
            pb::Trigger {
                schedule_id: "no-such".into(),
                ..Default::default()
            },
            "schedule",
        ),
        (
            pb::Trigger {
                trigger_id: "a/b".into(),
                ..Default::default()
            },
            "trigger_id",
        ),
        (
            pb::Trigger {
                secret: "mine".into(),
                ..Default::default()
            },
            "secret",
        ),
    ] {
        let e = c
            .create_trigger(pb::CreateTriggerRequest { trigger: Some(bad) })
            .await
            .unwrap_err();
        assert!(
            matches!(
                e.code(),
                tonic::Code::InvalidArgument | tonic::Code::NotFound
            ),
            "{field}: {e:?}"
        );
        assert!(e.message().contains(field), "{field}: {e:?}");
    }
}

/// Runs the host-agent CLI against `addr` with `args`; its stdout as JSON
/// lines, or a panic with its stderr.
fn cli_json(addr: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .arg("--addr")
        .arg(addr)
        .args(["--output", "json"])
        .args(args)
        .output()
        .expect("running the host-agent CLI");
    assert!(
        out.status.success(),
        "host-agent {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_triggers_and_shows_their_deliveries_and_runs() {
    // The stand-in guest is kept (not `_`): dropping it closes its socket.
    let Node {
        agent,
        guest: _guest,
        port,
        repo,
        _dir,
    } = node().await;
    let a = agent.addr.as_str();
    let repo_arg = repo.display().to_string();
    let made = cli_json(
        a,
        &[
            "triggers",
            "create",
            "--id",
            "cli-hook",
            "--image",
            "gi",
            "--repository",
            &repo_arg,
            "--agent",
            "good",
            "--base-ref",
            "main",
            "--",
            "make",
            "report",
        ],
    );
    let t = &made[0];
    assert_eq!(t["kind"], "RUN", "{t}");
    assert_eq!(t["path"], "/triggers/cli-hook");
    let secret = t["secret"].as_str().unwrap().to_string();
    assert_eq!(secret.len(), 64);
    // Listed without its secret.
    let listed = cli_json(a, &["triggers", "list"]);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["secret"], "");

    let body = b"{}";
    let (status, answer) = post(
        port,
        "/triggers/cli-hook",
        &signed(&secret, now_s(), "c-1", body),
        body,
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    let mut c = SchedulesClient::new(agent.channel().await);
    run_of(&mut c, "cli-hook", run_id(&answer)).await;
    let runs = cli_json(a, &["triggers", "runs", "cli-hook"]);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["state"], "SUCCEEDED", "{}", runs[0]);
    assert_eq!(runs[0]["key"], "trigger:cli-hook:c-1", "{}", runs[0]);
    let kept = cli_json(a, &["triggers", "deliveries", "cli-hook"]);
    assert_eq!(kept.len(), 1);
    assert_eq!(
        (kept[0]["outcome"].as_str(), kept[0]["http_status"].as_u64()),
        (Some("accepted"), Some(202))
    );
    cli_json(a, &["triggers", "delete", "cli-hook"]);
    assert!(cli_json(a, &["triggers", "list"]).is_empty());
}
