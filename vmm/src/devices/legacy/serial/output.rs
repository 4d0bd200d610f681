//! Guest console output decoupled from the vCPU: bytes go into a bounded
//! buffer that a writer thread drains to stdout or a file. A guest that
//! floods the console while the reader is slow (a full pipe, a stuck
//! terminal) loses the bytes that do not fit, counted, instead of blocking
//! its vCPU in write(2) or growing host memory.
//!
//! With a direct descriptor (stdout), the vCPU writes a few bytes itself
//! when nothing is queued and `poll` says the descriptor takes them without
//! blocking: the usual case, a reader that keeps up, then costs two system
//! calls per UART byte instead of waking the writer thread for each one
//! (a futex wake, its wait, its write and two context switches).

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes held for the writer thread at most.
pub const OUTPUT_BUFFER: usize = 64 * 1024;
/// How long [`WriterHandle::wait_written`] waits for the writer (at VM exit).
const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// The most bytes the vCPU writes directly in one call: a descriptor that
/// `poll` reports writable takes this many without blocking (a pipe with a
/// free buffer takes up to PIPE_BUF, a terminal below its wake-up mark has
/// 256 bytes of room). The UART writes one byte per call.
const DIRECT_MAX: usize = 64;

/// Work the writer thread does between batches, when a period passes
/// without output: emptying KVM's coalesced ring of console writes a guest
/// made without exiting since ([`super::coalesced`]).
pub trait IdleWork: Send + Sync {
    /// How long the writer may wait for output before it calls `run` (`None`:
    /// until output arrives). Asked again after every wait.
    fn period(&self) -> Option<Duration>;
    /// Called on the writer thread, without any lock of the output held.
    fn run(&self);
}

#[derive(Default)]
struct State {
    buf: VecDeque<u8>,
    dropped: u64,
    writing: bool,
    /// Callers waiting in `wait_written` (the writer wakes them after each batch).
    flushers: u32,
    /// What the writer does while no output comes.
    idle: Option<Arc<dyn IdleWork>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The vCPU-side handle: never blocks on the real output.
pub struct BufferedOutput {
    shared: Arc<Shared>,
    /// The descriptor `sink` writes to, when the vCPU may write to it
    /// itself (see the module's doc).
    direct: Option<RawFd>,
}

impl BufferedOutput {
    /// Starts the writer thread draining into `sink`. With `direct`, small
    /// writes go straight to that descriptor while nothing is queued and it
    /// is writable: `sink` must write to it unbuffered (or flush what it
    /// buffers, as the writer thread does after every batch), and it must
    /// stay open while this lives.
    pub fn new(
        mut sink: Box<dyn Write + Send>,
        direct: Option<RawFd>,
    ) -> std::io::Result<BufferedOutput> {
        let shared = Arc::new(Shared::default());
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("serial-out".into())
            .spawn(move || {
                crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
                let mut chunk = Vec::with_capacity(OUTPUT_BUFFER);
                loop {
                    {
                        let mut st = thread_shared.lock();
                        while st.buf.is_empty() {
                            let idle = st.idle.clone();
                            let Some(period) = idle.as_ref().and_then(|w| w.period()) else {
                                st = thread_shared
                                    .changed
                                    .wait(st)
                                    .unwrap_or_else(|p| p.into_inner());
                                continue;
                            };
                            let (guard, waited) = thread_shared
                                .changed
                                .wait_timeout(st, period)
                                .unwrap_or_else(|p| p.into_inner());
                            st = guard;
                            if let (true, Some(work)) = (waited.timed_out(), idle) {
                                if st.buf.is_empty() {
                                    // The work may write output (and so take this lock).
                                    drop(st);
                                    work.run();
                                    st = thread_shared.lock();
                                }
                            }
                        }
                        chunk.clear();
                        chunk.extend(st.buf.drain(..));
                        st.writing = true;
                    }
                    let failed = sink.write_all(&chunk).and_then(|()| sink.flush()).is_err();
                    let mut st = thread_shared.lock();
                    st.writing = false;
                    if failed {
                        // A closed stdout must not stop the guest: drop what we had.
                        st.dropped += chunk.len() as u64;
                    }
                    if st.flushers > 0 {
                        thread_shared.changed.notify_all();
                    }
                }
            })?;
        Ok(BufferedOutput { shared, direct })
    }

    /// A handle to the writer thread: to wait until it has written what
    /// is queued, and to give it work for its idle periods.
    pub fn handle(&self) -> WriterHandle {
        WriterHandle {
            shared: self.shared.clone(),
        }
    }

    /// Bytes lost because the output could not keep up.
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }
}

/// A [`BufferedOutput`]'s writer thread, seen from elsewhere: the UART
/// holds the output itself (as its `Write`), the VM's teardown and the
/// coalesced transmit hold this.
#[derive(Clone)]
pub struct WriterHandle {
    shared: Arc<Shared>,
}

impl WriterHandle {
    /// Waits (bounded) until the writer thread has written everything
    /// queued: at VM exit, and before the console is read back.
    pub fn wait_written(&self) {
        let deadline = Instant::now() + FLUSH_WAIT;
        let mut st = self.shared.lock();
        st.flushers += 1;
        while !st.buf.is_empty() || st.writing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.flushers -= 1;
    }

    /// Installs `work` (replacing any before) and wakes the writer to wait
    /// by its period.
    pub fn set(&self, work: Arc<dyn IdleWork>) {
        self.shared.lock().idle = Some(work);
        self.shared.changed.notify_all();
    }
}

/// Writes `data` to `fd` if `poll` says it is writable now and `data` is
/// small enough to go in without blocking; the bytes written (0 when not
/// writable, on any error, or for larger `data`).
fn write_if_ready(fd: RawFd, data: &[u8]) -> usize {
    if data.is_empty() || data.len() > DIRECT_MAX {
        return 0;
    }
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, count 1, zero timeout (never blocks).
    let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
    let refused = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    if ready != 1 || pfd.revents & libc::POLLOUT == 0 || pfd.revents & refused != 0 {
        return 0;
    }
    // SAFETY: `data` is a live slice of `data.len()` bytes; `fd` is open (the
    // caller's contract).
    let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
    usize::try_from(n).unwrap_or(0)
}

impl Write for BufferedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let mut st = self.shared.lock();
        // Straight out while nothing is queued or being written (the lock is
        // held, so the writer thread cannot start a batch meanwhile: order
        // is kept); what does not go out this way is queued.
        let mut data = data;
        let asked = data.len();
        if let Some(fd) = self.direct {
            if st.buf.is_empty() && !st.writing {
                data = &data[write_if_ready(fd, data)..];
                if data.is_empty() {
                    return Ok(asked);
                }
            }
        }
        let was_empty = st.buf.is_empty();
        let room = OUTPUT_BUFFER.saturating_sub(st.buf.len());
        let n = data.len().min(room);
        st.buf.extend(&data[..n]);
        st.dropped += (data.len() - n) as u64;
        // The writer only sleeps on an empty buffer: wake it once per batch, not per byte
        // (the UART writes one byte per call, so this is the console's hot path).
        if was_empty && n > 0 {
            self.shared.changed.notify_all();
        }
        // Report everything as written: the guest's UART never waits on the host.
        Ok(asked)
    }

    /// Returns at once: the writer thread flushes after every batch. The
    /// UART flushes after every byte, and a vCPU must never wait here for a
    /// slow reader (bytes that do not fit are dropped, counted); waiting
    /// for the queue is [`WriterHandle::wait_written`].
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Default)]
    struct Collect(Arc<Mutex<Vec<u8>>>);

    impl Write for Collect {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    struct Stuck(Arc<(Mutex<bool>, Condvar)>);

    impl Write for Stuck {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            let (m, c) = &*self.0;
            let mut open = m.lock().unwrap();
            while !*open {
                open = c.wait(open).unwrap();
            }
            Err(std::io::Error::other("closed"))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn everything_arrives_in_order_and_wait_written_waits_for_it() {
        let sink = Collect::default();
        let mut out = BufferedOutput::new(Box::new(sink.clone()), None).unwrap();
        for i in 0..1000u32 {
            out.write_all(format!("{i}\n").as_bytes()).unwrap();
        }
        out.handle().wait_written();
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1000);
        assert_eq!(text.lines().last(), Some("999"));
        assert_eq!(out.dropped(), 0);
    }

    /// Reads what `r` holds now, without blocking.
    fn read_now(r: &std::io::PipeReader) -> Vec<u8> {
        use std::os::fd::AsRawFd;
        let mut out = Vec::new();
        let mut buf = [0u8; 65536];
        loop {
            let mut pfd = libc::pollfd {
                fd: r.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, count 1, zero timeout.
            if unsafe { libc::poll(&mut pfd, 1, 0) } != 1 {
                return out;
            }
            let n = std::io::Read::read(&mut &*r, &mut buf).unwrap();
            out.extend_from_slice(&buf[..n]);
        }
    }

    /// A sink that counts the bytes the writer thread wrote through it.
    struct Counted(std::io::PipeWriter, Arc<Mutex<usize>>);

    impl Write for Counted {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            *self.1.lock().unwrap() += b.len();
            self.0.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_writable_pipe_gets_the_bytes_from_the_vcpu_without_the_writer_thread() {
        use std::os::fd::AsRawFd;
        let (r, w) = std::io::pipe().unwrap();
        let through_thread = Arc::new(Mutex::new(0));
        let sink = Counted(w.try_clone().unwrap(), through_thread.clone());
        let mut out = BufferedOutput::new(Box::new(sink), Some(w.as_raw_fd())).unwrap();
        for b in b"hello\n" {
            assert_eq!(out.write(std::slice::from_ref(b)).unwrap(), 1);
        }
        // Already in the pipe when write returned: no flush, no thread.
        assert_eq!(read_now(&r), b"hello\n");
        assert_eq!(*through_thread.lock().unwrap(), 0);
        assert_eq!(out.dropped(), 0);
    }

    #[test]
    fn a_full_pipe_queues_the_bytes_and_they_follow_in_order() {
        use std::os::fd::AsRawFd;
        let (r, w) = std::io::pipe().unwrap();
        // Fill the pipe so that poll reports it not writable.
        // SAFETY: F_SETFL on a descriptor owned by this test.
        unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let mut filled = 0usize;
        while let Ok(n) = (&w).write(&[b'.'; 4096]) {
            filled += n;
        }
        // SAFETY: as above; back to blocking for the writer thread.
        unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETFL, 0) };
        let through_thread = Arc::new(Mutex::new(0));
        let sink = Counted(w.try_clone().unwrap(), through_thread.clone());
        let mut out = BufferedOutput::new(Box::new(sink), Some(w.as_raw_fd())).unwrap();
        for b in b"abc" {
            out.write_all(std::slice::from_ref(b)).unwrap();
        }
        // Drain the pipe while the writer thread delivers the queue.
        let mut got = Vec::new();
        while got.len() < filled + 3 {
            let mut buf = [0u8; 65536];
            let n = std::io::Read::read(&mut &r, &mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        out.handle().wait_written();
        assert_eq!(&got[filled..], b"abc");
        assert_eq!(
            *through_thread.lock().unwrap(),
            3,
            "the queue went through the thread"
        );
        // The queue is empty again: the next bytes go straight out.
        out.write_all(b"d").unwrap();
        assert_eq!(read_now(&r), b"d");
        assert_eq!(*through_thread.lock().unwrap(), 3);
    }

    #[test]
    fn a_pipe_without_reader_drops_instead_of_failing_the_guest() {
        use std::os::fd::AsRawFd;
        let (r, w) = std::io::pipe().unwrap();
        drop(r);
        let sink = Counted(w.try_clone().unwrap(), Arc::new(Mutex::new(0)));
        let mut out = BufferedOutput::new(Box::new(sink), Some(w.as_raw_fd())).unwrap();
        assert_eq!(out.write(b"x").unwrap(), 1);
        out.handle().wait_written();
        assert_eq!(out.dropped(), 1);
    }

    /// Idle work that counts its runs and asks for `period` until woken.
    struct Ticks {
        runs: Mutex<u32>,
        period: Mutex<Option<Duration>>,
    }

    impl IdleWork for Ticks {
        fn period(&self) -> Option<Duration> {
            *self.period.lock().unwrap()
        }
        fn run(&self) {
            *self.runs.lock().unwrap() += 1;
        }
    }

    /// Waits (10 s at most) until `work` has run `n` times.
    fn wait_runs(work: &Ticks, n: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while *work.runs.lock().unwrap() < n {
            assert!(
                Instant::now() < deadline,
                "idle work ran fewer than {n} times"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn the_writer_runs_idle_work_by_its_period() {
        let sink = Collect::default();
        let mut out = BufferedOutput::new(Box::new(sink.clone()), None).unwrap();
        let work = Arc::new(Ticks {
            runs: Mutex::new(0),
            period: Mutex::new(Some(Duration::from_millis(1))),
        });
        out.handle().set(work.clone());
        wait_runs(&work, 3);
        // Output in between is written, and the polls go on after it.
        out.write_all(b"x").unwrap();
        out.handle().wait_written();
        assert_eq!(*sink.0.lock().unwrap(), b"x");
        let runs = *work.runs.lock().unwrap();
        wait_runs(&work, runs + 3);
    }

    #[test]
    fn a_stuck_output_drops_bytes_instead_of_blocking_or_growing() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let mut out = BufferedOutput::new(Box::new(Stuck(gate.clone())), None).unwrap();
        let flood = vec![b'x'; 1 << 20];
        for _ in 0..8 {
            assert_eq!(out.write(&flood).unwrap(), flood.len());
        }
        assert!(out.shared.lock().buf.len() <= OUTPUT_BUFFER);
        assert!(out.dropped() >= 8 * (1 << 20) - 2 * OUTPUT_BUFFER as u64);
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
    }
}
