//! The Snapshots service and `host-agent snapshots list|gc`: the node's
//! snapshot layers as one tree (an image's golden snapshot, the diffs its
//! sessions write over it when paused to disk), listed parents first with
//! who holds each; what nothing needs goes as soon as its holder lets go,
//! so CollectGarbage on a held tree deletes nothing; admins only.

mod common;

use std::path::Path;
use std::process::Output;

use common::*;
use proto::hostagent as pb;
use proto::hostagent::snapshots_client::SnapshotsClient;
use sha2::{Digest, Sha256};
use tonic::transport::Channel;
use tonic::{Code, Request};

const ADMIN: &str = "admin-token-0123456789";
const ALICE: &str = "alice-token-0123456789";
const READER: &str = "reader-token-0123456789";

async fn layers(ch: Channel) -> Vec<pb::Layer> {
    SnapshotsClient::new(ch)
        .list_layers(pb::ListLayersRequest {})
        .await
        .expect("list layers")
        .into_inner()
        .layers
}

/// `(kind, parent, holders sorted, children)` of each layer, in order.
fn shape(layers: &[pb::Layer]) -> Vec<(String, String, Vec<String>, u32)> {
    layers
        .iter()
        .map(|l| {
            let mut holders = l.holders.clone();
            holders.sort();
            (l.kind.clone(), l.parent_id.clone(), holders, l.children)
        })
        .collect()
}

fn persist(id: &str) -> pb::PauseSessionRequest {
    pb::PauseSessionRequest {
        session_id: id.into(),
        idempotency_key: String::new(),
        persist: true,
    }
}

/// Runs the host-agent CLI against `addr` with `args`.
fn cli(addr: &str, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .output()
        .expect("running the host-agent CLI")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_follow_images_and_sessions_and_go_when_nothing_holds_them() {
    let agent = Agent::start(&[]);
    let ch = agent.channel().await;
    let health = tonic_health::pb::health_client::HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: "hostagent.v1.Snapshots".into(),
        })
        .await
        .expect("the service has a health status")
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    assert!(layers(ch.clone()).await.is_empty());
    let image = agent.counter_image("count").await;

    // The golden snapshot is one full layer, held by its image.
    let listed = layers(ch.clone()).await;
    assert_eq!(
        shape(&listed),
        [(
            "golden".into(),
            String::new(),
            vec!["image:count".into()],
            0
        )],
        "{listed:?}"
    );
    let golden = listed[0].clone();
    assert_eq!(golden.dir, image.golden_snapshot_dir);
    assert!(golden.bytes > 0 && golden.created_at > 0, "{golden:?}");

    // A session holds the layer its memory descends from.
    let s = agent.create("count", "").await;
    let holder = format!("session:{}", s.session_id);
    let listed = layers(ch.clone()).await;
    assert_eq!(
        shape(&listed),
        [(
            "golden".into(),
            String::new(),
            vec!["image:count".into(), holder.clone()],
            0
        )]
    );

    // Paused to disk: a diff over the golden layer, held by the session
    // (which lets go of the golden layer: the diff needs it now).
    let mut sessions = agent.sessions().await;
    let paused = sessions
        .pause_session(persist(&s.session_id))
        .await
        .expect("pause to disk")
        .into_inner();
    assert!(paused.persisted, "{paused:?}");
    let listed = layers(ch.clone()).await;
    assert_eq!(
        shape(&listed),
        [
            (
                "golden".into(),
                String::new(),
                vec!["image:count".into()],
                1
            ),
            (
                "pause".into(),
                golden.layer_id.clone(),
                vec![holder.clone()],
                0
            ),
        ],
        "{listed:?}"
    );
    let first = listed[1].clone();
    assert!(
        Path::new(&first.dir).join("manifest").is_file(),
        "{first:?}"
    );
    assert_eq!(first.bytes, paused.snapshot_bytes);

    // Resumed and paused to disk again: a diff over the first, which nothing
    // holds but its child needs. Parents come before their children.
    sessions
        .resume_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .expect("resume from disk");
    sessions
        .pause_session(persist(&s.session_id))
        .await
        .expect("pause to disk again");
    let listed = layers(ch.clone()).await;
    assert_eq!(
        shape(&listed),
        [
            (
                "golden".into(),
                String::new(),
                vec!["image:count".into()],
                1
            ),
            ("pause".into(), golden.layer_id.clone(), vec![], 1),
            (
                "pause".into(),
                first.layer_id.clone(),
                vec![holder.clone()],
                0
            ),
        ],
        "{listed:?}"
    );
    assert_eq!(listed[1].layer_id, first.layer_id);
    let second = listed[2].clone();

    // Everything is needed: a collection, dry or not, deletes nothing.
    let mut snaps = SnapshotsClient::new(ch.clone());
    for dry_run in [true, false] {
        let gc = snaps
            .collect_garbage(pb::CollectGarbageRequest { dry_run })
            .await
            .expect("collect garbage")
            .into_inner();
        assert_eq!(
            gc,
            pb::CollectGarbageResponse::default(),
            "dry_run {dry_run}"
        );
    }
    assert_eq!(layers(ch.clone()).await, listed);

    // The CLI lists the same layers, one JSON object each, in order.
    let out = cli(&agent.addr, &["snapshots", "list", "--output", "json"]);
    assert!(out.status.success(), "{out:?}");
    let json: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let ids: Vec<&str> = json
        .iter()
        .map(|j| j["layer_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [&golden.layer_id, &first.layer_id, &second.layer_id]);
    assert_eq!(json[2]["parent_id"], first.layer_id.as_str());
    assert_eq!(json[2]["holders"][0], holder.as_str());
    assert_eq!(json[2]["bytes"], second.bytes);
    let out = cli(&agent.addr, &["snapshots", "gc", "--dry-run"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "would delete 0 layers, would free 0 B\n"
    );

    // Stopped, the session lets go: both diffs go, the golden layer stays
    // with its image.
    agent.stop(&s.session_id).await;
    let listed = layers(ch.clone()).await;
    assert_eq!(
        shape(&listed),
        [(
            "golden".into(),
            String::new(),
            vec!["image:count".into()],
            0
        )]
    );
    assert!(!Path::new(&first.dir).exists() && !Path::new(&second.dir).exists());

    // Deleted, the image lets go of its golden snapshot.
    agent
        .images()
        .await
        .delete_image(pb::DeleteImageRequest {
            image_id: "count".into(),
            idempotency_key: String::new(),
        })
        .await
        .expect("delete the image");
    assert!(layers(ch.clone()).await.is_empty());
    assert!(!Path::new(&golden.dir).exists());
}

fn sha(t: &str) -> String {
    hex::encode(Sha256::digest(t.as_bytes()))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_admins_see_or_collect_layers() {
    let files = tempfile::tempdir().unwrap();
    let clients = files.path().join("clients");
    std::fs::write(
        &clients,
        format!(
            "ops    admin    sha256:{}\n\
             alice  sessions sha256:{}\n\
             dash   read     sha256:{}\n",
            sha(ADMIN),
            sha(ALICE),
            sha(READER)
        ),
    )
    .unwrap();
    let agent = Agent::start(&["--clients-file", &clients.display().to_string()]);
    let mut snaps = SnapshotsClient::new(agent.channel().await);

    for (token, want) in [
        (None, Code::Unauthenticated),
        (Some(READER), Code::PermissionDenied),
        (Some(ALICE), Code::PermissionDenied),
    ] {
        let err = snaps
            .list_layers(req(token, pb::ListLayersRequest {}))
            .await
            .unwrap_err();
        assert_eq!(err.code(), want, "ListLayers as {token:?}: {err:?}");
        let err = snaps
            .collect_garbage(req(token, pb::CollectGarbageRequest { dry_run: true }))
            .await
            .unwrap_err();
        assert_eq!(err.code(), want, "CollectGarbage as {token:?}: {err:?}");
    }
    let listed = snaps
        .list_layers(req(Some(ADMIN), pb::ListLayersRequest {}))
        .await
        .expect("an admin lists layers")
        .into_inner();
    assert!(listed.layers.is_empty(), "{listed:?}");
    snaps
        .collect_garbage(req(
            Some(ADMIN),
            pb::CollectGarbageRequest { dry_run: false },
        ))
        .await
        .expect("an admin collects");

    // The CLI says why it was refused.
    let tok = files.path().join("token");
    std::fs::write(&tok, READER).unwrap();
    let out = cli(
        &agent.addr,
        &[
            "--token-file",
            &tok.display().to_string(),
            "snapshots",
            "list",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("PermissionDenied"),
        "{out:?}"
    );
}
