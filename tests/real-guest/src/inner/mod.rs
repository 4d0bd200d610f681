//! The scenario runner, run inside the outer VM (chrooted into the host's
//! tree, so the host's binaries run unchanged): one group, scenario by
//! scenario, each printing `RGH START` and `RGH RESULT` lines.

mod groups;
pub mod hang;
pub mod net;
pub mod virtiofsd;
pub mod vm;
pub mod vsock;
mod watchdog;

use std::path::PathBuf;
use std::time::Instant;

use crate::catalogue::Group;
use crate::env::InnerEnv;
use crate::report::{self, Outcome, Status};

/// A scenario's verdict: what it showed, or why it failed.
pub type Check = Result<String, String>;

/// Starts a failure reason that is the outer VM's fault, not the product's
/// (a recognised emulation stall). Reasons are plain strings passed up
/// through `?` and wrapped with context on the way, so the runner looks for
/// the mark anywhere in the reason.
pub const INFRA_MARK: &str = "[outer-VM emulation] ";

/// What scenarios of one group share.
pub struct Ctx {
    /// The prepared paths.
    pub env: InnerEnv,
    /// This group's logs (consoles, hang reports).
    pub out: PathBuf,
    /// Scratch space in the outer VM's memory (tmpfs): disks, snapshots, sockets.
    pub scratch: PathBuf,
    /// Fixtures a group's scenarios share, built on first use.
    pub fixtures: groups::Fixtures,
}

impl Ctx {
    /// Notes a line under `scenario` (shown live by the harness).
    pub fn info(&self, scenario: &str, text: &str) {
        println!("{}", report::info_line(scenario, text));
    }
}

/// The folder under the work directory's `logs/` where `group`'s `attempt`
/// keeps its guests' consoles, vmm logs and hang reports.
pub fn logs_dir(group: &str, attempt: u32) -> String {
    format!("{group}-{attempt}")
}

/// Runs `group`'s scenarios except `skip` as the group's `attempt`; returns
/// 0 when all passed.
pub fn run(env: InnerEnv, group: &Group, skip: &[String], attempt: u32) -> i32 {
    let out = env.work.join("logs").join(logs_dir(group.name, attempt));
    let scratch = PathBuf::from("/run/real-guest").join(group.name);
    let _ = std::fs::remove_dir_all(&scratch);
    if let Err(e) = std::fs::create_dir_all(&out).and_then(|_| std::fs::create_dir_all(&scratch)) {
        eprintln!("real-guest inner: cannot create {}: {e}", out.display());
        return 2;
    }
    let mut ctx = Ctx {
        env,
        out,
        scratch,
        fixtures: groups::Fixtures::default(),
    };
    let mut failed = 0;
    let running = watchdog::start(group);
    for name in group.scenarios {
        if skip.iter().any(|s| s == name) {
            continue;
        }
        println!("{}", report::start_line(name));
        let t0 = Instant::now();
        running.set(Some(name));
        let result = groups::run(&mut ctx, name);
        running.set(None);
        let outcome = Outcome {
            name: name.to_string(),
            status: match &result {
                Ok(_) => Status::Pass,
                Err(e) if e.contains(INFRA_MARK) => Status::Infra,
                Err(_) => Status::Fail,
            },
            secs: t0.elapsed().as_secs_f64(),
            detail: result.unwrap_or_else(|e| e),
        };
        if outcome.status == Status::Fail {
            failed += 1;
        }
        println!("{}", outcome.line());
    }
    i32::from(failed > 0)
}
