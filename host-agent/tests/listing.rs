//! Labels and listing: ListSessions filtered by labels, states and image,
//! a page at a time (sessions created between pages neither repeated nor
//! skipped), only the caller's own sessions for a non-admin; Watch filtered
//! by label (sessions created after it started included); bad filters and
//! page tokens refused naming the field; and the CLI's `--label`, `--state`
//! and paging.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use common::*;
use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, images_client::ImagesClient, sessions_client::SessionsClient,
};
use sha2::{Digest, Sha256};
use tonic::{Code, Request};

const ADMIN: &str = "admin-token-0123456789";
const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789";

/// host-agent with an admin and two `sessions` clients, alice and bob.
fn start() -> (Agent, tempfile::TempDir) {
    let files = tempfile::tempdir().unwrap();
    let sha = |t: &str| hex::encode(Sha256::digest(t.as_bytes()));
    let clients = files.path().join("clients");
    std::fs::write(
        &clients,
        format!(
            "ops    admin    sha256:{}\nalice  sessions sha256:{}\nbob    sessions sha256:{}\n",
            sha(ADMIN),
            sha(ALICE),
            sha(BOB)
        ),
    )
    .unwrap();
    let kdir = Path::new(&counter_kernel())
        .parent()
        .unwrap()
        .display()
        .to_string();
    let agent = Agent::start(&[
        "--clients-file",
        &clients.display().to_string(),
        "--allowed-image-root",
        &kdir,
    ]);
    (agent, files)
}

fn req<T>(token: &str, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Registers the counter guest as `id` and builds its golden snapshot.
async fn image(agent: &Agent, id: &str) {
    let mut im = ImagesClient::new(agent.channel().await);
    im.register_image(req(
        ADMIN,
        pb::RegisterImageRequest {
            image_id: id.into(),
            kernel_path: counter_kernel(),
            cmdline: "interval=100000000".into(),
            mem_mib: 32,
            vcpus: 1,
            ..Default::default()
        },
    ))
    .await
    .expect("register image");
    im.build_golden_snapshot(req(
        ADMIN,
        pb::BuildGoldenSnapshotRequest {
            image_id: id.into(),
            settle_ms: 50,
            ..Default::default()
        },
    ))
    .await
    .expect("build golden snapshot");
}

/// Creates a session of `image` as `token`'s client with `l`; its id.
async fn create(agent: &Agent, token: &str, image: &str, l: &[(&str, &str)]) -> String {
    SessionsClient::new(agent.channel().await)
        .create_session(req(
            token,
            pb::CreateSessionRequest {
                image_id: image.into(),
                labels: labels(l),
                ..Default::default()
            },
        ))
        .await
        .expect("create session")
        .into_inner()
        .session_id
}

/// Stops session `id` as the admin.
async fn stop(agent: &Agent, id: &str) {
    SessionsClient::new(agent.channel().await)
        .stop_session(req(
            ADMIN,
            pb::SessionCall {
                session_id: id.into(),
                idempotency_key: String::new(),
            },
        ))
        .await
        .expect("stop session");
}

async fn list(
    agent: &Agent,
    token: &str,
    r: pb::ListSessionsRequest,
) -> Result<pb::ListSessionsResponse, tonic::Status> {
    SessionsClient::new(agent.channel().await)
        .list_sessions(req(token, r))
        .await
        .map(|r| r.into_inner())
}

/// The ids of one page, which must be the last.
async fn ids(agent: &Agent, token: &str, r: pb::ListSessionsRequest) -> Vec<String> {
    let page = list(agent, token, r).await.expect("list sessions");
    assert_eq!(page.next_page_token, "", "one page holds them all");
    page.sessions.into_iter().map(|s| s.session_id).collect()
}

fn by_labels(l: &[(&str, &str)]) -> pb::ListSessionsRequest {
    pb::ListSessionsRequest {
        labels: labels(l),
        ..Default::default()
    }
}

/// Checks that `r` failed with InvalidArgument naming `field`.
fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>, field: &str) {
    let e = r.expect_err(&format!("{field}: refused"));
    assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
    assert!(e.message().contains(field), "{field}: {e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_listed_by_label_state_and_image_a_page_at_a_time() {
    let (agent, _files) = start();
    image(&agent, "counter").await;
    image(&agent, "other").await;
    let a1 = create(&agent, ALICE, "counter", &[("team", "x"), ("tier", "")]).await;
    let a2 = create(&agent, ALICE, "counter", &[("team", "y")]).await;
    let a3 = create(&agent, ALICE, "other", &[("team", "x")]).await;
    let b1 = create(&agent, BOB, "counter", &[("team", "x")]).await;
    stop(&agent, &a2).await;

    // Labels, value for value, and only the caller's own sessions.
    let team_x = by_labels(&[("team", "x")]);
    assert_eq!(
        ids(&agent, ALICE, team_x.clone()).await,
        [a1.as_str(), a3.as_str()]
    );
    assert_eq!(ids(&agent, BOB, team_x.clone()).await, [b1.as_str()]);
    assert_eq!(
        ids(&agent, ADMIN, team_x.clone()).await,
        [a1.as_str(), a3.as_str(), b1.as_str()]
    );
    assert_eq!(
        ids(&agent, ALICE, by_labels(&[("team", "x"), ("tier", "")])).await,
        [a1.as_str()]
    );
    // An empty value is a value: it does not mean "any".
    assert!(ids(&agent, ALICE, by_labels(&[("team", "")]))
        .await
        .is_empty());
    // States (any of them), image, and all together.
    let states = |s: &[S]| pb::ListSessionsRequest {
        states: s.iter().map(|s| *s as i32).collect(),
        ..Default::default()
    };
    assert_eq!(
        ids(&agent, ALICE, states(&[S::Stopped])).await,
        [a2.as_str()]
    );
    assert_eq!(
        ids(&agent, ALICE, states(&[S::Stopped, S::Running])).await,
        [a1.as_str(), a2.as_str(), a3.as_str()]
    );
    let other = pb::ListSessionsRequest {
        image_id: "other".into(),
        ..Default::default()
    };
    assert_eq!(ids(&agent, ALICE, other.clone()).await, [a3.as_str()]);
    assert!(ids(&agent, BOB, other).await.is_empty());
    let everything = pb::ListSessionsRequest {
        states: vec![S::Running as i32],
        image_id: "counter".into(),
        ..team_x.clone()
    };
    assert_eq!(
        ids(&agent, ADMIN, everything).await,
        [a1.as_str(), b1.as_str()]
    );

    // Pages of two, with a session created after each page: every session
    // comes once, in order of creation, the new ones on later pages.
    let mut seen = Vec::new();
    let mut made = Vec::new();
    let mut token = String::new();
    loop {
        let page = list(
            &agent,
            ADMIN,
            pb::ListSessionsRequest {
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            },
        )
        .await
        .expect("a page");
        assert!(page.sessions.len() <= 2);
        seen.extend(page.sessions.into_iter().map(|s| s.session_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        if made.len() < 2 {
            made.push(create(&agent, BOB, "counter", &[("team", "z")]).await);
        }
    }
    let mut all = vec![a1.clone(), a2.clone(), a3.clone(), b1.clone()];
    all.extend(made.iter().cloned());
    assert_eq!(seen, all);
    // A filtered listing pages over the matching sessions only.
    let first = list(
        &agent,
        ALICE,
        pb::ListSessionsRequest {
            page_size: 1,
            ..team_x.clone()
        },
    )
    .await
    .unwrap();
    assert_eq!(first.sessions[0].session_id, a1);
    let second = list(
        &agent,
        ALICE,
        pb::ListSessionsRequest {
            page_size: 1,
            page_token: first.next_page_token.clone(),
            ..team_x.clone()
        },
    )
    .await
    .unwrap();
    assert_eq!(second.sessions[0].session_id, a3);
    assert_eq!(second.next_page_token, "", "b1 is bob's");

    // A token is good for its own query only.
    let after = |token: &str, r: pb::ListSessionsRequest| pb::ListSessionsRequest {
        page_token: token.into(),
        ..r
    };
    refused(
        list(&agent, BOB, after(&first.next_page_token, team_x.clone())).await,
        "page_token",
    );
    refused(
        list(&agent, ALICE, after(&first.next_page_token, by_labels(&[]))).await,
        "page_token",
    );
    for bad in ["x", "00", &"ab".repeat(100), "zz"] {
        refused(
            list(&agent, ALICE, after(bad, team_x.clone())).await,
            "page_token",
        );
    }
    // Bad filters, each named.
    let long_key = "k".repeat(65);
    let long_value = "v".repeat(257);
    for (bad, field) in [
        (by_labels(&[("", "x")]), "labels"),
        (by_labels(&[(&long_key, "x")]), "labels"),
        (by_labels(&[("k", &long_value)]), "labels"),
        (states(&[S::Unspecified]), "states[0]"),
        (
            pb::ListSessionsRequest {
                states: vec![4, 42],
                ..Default::default()
            },
            "states[1]",
        ),
        (
            pb::ListSessionsRequest {
                image_id: "../x".into(),
                ..Default::default()
            },
            "image_id",
        ),
        (
            pb::ListSessionsRequest {
                page_size: 1001,
                ..Default::default()
            },
            "page_size",
        ),
    ] {
        refused(list(&agent, ALICE, bad).await, field);
    }
    let too_many: Vec<(String, String)> = (0..17).map(|i| (i.to_string(), String::new())).collect();
    refused(
        list(
            &agent,
            ALICE,
            pb::ListSessionsRequest {
                labels: too_many.iter().cloned().collect(),
                ..Default::default()
            },
        )
        .await,
        "labels",
    );
    refused(
        SessionsClient::new(agent.channel().await)
            .create_session(req(
                ALICE,
                pb::CreateSessionRequest {
                    image_id: "counter".into(),
                    labels: labels(&[("k", &long_value)]),
                    ..Default::default()
                },
            ))
            .await,
        "labels",
    );
    refused(
        EventsClient::new(agent.channel().await)
            .watch(req(
                ALICE,
                pb::WatchRequest {
                    labels: labels(&[("", "x")]),
                    ..Default::default()
                },
            ))
            .await,
        "labels",
    );
}

/// Reads `stream` until session `last`'s STOPPED event; every event read.
async fn events_until_stopped(
    stream: &mut tonic::Streaming<pb::Event>,
    last: &str,
) -> Vec<pb::Event> {
    let mut out = Vec::new();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(120), stream.message())
            .await
            .expect("the watch goes on delivering")
            .expect("stream ok")
            .expect("stream open");
        let done = e.session_id == last && e.to == S::Stopped as i32;
        out.push(e);
        if done {
            return out;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_by_label_sends_only_matching_sessions_events() {
    let (agent, _files) = start();
    image(&agent, "counter").await;
    let watch = |token: &'static str, r: pb::WatchRequest| {
        let agent = &agent;
        async move {
            EventsClient::new(agent.channel().await)
                .watch(req(token, r))
                .await
                .expect("watch")
                .into_inner()
        }
    };
    let team_x = pb::WatchRequest {
        labels: labels(&[("team", "x")]),
        ..Default::default()
    };
    // Started before any session exists.
    let mut admin_x = watch(ADMIN, team_x.clone()).await;
    let mut alice_x = watch(ALICE, team_x.clone()).await;
    let x1 = create(&agent, ALICE, "counter", &[("team", "x"), ("n", "1")]).await;
    let y = create(&agent, ALICE, "counter", &[("team", "y")]).await;
    let bx = create(&agent, BOB, "counter", &[("team", "x")]).await;
    let x2 = create(&agent, ALICE, "counter", &[("team", "x")]).await;
    // Stopped in this order, so x2's STOPPED is the last event of all.
    for id in [&x1, &y, &bx, &x2] {
        stop(&agent, id).await;
    }

    let sessions = |evs: &[pb::Event]| -> HashSet<String> {
        evs.iter().map(|e| e.session_id.clone()).collect()
    };
    let all = events_until_stopped(&mut admin_x, &x2).await;
    assert_eq!(
        sessions(&all),
        HashSet::from([x1.clone(), bx.clone(), x2.clone()])
    );
    let hers = events_until_stopped(&mut alice_x, &x2).await;
    assert_eq!(sessions(&hers), HashSet::from([x1.clone(), x2.clone()]));
    // Each matching session's whole lifecycle, in seq order.
    for id in [&x1, &x2] {
        let tos: Vec<i32> = hers
            .iter()
            .filter(|e| &e.session_id == id)
            .map(|e| e.to)
            .collect();
        assert_eq!(tos.first(), Some(&(S::Pending as i32)), "{id}");
        assert_eq!(tos.last(), Some(&(S::Stopped as i32)), "{id}");
    }
    assert!(hers.windows(2).all(|w| w[0].seq < w[1].seq));

    // Replayed from seq 0 after the fact: two labels, both to match; labels
    // and the session filter, both to match.
    let mut replay = watch(
        ALICE,
        pb::WatchRequest {
            labels: labels(&[("team", "x"), ("n", "1")]),
            ..Default::default()
        },
    )
    .await;
    let x1_events = events_until_stopped(&mut replay, &x1).await;
    assert_eq!(sessions(&x1_events), HashSet::from([x1.clone()]));
    let mut both = watch(
        ADMIN,
        pb::WatchRequest {
            session_id: x2.clone(),
            ..team_x.clone()
        },
    )
    .await;
    let x2_events = events_until_stopped(&mut both, &x2).await;
    assert_eq!(sessions(&x2_events), HashSet::from([x2.clone()]));
}

/// Runs the CLI against `agent`; (success, stdout, stderr).
fn cli(agent: &Agent, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .arg("--addr")
        .arg(&agent.addr)
        .args(args)
        .output()
        .expect("running the host-agent CLI");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Session ids of `sessions list --output json` output.
fn json_ids(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["session_id"].as_str().expect("session_id").to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_with_labels_and_lists_and_watches_by_them() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let mut made = Vec::new();
    for team in ["x", "y", "x"] {
        let label = format!("team={team}");
        let (ok, out, err) = cli(
            &agent,
            &[
                "--output", "json", "sessions", "create", "counter", "--label", &label, "--label",
                "note=",
            ],
        );
        assert!(ok, "{err}");
        let s: serde_json::Value = serde_json::from_str(out.trim()).expect("the session");
        assert_eq!(s["labels"]["team"], team);
        assert_eq!(s["labels"]["note"], "");
        made.push(s["session_id"].as_str().unwrap().to_string());
    }
    agent.stop(&made[2]).await;

    let (ok, out, err) = cli(
        &agent,
        &["--output", "json", "sessions", "list", "--label", "team=x"],
    );
    assert!(ok, "{err}");
    assert_eq!(json_ids(&out), [made[0].as_str(), made[2].as_str()]);
    let (ok, out, err) = cli(
        &agent,
        &[
            "--output", "json", "sessions", "list", "--label", "team=x", "--state", "running",
            "--image", "counter",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(json_ids(&out), [made[0].as_str()]);

    // One page, its token on stderr; then that page's successor; or all.
    let (ok, out, err) = cli(
        &agent,
        &["--output", "json", "sessions", "list", "--page-size", "2"],
    );
    assert!(ok, "{err}");
    assert_eq!(json_ids(&out), [made[0].as_str(), made[1].as_str()]);
    let token = err
        .lines()
        .find_map(|l| l.strip_prefix("next_page_token: "))
        .unwrap_or_else(|| panic!("a next page token in {err:?}"));
    let (ok, out, err) = cli(
        &agent,
        &[
            "--output",
            "json",
            "sessions",
            "list",
            "--page-size",
            "2",
            "--page-token",
            token,
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(json_ids(&out), [made[2].as_str()]);
    assert!(!err.contains("next_page_token"), "{err}");
    let (ok, out, err) = cli(
        &agent,
        &[
            "--output",
            "json",
            "sessions",
            "list",
            "--page-size",
            "1",
            "--all",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(json_ids(&out), made);

    // Bad syntax is refused before any call, saying what was expected.
    for bad in [
        &["sessions", "create", "counter", "--label", "team"][..],
        &["sessions", "list", "--label", "=x"],
        &["events", "watch", "--label", "novalue"],
        &["sessions", "list", "--state", "sleeping"],
        &["sessions", "list", "--all", "--page-token", "t"],
    ] {
        let (ok, _, err) = cli(&agent, bad);
        assert!(!ok, "{bad:?} was accepted");
        assert!(
            err.contains("KEY=VALUE") || err.contains("--state") || err.contains("--all"),
            "{bad:?}: {err}"
        );
    }
    // The server's own refusal comes through with its field.
    let (ok, _, err) = cli(&agent, &["sessions", "list", "--page-token", "zz"]);
    assert!(!ok);
    assert!(
        err.contains("InvalidArgument") && err.contains("page_token"),
        "{err}"
    );

    // `events watch --label` follows only matching sessions; killed once
    // the stopped session's events arrived.
    let mut watch = tokio::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["--addr", &agent.addr, "--output", "json", "events", "watch"])
        .args(["--label", "team=x"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("events watch");
    let stdout = watch.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let mut seen = HashSet::new();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("events in time")
            .expect("reading events")
            .expect("events watch goes on");
        let e: serde_json::Value = serde_json::from_str(&line).expect("an event as JSON");
        let id = e["session_id"].as_str().unwrap().to_string();
        let stopped = id == made[2] && e["to"] == "STOPPED";
        seen.insert(id);
        if stopped {
            break;
        }
    }
    assert_eq!(seen, HashSet::from([made[0].clone(), made[2].clone()]));
}
