//! MoveSession: a session paused to disk on node A moves to node B through
//! the image store both share (a local directory here; no NATS needed). A
//! records it STOPPED (moved) with no final usage record; B's first
//! ResumeSession of the id takes it in and resumes it where it was: the
//! counting guest counts on, its audit chain and its cumulative usage go
//! on. Another node cannot take it, a damaged bundle is DATA_LOSS and
//! leaves nothing, and what cannot move says why.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::counts::{counts, wait_for_counts};
use common::*;
use proto::hostagent as pb;
use proto::hostagent::approvals_client::ApprovalsClient;
use proto::hostagent::fleet_client::FleetClient;
use sha2::{Digest, Sha256};
use tonic::Code;

/// A node named `name` on image store directory `store`.
fn node(name: &str, store: &Path) -> Agent {
    let url = format!("file://{}", store.display());
    Agent::start(&[
        "--node-name",
        name,
        "--image-store",
        &url,
        "--usage-interval-ms",
        "200",
    ])
}

fn move_req(id: &str, to: &str) -> pb::MoveSessionRequest {
    pb::MoveSessionRequest {
        session_id: id.into(),
        to_node: to.into(),
    }
}

async fn fleet(a: &Agent) -> FleetClient<tonic::transport::Channel> {
    FleetClient::new(a.channel().await)
}

/// The serial log of session `id`'s (jailed) vmm on `agent`.
fn serial_log(agent: &Agent, id: &str) -> PathBuf {
    agent
        .state_dir()
        .join("sessions")
        .join(id)
        .join("jail/run/serial.log")
}

/// The names in `agent`'s layer store that are directories (diff layers,
/// pulls in progress), not golden snapshots' links.
fn layer_dirs(agent: &Agent) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(agent.state_dir().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

async fn audit_of(agent: &Agent, id: &str) -> Vec<pb::AuditRecord> {
    ApprovalsClient::new(agent.channel().await)
        .list_audit(pb::ListAuditRequest {
            session_id: id.into(),
            since_guest_seq: 0,
        })
        .await
        .expect("list audit")
        .into_inner()
        .records
}

/// Writes `n` chained audit records of session `id` into the database of
/// the (stopped) host-agent in `state`, as its guest channel would have.
fn plant_audit(state: &Path, id: &str, n: u64) {
    let db = rusqlite::Connection::open(state.join("host-agent.db")).unwrap();
    let mut prev = String::new();
    for seq in 1..=n {
        let json = format!("{{\"seq\":{seq},\"event\":\"exec.start\",\"argv\":[\"make\"]}}");
        let mut h = Sha256::new();
        h.update(prev.as_bytes());
        h.update(json.as_bytes());
        prev = hex::encode(h.finalize());
        db.execute(
            "INSERT INTO audit VALUES (?1,?2,?3,?4,?5)",
            rusqlite::params![id, seq as i64, json, prev, 1000 + seq as i64],
        )
        .unwrap();
    }
}

/// The manifest of session `id`'s bundle in image store `store`.
fn bundle_manifest(store: &Path, id: &str) -> serde_json::Value {
    let path = store.join(format!("manifests/session-{id}.json"));
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_paused_to_disk_moves_to_another_node_and_resumes_there_where_it_was() {
    let store = tempfile::tempdir().unwrap();
    let mut a = node("node-a", store.path());
    let b = node("node-b", store.path());
    let c = node("node-c", store.path());
    test_guest_image(&a, "count", "counter", "interval=20000", 32, None).await;
    let s = a.create("count", "").await;
    let id = s.session_id.clone();
    let log_a = serial_log(&a, &id);
    wait_for_counts(&log_a, 0, 2);
    // Billed for a while on A.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut sa = a.sessions().await;
    let p = sa
        .pause_session(persist_req(&id))
        .await
        .unwrap()
        .into_inner();
    assert!(p.state == S::Paused as i32 && p.persisted, "{p:?}");
    let last_count = *counts(&log_a, 0).last().unwrap();

    // Its guest sent audit records on A (planted while A is down: the
    // counting guest has no guest-init to send them).
    a.kill9();
    plant_audit(&a.state_dir(), &id, 3);
    a.spawn();
    let mut sa = a.sessions().await;
    let audit_a = audit_of(&a, &id).await;
    assert_eq!(audit_a.len(), 3);

    let moved = fleet(&a)
        .await
        .move_session(move_req(&id, "node-b"))
        .await
        .expect("move to node-b")
        .into_inner();
    assert_eq!(moved.state, S::Stopped as i32, "{moved:?}");
    assert_eq!(moved.reason, "moved");
    assert_eq!(moved.detail, "moved to node node-b");
    // The image went first, then the bundle.
    assert!(store.path().join("manifests/count.json").is_file());
    let manifest = bundle_manifest(store.path(), &id);
    assert_eq!(manifest["meta"]["to_node"], "node-b");
    assert_eq!(manifest["meta"]["from_node"], "node-a");
    let chain = manifest["meta"]["layers"].as_array().unwrap().clone();
    assert_eq!(chain[0]["kind"], "golden");
    assert_eq!(manifest["meta"]["golden_layer"], chain[0]["id"]);
    assert!(manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["name"].as_str().unwrap().starts_with("layers/")));
    // Nothing of it is left on A but its record.
    assert!(layer_dirs(&a).is_empty(), "{:?}", layer_dirs(&a));
    assert!(!a.state_dir().join("sessions").join(&id).exists());
    let usage_a = a.usage_of(&id).await;
    check_usage_chain(&usage_a);
    let last_a = usage_a.last().unwrap().clone();
    assert!(
        !last_a.r#final,
        "no final record on A: billing goes on on B"
    );
    assert!(last_a.billed_seconds >= 1.0, "{last_a:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        a.usage_of(&id).await.len(),
        usage_a.len(),
        "A meters it no more"
    );
    let events_a = a.session_events(&id).await;
    let ends: Vec<(i32, &str)> = events_a
        .iter()
        .rev()
        .take(2)
        .map(|e| (e.to, e.reason.as_str()))
        .collect();
    assert_eq!(
        ends,
        [(S::Stopped as i32, "moved"), (S::Stopping as i32, "moved")]
    );
    // A retried move answers the same; A does not resume it any more.
    let again = fleet(&a)
        .await
        .move_session(move_req(&id, "node-b"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.state, S::Stopped as i32);
    let e = sa.resume_session(call(&id)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("moved to node node-b"), "{e:?}");

    // Node C shares the store, but the bundle is not for it.
    let e = c
        .sessions()
        .await
        .resume_session(call(&id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(layer_dirs(&c).is_empty());

    // B does not know it until it is resumed there.
    let e = b
        .sessions()
        .await
        .get_session(pb::SessionRef {
            session_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let r = b
        .sessions()
        .await
        .resume_session(call(&id))
        .await
        .expect("resume on node-b")
        .into_inner();
    assert_eq!(r.state, S::Running as i32, "{r:?}");
    assert_eq!(r.session_id, id);
    assert!(!r.persisted && r.vmm_pid != 0, "{r:?}");
    assert_ne!(
        r.execution_id, s.execution_id,
        "a resume from disk runs under a new execution id"
    );
    // The guest counts on from where it was on A.
    let after = wait_for_counts(&serial_log(&b, &id), 0, 2);
    assert!(
        after[0] > last_count && after[0] <= last_count + 2 * 20000,
        "first count on B {} does not follow the last on A {last_count}",
        after[0]
    );
    // The chain is the one A wrote, under its ids, over the golden
    // snapshot B pulled with the image (recorded under A's golden id).
    let moved_ids: Vec<String> = chain[1..]
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(layer_dirs(&b), moved_ids);
    let golden_link = b
        .state_dir()
        .join("layers")
        .join(chain[0]["id"].as_str().unwrap());
    assert!(golden_link.is_symlink(), "{}", golden_link.display());

    // Its events on B: taken in (under its execution id on A), then resumed.
    let events_b = b.session_events(&id).await;
    let first = &events_b[0];
    assert_eq!(
        (first.reason.as_str(), first.from, first.to),
        ("moved", S::Paused as i32, S::Paused as i32),
        "{events_b:?}"
    );
    assert_eq!(first.detail, "moved from node node-a");
    assert_eq!(first.execution_id, s.execution_id);
    // (Event.node names the node only with --nats: these nodes share an
    // image store but no NATS, and Watch leaves it empty.)
    assert!(events_b
        .iter()
        .any(|e| e.reason == "resumed" && e.to == S::Running as i32));

    // Its audit chain is A's, record for record.
    assert_eq!(audit_of(&b, &id).await, audit_a);

    // Its usage continues A's cumulative counters.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let usage_b = b.usage_of(&id).await;
    check_usage_chain(&usage_b);
    assert!(usage_b.len() >= 3, "{usage_b:?}");
    assert!(usage_b[0].billed_seconds >= last_a.billed_seconds);
    assert_eq!(usage_b[0].interval_end, last_a.interval_end, "{usage_b:?}");
    let now_b = usage_b.last().unwrap();
    assert!(
        now_b.billed_seconds >= last_a.billed_seconds + 1.0,
        "billed on B on top of A's: {} after {}",
        now_b.billed_seconds,
        last_a.billed_seconds
    );
    assert!(now_b.snapshot_gib_seconds >= last_a.snapshot_gib_seconds);

    // A second resume on B is the usual one.
    let r2 = b
        .sessions()
        .await
        .resume_session(call(&id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r2.execution_id, r.execution_id);

    // And back to A, which must forget its own record of it first.
    let mut sb = b.sessions().await;
    sb.pause_session(persist_req(&id)).await.unwrap();
    let log_b = serial_log(&b, &id);
    let last_on_b = *counts(&log_b, 0).last().unwrap();
    let back = fleet(&b)
        .await
        .move_session(move_req(&id, "node-a"))
        .await
        .expect("move back to node-a")
        .into_inner();
    assert_eq!(back.detail, "moved to node node-a");
    let mut sa = a.sessions().await;
    let e = sa.resume_session(call(&id)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("DeleteSession"), "{e:?}");
    sa.delete_session(call(&id)).await.unwrap();
    let home = sa
        .resume_session(call(&id))
        .await
        .expect("resume back on node-a")
        .into_inner();
    assert_eq!(home.state, S::Running as i32, "{home:?}");
    let after = wait_for_counts(&serial_log(&a, &id), 0, 2);
    assert!(
        after[0] > last_on_b && after[0] <= last_on_b + 2 * 20000,
        "first count back on A {} does not follow the last on B {last_on_b}",
        after[0]
    );
    assert_eq!(audit_of(&a, &id).await, audit_a);
    let stopped = a.stop(&id).await;
    assert_eq!(stopped.state, S::Stopped as i32);
    assert!(a.usage_of(&id).await.last().unwrap().r#final);
    assert!(
        !b.usage_of(&id).await.last().unwrap().r#final,
        "B left its billing to A"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_move_says_why_and_a_damaged_bundle_leaves_nothing() {
    let store = tempfile::tempdir().unwrap();
    let a = node("node-a", store.path());
    let b = node("node-b", store.path());
    test_guest_image(&a, "count", "counter", "interval=20000", 32, None).await;
    let s = a.create("count", "").await;
    let id = s.session_id.clone();
    let mut fa = fleet(&a).await;

    let e = fa.move_session(move_req(&id, "node-b")).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message()
            .contains("pause it to disk first (PauseSession persist)"),
        "{e:?}"
    );
    let mut sa = a.sessions().await;
    sa.pause_session(persist_req(&id)).await.unwrap();
    for (to, why) in [
        ("node-a", "is this node"),
        ("bad name", "must be a node name"),
        ("", "must be a node name"),
    ] {
        let e = fa.move_session(move_req(&id, to)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{to:?}: {e:?}");
        assert!(e.message().contains(why), "{to:?}: {e:?}");
    }
    let e = fa
        .move_session(move_req("0b6f9d9e-0000-4000-8000-000000000000", "node-b"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // Nothing was pushed, and the session is as it was.
    assert!(!store.path().join("manifests").exists());
    let still = a.get(&id).await;
    assert!(
        still.state == S::Paused as i32 && still.persisted,
        "{still:?}"
    );

    // A node without an image store moves nothing.
    let lone = Agent::start(&["--node-name", "node-d"]);
    let e = fleet(&lone)
        .await
        .move_session(move_req(&id, "node-b"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("image store"), "{e:?}");

    // Moved, then a chunk of the bundle is damaged in the store.
    let moved = fa
        .move_session(move_req(&id, "node-b"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(moved.state, S::Stopped as i32);
    let manifest = bundle_manifest(store.path(), &id);
    let state = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"].as_str().unwrap().ends_with("/state"))
        .expect("a layer's state file")
        .clone();
    let chunk = store
        .path()
        .join("chunks")
        .join(state["chunks"][0].as_str().unwrap());
    let len = std::fs::metadata(&chunk).unwrap().len() as usize;
    std::fs::write(&chunk, vec![0x5a; len]).unwrap();

    let e = b
        .sessions()
        .await
        .resume_session(call(&id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DataLoss, "{e:?}");
    assert!(
        e.message().contains("is damaged") && e.message().contains("/state"),
        "{e:?}"
    );
    let e = b
        .sessions()
        .await
        .get_session(pb::SessionRef {
            session_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "nothing of it is recorded on B");
    assert!(layer_dirs(&b).is_empty(), "{:?}", layer_dirs(&b));
    assert!(!b.state_dir().join("sessions").join(&id).exists());
    // Asked again, the same.
    let e = b
        .sessions()
        .await
        .resume_session(call(&id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DataLoss, "{e:?}");
}
