//! A hostile guest against host-agent: a stand-in guest (tests/common/
//! fake_guest.rs) floods its channel with 4 MiB frames of every kind, sends
//! more audit than a session may store, and audit events out of sequence.
//! host-agent's memory stays bounded, other sessions keep working, and the
//! offending sessions are stopped with the reason on record.

mod common;

use std::time::{Duration, Instant};

use common::fake_guest::{FakeGuest, BIG, FLOOD_OUTPUT};
use common::*;
use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How far host-agent's peak RSS may rise over its level before the flood.
/// The flood sends well over 1 GiB that host-agent used to keep.
const RSS_BOUND: u64 = 384 << 20;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn metrics(addr: &str) -> String {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    sock.read_to_string(&mut body).await.unwrap();
    body
}

/// The value of a metric line starting with `name` (0 when absent).
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

fn start(s: &pb::Session, argv: &[&str]) -> pb::ExecRequest {
    pb::ExecRequest {
        kind: Some(Req::Start(pb::ExecStart {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            argv: argv.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_guest_cannot_grow_host_agent_and_other_sessions_keep_working() {
    let guest = FakeGuest::start();
    let maddr = format!("127.0.0.1:{}", free_port());
    let agent = Agent::start(&[
        "--guest-vsock-uds",
        &guest.sock(),
        "--no-vsock-device",
        "--metrics-listen",
        &maddr,
    ]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let good = agent.guest_session(&repo, "good", "main").await.unwrap();
    let flood = agent.guest_session(&repo, "flood", "main").await.unwrap();
    let before = agent.memory("VmHWM");

    // Bundle chunks nobody asked for, oversize and surplus control messages.
    guest.go();
    guest.wait_phase("unrequested").await;

    // An exec whose client reads the first message, then stops reading while
    // the guest sends asks and floods output.
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let mut stream = ex
        .exec(tokio_stream::iter(vec![start(&flood, &["yes"])]))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert!(matches!(first.kind, Some(Resp::Started(_))), "{first:?}");
    guest.wait_phase("asks").await;
    // host-agent stops reading the channel (or, unbounded, the guest gets all
    // of its output written).
    let deadline = Instant::now() + Duration::from_secs(120);
    while !guest.phase_done("output")
        && metric(
            &metrics(&maddr).await,
            "hostagent_guest_channels_backpressured",
        ) == 0
    {
        assert!(
            Instant::now() < deadline,
            "host-agent neither stopped reading nor took all output"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The other session works meanwhile.
    let mut ex2 = pb::exec_client::ExecClient::new(agent.channel().await);
    let mut s2 = ex2
        .exec(tokio_stream::iter(vec![start(&good, &["echo", "ok"])]))
        .await
        .expect("exec on the other session")
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = s2.message().await.expect("exec stream") {
        out.push(m.kind.unwrap());
    }
    assert!(out.contains(&Resp::Stdout(b"ok\n".to_vec())), "{out:?}");
    assert!(
        out.iter().any(|k| matches!(
            k,
            Resp::Exit(pb::ExecExit {
                status: Some(pb::exec_exit::Status::Code(0)),
                ..
            })
        )),
        "{out:?}"
    );

    let peak = agent.memory("VmHWM");
    assert!(
        peak <= before + RSS_BOUND,
        "host-agent's peak RSS grew from {} MiB to {} MiB under the flood (bound: +{} MiB)",
        before >> 20,
        peak >> 20,
        RSS_BOUND >> 20
    );
    let written = guest
        .seen
        .output_written
        .load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        written < FLOOD_OUTPUT,
        "the guest wrote all {written} output frames although the client read none"
    );

    // Asks are bounded; everything dropped is counted.
    let asks = pb::approvals_client::ApprovalsClient::new(agent.channel().await)
        .list_asks(pb::ListAsksRequest {
            session_id: flood.session_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .asks;
    assert!(!asks.is_empty() && asks.len() <= 64, "{} asks", asks.len());
    let m = metrics(&maddr).await;
    for reason in [
        "bundle_unrequested",
        "control_too_large",
        "ask_too_large",
        "asks_full",
    ] {
        let name = format!("hostagent_guest_messages_dropped_total{{reason=\"{reason}\"}}");
        assert!(metric(&m, &name) > 0, "no {name} in\n{m}");
    }

    // Reading on, the client gets every byte: output waited, it was not dropped.
    let mut bytes = 0u64;
    let mut exit = None;
    while let Some(m) = stream.message().await.expect("exec stream") {
        match m.kind.unwrap() {
            Resp::Stdout(d) => bytes += d.len() as u64,
            Resp::Exit(e) => exit = Some(e),
            _ => {}
        }
    }
    assert_eq!(bytes, FLOOD_OUTPUT * BIG as u64);
    assert!(exit.is_some());
    let peak = agent.memory("VmHWM");
    assert!(
        peak <= before + RSS_BOUND,
        "peak RSS {} MiB over {} MiB + {} MiB",
        peak >> 20,
        before >> 20,
        RSS_BOUND >> 20
    );

    let st = agent.stop(&flood.session_id).await;
    assert_eq!(st.state, S::Stopped as i32);
    let st = agent.stop(&good.session_id).await;
    assert_eq!(st.state, S::Stopped as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_much_audit_or_audit_out_of_sequence_stops_the_session_on_record() {
    let guest = FakeGuest::start();
    let agent = Agent::start(&["--guest-vsock-uds", &guest.sock(), "--no-vsock-device"]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let full = agent
        .guest_session(&repo, "audit-flood", "main")
        .await
        .unwrap();
    let bad = agent.guest_session(&repo, "bad-seq", "main").await.unwrap();
    guest.go();

    // More audit than a session may store (64 MiB by default).
    let st = agent.wait_state(&full.session_id, S::Stopped).await;
    assert_eq!(st.reason, "audit_limit", "{st:?}");
    let events = agent.session_events(&full.session_id).await;
    let stopping = events
        .iter()
        .find(|e| e.to == S::Stopping as i32)
        .expect("a STOPPING event");
    assert_eq!(stopping.reason, "audit_limit");
    assert!(
        stopping
            .detail
            .contains("audit volume limit of 67108864 bytes"),
        "{stopping:?}"
    );
    let audit = list_audit(&agent, &full).await;
    let stored: usize = audit.iter().map(|a| a.json.len()).sum();
    assert!(stored <= (64 << 20) + 4096, "{stored} bytes stored");
    let last = audit.last().expect("audit records");
    assert!(last.json.contains("audit.limit_exceeded"), "{last:?}");
    for w in audit.windows(2) {
        assert_eq!(w[1].guest_seq, w[0].guest_seq + 1);
    }
    assert!(
        guest
            .host_errors(&full.session_id)
            .iter()
            .any(|e| e.message.contains("audit volume limit")),
        "the guest was told"
    );

    // seq 1, then u64::MAX: refused, on the channel and in the events.
    let st = agent.wait_state(&bad.session_id, S::Stopped).await;
    assert_eq!(st.reason, "audit_out_of_order", "{st:?}");
    let events = agent.session_events(&bad.session_id).await;
    let stopping = events
        .iter()
        .find(|e| e.to == S::Stopping as i32)
        .expect("a STOPPING event");
    assert!(
        stopping
            .detail
            .contains("audit event seq 18446744073709551615 where seq 2 was due"),
        "{stopping:?}"
    );
    let audit = list_audit(&agent, &bad).await;
    assert_eq!(
        audit.iter().map(|a| a.guest_seq).collect::<Vec<_>>(),
        vec![1],
        "only the event in sequence is stored"
    );
    let errors = guest.host_errors(&bad.session_id);
    assert!(
        errors
            .iter()
            .any(|e| e.message.contains("18446744073709551615")),
        "{errors:?}"
    );
}

async fn list_audit(agent: &Agent, s: &pb::Session) -> Vec<pb::AuditRecord> {
    // 64 MiB of audit, in pages a default client (4 MiB per message) decodes.
    let mut client = pb::approvals_client::ApprovalsClient::new(agent.channel().await);
    let mut records: Vec<pb::AuditRecord> = Vec::new();
    loop {
        let page = client
            .list_audit(pb::ListAuditRequest {
                session_id: s.session_id.clone(),
                since_guest_seq: records.last().map_or(0, |r| r.guest_seq),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            !page.records.is_empty() || !page.more,
            "an empty page says more"
        );
        records.extend(page.records);
        if !page.more {
            return records;
        }
    }
}
