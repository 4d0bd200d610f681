//! Kicking a vCPU thread out of KVM_RUN.
//!
//! The kick is a real-time signal whose handler sets `kvm_run.immediate_exit`
//! of the interrupted thread's vCPU. If the signal lands while the thread is in
//! the guest, KVM_RUN returns EINTR; if it lands just before KVM_RUN, the
//! immediate_exit flag makes the next KVM_RUN return EINTR at once, so a kick
//! is never lost (the race KVM_CAP_IMMEDIATE_EXIT exists for).

use std::cell::Cell;

use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

thread_local! {
    /// `&kvm_run.immediate_exit` of the vCPU owned by this thread, or null.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

/// The signal used to kick vCPU threads.
pub fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Only a const-initialised thread-local Cell is touched: no allocation, no locks.
    let ptr = IMMEDIATE_EXIT.with(|p| p.get());
    if !ptr.is_null() {
        // SAFETY: the pointer was set by `set_immediate_exit_target` of this very thread to
        // the immediate_exit byte of the kvm_run mapping its VcpuFd owns, and is cleared
        // before that VcpuFd is dropped; a volatile byte store is async-signal-safe.
        unsafe { std::ptr::write_volatile(ptr, 1) };
    }
}

/// Installs the kick handler (process-wide; call once before starting vCPUs).
pub fn install_handler() -> std::io::Result<()> {
    register_signal_handler(kick_signal(), handle_kick)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

/// Points this thread's kick handler at `target` (null to disarm).
pub fn set_immediate_exit_target(target: *mut u8) {
    IMMEDIATE_EXIT.with(|p| p.set(target));
}

/// A thread of this process to signal: its `pthread_t`, which glibc makes an
/// integer and musl a pointer.
#[derive(Debug, Clone, Copy)]
pub struct ThreadHandle(libc::pthread_t);

// SAFETY: the handle is only ever passed to pthread_kill and pthread_equal,
// from any thread of the process; it is never dereferenced here (with musl it
// points at the thread's control block, which libc alone reads).
unsafe impl Send for ThreadHandle {}
// SAFETY: as for Send: shared references only copy the handle out.
unsafe impl Sync for ThreadHandle {}

impl ThreadHandle {
    /// The calling thread.
    pub fn current() -> Self {
        // SAFETY: pthread_self has no preconditions and always succeeds.
        ThreadHandle(unsafe { libc::pthread_self() })
    }

    /// Whether both name the same thread.
    pub fn same(&self, other: &ThreadHandle) -> bool {
        // SAFETY: pthread_equal only compares two handles.
        unsafe { libc::pthread_equal(self.0, other.0) != 0 }
    }

    /// Queues `signal` for the thread (pthread_kill's return code).
    ///
    /// # Safety
    ///
    /// The thread must still be alive (a handle of a thread that has ended
    /// may be reused or dangle).
    pub unsafe fn signal(&self, signal: libc::c_int) -> libc::c_int {
        // SAFETY: the caller guarantees the thread is alive.
        unsafe { libc::pthread_kill(self.0, signal) }
    }
}

/// Sends the kick signal to `thread`.
pub fn kick(thread: ThreadHandle) {
    // SAFETY: `thread` was registered by a vCPU thread of this process; its handler is installed
    // before any vCPU thread starts. The coordinator removes a thread's id before the thread
    // leaves its run loop, so only live threads are signalled.
    let rc = unsafe { thread.signal(kick_signal()) };
    if rc != 0 {
        tracing::debug!(rc, "kicking a vCPU thread failed");
    }
}
