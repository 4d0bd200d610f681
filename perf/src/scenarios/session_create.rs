//! session-create: CreateSession wall time until the session is READY,
//! through a real host-agent, with [`IN_FLIGHT`] creates in flight at
//! once, on two paths: from the warm pool (host-agent started with
//! `--warm-pool`, every create of a round taking a pre-restored paused VM)
//! and from the golden snapshot (no warm pool: each create restores it).
//! Which path each create took is read from its READY event (host-agent
//! says where the VM came from there), outside the clock, and a create
//! that took the other path fails the scenario. vmm only (Firecracker has
//! no host-agent).
//!
//! Each create in flight has a gRPC connection of its own, as separate
//! clients would: host-agent's TCP sockets do not set TCP_NODELAY, so on
//! one shared HTTP/2 connection the answers after the first of a round wait
//! for the client's delayed ACK (about 40 ms) behind Nagle's algorithm,
//! which would measure that rather than the create.

use std::time::{Duration, Instant};

use proto::hostagent::{
    events_client::EventsClient, images_client::ImagesClient, node_client::NodeClient,
    sessions_client::SessionsClient, CreateSessionRequest,
};

use super::node::{self, dispose, rpc, Node};
use crate::backend::Subject;
use crate::error::{PerfError, Result};
use crate::guests;
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "session-create";
/// Guest memory of the image, MiB.
pub const MEM_MIB: u32 = 256;
/// Creates in flight at once; also the warm pool's size.
pub const IN_FLIGHT: usize = 4;
/// The image's id.
const IMAGE: &str = "counter";
/// The counter guest's command line: one count, then idle in HLT, so the
/// sessions of a round do not compete with the next round for the CPUs.
const CMDLINE: &str = "interval=1 halt_after=1";

/// Where CreateSession gets its VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreatePath {
    /// A paused VM of host-agent's warm pool, resumed.
    WarmPool,
    /// A new vmm restoring the image's golden snapshot.
    Golden,
}

impl CreatePath {
    /// Both, in the order measured.
    pub const ALL: [CreatePath; 2] = [CreatePath::WarmPool, CreatePath::Golden];

    /// Its part of the metric id.
    pub fn id(self) -> &'static str {
        match self {
            CreatePath::WarmPool => "warm-pool",
            CreatePath::Golden => "golden",
        }
    }

    /// Metric id: `session-create.warm-pool.latency`.
    pub fn metric_id(self) -> String {
        format!("{NAME}.{}.latency", self.id())
    }

    /// The `host-agent serve` flags of this path.
    fn serve_args(self) -> Vec<String> {
        match self {
            CreatePath::WarmPool => vec!["--warm-pool".into(), IN_FLIGHT.to_string()],
            CreatePath::Golden => Vec::new(),
        }
    }

    /// How host-agent's READY event of a session created this way begins
    /// (its detail says where the VM came from).
    fn ready_detail(self) -> &'static str {
        match self {
            CreatePath::WarmPool => "from a warm VM",
            CreatePath::Golden => "from the golden snapshot",
        }
    }
}

fn runs(ctx: &Context) -> u32 {
    ctx.runs(200, 20)
}

/// The rounds of one path: `(warm-up, creates in flight)`; `--warmup`
/// rounds of [`IN_FLIGHT`], then the measured creates [`IN_FLIGHT`] at a
/// time (the last round holds the rest).
fn schedule(warmup: u32, runs: u32) -> Vec<(bool, usize)> {
    let mut rounds = vec![(true, IN_FLIGHT); warmup as usize];
    let mut left = runs as usize;
    while left > 0 {
        let n = left.min(IN_FLIGHT);
        rounds.push((false, n));
        left -= n;
    }
    rounds
}

/// Progress steps: one per round of each path.
pub fn plan(ctx: &Context) -> u64 {
    (CreatePath::ALL.len() * schedule(ctx.warmup(), runs(ctx)).len()) as u64
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(why) = node::unavailable(ctx) {
        return ScenarioResult::skipped(NAME, why);
    }
    super::guarded(NAME, |result| {
        result.notes.push(format!(
            "host-agent (release, {}) driven over gRPC; counter guest ({CMDLINE}), {MEM_MIB} MiB, \
             1 vCPU; rounds of {IN_FLIGHT} CreateSession calls at once, one gRPC connection \
             each, each timed from the call to its answer (RUNNING, so past READY); warm-pool: `--warm-pool {IN_FLIGHT}`, every \
             round starts once the pool is full again and every create is checked (its READY \
             event) to have taken a warm VM; golden: no warm pool; vmm only",
            if node::is_root() {
                "vmms jailed"
            } else {
                "vmms unjailed: not root"
            }
        ));
        for path in CreatePath::ALL {
            measure_path(ctx, path, result)?;
        }
        Ok(())
    })
}

fn fail(what: impl std::fmt::Display) -> PerfError {
    PerfError::HostAgent(format!("{NAME}: {what}"))
}

/// Starts a host-agent for `path`, measures its creates and keeps the
/// metric in `result`, with the samples taken before an error.
fn measure_path(ctx: &Context, path: CreatePath, result: &mut ScenarioResult) -> Result<()> {
    ctx.status(format!("{NAME} ({})", path.id()));
    let (kernel, image_root) = node::guest_and_image_root(guests::COUNTER)?;
    let scratch = ctx.scratch()?;
    let node = Node::start_with(ctx, scratch.path(), &image_root, &path.serve_args())?;
    let rt = node::runtime()?;
    let mut metric = Metric::new(
        path.metric_id(),
        format!(
            "CreateSession until READY, {IN_FLIGHT} in flight, {}, {MEM_MIB} MiB",
            path.id()
        ),
        "ms",
        Subject::Vmm,
    )
    .param("path", path.id())
    .param("in_flight", IN_FLIGHT as u64)
    .param("mem_mib", MEM_MIB);
    let outcome = rt.block_on(drive(ctx, &node, path, &kernel, &mut metric));
    if !metric.samples.is_empty() || !metric.warmup.is_empty() {
        result.metrics.push(metric.finish());
    }
    drop(node);
    outcome
}

/// Waits (GetCapacity, every 10 ms) until host-agent's warm pool holds at
/// least `$n` VMs, through the Node client `$capacity`; an error at
/// `$deadline`. `$node` is the [`Node`], for its log.
macro_rules! wait_warm {
    ($capacity:expr, $node:expr, $n:expr, $deadline:expr) => {
        async {
            loop {
                let c = rpc!(
                    "GetCapacity",
                    $capacity.get_capacity(proto::hostagent::GetCapacityRequest {})
                )?;
                if c.warm_pool_ready as usize >= $n {
                    return Ok::<(), PerfError>(());
                }
                if Instant::now() > $deadline {
                    return Err(fail(format!(
                        "the warm pool holds {} VMs, not {}; host-agent's log ends: {}",
                        c.warm_pool_ready,
                        $n,
                        $node.log_tail()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
}

/// One CreateSession through the Sessions client `$sessions` (moved in),
/// timed from just before the call until the session is READY as seen
/// here: the answer's state when it is READY or RUNNING, else GetSession
/// polled every millisecond with the clock running. Gives the session's id
/// and the time. `$node` is the [`Node`], for its log.
macro_rules! create_until_ready {
    ($sessions:expr, $node:expr, $timeout:expr) => {
        async move {
            use proto::hostagent::SessionState as S;
            let mut sessions = $sessions;
            let t = Instant::now();
            let created = rpc!(
                "CreateSession",
                sessions.create_session(CreateSessionRequest {
                    image_id: IMAGE.into(),
                    ..Default::default()
                })
            )?;
            let id = created.session_id;
            let mut state = created.state;
            while state != S::Ready as i32 && state != S::Running as i32 {
                if t.elapsed() > $timeout || state == S::Failed as i32 || state == S::Stopped as i32
                {
                    return Err(fail(format!(
                        "session {id} is {} instead of READY; host-agent's log ends: {}",
                        S::try_from(state).map_or("unknown", |s| s.as_str_name()),
                        $node.log_tail()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                state = rpc!(
                    "GetSession",
                    sessions.get_session(proto::hostagent::SessionRef {
                        session_id: id.clone(),
                    })
                )?
                .state;
            }
            Ok::<(String, Duration), PerfError>((id, t.elapsed()))
        }
    };
}

/// The detail of session `$id`'s READY event (where its VM came from),
/// from the Events client `$events`' Watch of its events; an error when it
/// does not come within `$timeout`.
macro_rules! ready_detail {
    ($events:expr, $id:expr, $timeout:expr) => {
        async {
            use proto::hostagent::SessionState as S;
            let mut stream = rpc!(
                "Watch",
                $events.watch(proto::hostagent::WatchRequest {
                    session_id: $id.to_string(),
                    kinds: vec!["session".into()],
                    ..Default::default()
                })
            )?;
            let deadline = Instant::now() + $timeout;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let next = tokio::time::timeout(left, stream.message()).await;
                let event = match next {
                    Ok(Ok(Some(event))) => event,
                    Ok(Err(s)) => {
                        return Err(PerfError::Rpc {
                            call: "Watch",
                            code: i32::from(s.code()),
                            code_name: format!("{:?}", s.code()),
                            message: s.message().to_string(),
                        })
                    }
                    Ok(Ok(None)) | Err(_) => {
                        return Err(fail(format!("session {} has no READY event", $id)))
                    }
                };
                if event.to == S::Ready as i32 {
                    return Ok::<String, PerfError>(event.detail);
                }
            }
        }
    };
}

/// Registers the image, builds its golden snapshot and times the creates
/// of `path` into `metric`, round by round; every session is stopped and
/// deleted after its round, outside the clock.
async fn drive(
    ctx: &Context,
    node: &Node,
    path: CreatePath,
    kernel: &std::path::Path,
    metric: &mut Metric,
) -> Result<()> {
    let ch = host_agent::connect(&node.addr, None)
        .await
        .map_err(PerfError::HostAgent)?;
    // One connection per create in flight: see the module's doc.
    let mut workers = Vec::new();
    for _ in 0..IN_FLIGHT {
        let worker = host_agent::connect(&node.addr, None)
            .await
            .map_err(PerfError::HostAgent)?;
        workers.push(SessionsClient::new(worker));
    }
    let mut images = ImagesClient::new(ch.clone());
    let mut sessions = SessionsClient::new(ch.clone());
    let mut events = EventsClient::new(ch.clone());
    let mut capacity = NodeClient::new(ch);
    node::register_with_golden(&mut images, IMAGE, kernel, CMDLINE, MEM_MIB).await?;
    let timeout = ctx.timeout();
    for (warmup, n) in schedule(ctx.warmup(), runs(ctx)) {
        if path == CreatePath::WarmPool {
            // Outside the clock: every create of the round finds a warm VM.
            wait_warm!(capacity, node, n, Instant::now() + timeout).await?;
        }
        let round = workers.iter().take(n).map(|worker| {
            let client = worker.clone();
            create_until_ready!(client, node, timeout)
        });
        let outcomes = futures::future::join_all(round).await;
        let mut created = Vec::new();
        let mut error = None;
        for outcome in outcomes {
            match outcome {
                Ok(c) => created.push(c),
                Err(e) => error = error.or(Some(e)),
            }
        }
        for (id, _) in &created {
            let detail = ready_detail!(events, id, timeout).await;
            let checked = detail.and_then(|d| match d.starts_with(path.ready_detail()) {
                true => Ok(()),
                false => Err(fail(format!(
                    "session {id} was to be created {}, but host-agent made it {d:?}",
                    path.ready_detail()
                ))),
            });
            error = error.or(checked.err());
        }
        for (id, _) in &created {
            dispose!(sessions, id).await?;
        }
        if let Some(e) = error {
            return Err(e);
        }
        for (_, took) in created {
            metric.push(ms(took), warmup);
        }
        ctx.progress.inc(1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_hold_the_warmup_then_the_runs_four_at_a_time() {
        assert_eq!(
            schedule(1, 10),
            [(true, 4), (false, 4), (false, 4), (false, 2)]
        );
        assert_eq!(schedule(0, 2), [(false, 2)]);
        assert_eq!(schedule(0, 200).len(), 50);
    }

    #[test]
    fn metric_ids_name_the_path() {
        assert_eq!(
            CreatePath::WarmPool.metric_id(),
            "session-create.warm-pool.latency"
        );
        assert_eq!(
            CreatePath::Golden.metric_id(),
            "session-create.golden.latency"
        );
    }
}
