//! session-persist: what pausing a session to disk costs, through a real
//! host-agent: PauseSession `persist` wall time, the snapshot it leaves
//! (Session.snapshot_bytes), and ResumeSession wall time until the session
//! is RUNNING again, for the dirtier guest at several dirty fractions.
//!
//! A persisted pause writes a diff layer over the layer the session's memory
//! descends from (at first its image's golden snapshot), so its size and
//! time should follow the pages the guest dirtied, not the guest's memory:
//! the size metrics are also given as ratios to the dirtied bytes and to
//! the guest's memory. vmm only (Firecracker has no host-agent).

use std::time::Instant;

use proto::hostagent::{
    images_client::ImagesClient, sessions_client::SessionsClient, CreateSessionRequest,
    DeleteImageRequest, PauseSessionRequest, SessionCall, SessionState,
};

use super::node::{self, dispose, rpc, wait_running, Node};
use crate::backend::Subject;
use crate::error::{PerfError, Result};
use crate::guests;
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "session-persist";
/// Bytes in a MiB.
const MIB: f64 = (1u64 << 20) as f64;

fn runs(ctx: &Context) -> u32 {
    ctx.runs(5, 2)
}

/// Progress steps: one per run and dirty fraction.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(ctx.warmup() + runs(ctx)) * ctx.settings.dirty_permille.len() as u64
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(why) = node::unavailable(ctx) {
        return ScenarioResult::skipped(NAME, why);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

fn fail(what: impl std::fmt::Display) -> PerfError {
    PerfError::HostAgent(format!("session-persist: {what}"))
}

/// The metrics of one dirty fraction.
struct Fraction {
    persist: Metric,
    size: Metric,
    vs_dirtied: Metric,
    vs_memory: Metric,
    resume: Metric,
}

impl Fraction {
    fn new(mem_mib: u64, permille: u64, dirtied: u64) -> Self {
        let pct = permille as f64 / 10.0;
        let metric = |what: &str, label: &str, unit: &str| {
            Metric::new(
                format!("{NAME}.{what}.{permille}permille.mem{mem_mib}"),
                format!("{label}, {pct} % dirty, {mem_mib} MiB"),
                unit,
                Subject::Vmm,
            )
            .param("mem_mib", mem_mib)
            .param("dirty_permille", permille)
            .param("dirtied_mib", dirtied as f64 / MIB)
        };
        Fraction {
            persist: metric("persist", "PauseSession persist wall time", "ms"),
            size: metric("snapshot", "snapshot_bytes after the persist", "MiB"),
            vs_dirtied: metric(
                "snapshot-vs-dirtied",
                "snapshot_bytes / bytes dirtied",
                "ratio",
            ),
            vs_memory: metric(
                "snapshot-vs-memory",
                "snapshot_bytes / guest memory",
                "ratio",
            ),
            resume: metric("resume", "ResumeSession wall time to RUNNING", "ms"),
        }
    }

    fn finish(self) -> [Metric; 5] {
        [
            self.persist.finish(),
            self.size.finish(),
            self.vs_dirtied.finish(),
            self.vs_memory.finish(),
            self.resume.finish(),
        ]
    }
}

/// What the dirtier says it dirties per pass, from its golden boot's console.
fn dirtied_bytes(console: &str) -> Option<u64> {
    let only = console.lines().find_map(|l| {
        l.strip_prefix("dirtier: only ")?
            .split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
    });
    let want = console.lines().find_map(|l| {
        l.strip_prefix("dirtier: start pages=")?
            .trim()
            .parse::<u64>()
            .ok()
    });
    Some(only.or(want)? * 4096)
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    let (kernel, image_root) = node::guest_and_image_root(guests::DIRTIER)?;
    let scratch = ctx.scratch()?;
    let node = Node::start(ctx, scratch.path(), &image_root)?;
    let mem_mib = ctx.settings.session_mem_mib;
    result.notes.push(format!(
        "host-agent (release, {}) driven over gRPC; dirtier guest, {mem_mib} MiB, 1 vCPU; a new \
         session per run, paused to disk after its second dirtying pass since its restore \
         (every dirtied page written since the golden snapshot), then resumed; vmm only",
        if node::is_root() {
            "vmms jailed"
        } else {
            "vmms unjailed: not root"
        }
    ));
    let rt = node::runtime()?;
    let timeout = ctx.timeout();
    rt.block_on(async {
        let ch = host_agent::connect(&node.addr, None)
            .await
            .map_err(PerfError::HostAgent)?;
        let mut images = ImagesClient::new(ch.clone());
        let mut sessions = SessionsClient::new(ch);
        for &permille in &ctx.settings.dirty_permille {
            ctx.status(format!("{NAME}: {} % dirty", permille as f64 / 10.0));
            let image_id = format!("dirtier-{permille}");
            let image = node::register_with_golden(
                &mut images,
                &image_id,
                &kernel,
                &format!("permille={permille}"),
                mem_mib as u32,
            )
            .await?;
            let console_path = std::path::Path::new(&image.golden_snapshot_dir).join("console.log");
            let console = std::fs::read_to_string(&console_path)
                .map_err(PerfError::io("cannot read", &console_path))?;
            let dirtied = dirtied_bytes(&console).ok_or_else(|| {
                fail(format!(
                    "the dirtier did not say how many pages it dirties: {console:?}"
                ))
            })?;
            result.notes.push(format!(
                "{} % dirty: the guest writes {} pages ({:.1} MiB) per pass",
                permille as f64 / 10.0,
                dirtied / 4096,
                dirtied as f64 / MIB
            ));
            let mut m = Fraction::new(mem_mib, permille, dirtied);
            for i in 0..ctx.warmup() + runs(ctx) {
                let warmup = i < ctx.warmup();
                let s = rpc!(
                    "CreateSession",
                    sessions.create_session(CreateSessionRequest {
                        image_id: image_id.clone(),
                        ..Default::default()
                    })
                )?;
                let id = s.session_id;
                let log = node.serial_log(&id);
                // The pass the restore fell into, then one whole pass.
                node::wait_lines(&log, 0, "pass=", 2, timeout).await?;
                let t = Instant::now();
                let p = rpc!(
                    "PauseSession",
                    sessions.pause_session(PauseSessionRequest {
                        session_id: id.clone(),
                        idempotency_key: String::new(),
                        persist: true,
                    })
                )?;
                let persist = t.elapsed();
                if p.state != SessionState::Paused as i32 || !p.persisted {
                    return Err(fail(format!("the session did not pause to disk: {p:?}")));
                }
                let log_len = node::len(&log);
                let t = Instant::now();
                let r = rpc!(
                    "ResumeSession",
                    sessions.resume_session(SessionCall {
                        session_id: id.clone(),
                        idempotency_key: String::new(),
                    })
                )?;
                wait_running!(sessions, node, id, r.state, t + timeout).await?;
                let resume = t.elapsed();
                // Outside the clock: the guest runs on where it was.
                node::wait_lines(&node.serial_log(&id), log_len, "pass=", 1, timeout).await?;
                dispose!(sessions, id).await?;
                let bytes = p.snapshot_bytes as f64;
                m.persist.push(ms(persist), warmup);
                m.size.push(bytes / MIB, warmup);
                m.vs_dirtied.push(bytes / dirtied as f64, warmup);
                m.vs_memory.push(bytes / (mem_mib as f64 * MIB), warmup);
                m.resume.push(ms(resume), warmup);
                ctx.progress.inc(1);
            }
            result.metrics.extend(m.finish());
            rpc!(
                "DeleteImage",
                images.delete_image(DeleteImageRequest {
                    image_id,
                    idempotency_key: String::new(),
                })
            )?;
        }
        Ok::<_, PerfError>(())
    })?;
    drop(node);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::dirtied_bytes;

    #[test]
    fn the_dirtied_pages_come_from_the_console() {
        assert_eq!(
            dirtied_bytes("hi\ndirtier: start pages=2611\npass=1\n"),
            Some(2611 * 4096)
        );
        assert_eq!(
            dirtied_bytes(
                "dirtier: start pages=300000\ndirtier: only 260000 pages fit below 1 GiB\n"
            ),
            Some(260000 * 4096)
        );
        assert_eq!(dirtied_bytes("pass=1\n"), None);
    }
}
