//! `perf`: the benchmark harness operators run to measure the vmm's cold
//! start, restore latency, creation rate, memory overhead, snapshot write
//! and network (virtio-net throughput and latency, per-VM network setup),
//! optionally side by side with a Firecracker binary. See README.md for the
//! methodology.

#![warn(missing_docs)]

pub mod backend;
pub mod cli;
pub mod error;
pub mod guests;
pub mod machine;
pub mod netns;
pub mod phases;
pub mod process;
pub mod report;
pub mod results;
pub mod runner;
pub mod scenarios;
pub mod smaps;
pub mod stats;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use backend::firecracker::FirecrackerBackend;
use backend::vmm::VmmBackend;
use backend::Backend;
use cli::{Cli, ScenarioArg};
use error::{PerfError, Result};
use machine::MachineInfo;
use results::{Results, Settings, SCHEMA_VERSION};
use runner::Context;

/// Default guest memory sizes, MiB.
pub const DEFAULT_MEM_SIZES: &[u64] = &[128, 1024, 4096];
/// Default dirty fractions of session-persist, thousandths of the guest's
/// pages: 0.5 %, 2.5 %, 10 %.
pub const DEFAULT_DIRTY_PERMILLE: &[u64] = &[5, 25, 100];
/// Default numbers of idle sessions density restores at once.
pub const DEFAULT_DENSITY_COUNTS: &[u64] = &[10, 50, 100];
/// Most sessions density restores at once.
pub const MAX_DENSITY_COUNT: u64 = 10_000;

/// What a run produced.
pub struct Outcome {
    /// Everything measured.
    pub results: Results,
    /// The files written.
    pub files: Vec<PathBuf>,
}

impl Outcome {
    /// Whether any scenario failed.
    pub fn failed(&self) -> bool {
        self.results
            .scenarios
            .iter()
            .any(|s| s.status == results::Status::Failed)
    }
}

/// The vmm next to the running perf binary (target/<profile>/vmm).
pub fn default_vmm() -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(PerfError::io("cannot locate", "the perf binary"))?;
    Ok(exe.with_file_name("vmm"))
}

/// Runs the scenarios `cli` asks for and writes the reports.
pub fn run(cli: Cli) -> Result<Outcome> {
    let vmm = match cli.vmm {
        Some(p) => p,
        None => default_vmm()?,
    };
    if !vmm.is_file() {
        return Err(PerfError::VmmNotFound(vmm));
    }
    if let Some(fc) = &cli.vs_firecracker {
        if !fc.is_file() {
            return Err(PerfError::BinaryNotFound {
                what: "Firecracker binary",
                path: fc.clone(),
                flag: "--vs-firecracker",
            });
        }
    }
    if let Some(kernel) = &cli.kernel {
        if !kernel.is_file() {
            return Err(PerfError::BinaryNotFound {
                what: "kernel image",
                path: kernel.clone(),
                flag: "--kernel",
            });
        }
    }
    let mem_sizes = cli.mem_sizes.clone().unwrap_or_else(|| {
        if cli.quick {
            vec![128]
        } else {
            DEFAULT_MEM_SIZES.to_vec()
        }
    });
    if mem_sizes.is_empty() || mem_sizes.iter().any(|&m| m < 2) {
        return Err(PerfError::Usage(
            "--mem-sizes needs a comma-separated list of sizes of at least 2 MiB, e.g. 128,1024"
                .into(),
        ));
    }
    let session_mem_mib = cli
        .session_mem_mib
        .unwrap_or(if cli.quick { 256 } else { 2048 });
    if session_mem_mib < 16 {
        return Err(PerfError::Usage(
            "--session-mem-mib needs at least 16 (MiB)".into(),
        ));
    }
    let dirty_permille = cli
        .dirty_permille
        .clone()
        .unwrap_or_else(|| DEFAULT_DIRTY_PERMILLE.to_vec());
    if dirty_permille.is_empty() || dirty_permille.iter().any(|&p| p == 0 || p > 1000) {
        return Err(PerfError::Usage(
            "--dirty-permille needs a comma-separated list of thousandths from 1 to 1000, e.g. \
             5,25,100"
                .into(),
        ));
    }
    let density_counts = cli.density_counts.clone().unwrap_or_else(|| {
        if cli.quick {
            vec![DEFAULT_DENSITY_COUNTS[0]]
        } else {
            DEFAULT_DENSITY_COUNTS.to_vec()
        }
    });
    if density_counts.is_empty()
        || density_counts
            .iter()
            .any(|&n| n == 0 || n > MAX_DENSITY_COUNT)
    {
        return Err(PerfError::Usage(format!(
            "--density-counts needs a comma-separated list of counts from 1 to \
             {MAX_DENSITY_COUNT}, e.g. 10,50,100"
        )));
    }
    if cli.timeout_secs == 0 {
        return Err(PerfError::Usage("--timeout-secs must be at least 1".into()));
    }
    let machine = MachineInfo::probe(&vmm, cli.vs_firecracker.as_deref());
    let settings = Settings {
        scenario: cli.scenario.name().into(),
        runs: cli.runs,
        warmup: cli.warmup.unwrap_or(if cli.quick { 1 } else { 2 }),
        quick: cli.quick,
        mem_sizes_mib: mem_sizes,
        concurrency: cli.concurrency.unwrap_or(machine.cores).max(1),
        kernel: cli.kernel.as_ref().map(|k| k.display().to_string()),
        memory_backend: cli.memory_backend.clone(),
        memory: cli.memory.clone(),
        timeout_s: cli.timeout_secs,
        net_frames: cli.net_frames,
        net_pings: cli.net_pings,
        session_mem_mib,
        dirty_permille,
        density_counts,
    };
    let mut backends: Vec<Box<dyn Backend>> = vec![Box::new(VmmBackend::with_memory(
        vmm.clone(),
        cli.memory_backend.clone(),
        cli.memory.clone(),
    ))];
    if let Some(fc) = &cli.vs_firecracker {
        backends.push(Box::new(FirecrackerBackend::new(fc.clone())));
    }
    let work_dir = cli
        .work_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("perf-work-{}", std::process::id())));
    let progress = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    progress.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
            // Invariant: the template above is a fixed, valid template.
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
    let ctx = Context::new(
        settings.clone(),
        vmm,
        backends,
        work_dir.clone(),
        progress.clone(),
        cli.cmdline.clone(),
        machine.hardware_virtualization,
    )?;
    let started_at = machine::now_rfc3339();
    let start = Instant::now();
    let chosen: Vec<&scenarios::Scenario> = scenarios::ALL
        .iter()
        .filter(|s| cli.scenario == ScenarioArg::All || s.name == cli.scenario.name())
        .collect();
    let scenario_results = scenarios::run_all(&ctx, &chosen);
    progress.finish_and_clear();
    let _ = std::fs::remove_dir_all(&work_dir);
    let comparisons = results::compare(&scenario_results);
    let results = Results {
        schema_version: SCHEMA_VERSION,
        started_at,
        duration_s: start.elapsed().as_secs_f64(),
        machine,
        settings,
        scenarios: scenario_results,
        comparisons,
    };
    let files = report::write_all(&results, &cli.out)?;
    Ok(Outcome { results, files })
}
