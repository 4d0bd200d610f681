//! Seccomp filters, one per kind of vmm thread, built with seccompiler.
//!
//! Each thread installs its own filter (seccomp filters are per thread and
//! inherited by threads it creates) before it does any work that touches the
//! guest: vCPU threads before their first KVM_RUN, the main thread once every
//! helper thread has been started. A system call outside the thread's list
//! raises SIGSYS; the handler writes one line naming the thread kind and the
//! call to stderr and ends the process with exit code 1.
//!
//! Arguments are checked where they decide what a call can do (see
//! `rules.rs`): `socket` only for Unix sockets, `clone` only with the thread
//! flags, `clone3` always ENOSYS (a second filter; glibc falls back to clone),
//! `prctl`, `fcntl` and `ioctl` only with the options and requests the vmm
//! uses, `mmap`/`mprotect` never executable.
//!
//! The clone3 filter is the same for every kind: [`init`] installs it once on
//! the main thread, before any other thread exists, and every thread inherits
//! it. Each installed filter costs the kernel a BPF conversion and JIT (about
//! 0.1 ms for the clone3 one, 0.5 ms for a kind's list, on this development
//! machine), so one install instead of one per thread saves a little CPU and
//! start-up time on every thread.
//!
//! `vmm --no-seccomp` turns the filters off for debugging and says so loudly.

mod handler;
mod rules;

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub use handler::SelftestCall;
pub use rules::ThreadKind;

/// Errors building or installing filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// A filter could not be compiled.
    #[error("cannot build the seccomp filter for {kind} threads: {message}")]
    Build {
        /// The thread kind.
        kind: &'static str,
        /// What failed.
        message: String,
    },
    /// The kernel refused the filter.
    #[error("cannot install the seccomp filter for {kind} threads: {message}")]
    Install {
        /// The thread kind.
        kind: &'static str,
        /// What failed.
        message: String,
    },
    /// The SIGSYS handler could not be installed.
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
}

/// The filter of one thread kind (on top of the inherited clone3 one).
struct Filters {
    /// The kind's allow list; anything else raises SIGSYS.
    main: BpfProgram,
}

/// Compiled filters for every thread kind, or `None` when seccomp is off.
static FILTERS: OnceLock<Option<BTreeMap<ThreadKind, Filters>>> = OnceLock::new();
/// A thread kind that must make a forbidden call right after its filter is
/// installed, and which (test hook for `--seccomp-selftest`).
static SELFTEST: OnceLock<Option<(ThreadKind, SelftestCall)>> = OnceLock::new();

fn compile(kind: ThreadKind) -> Result<Filters, SeccompError> {
    let build = |message: String| SeccompError::Build {
        kind: kind.name(),
        message,
    };
    let program = |rules, mismatch, matched| {
        let filter = SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64)
            .map_err(|e| build(e.to_string()))?;
        BpfProgram::try_from(filter).map_err(|e| build(e.to_string()))
    };
    Ok(Filters {
        main: program(
            rules::rules(kind).map_err(|e| build(e.to_string()))?,
            SeccompAction::Trap,
            SeccompAction::Allow,
        )?,
    })
}

/// Compiles every filter and installs the SIGSYS handler (call once, early in
/// main). With `enabled == false` every later `apply` does nothing.
pub fn init(
    enabled: bool,
    selftest: Option<(ThreadKind, SelftestCall)>,
) -> Result<(), SeccompError> {
    let filters = if enabled {
        handler::install().map_err(SeccompError::Handler)?;
        // clone3 → ENOSYS, everything else passes to the thread's own filter.
        // Installed here, on the only thread so far, so every thread the vmm
        // starts inherits it.
        let clone3 = SeccompFilter::new(
            rules::clone3_rules().map_err(|e| SeccompError::Build {
                kind: "every",
                message: e.to_string(),
            })?,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
            TargetArch::x86_64,
        )
        .and_then(BpfProgram::try_from)
        .map_err(|e| SeccompError::Build {
            kind: "every",
            message: e.to_string(),
        })?;
        seccompiler::apply_filter(&clone3).map_err(|e| SeccompError::Install {
            kind: "every",
            message: e.to_string(),
        })?;
        let mut map = BTreeMap::new();
        for kind in ThreadKind::ALL {
            map.insert(kind, compile(kind)?);
        }
        Some(map)
    } else {
        tracing::warn!("seccomp filters are OFF (--no-seccomp): use this for debugging only");
        eprintln!("vmm: WARNING: seccomp filters are disabled (--no-seccomp); never run untrusted guests like this");
        None
    };
    let _ = FILTERS.set(filters);
    let _ = SELFTEST.set(selftest);
    Ok(())
}

/// Installs the filter for `kind` on the calling thread (no-op if seccomp is off
/// or `init` was not called, as in unit tests).
pub fn apply(kind: ThreadKind) -> Result<(), SeccompError> {
    let Some(Some(filters)) = FILTERS.get() else {
        return Ok(());
    };
    let Some(filters) = filters.get(&kind) else {
        return Ok(());
    };
    handler::set_thread_kind(kind);
    seccompiler::apply_filter(&filters.main).map_err(|e| SeccompError::Install {
        kind: kind.name(),
        message: e.to_string(),
    })?;
    if let Some((selftest_kind, call)) = SELFTEST.get().copied().flatten() {
        if selftest_kind == kind {
            handler::forbidden_call(call);
        }
    }
    Ok(())
}

/// Installs the filter for `kind`, ending the process if that fails: a thread
/// must never run unfiltered when filters were asked for.
pub fn apply_or_die(kind: ThreadKind) {
    if let Err(e) = apply(kind) {
        tracing::error!("{e}");
        eprintln!("vmm: {e}");
        std::process::exit(crate::exit::EXIT_VM_FAILURE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_filter_compiles() {
        for kind in ThreadKind::ALL {
            let filters = compile(kind).unwrap();
            assert!(filters.main.len() > 10, "{kind:?}");
        }
    }
}
