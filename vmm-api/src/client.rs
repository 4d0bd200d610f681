//! The blocking control-socket client (the images CLI, perf, tests).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use crate::error::ControlError;
use crate::protocol::{
    decode_answer, AnswerError, ChecksumReply, Request, SnapshotKind, SnapshotReply, StatusReply,
    MAX_ANSWER_LEN,
};

/// A connection to one vmm's control socket; requests are answered in order.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    path: PathBuf,
    timeout: Duration,
}

const WHAT: &str = "control socket";

impl Client {
    /// Connects to `path`; `timeout` bounds each answer (a snapshot of a
    /// large guest takes seconds).
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ControlError> {
        Self::connect_checked(path, None, timeout)
    }

    /// [`Client::connect`], requiring the socket to be served by `peer`.
    pub fn connect_checked(
        path: &Path,
        peer: Option<u32>,
        timeout: Duration,
    ) -> Result<Self, ControlError> {
        let io = |source| ControlError::Io {
            what: WHAT,
            path: path.to_path_buf(),
            source,
        };
        let writer = UnixStream::connect(path).map_err(io)?;
        crate::peer::check(&writer, peer, WHAT, path)?;
        writer.set_read_timeout(Some(timeout)).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        Ok(Self {
            reader,
            writer,
            path: path.to_path_buf(),
            timeout,
        })
    }

    /// Connects, retrying until `wait` has passed while the socket does not
    /// exist or nobody listens yet (a vmm that was just started).
    pub fn connect_retry(
        path: &Path,
        wait: Duration,
        timeout: Duration,
    ) -> Result<Self, ControlError> {
        let deadline = Instant::now() + wait;
        loop {
            match Self::connect(path, timeout) {
                Ok(c) => return Ok(c),
                Err(ControlError::Io { source, .. })
                    if Instant::now() < deadline
                        && matches!(
                            source.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_micros(500));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends `request` and decodes its answer as `T`.
    pub fn call<T: DeserializeOwned>(&mut self, request: &Request) -> Result<T, ControlError> {
        let op = request.op();
        let io = |source: std::io::Error| match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                ControlError::Timeout {
                    op,
                    after: self.timeout,
                }
            }
            _ => ControlError::Io {
                what: WHAT,
                path: self.path.clone(),
                source,
            },
        };
        let mut line = request.to_line();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(io)?;
        let mut answer = String::new();
        let n = (&mut self.reader)
            .take(MAX_ANSWER_LEN as u64 + 1)
            .read_line(&mut answer)
            .map_err(io)?;
        decode_line(op, n, &answer)
    }

    /// The VM's state.
    pub fn status(&mut self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Status)
    }

    /// Parks every vCPU.
    pub fn pause(&mut self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Pause)
    }

    /// Lets the parked vCPUs run.
    pub fn resume(&mut self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Resume)
    }

    /// Ends the VM (the answer comes before the process exits).
    pub fn stop(&mut self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Stop)
    }

    /// Writes a snapshot of the paused VM into `dir` (which must not exist).
    pub fn snapshot(
        &mut self,
        dir: &Path,
        kind: SnapshotKind,
    ) -> Result<SnapshotReply, ControlError> {
        self.call(&Request::Snapshot {
            dir: dir.to_path_buf(),
            kind,
        })
    }

    /// CRC-64 of the paused VM's memory.
    pub fn memory_checksum(&mut self) -> Result<ChecksumReply, ControlError> {
        self.call(&Request::MemoryChecksum)
    }

    /// Loads `snapshot` into a vmm on standby (`vmm restore --standby`) and
    /// runs it, or leaves it paused; answers once the VM is restored.
    pub fn restore(&mut self, snapshot: &Path, paused: bool) -> Result<StatusReply, ControlError> {
        self.call(&Request::Restore {
            snapshot: snapshot.to_path_buf(),
            paused,
        })
    }
}

/// Decodes the answer line of `n` bytes read (at most
/// [`MAX_ANSWER_LEN`] + 1) for the request `op`, as either client reads it.
pub(crate) fn decode_line<T: DeserializeOwned>(
    op: &'static str,
    n: usize,
    answer: &str,
) -> Result<T, ControlError> {
    if n == 0 {
        return Err(ControlError::Closed { op });
    }
    if !answer.ends_with('\n') {
        return Err(ControlError::BadAnswer {
            op,
            message: format!("no end of line within {MAX_ANSWER_LEN} bytes"),
        });
    }
    decode_answer(answer).map_err(|e| match e {
        AnswerError::Refused(message) => ControlError::Refused { op, message },
        AnswerError::Malformed(message) => ControlError::BadAnswer { op, message },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A stand-in vmm that answers each request line with the next of `answers`.
    fn serve(
        answers: Vec<Vec<u8>>,
    ) -> (
        tempfile::TempDir,
        PathBuf,
        std::thread::JoinHandle<Vec<String>>,
    ) {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("c.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut w = s;
            let mut seen = vec![];
            for a in answers {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                seen.push(line);
                w.write_all(&a).unwrap();
            }
            seen
        });
        (d, sock, t)
    }

    #[test]
    fn typed_requests_and_replies() {
        let (_d, sock, t) = serve(vec![
            b"{\"ok\":true,\"state\":\"paused\",\"vcpus\":1}\n".to_vec(),
            b"{\"ok\":false,\"error\":\"the VM is not paused\"}\n".to_vec(),
            b"{\"ok\":true,\"crc64\":\"00000000000000ab\"}\n".to_vec(),
        ]);
        let mut c = Client::connect(&sock, Duration::from_secs(5)).unwrap();
        assert_eq!(c.pause().unwrap().state, crate::VmState::Paused);
        let e = c.snapshot(Path::new("/x"), SnapshotKind::Full).unwrap_err();
        assert!(e.is_refusal());
        assert_eq!(e.to_string(), "vmm refused snapshot: the VM is not paused");
        assert_eq!(c.memory_checksum().unwrap().crc64, "00000000000000ab");
        let seen = t.join().unwrap();
        assert_eq!(seen[0], "{\"op\":\"pause\"}\n");
        assert_eq!(
            seen[1],
            "{\"op\":\"snapshot\",\"dir\":\"/x\",\"kind\":\"full\"}\n"
        );
    }

    #[test]
    fn hostile_answers_are_bounded_and_reported() {
        let (_d, sock, t) = serve(vec![vec![b'x'; MAX_ANSWER_LEN + 10]]);
        let mut c = Client::connect(&sock, Duration::from_secs(5)).unwrap();
        let e = c.status().unwrap_err();
        assert!(matches!(e, ControlError::BadAnswer { .. }), "{e}");
        t.join().unwrap();

        let (_d, sock, t) = serve(vec![b"{\"ok\":true}\n".to_vec()]);
        let mut c = Client::connect(&sock, Duration::from_secs(5)).unwrap();
        let e = c.status().unwrap_err();
        assert!(e.to_string().contains("not the expected reply"), "{e}");
        t.join().unwrap();

        let (_d, sock, t) = serve(vec![vec![]]);
        let mut c = Client::connect(&sock, Duration::from_secs(5)).unwrap();
        assert!(matches!(
            c.stop().unwrap_err(),
            ControlError::Closed { op: "stop" }
        ));
        t.join().unwrap();
    }

    #[test]
    fn a_silent_vmm_times_out() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("c.sock");
        let _l = UnixListener::bind(&sock).unwrap();
        let mut c = Client::connect(&sock, Duration::from_millis(100)).unwrap();
        assert!(matches!(
            c.status().unwrap_err(),
            ControlError::Timeout { op: "status", .. }
        ));
    }

    #[test]
    fn connect_retry_waits_for_the_socket_and_gives_up() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("late.sock");
        let e = Client::connect_retry(&sock, Duration::from_millis(50), Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(matches!(e, ControlError::Io { .. }), "{e}");
        let s2 = sock.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let l = UnixListener::bind(&s2).unwrap();
            let _ = l.accept().unwrap();
        });
        assert!(
            Client::connect_retry(&sock, Duration::from_secs(10), Duration::from_secs(1)).is_ok()
        );
        t.join().unwrap();
    }
}
