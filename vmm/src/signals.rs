//! Termination signals: SIGTERM, SIGINT and SIGHUP stop the VM cleanly (as a
//! requested stop) instead of killing the process mid-write.
//!
//! The signals are blocked in the main thread before any other thread starts,
//! so every thread inherits the mask, and one watcher thread takes them with
//! `sigwait`. That avoids doing work inside a signal handler.

use std::sync::Arc;

use crate::exit::ExitReason;
use crate::vcpu::coordinator::Coordinator;

const TERMINATION_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

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
    for sig in TERMINATION_SIGNALS {
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

/// Starts the thread that turns a termination signal into a requested stop.
pub fn spawn_termination_watcher(
    blocked: BlockedSignals,
    coordinator: Arc<Coordinator>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `blocked.set` is an initialised sigset of signals blocked in this thread.
            let rc = unsafe { libc::sigwait(&blocked.set, &mut sig) };
            if rc == 0 {
                tracing::info!(signal = sig, "termination signal: stopping the VM");
                coordinator.request_exit(ExitReason::StopRequested);
                return;
            }
        })
        .map(|_| ())
}
