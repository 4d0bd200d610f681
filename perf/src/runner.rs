//! What every scenario shares: the settings, the VMMs under test, scratch
//! folders, the warm-up/measure loop and the progress bar.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use indicatif::ProgressBar;

use crate::backend::Backend;
use crate::error::{PerfError, Result};
use crate::results::Settings;

/// Shared state of one `perf` run.
pub struct Context {
    /// The effective settings.
    pub settings: Settings,
    /// The vmm binary under test (host-agent is given it in the session
    /// scenarios).
    pub vmm: PathBuf,
    /// The VMMs under test; the vmm first.
    pub backends: Vec<Box<dyn Backend>>,
    /// Where scratch folders (sockets, snapshots) go; removed at the end.
    pub work_dir: PathBuf,
    /// The progress bar (hidden when stderr is not a terminal).
    pub progress: ProgressBar,
    /// Kernel command line given with `--cmdline`.
    pub cmdline: Option<String>,
    /// Whether the host has hardware virtualization (vmx/svm).
    pub hardware_virtualization: bool,
    next_scratch: AtomicU64,
}

impl Context {
    /// A context; creates `work_dir`.
    pub fn new(
        settings: Settings,
        vmm: PathBuf,
        backends: Vec<Box<dyn Backend>>,
        work_dir: PathBuf,
        progress: ProgressBar,
        cmdline: Option<String>,
        hardware_virtualization: bool,
    ) -> Result<Self> {
        std::fs::create_dir_all(&work_dir).map_err(PerfError::io("cannot create", &work_dir))?;
        Ok(Context {
            settings,
            vmm,
            backends,
            work_dir,
            progress,
            cmdline,
            hardware_virtualization,
            next_scratch: AtomicU64::new(0),
        })
    }

    /// Timeout for one step (a boot, a restore, a snapshot).
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.settings.timeout_s)
    }

    /// Measured runs: `--runs` when given, else `quick` under `--quick`, else `normal`.
    pub fn runs(&self, normal: u32, quick: u32) -> u32 {
        self.settings
            .runs
            .unwrap_or(if self.settings.quick { quick } else { normal })
            .max(1)
    }

    /// Warm-up runs discarded before measuring.
    pub fn warmup(&self) -> u32 {
        self.settings.warmup
    }

    /// A new empty scratch folder, removed when the guard is dropped.
    pub fn scratch(&self) -> Result<ScratchDir> {
        let n = self.next_scratch.fetch_add(1, Ordering::Relaxed);
        let path = self.work_dir.join(format!("{n:05}"));
        std::fs::create_dir_all(&path).map_err(PerfError::io("cannot create", &path))?;
        Ok(ScratchDir(path))
    }

    /// Runs `step` `warmup + runs` times, telling it whether the run is a
    /// warm-up one, and advances the progress bar after each.
    pub fn repeat(&self, runs: u32, mut step: impl FnMut(bool) -> Result<()>) -> Result<()> {
        let warmup = self.warmup();
        for i in 0..warmup + runs {
            step(i < warmup)?;
            self.progress.inc(1);
        }
        Ok(())
    }

    /// Says what is running now, on the progress bar.
    pub fn status(&self, message: String) {
        self.progress.set_message(message);
    }
}

/// A scratch folder that is removed with everything in it when dropped.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// The folder.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Milliseconds in `d`, as a float.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
