//! Guest console output decoupled from the vCPU: bytes go into a bounded
//! buffer that a writer thread drains to stdout or a file. A guest that
//! floods the console while the reader is slow (a full pipe, a stuck
//! terminal) loses the bytes that do not fit, counted, instead of blocking
//! its vCPU in write(2) or growing host memory.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes held for the writer thread at most.
pub const OUTPUT_BUFFER: usize = 64 * 1024;
/// How long `flush` waits for the writer (at VM exit).
const FLUSH_WAIT: Duration = Duration::from_secs(2);

#[derive(Default)]
struct State {
    buf: VecDeque<u8>,
    dropped: u64,
    writing: bool,
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
}

impl BufferedOutput {
    /// Starts the writer thread draining into `sink`.
    pub fn new(mut sink: Box<dyn Write + Send>) -> std::io::Result<BufferedOutput> {
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
                            st = thread_shared
                                .changed
                                .wait(st)
                                .unwrap_or_else(|p| p.into_inner());
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
                    thread_shared.changed.notify_all();
                }
            })?;
        Ok(BufferedOutput { shared })
    }

    /// Bytes lost because the output could not keep up.
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }
}

impl Write for BufferedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let mut st = self.shared.lock();
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
        Ok(data.len())
    }

    /// Waits (bounded) until the writer thread has written everything queued.
    fn flush(&mut self) -> std::io::Result<()> {
        let deadline = Instant::now() + FLUSH_WAIT;
        let mut st = self.shared.lock();
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
    fn everything_arrives_in_order_and_flush_waits_for_it() {
        let sink = Collect::default();
        let mut out = BufferedOutput::new(Box::new(sink.clone())).unwrap();
        for i in 0..1000u32 {
            out.write_all(format!("{i}\n").as_bytes()).unwrap();
        }
        out.flush().unwrap();
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1000);
        assert_eq!(text.lines().last(), Some("999"));
        assert_eq!(out.dropped(), 0);
    }

    #[test]
    fn a_stuck_output_drops_bytes_instead_of_blocking_or_growing() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let mut out = BufferedOutput::new(Box::new(Stuck(gate.clone()))).unwrap();
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
