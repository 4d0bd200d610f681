//! Benchmarks (ignored by default; run with
//! `cargo test -p host-agent --release --test bench -- --ignored --nocapture`):
//! Create from the warm pool to READY (p50/p99), sustained creates per
//! second, and GetSession p99 under load. Figures are printed, never
//! asserted.

mod common;

use std::time::{Duration, Instant};

use common::*;
use proto::hostagent as pb;

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn wait_pool(agent: &Agent, n: u32) {
    let mut node = agent.node().await;
    loop {
        let c = node
            .get_capacity(pb::GetCapacityRequest {})
            .await
            .unwrap()
            .into_inner();
        if c.warm_pool_ready >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn stop(agent: &Agent, id: &str) {
    agent
        .sessions()
        .await
        .stop_session(pb::SessionCall {
            session_id: id.into(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark"]
async fn bench_create_and_get() {
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let agent = Agent::start(&["--warm-pool", "4"]);
    agent.counter_image("counter").await;

    // Create from the warm pool to READY (Create returns RUNNING, after READY).
    let mut warm = Vec::new();
    for _ in 0..rounds {
        wait_pool(&agent, 4).await;
        let t = Instant::now();
        let s = agent.create("counter", "").await;
        warm.push(t.elapsed());
        stop(&agent, &s.session_id).await;
    }
    println!(
        "create from warm pool -> RUNNING: p50 {:?} p99 {:?} (n={rounds})",
        pct(&mut warm, 0.5),
        pct(&mut warm, 0.99)
    );

    // Sustained creates (restore from the golden snapshot, pool drained).
    let agent2 = Agent::start(&[]);
    agent2.counter_image("counter").await;
    let t = Instant::now();
    let mut ids = Vec::new();
    let mut cold = Vec::new();
    for _ in 0..rounds {
        let t1 = Instant::now();
        let s = agent2.create("counter", "").await;
        cold.push(t1.elapsed());
        // Pause at once so spinning guests do not eat the CPUs.
        agent2
            .sessions()
            .await
            .pause_session(proto::hostagent::PauseSessionRequest::from(
                pb::SessionCall {
                    session_id: s.session_id.clone(),
                    idempotency_key: String::new(),
                },
            ))
            .await
            .unwrap();
        ids.push(s.session_id);
    }
    let el = t.elapsed();
    println!(
        "sequential create (golden restore) + pause: {:.1}/s; create p50 {:?} p99 {:?}",
        rounds as f64 / el.as_secs_f64(),
        pct(&mut cold, 0.5),
        pct(&mut cold, 0.99)
    );

    // GetSession p99 under load: 4 clients hammer GetSession while creates run.
    let mut tasks = Vec::new();
    for i in 0..4 {
        let addr = agent2.addr.clone();
        let id = ids[i % ids.len()].clone();
        tasks.push(tokio::spawn(async move {
            let ch = tonic::transport::Channel::from_shared(addr)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = pb::sessions_client::SessionsClient::new(ch);
            let mut lat = Vec::new();
            let end = Instant::now() + Duration::from_secs(3);
            while Instant::now() < end {
                let t = Instant::now();
                c.get_session(pb::SessionRef {
                    session_id: id.clone(),
                })
                .await
                .unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let load_end = Instant::now() + Duration::from_secs(3);
    while Instant::now() < load_end {
        let s = agent2.create("counter", "").await;
        stop(&agent2, &s.session_id).await;
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let n = lat.len();
    println!(
        "GetSession under load: p50 {:?} p99 {:?} ({n} calls in 3 s)",
        pct(&mut lat, 0.5),
        pct(&mut lat, 0.99)
    );
}
