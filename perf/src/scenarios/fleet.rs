//! fleet: two real host-agents in a fleet over one `nats-server -js` (its
//! own store, a loopback port), as two nodes of a fleet run them:
//!
//! * export latency: from an event's commit on node A (its `at`) until a
//!   JetStream consumer of `agentvm.<A>.events` receives it, per event of
//!   a session's create and stop;
//! * image pull throughput: PullImage of an image A pushed (its kernel and
//!   golden snapshot; the counter guest of `MEM_MIB`) on node B, in MB/s of
//!   the image's bytes and of the bytes fetched (zero chunks are holes,
//!   never fetched);
//! * time to first session: CreateSession on node B, which lacks the image,
//!   until the session is RUNNING (the pull included);
//! * moving a paused session: a dirtier session of `--session-mem-mib`
//!   (2 GiB) that dirtied 100 MiB, paused to disk on A, MoveSession to B
//!   (its layers and disk through the JetStream object store), then
//!   ResumeSession on B until RUNNING.
//!
//! Skipped, saying why, where there is no `nats-server` (Debian's package)
//! or host-agent cannot run. vmm only.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use prost::Message as _;
use proto::hostagent::{
    fleet_client::FleetClient, images_client::ImagesClient, sessions_client::SessionsClient,
    CreateSessionRequest, DeleteImageRequest, Event, MoveSessionRequest, PauseSessionRequest,
    PullImageRequest, PushImageRequest, SessionCall, SessionState,
};

use super::node::{self, dispose, rpc, wait_running, Node};
use crate::backend::Subject;
use crate::error::{PerfError, Result};
use crate::guests;
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "fleet";
/// Guest memory of the pushed image, MiB.
pub const MEM_MIB: u32 = 256;
/// The counter guest's command line.
const CMDLINE: &str = "interval=10000000";
/// What the moved session has dirtied, MiB (the 100 MiB of 2 GiB).
const MOVE_DIRTY_MIB: u64 = 100;
/// Node names.
const NODE_A: &str = "perf-a";
const NODE_B: &str = "perf-b";

fn runs(ctx: &Context) -> u32 {
    ctx.runs(10, 2)
}

/// Progress steps: one per run.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(ctx.warmup() + runs(ctx))
}

/// Where Debian puts nats-server, or one in PATH.
fn nats_binary() -> Option<PathBuf> {
    let debian = PathBuf::from("/usr/sbin/nats-server");
    if debian.exists() {
        return Some(debian);
    }
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("nats-server"))
            .find(|c| c.exists())
    })
}

/// A nats-server of this run, killed when dropped.
struct Nats {
    child: Child,
    url: String,
}

impl Nats {
    fn start(bin: &PathBuf, store: &std::path::Path) -> Result<Nats> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| fail(format!("finding a free port: {e}")))?
            .port();
        let child = Command::new(bin)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| PerfError::Spawn {
                path: bin.clone(),
                source,
            })?;
        let nats = Nats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                return Err(fail("nats-server did not listen within 20 s"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(nats)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fail(what: impl std::fmt::Display) -> PerfError {
    PerfError::HostAgent(format!("fleet: {what}"))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(why) = node::unavailable(ctx) {
        return ScenarioResult::skipped(NAME, why);
    }
    let Some(nats) = nats_binary() else {
        return ScenarioResult::skipped(
            NAME,
            String::from("skipped: no nats-server (Debian package nats-server)"),
        );
    };
    super::guarded(NAME, |result| measure(ctx, &nats, result))
}

/// The dirtier's `permille` for `dirty_mib` of `mem_mib` (at least 1, at
/// most all of it).
fn permille_of(dirty_mib: u64, mem_mib: u64) -> u64 {
    (dirty_mib * 1000).div_ceil(mem_mib.max(1)).clamp(1, 1000)
}

fn measure(ctx: &Context, nats_bin: &PathBuf, result: &mut ScenarioResult) -> Result<()> {
    let (kernel, image_root) = node::guest_and_image_root(guests::COUNTER)?;
    let dirtier = guests::path(guests::DIRTIER)?;
    let move_mem = ctx.settings.session_mem_mib;
    let move_permille = permille_of(MOVE_DIRTY_MIB, move_mem);
    let scratch = ctx.scratch()?;
    let nats = Nats::start(nats_bin, &scratch.path().join("nats"))?;
    let flags = |name: &str| {
        vec![
            "--nats".to_string(),
            nats.url.clone(),
            "--node-name".into(),
            name.into(),
        ]
    };
    let dir_a = scratch.path().join("a");
    let dir_b = scratch.path().join("b");
    for d in [&dir_a, &dir_b] {
        std::fs::create_dir_all(d).map_err(PerfError::io("cannot create", d))?;
    }
    if dirtier.parent() != Some(image_root.as_path()) {
        return Err(fail("the counter and dirtier guests are not in one folder"));
    }
    let a = Node::start_with(ctx, &dir_a, &image_root, &flags(NODE_A))?;
    let b = Node::start_with(ctx, &dir_b, &image_root, &flags(NODE_B))?;
    let rt = node::runtime()?;
    let timeout = ctx.timeout();
    let mut latency = Metric::new(
        format!("{NAME}.export-latency"),
        "event commit -> JetStream consumer receives",
        "ms",
        Subject::Vmm,
    );
    let mut pull = Metric::new(
        format!("{NAME}.pull-throughput.mem{MEM_MIB}"),
        format!("PullImage of a {MEM_MIB} MiB counter image (kernel, golden snapshot)"),
        "MB/s",
        Subject::Vmm,
    )
    .higher_is_better()
    .param("mem_mib", MEM_MIB);
    let mut fetched = Metric::new(
        format!("{NAME}.pull-fetched.mem{MEM_MIB}"),
        "PullImage: bytes fetched from the store per second (zero chunks are not fetched)",
        "MB/s",
        Subject::Vmm,
    )
    .higher_is_better()
    .param("mem_mib", MEM_MIB);
    let mut first = Metric::new(
        format!("{NAME}.first-session.mem{MEM_MIB}"),
        "CreateSession on a node without the image until RUNNING (pull included)",
        "ms",
        Subject::Vmm,
    )
    .param("mem_mib", MEM_MIB);
    let mut moved = Metric::new(
        format!("{NAME}.move.mem{move_mem}"),
        format!(
            "MoveSession of a session paused to disk, {move_mem} MiB, {move_permille} permille dirty"
        ),
        "ms",
        Subject::Vmm,
    )
    .param("mem_mib", move_mem)
    .param("dirty_permille", move_permille);
    let mut moved_resume = Metric::new(
        format!("{NAME}.move-resume.mem{move_mem}"),
        "ResumeSession of the moved session on the other node until RUNNING",
        "ms",
        Subject::Vmm,
    )
    .param("mem_mib", move_mem)
    .param("dirty_permille", move_permille);
    let mut image_bytes = 0u64;
    let outcome = rt.block_on(async {
        let ch_a = host_agent::connect(&a.addr, None)
            .await
            .map_err(PerfError::HostAgent)?;
        let ch_b = host_agent::connect(&b.addr, None)
            .await
            .map_err(PerfError::HostAgent)?;
        let mut images_a = ImagesClient::new(ch_a.clone());
        let mut sessions_a = SessionsClient::new(ch_a.clone());
        let mut fleet_a = FleetClient::new(ch_a);
        let mut images_b = ImagesClient::new(ch_b.clone());
        let mut sessions_b = SessionsClient::new(ch_b.clone());
        let mut fleet_b = FleetClient::new(ch_b);
        node::register_with_golden(&mut images_a, "counter", &kernel, CMDLINE, MEM_MIB).await?;
        let pushed = rpc!(
            "PushImage",
            fleet_a.push_image(PushImageRequest {
                image_id: "counter".into(),
            })
        )?;
        image_bytes = pushed.bytes;
        node::register_with_golden(
            &mut images_a,
            "dirtier",
            &dirtier,
            &format!("permille={move_permille}"),
            move_mem as u32,
        )
        .await?;

        // A consumer of A's events, from now on.
        let client = async_nats::connect(&nats.url)
            .await
            .map_err(|e| fail(format!("connecting to NATS: {e}")))?;
        let js = async_nats::jetstream::new(client);
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match js.get_stream("AGENTVM_EVENTS").await {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => return Err(fail(format!("stream AGENTVM_EVENTS: {e}"))),
            }
        };
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::New,
                filter_subject: format!("agentvm.{NODE_A}.events"),
                ..Default::default()
            })
            .await
            .map_err(|e| fail(format!("consumer: {e}")))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| fail(format!("consumer messages: {e}")))?;
        let received: Arc<Mutex<Vec<(i64, Event)>>> = Arc::default();
        let sink = received.clone();
        let reader = tokio::spawn(async move {
            while let Some(Ok(m)) = messages.next().await {
                let at = now_ms();
                if let Ok(e) = Event::decode(m.payload.as_ref()) {
                    if let Ok(mut v) = sink.lock() {
                        v.push((at, e));
                    }
                }
            }
        });

        for i in 0..ctx.warmup() + runs(ctx) {
            let warmup = i < ctx.warmup();
            // Export latency: the events of a create and stop on A.
            let before = received.lock().map_or(0, |v| v.len());
            let s = rpc!(
                "CreateSession",
                sessions_a.create_session(CreateSessionRequest {
                    image_id: "counter".into(),
                    ..Default::default()
                })
            )?;
            let deadline = Instant::now() + timeout;
            wait_running!(sessions_a, a, s.session_id, s.state, deadline).await?;
            dispose!(sessions_a, s.session_id).await?;
            // Wait for the stop's event (STOPPED) to arrive.
            let deadline = Instant::now() + timeout;
            loop {
                let done = received.lock().is_ok_and(|v| {
                    v[before..].iter().any(|(_, e)| {
                        e.session_id == s.session_id
                            && e.to == proto::hostagent::SessionState::Stopped as i32
                    })
                });
                if done {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(fail(
                        "the session's STOPPED event never reached the consumer",
                    ));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if let Ok(v) = received.lock() {
                for (at, e) in &v[before..] {
                    if e.session_id == s.session_id {
                        latency.push((at - e.at) as f64, warmup);
                    }
                }
            }

            // Pull throughput, then time to first session, on B.
            let t = Instant::now();
            let r = rpc!(
                "PullImage",
                fleet_b.pull_image(PullImageRequest {
                    image_id: "counter".into(),
                })
            )?;
            let took = t.elapsed().as_secs_f64();
            pull.push(r.bytes as f64 / 1e6 / took.max(1e-9), warmup);
            fetched.push(r.bytes_fetched as f64 / 1e6 / took.max(1e-9), warmup);
            rpc!(
                "DeleteImage",
                images_b.delete_image(DeleteImageRequest {
                    image_id: "counter".into(),
                    idempotency_key: String::new(),
                })
            )?;
            let t = Instant::now();
            let s = rpc!(
                "CreateSession",
                sessions_b.create_session(CreateSessionRequest {
                    image_id: "counter".into(),
                    ..Default::default()
                })
            )?;
            let deadline = t + timeout;
            wait_running!(sessions_b, b, s.session_id, s.state, deadline).await?;
            first.push(ms(t.elapsed()), warmup);
            dispose!(sessions_b, s.session_id).await?;
            rpc!(
                "DeleteImage",
                images_b.delete_image(DeleteImageRequest {
                    image_id: "counter".into(),
                    idempotency_key: String::new(),
                })
            )?;

            // A session paused to disk on A, moved to B and resumed there.
            let s = rpc!(
                "CreateSession",
                sessions_a.create_session(CreateSessionRequest {
                    image_id: "dirtier".into(),
                    ..Default::default()
                })
            )?;
            let id = s.session_id;
            // The pass the restore fell into, then one whole pass.
            node::wait_lines(&a.serial_log(&id), 0, "pass=", 2, timeout).await?;
            let p = rpc!(
                "PauseSession",
                sessions_a.pause_session(PauseSessionRequest {
                    session_id: id.clone(),
                    idempotency_key: String::new(),
                    persist: true,
                })
            )?;
            if p.state != SessionState::Paused as i32 || !p.persisted {
                return Err(fail(format!("the session did not pause to disk: {p:?}")));
            }
            let t = Instant::now();
            rpc!(
                "MoveSession",
                fleet_a.move_session(MoveSessionRequest {
                    session_id: id.clone(),
                    to_node: NODE_B.into(),
                })
            )?;
            moved.push(ms(t.elapsed()), warmup);
            let call = || SessionCall {
                session_id: id.clone(),
                idempotency_key: String::new(),
            };
            let t = Instant::now();
            let r = rpc!("ResumeSession", sessions_b.resume_session(call()))?;
            wait_running!(sessions_b, b, id, r.state, t + timeout).await?;
            moved_resume.push(ms(t.elapsed()), warmup);
            dispose!(sessions_b, id).await?;
            rpc!("DeleteSession", sessions_a.delete_session(call()))?;
            ctx.progress.inc(1);
        }
        reader.abort();
        Ok::<_, PerfError>(())
    });
    if !latency.samples.is_empty() || !pull.samples.is_empty() {
        result.notes.push(format!(
            "two release host-agents ({}) and one nats-server -js on this machine's loopback; \
             export latency from each event's recorded time (ms resolution) to an ordered \
             JetStream consumer; the image is {image_bytes} bytes (counter guest, {MEM_MIB} MiB \
             guest memory, its golden snapshot's memory file sparse); the moved session is the \
             dirtier guest, its chain and disk through the JetStream object store; vmm only",
            if node::is_root() {
                "vmms jailed"
            } else {
                "vmms unjailed: not root"
            }
        ));
        result.metrics.extend(
            [latency, pull, fetched, first, moved, moved_resume]
                .into_iter()
                .map(Metric::finish),
        );
    }
    drop(a);
    drop(b);
    drop(nats);
    outcome
}

#[cfg(test)]
mod tests {
    use super::permille_of;

    #[test]
    fn the_moved_session_dirties_about_100_mib() {
        assert_eq!(permille_of(100, 2048), 49);
        assert_eq!(permille_of(100, 64), 1000);
        assert_eq!(permille_of(0, 2048), 1);
    }
}
