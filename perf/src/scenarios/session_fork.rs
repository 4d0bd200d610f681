//! session-fork: ForkSession wall time, through a real host-agent, from
//! the call until every new session is RUNNING, for a fork of 1 and of 10
//! sessions from a running session of the counter guest. A host-agent
//! without ForkSession (UNIMPLEMENTED) has the scenario skipped, with the
//! reason. vmm only (Firecracker has no host-agent).

use std::time::Instant;

use proto::hostagent::{
    images_client::ImagesClient, sessions_client::SessionsClient, CreateSessionRequest,
    ForkSessionRequest,
};

use super::node::{self, dispose, rpc, wait_running, Node, UNIMPLEMENTED};
use crate::backend::Subject;
use crate::error::{PerfError, Result};
use crate::guests;
use crate::results::{Metric, ScenarioResult, Status};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "session-fork";
/// How many sessions each fork makes.
pub const COUNTS: &[u32] = &[1, 10];
/// Guest memory of the source session, MiB.
pub const MEM_MIB: u32 = 256;
/// The counter guest's command line: a count printed now and then.
const CMDLINE: &str = "interval=10000000";

fn runs(ctx: &Context) -> u32 {
    ctx.runs(5, 2)
}

/// Progress steps: one per run and fork size.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(ctx.warmup() + runs(ctx)) * COUNTS.len() as u64
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(why) = node::unavailable(ctx) {
        return ScenarioResult::skipped(NAME, why);
    }
    let mut unsupported = None;
    let result = super::guarded(NAME, |result| {
        unsupported = measure(ctx, result)?;
        Ok(())
    });
    skipped_if(result, unsupported)
}

/// `result` as skipped for reason `why`, if there is one: a host-agent
/// without ForkSession is not a failure of the run.
fn skipped_if(result: ScenarioResult, why: Option<String>) -> ScenarioResult {
    match why {
        Some(why) => ScenarioResult {
            status: Status::Skipped,
            reason: Some(format!("skipped: {why}")),
            ..result
        },
        None => result,
    }
}

fn fail(what: impl std::fmt::Display) -> PerfError {
    PerfError::HostAgent(format!("session-fork: {what}"))
}

/// Measures into `result`; `Some(reason)` when host-agent has no ForkSession.
fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<Option<String>> {
    let (kernel, image_root) = node::guest_and_image_root(guests::COUNTER)?;
    let scratch = ctx.scratch()?;
    let node = Node::start(ctx, scratch.path(), &image_root)?;
    let rt = node::runtime()?;
    let timeout = ctx.timeout();
    let mut metrics: Vec<Metric> = COUNTS
        .iter()
        .map(|&n| {
            Metric::new(
                format!("{NAME}.fork{n}.mem{MEM_MIB}"),
                format!("ForkSession of {n} until all RUNNING, {MEM_MIB} MiB"),
                "ms",
                Subject::Vmm,
            )
            .param("count", n)
            .param("mem_mib", MEM_MIB)
        })
        .collect();
    let outcome = rt.block_on(async {
        let ch = host_agent::connect(&node.addr, None)
            .await
            .map_err(PerfError::HostAgent)?;
        let mut images = ImagesClient::new(ch.clone());
        let mut sessions = SessionsClient::new(ch);
        node::register_with_golden(&mut images, "counter", &kernel, CMDLINE, MEM_MIB).await?;
        for i in 0..ctx.warmup() + runs(ctx) {
            let warmup = i < ctx.warmup();
            for (metric, &count) in metrics.iter_mut().zip(COUNTS) {
                let created = rpc!(
                    "CreateSession",
                    sessions.create_session(CreateSessionRequest {
                        image_id: "counter".into(),
                        ..Default::default()
                    })
                )?;
                let source = created.session_id;
                // The source runs before it is forked.
                let deadline = Instant::now() + timeout;
                wait_running!(sessions, node, source, created.state, deadline).await?;
                let t = Instant::now();
                let forked = sessions
                    .fork_session(ForkSessionRequest {
                        session_id: source.clone(),
                        count,
                        ..Default::default()
                    })
                    .await;
                let forked = match forked {
                    Ok(r) => r.into_inner(),
                    Err(s) if i32::from(s.code()) == UNIMPLEMENTED => {
                        dispose!(sessions, source).await?;
                        return Ok(Some(format!(
                            "host-agent has no ForkSession (it answered UNIMPLEMENTED: {})",
                            s.message()
                        )));
                    }
                    Err(s) => {
                        return Err(PerfError::Rpc {
                            call: "ForkSession",
                            code: i32::from(s.code()),
                            code_name: format!("{:?}", s.code()),
                            message: s.message().to_string(),
                        })
                    }
                };
                if forked.sessions.len() != count as usize {
                    return Err(fail(format!(
                        "asked for {count} sessions, got {}",
                        forked.sessions.len()
                    )));
                }
                // The answer holds them RUNNING; should one not be yet, the
                // clock runs on until it is.
                let deadline = t + timeout;
                for s in &forked.sessions {
                    wait_running!(sessions, node, s.session_id, s.state, deadline).await?;
                }
                let took = t.elapsed();
                metric.push(ms(took), warmup);
                for s in &forked.sessions {
                    dispose!(sessions, s.session_id).await?;
                }
                dispose!(sessions, source).await?;
                ctx.progress.inc(1);
            }
        }
        Ok::<_, PerfError>(None)
    });
    let measured = metrics
        .iter()
        .any(|m| !m.samples.is_empty() || !m.warmup.is_empty());
    if measured {
        result.notes.push(format!(
            "host-agent (release, {}) driven over gRPC; counter guest ({CMDLINE}), {MEM_MIB} MiB, \
         1 vCPU; a new running source session per fork, the clock from the call to the answer \
         with every new session RUNNING; vmm only",
            if node::is_root() {
                "vmms jailed"
            } else {
                "vmms unjailed: not root"
            }
        ));
        result
            .metrics
            .extend(metrics.into_iter().map(Metric::finish));
    }
    drop(node);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_agent_without_fork_session_has_the_scenario_skipped() {
        let ran = super::super::guarded(NAME, |_| Ok(()));
        let r = skipped_if(ran, Some("host-agent has no ForkSession".into()));
        assert_eq!(r.status, Status::Skipped);
        assert_eq!(
            r.reason.as_deref(),
            Some("skipped: host-agent has no ForkSession")
        );
        let ok = skipped_if(ScenarioResult::new(NAME), None);
        assert_eq!((ok.status, ok.reason), (Status::Ok, None));
    }
}
