//! A client for the vmm's JSON-lines control socket.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

/// Errors talking to the control socket.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket failed.
    #[error("control socket {path}: {source}")]
    Io {
        /// Its path.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The vmm answered `ok:false` or something that is not a response.
    #[error("vmm refused {request}: {answer}")]
    Refused {
        /// The request line.
        request: String,
        /// The answer.
        answer: String,
    },
}

/// A connection to one vmm's control socket.
pub struct VmmControl {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    path: String,
}

impl VmmControl {
    /// Connects; `timeout` bounds each answer (a large snapshot takes seconds).
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ControlError> {
        let p = path.display().to_string();
        let io = |source| ControlError::Io {
            path: p.clone(),
            source,
        };
        let writer = UnixStream::connect(path).map_err(io)?;
        writer.set_read_timeout(Some(timeout)).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        Ok(Self {
            reader,
            writer,
            path: p,
        })
    }

    /// Sends one request and returns the answer when it says `ok:true`.
    pub fn request(&mut self, request: &Value) -> Result<Value, ControlError> {
        let io = |source| ControlError::Io {
            path: self.path.clone(),
            source,
        };
        let line = request.to_string();
        self.writer
            .write_all(format!("{line}\n").as_bytes())
            .map_err(io)?;
        let mut answer = String::new();
        self.reader.read_line(&mut answer).map_err(io)?;
        let v: Value = serde_json::from_str(answer.trim()).map_err(|_| ControlError::Refused {
            request: line.clone(),
            answer: answer.trim().to_string(),
        })?;
        if v.get("ok") == Some(&Value::Bool(true)) {
            Ok(v)
        } else {
            Err(ControlError::Refused {
                request: line,
                answer: answer.trim().to_string(),
            })
        }
    }

    /// `{"op":"pause"}`.
    pub fn pause(&mut self) -> Result<Value, ControlError> {
        self.request(&serde_json::json!({"op": "pause"}))
    }

    /// `{"op":"resume"}`.
    pub fn resume(&mut self) -> Result<Value, ControlError> {
        self.request(&serde_json::json!({"op": "resume"}))
    }

    /// `{"op":"snapshot","dir":DIR,"kind":"full"}`.
    pub fn full_snapshot(&mut self, dir: &Path) -> Result<Value, ControlError> {
        self.request(&serde_json::json!({"op": "snapshot", "dir": dir, "kind": "full"}))
    }

    /// `{"op":"stop"}`.
    pub fn stop(&mut self) -> Result<Value, ControlError> {
        self.request(&serde_json::json!({"op": "stop"}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn sends_requests_and_reports_refusals() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("c.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut w = s;
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            assert_eq!(line, "{\"op\":\"pause\"}\n");
            w.write_all(b"{\"ok\":true,\"state\":\"paused\",\"vcpus\":1}\n")
                .unwrap();
            line.clear();
            r.read_line(&mut line).unwrap();
            w.write_all(b"{\"ok\":false,\"error\":\"the VM is not paused\"}\n")
                .unwrap();
        });
        let mut c = VmmControl::connect(&sock, Duration::from_secs(5)).unwrap();
        assert_eq!(c.pause().unwrap()["state"], "paused");
        let e = c.full_snapshot(Path::new("/x")).unwrap_err();
        assert!(e.to_string().contains("not paused"), "{e}");
        t.join().unwrap();
    }
}
