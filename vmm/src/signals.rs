//! Termination signals: SIGTERM, SIGINT and SIGHUP stop the VM cleanly (as a
//! requested stop) instead of killing the process mid-write.
//!
//! The signals are blocked in the main thread before any other thread starts,
//! so every thread inherits the mask, and the main thread takes them with
//! `sigwait` while it waits for the VM to end (the coordinator wakes it with
//! [`EXIT_WAKE`]). That avoids doing work inside a signal handler, and a
//! thread of its own.

use crate::exit::ExitReason;
use crate::vcpu::coordinator::Coordinator;

const TERMINATION_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// The signal the coordinator sends the main thread when the VM's end comes
/// nearer; blocked with the termination signals and taken by the same `sigwait`.
pub const EXIT_WAKE: libc::c_int = libc::SIGUSR2;

/// A set of blocked termination signals, to be handed to the watcher.
pub struct BlockedSignals {
    set: libc::sigset_t,
}

/// Blocks the termination signals in the calling thread (and so in every thread it spawns later).
pub fn block_termination_signals() -> std::io::Result<BlockedSignals> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for sig in TERMINATION_SIGNALS.into_iter().chain([EXIT_WAKE]) {
        // SAFETY: `set` is initialised and `sig` is a valid signal number.
        unsafe { libc::sigaddset(&mut set, sig) };
    }
    // SAFETY: `set` is initialised; the old mask is not needed (null).
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(BlockedSignals { set })
}

/// Waits in the calling (main) thread until the VM has ended, turning a
/// termination signal into a requested stop on the way: the coordinator wakes
/// it with [`EXIT_WAKE`] whenever the end comes nearer, so no thread of its
/// own is needed (each thread costs its creation and a seccomp filter install).
pub fn watch_until_ended(blocked: &BlockedSignals, coordinator: &Coordinator) {
    coordinator.wake_on_exit(EXIT_WAKE);
    while !coordinator.has_ended() {
        let mut sig: libc::c_int = 0;
        // SAFETY: `blocked.set` is an initialised sigset of signals blocked in this thread.
        let rc = unsafe { libc::sigwait(&blocked.set, &mut sig) };
        if rc != 0 {
            // Only an invalid set fails; wait without signals rather than spin.
            tracing::warn!(
                error = %std::io::Error::from_raw_os_error(rc),
                "cannot wait for termination signals"
            );
            coordinator.wait_for_exit();
            return;
        }
        if TERMINATION_SIGNALS.contains(&sig) {
            tracing::info!(signal = sig, "termination signal: stopping the VM");
            coordinator.request_exit(ExitReason::StopRequested);
        }
    }
}
