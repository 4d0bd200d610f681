//! Seccomp filters, one per kind of vmm thread. The build script compiles
//! the allow lists of `rules.rs` to BPF with `bpf.rs` (compact programs; the
//! tests check them against seccompiler's) and embeds the programs, so a
//! starting vmm only installs them.
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
//! it. Each installed filter costs the kernel a BPF conversion and JIT, in
//! proportion to its length (on this development machine 10-20 µs for the
//! clone3 one, 75-130 µs for a kind's list; 175-300 µs when seccompiler
//! compiled them), so one install instead of one per thread saves a little
//! CPU and start-up time on every thread.
//!
//! `vmm --no-seccomp` turns the filters off for debugging and says so loudly.

mod bpf;
mod handler;
// The lists are compiled by build.rs; the vmm itself uses the thread kinds
// (and its tests check the embedded programs against the lists).
#[cfg_attr(not(test), allow(dead_code))]
mod rules;

use std::sync::OnceLock;

use seccompiler::sock_filter;

pub use handler::SelftestCall;
pub use rules::ThreadKind;

/// Errors building or installing filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
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

/// The BPF programs, compiled from `rules.rs` by the build script.
mod programs {
    use seccompiler::sock_filter;
    include!(concat!(env!("OUT_DIR"), "/seccomp_programs.rs"));
}

/// The embedded program of `kind` (on top of the inherited clone3 one).
fn program(kind: ThreadKind) -> &'static [sock_filter] {
    match kind {
        ThreadKind::Main => programs::MAIN,
        ThreadKind::Vcpu => programs::VCPU,
        ThreadKind::Control => programs::CONTROL,
        ThreadKind::Device => programs::DEVICE,
    }
}

/// Whether filters are on (`None` before `init`, as in unit tests).
static ENABLED: OnceLock<bool> = OnceLock::new();
/// A thread kind that must make a forbidden call right after its filter is
/// installed, and which (test hook for `--seccomp-selftest`).
static SELFTEST: OnceLock<Option<(ThreadKind, SelftestCall)>> = OnceLock::new();

/// Installs the SIGSYS handler and the clone3 filter every thread inherits
/// (call once, early in main, before any other thread exists). With
/// `enabled == false` every later `apply` does nothing.
pub fn init(
    enabled: bool,
    selftest: Option<(ThreadKind, SelftestCall)>,
) -> Result<(), SeccompError> {
    if enabled {
        handler::install().map_err(SeccompError::Handler)?;
        seccompiler::apply_filter(programs::CLONE3).map_err(|e| SeccompError::Install {
            kind: "every",
            message: e.to_string(),
        })?;
    } else {
        tracing::warn!("seccomp filters are OFF (--no-seccomp): use this for debugging only");
        eprintln!("vmm: WARNING: seccomp filters are disabled (--no-seccomp); never run untrusted guests like this");
    }
    let _ = ENABLED.set(enabled);
    let _ = SELFTEST.set(selftest);
    Ok(())
}

/// Installs the filter for `kind` on the calling thread (no-op if seccomp is off
/// or `init` was not called, as in unit tests).
pub fn apply(kind: ThreadKind) -> Result<(), SeccompError> {
    if ENABLED.get() != Some(&true) {
        return Ok(());
    }
    handler::set_thread_kind(kind);
    seccompiler::apply_filter(program(kind)).map_err(|e| SeccompError::Install {
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
    fn the_embedded_programs_are_the_rules_compiled() {
        for kind in ThreadKind::ALL {
            let compiled = rules::program(kind).unwrap();
            assert!(compiled.len() > 10, "{kind:?}");
            assert_eq!(program(kind), compiled.as_slice(), "{kind:?}");
        }
        assert_eq!(
            programs::CLONE3,
            rules::clone3_program().unwrap().as_slice()
        );
        // The kinds differ (a build script that wrote one program four
        // times would not).
        assert_ne!(programs::MAIN, programs::VCPU);
        assert_ne!(programs::CONTROL, programs::DEVICE);
    }
}
