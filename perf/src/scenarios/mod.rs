//! The benchmark scenarios. Each module has a `NAME`, a `plan` (progress
//! steps it will take) and a `run` that never fails: errors and skips are
//! recorded in its [`ScenarioResult`].

pub mod breakdown;
pub mod cold_boot;
pub mod creation_rate;
pub mod density;
pub mod files_throughput;
pub mod fleet;
pub mod memory_overhead;
pub mod net_guest;
pub mod net_latency;
pub mod net_setup;
pub mod net_throughput;
pub mod node;
pub mod prepare;
pub mod restore;
pub mod restore_memory;
pub mod session_create;
pub mod session_fork;
pub mod session_persist;
pub mod snapshot_write;

use crate::results::{ScenarioResult, Status};
use crate::runner::Context;

/// A scenario's entry points.
pub struct Scenario {
    /// Its name on the command line and in results.
    pub name: &'static str,
    /// Number of progress steps it will take.
    pub plan: fn(&Context) -> u64,
    /// Runs it.
    pub run: fn(&Context) -> ScenarioResult,
}

/// Every scenario, in the order `all` runs them.
pub const ALL: &[Scenario] = &[
    Scenario {
        name: cold_boot::NAME,
        plan: cold_boot::plan,
        run: cold_boot::run,
    },
    Scenario {
        name: restore::NAME,
        plan: restore::plan,
        run: restore::run,
    },
    Scenario {
        name: restore_memory::NAME,
        plan: restore_memory::plan,
        run: restore_memory::run,
    },
    Scenario {
        name: creation_rate::NAME,
        plan: creation_rate::plan,
        run: creation_rate::run,
    },
    Scenario {
        name: memory_overhead::NAME,
        plan: memory_overhead::plan,
        run: memory_overhead::run,
    },
    Scenario {
        name: density::NAME,
        plan: density::plan,
        run: density::run,
    },
    Scenario {
        name: snapshot_write::NAME,
        plan: snapshot_write::plan,
        run: snapshot_write::run,
    },
    Scenario {
        name: net_throughput::NAME,
        plan: net_throughput::plan,
        run: net_throughput::run,
    },
    Scenario {
        name: net_latency::NAME,
        plan: net_latency::plan,
        run: net_latency::run,
    },
    Scenario {
        name: net_setup::NAME,
        plan: net_setup::plan,
        run: net_setup::run,
    },
    Scenario {
        name: files_throughput::NAME,
        plan: files_throughput::plan,
        run: files_throughput::run,
    },
    Scenario {
        name: session_persist::NAME,
        plan: session_persist::plan,
        run: session_persist::run,
    },
    Scenario {
        name: session_fork::NAME,
        plan: session_fork::plan,
        run: session_fork::run,
    },
    Scenario {
        name: session_create::NAME,
        plan: session_create::plan,
        run: session_create::run,
    },
    Scenario {
        name: fleet::NAME,
        plan: fleet::plan,
        run: fleet::run,
    },
];

/// Runs `scenarios` in order, keeping the progress bar's length right.
pub fn run_all(ctx: &Context, scenarios: &[&Scenario]) -> Vec<ScenarioResult> {
    let plans: Vec<u64> = scenarios.iter().map(|s| (s.plan)(ctx)).collect();
    ctx.progress.set_length(plans.iter().sum());
    let mut done = 0;
    let mut results = Vec::new();
    for (scenario, plan) in scenarios.iter().zip(plans) {
        ctx.status(scenario.name.to_string());
        let result = (scenario.run)(ctx);
        done += plan;
        // Skips and failures end early; keep the bar honest about what is left.
        ctx.progress.set_position(done);
        if result.status == Status::Failed {
            ctx.progress.println(format!(
                "{}: failed: {}",
                result.name,
                result.reason.as_deref().unwrap_or("")
            ));
        }
        results.push(result);
    }
    results
}

/// Runs `body`, turning an error into a failed result that keeps the
/// metrics measured before it.
pub fn guarded(
    name: &str,
    body: impl FnOnce(&mut ScenarioResult) -> crate::error::Result<()>,
) -> ScenarioResult {
    let mut result = ScenarioResult::new(name);
    if let Err(e) = body(&mut result) {
        result.status = Status::Failed;
        result.reason = Some(e.to_string());
    }
    result
}

/// Metric id suffix for a memory size: `mem128`.
pub fn mem_id(mem_mib: u64) -> String {
    format!("mem{mem_mib}")
}
