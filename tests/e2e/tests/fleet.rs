//! Many nodes on one machine: one `nats-server -js` on loopback (Debian's
//! package; the test skips, saying so, where it is missing) and three
//! host-agents with their own state directories and ports, in a fleet.
//!
//! * An image built on node A is pushed (a second push uploads no chunk),
//!   a session of it created on B, which lacks it (B pulls it), and C pulls
//!   it explicitly before its own session.
//! * The registry lists the three nodes with their addresses; a node
//!   SIGKILLed drops out within its TTL, one stopped cleanly at once.
//! * 30 creates and stops run across the nodes while nats-server is killed
//!   for 10 s in the middle (and node A SIGKILLed and restarted during the
//!   outage): afterwards a JetStream consumer reads every node's events and
//!   usage exactly once, in each node's seq order, the same records each
//!   node's own gRPC API holds.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use prost::Message as _;
use proto::hostagent as pb;
use proto::hostagent::fleet_client::FleetClient;
use test_harness::agent::{Agent, S};
use test_harness::nats::NatsServer;

mod common;

const TTL_S: u64 = 4;

fn node(name: &str, nats: &NatsServer) -> Agent {
    Agent::start(&[
        "--nats",
        &nats.url(),
        "--node-name",
        name,
        "--registry-interval",
        "1",
        "--registry-ttl",
        &TTL_S.to_string(),
    ])
}

async fn fleet(a: &Agent) -> FleetClient<tonic::transport::Channel> {
    FleetClient::new(a.channel().await)
}

async fn push(a: &Agent, image: &str) -> pb::PushImageResponse {
    fleet(a)
        .await
        .push_image(pb::PushImageRequest {
            image_id: image.into(),
        })
        .await
        .expect("push")
        .into_inner()
}

async fn node_names(a: &Agent) -> Vec<String> {
    fleet(a)
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .expect("list nodes")
        .into_inner()
        .nodes
        .into_iter()
        .map(|n| n.node)
        .collect()
}

/// Polls `a`'s view of the registry until `pred` holds; returns how long it took.
async fn until_nodes(a: &Agent, what: &str, pred: impl Fn(&[String]) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        let names = node_names(a).await;
        if pred(&names) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the registry never showed {what}: {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every event `a` holds, read with Watch from the start until it is quiet.
async fn all_events(a: &Agent) -> Vec<pb::Event> {
    let mut w = a
        .events()
        .await
        .watch(pb::WatchRequest::default())
        .await
        .expect("watch")
        .into_inner();
    let mut out = Vec::new();
    while let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_secs(2), w.message()).await {
        out.push(e);
    }
    out
}

/// Every usage record `a` holds.
async fn all_usage(a: &Agent) -> Vec<pb::UsageRecord> {
    let mut out: Vec<pb::UsageRecord> = Vec::new();
    loop {
        let page = a
            .usage()
            .await
            .list_usage(pb::ListUsageRequest {
                since_seq: out.last().map_or(0, |u| u.seq),
                limit: 10_000,
                ..Default::default()
            })
            .await
            .expect("list usage")
            .into_inner()
            .records;
        if page.is_empty() {
            return out;
        }
        out.extend(page);
    }
}

/// One stored message: its id, node header and payload.
struct Stored {
    id: String,
    node: String,
    payload: Vec<u8>,
}

/// Every message of `stream`, read by a fresh ordered consumer from the
/// first.
async fn read_stream(js: &async_nats::jetstream::Context, stream: &str) -> Vec<Stored> {
    let mut s = js.get_stream(stream).await.expect("stream exists");
    let n = s.info().await.expect("stream info").state.messages;
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("ordered consumer");
    let mut msgs = consumer.messages().await.expect("messages");
    let mut out = Vec::new();
    while (out.len() as u64) < n {
        let m = tokio::time::timeout(Duration::from_secs(20), msgs.next())
            .await
            .expect("the consumer stalled")
            .expect("stream ended")
            .expect("message");
        let h = m.headers.clone().unwrap_or_default();
        let get = |k: &str| h.get(k).map(|v| v.as_str().to_string()).unwrap_or_default();
        out.push(Stored {
            id: get("Nats-Msg-Id"),
            node: get("Agentvm-Node"),
            payload: m.payload.to_vec(),
        });
    }
    out
}

/// Waits until `stream` holds `want` messages (the export caught up).
async fn until_stream_holds(js: &async_nats::jetstream::Context, stream: &str, want: u64) {
    let start = Instant::now();
    loop {
        let have = match js.get_stream(stream).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        };
        if have >= want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "{stream} holds {have} messages, not the {want} the nodes recorded"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Checks that the stream's messages of each node are exactly that node's
/// records, in order, each once; `seq` reads a record's seq.
fn check_exactly_once<T: prost::Message + Default + std::fmt::Debug>(
    what: &str,
    stored: &[Stored],
    nodes: &BTreeMap<&str, Vec<u64>>,
    seq: impl Fn(&T) -> u64,
) {
    let ids: HashSet<&str> = stored.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids.len(),
        stored.len(),
        "{what}: a message id appears twice"
    );
    for (name, want) in nodes {
        let got: Vec<u64> = stored
            .iter()
            .filter(|m| m.node == *name)
            .map(|m| seq(&T::decode(m.payload.as_slice()).expect("a protobuf payload")))
            .collect();
        assert_eq!(
            &got, want,
            "{what} of {name}: the stream's seqs (left) differ from the node's own (right)"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn three_nodes_share_images_registry_events_and_usage_through_jetstream() {
    if !NatsServer::available() {
        return;
    }
    let mut nats = NatsServer::start();
    let mut a = node("node-a", &nats);
    let mut b = node("node-b", &nats);
    let mut c = node("node-c", &nats);

    // The registry: three nodes, each with its address.
    until_nodes(&a, "three nodes", |n| n.len() == 3).await;
    let listed = fleet(&a)
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    for (n, agent) in listed.iter().zip([&a, &b, &c]) {
        assert_eq!(n.address, agent.addr.trim_start_matches("http://"), "{n:?}");
        assert!(
            n.capacity.as_ref().is_some_and(|c| c.vcpus_total > 0),
            "{n:?}"
        );
    }

    // An image built on A, pushed; a second push uploads nothing.
    a.counter_image("img").await;
    let pushed = push(&a, "img").await;
    assert!(
        pushed.files >= 4 && pushed.chunks_uploaded > 0,
        "{pushed:?}"
    );
    assert!(
        pushed.store.starts_with("NATS object store agentvm_images"),
        "{pushed:?}"
    );
    let again = push(&a, "img").await;
    assert_eq!(
        (again.chunks_uploaded, again.bytes_uploaded),
        (0, 0),
        "{again:?}"
    );
    // B lacks the image: its create pulls it.
    let sb = b.create("img", "").await;
    b.wait_state(&sb.session_id, S::Running).await;
    let pulled = b
        .images()
        .await
        .get_image(pb::GetImageRequest {
            image_id: "img".into(),
        })
        .await
        .expect("B has the image now")
        .into_inner();
    assert!(!pulled.golden_snapshot_dir.is_empty());
    assert!(pulled
        .golden_snapshot_dir
        .starts_with(&b.state_dir().display().to_string()));
    // C pulls it explicitly; a second pull is refused; an unknown image is not found.
    let r = fleet(&c)
        .await
        .pull_image(pb::PullImageRequest {
            image_id: "img".into(),
        })
        .await
        .expect("pull")
        .into_inner();
    assert_eq!((r.files, r.bytes), (pushed.files, pushed.bytes), "{r:?}");
    assert!(r.bytes_fetched > 0, "{r:?}");
    assert_eq!(r.image.as_ref().map(|i| i.image_id.as_str()), Some("img"));
    let twice = fleet(&c)
        .await
        .pull_image(pb::PullImageRequest {
            image_id: "img".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(twice.code(), tonic::Code::AlreadyExists, "{twice:?}");
    let unknown = fleet(&c)
        .await
        .pull_image(pb::PullImageRequest {
            image_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    let sc = c.create("img", "").await;
    c.wait_state(&sc.session_id, S::Running).await;
    b.stop(&sb.session_id).await;
    c.stop(&sc.session_id).await;
    // The registry shows where the image is (at the nodes' next puts).
    let start = Instant::now();
    loop {
        let listed = fleet(&b)
            .await
            .list_nodes(pb::ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        if listed.len() == 3 && listed.iter().all(|n| n.images == ["img"]) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the registry never showed img on every node: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // 30 creates and stops, NATS down for 10 s in the middle, node A
    // SIGKILLed and restarted meanwhile.
    for i in 0..30 {
        if i == 10 {
            nats.kill();
        }
        let agent = [&a, &b, &c][i % 3];
        let s = agent.create("img", &format!("cycle-{i}")).await;
        agent.wait_state(&s.session_id, S::Running).await;
        agent.stop(&s.session_id).await;
        if i == 15 {
            a.kill9();
            a.spawn();
        }
        if i == 19 {
            tokio::time::sleep(Duration::from_secs(10)).await;
            nats.resume();
        }
    }

    let client = async_nats::connect(nats.url())
        .await
        .expect("connect to NATS");
    let js = async_nats::jetstream::new(client);
    let mut events = BTreeMap::new();
    let mut usage = BTreeMap::new();
    for (name, agent) in [("node-a", &a), ("node-b", &b), ("node-c", &c)] {
        events.insert(
            name,
            all_events(agent)
                .await
                .iter()
                .map(|e| e.seq)
                .collect::<Vec<_>>(),
        );
        usage.insert(
            name,
            all_usage(agent)
                .await
                .iter()
                .map(|u| u.seq)
                .collect::<Vec<_>>(),
        );
    }
    until_stream_holds(
        &js,
        "AGENTVM_EVENTS",
        events.values().map(|v| v.len() as u64).sum(),
    )
    .await;
    until_stream_holds(
        &js,
        "AGENTVM_USAGE",
        usage.values().map(|v| v.len() as u64).sum(),
    )
    .await;
    let stored = read_stream(&js, "AGENTVM_EVENTS").await;
    check_exactly_once::<pb::Event>("events", &stored, &events, |e| e.seq);
    // Each event names its node.
    for m in &stored {
        let e = pb::Event::decode(m.payload.as_slice()).unwrap();
        assert_eq!(e.node, m.node, "{e:?}");
        assert!(m.id.starts_with(&format!("{}:events:", m.node)), "{}", m.id);
    }
    check_exactly_once::<pb::UsageRecord>(
        "usage",
        &read_stream(&js, "AGENTVM_USAGE").await,
        &usage,
        |u| u.seq,
    );
    let total: usize = events.values().map(Vec::len).sum();
    eprintln!("{total} events of three nodes in AGENTVM_EVENTS, each once, in order");

    // A node SIGKILLed drops out of the registry within its TTL; one that
    // stops cleanly leaves at once.
    until_nodes(&a, "three nodes again", |n| n.len() == 3).await;
    c.kill9();
    let gone = until_nodes(&a, "node-c gone", |n| !n.iter().any(|x| x == "node-c")).await;
    eprintln!("node-c left the registry {gone:?} after its SIGKILL (TTL {TTL_S} s)");
    // Its entry expires TTL_S after its last put, at most a second before
    // the kill; the bound leaves room for a loaded machine, and an entry
    // without a TTL would never go (until_nodes gives up after a minute).
    assert!(
        gone <= Duration::from_secs(2 * TTL_S),
        "node-c stayed {gone:?}, past its {TTL_S} s TTL"
    );
    // A clean stop deletes the entry before host-agent exits.
    b.terminate();
    assert_eq!(
        node_names(&a).await,
        ["node-a"],
        "node-b's entry outlived its clean stop"
    );
}

#[tokio::test]
async fn a_node_outside_a_fleet_says_how_to_join_one() {
    let a = Agent::start(&[]);
    let e = fleet(&a)
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("--nats"), "{e:?}");
    let e = fleet(&a)
        .await
        .push_image(pb::PushImageRequest {
            image_id: "img".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
}

#[tokio::test]
async fn a_node_joins_a_server_that_wants_a_token_only_with_it() {
    if !NatsServer::available() {
        return;
    }
    let nats = NatsServer::start_with(&["--auth", "fleet-token-1"]);
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    let bad = dir.path().join("bad");
    std::fs::write(&good, "fleet-token-1\n").unwrap();
    std::fs::write(&bad, "not-the-token\n").unwrap();
    let flags = |name: &'static str, token: &std::path::Path| {
        vec![
            "--nats".to_string(),
            nats.url(),
            "--node-name".into(),
            name.into(),
            "--registry-interval".into(),
            "1".into(),
            "--nats-token-file".into(),
            token.display().to_string(),
        ]
    };
    let with = flags("with-token", &good);
    let a = Agent::start(&with.iter().map(String::as_str).collect::<Vec<_>>());
    until_nodes(&a, "the node with the token", |n| n == ["with-token"]).await;
    let without = flags("wrong-token", &bad);
    let b = Agent::start(&without.iter().map(String::as_str).collect::<Vec<_>>());
    // The refused node never reaches the registry (the other one stays
    // alone in it), and its calls that need NATS fail.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(node_names(&a).await, ["with-token"]);
    let e = fleet(&b)
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_and_audit_records_of_a_guest_init_session_are_exported_each_once() {
    if !NatsServer::available() {
        return;
    }
    let nats = NatsServer::start();
    let guest = common::start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&[
        "--guest-vsock-uds",
        &vsock,
        "--no-vsock-device",
        "--nats",
        &nats.url(),
        "--node-name",
        "gi-node",
    ]);
    agent.guest_init_image().await;
    let s = common::guest_init_session(&agent, &guest).await;
    // An allowed command, then one the rules ask about, answered once.
    let (out, _) = common::exec(&agent, &s, &["echo", "exported"], vec![])
        .await
        .expect("exec echo");
    assert_eq!(common::exit_code(&out), Some(0), "{out:?}");
    let answer = async {
        let mut approvals = pb::approvals_client::ApprovalsClient::new(agent.channel().await);
        let start = Instant::now();
        loop {
            let asks = approvals
                .list_asks(pb::ListAsksRequest {
                    session_id: s.session_id.clone(),
                })
                .await
                .expect("list asks")
                .into_inner()
                .asks;
            if let Some(ask) = asks.first() {
                approvals
                    .answer(pb::AnswerRequest {
                        session_id: s.session_id.clone(),
                        execution_id: s.execution_id.clone(),
                        ask_id: ask.ask_id.clone(),
                        reply: pb::Reply::Once as i32,
                    })
                    .await
                    .expect("answer");
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no ask came");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (asked, ()) = tokio::join!(common::exec(&agent, &s, &["ls", "-a"], vec![]), answer);
    let (out, _) = asked.expect("exec ls");
    assert_eq!(common::exit_code(&out), Some(0), "{out:?}");
    agent.stop(&s.session_id).await;

    // What the node holds, and what JetStream holds of it.
    let asks: Vec<u64> = all_events(&agent)
        .await
        .iter()
        .filter(|e| e.reason.starts_with("ask"))
        .map(|e| e.seq)
        .collect();
    assert!(asks.len() >= 2, "an ask and its answer: {asks:?}");
    let audit = common::host_audit(&agent, &s).await;
    assert!(!audit.is_empty());
    let client = async_nats::connect(nats.url())
        .await
        .expect("connect to NATS");
    let js = async_nats::jetstream::new(client);
    until_stream_holds(&js, "AGENTVM_ASKS", asks.len() as u64).await;
    until_stream_holds(&js, "AGENTVM_AUDIT", audit.len() as u64).await;
    let mut want = BTreeMap::new();
    want.insert("gi-node", asks);
    check_exactly_once::<pb::Event>(
        "asks",
        &read_stream(&js, "AGENTVM_ASKS").await,
        &want,
        |e| e.seq,
    );
    let stored = read_stream(&js, "AGENTVM_AUDIT").await;
    let got: Vec<pb::AuditRecord> = stored
        .iter()
        .map(|m| pb::AuditRecord::decode(m.payload.as_slice()).expect("an AuditRecord"))
        .collect();
    assert_eq!(got, audit, "the exported audit chain is the node's");
    assert!(stored
        .iter()
        .all(|m| m.node == "gi-node" && m.id.starts_with("gi-node:audit:")));
}
