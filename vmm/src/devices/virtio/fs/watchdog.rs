//! A bound on how long the vmm waits for a vhost-user backend. The vhost
//! crate's receive loop retries on `EAGAIN`, so a socket receive timeout only
//! makes it spin; instead a watchdog thread shuts the socket down when a
//! request has been waiting longer than the limit, which turns the blocked
//! receive into an error. Backend requests are rare (start, stop, snapshot),
//! not per I/O, so one parked thread per backend is cheap.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    deadline: Option<Instant>,
    fired: bool,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The watchdog of one backend socket; stops its thread when dropped.
pub struct Watchdog {
    shared: Arc<Shared>,
    limit: Duration,
}

/// A request in progress; the deadline is cleared when it is dropped.
pub struct Armed<'a>(&'a Watchdog);

impl Watchdog {
    /// Starts watching `stream` with requests limited to `limit`.
    pub fn start(stream: &UnixStream, limit: Duration) -> std::io::Result<Watchdog> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let fd = stream.as_raw_fd();
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("vhost-watchdog".into())
            .spawn(move || {
                crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
                watch(&thread_shared, fd);
            })?;
        Ok(Watchdog { shared, limit })
    }

    /// Starts the clock for one request.
    pub fn arm(&self) -> Armed<'_> {
        let mut state = self.shared.lock();
        state.deadline = Some(Instant::now() + self.limit);
        drop(state);
        self.shared.wake.notify_all();
        Armed(self)
    }

    /// Whether the watchdog cut the connection.
    pub fn fired(&self) -> bool {
        self.shared.lock().fired
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.shared.lock().deadline = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
    }
}

fn watch(shared: &Shared, fd: RawFd) {
    let mut state = shared.lock();
    loop {
        if state.stop {
            return;
        }
        state = match state.deadline {
            None => shared.wake.wait(state).unwrap_or_else(|p| p.into_inner()),
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    state.fired = true;
                    state.deadline = None;
                    // The descriptor is the backend connection's, which outlives
                    // this thread's use of it: the thread stops with the Watchdog,
                    // dropped with the connection, and only a pending request's
                    // deadline gets here (a stale number would only fail, EBADF).
                    // SAFETY: shutdown(2) only changes the state of a socket.
                    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                    state
                } else {
                    shared
                        .wake
                        .wait_timeout(state, deadline - now)
                        .map(|(s, _)| s)
                        .unwrap_or_else(|p| p.into_inner().0)
                }
            }
        };
    }
}
