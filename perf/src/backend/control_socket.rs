//! Client for the vmm's control socket: one JSON object per line each way.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::{PerfError, Result};

/// A connection to a vmm control socket.
pub struct ControlClient {
    path: PathBuf,
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl ControlClient {
    /// Connects to `path`, retrying while the vmm has not bound it yet.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(source) => {
                    return Err(PerfError::Socket {
                        path: path.into(),
                        action: "cannot connect".into(),
                        source,
                    })
                }
            }
        };
        let sock_err = |action: &str| {
            let path = path.to_path_buf();
            let action = action.to_string();
            move |source| PerfError::Socket {
                path,
                action,
                source,
            }
        };
        // Snapshots of large guests take a while; never block forever though.
        stream
            .set_read_timeout(Some(Duration::from_secs(600)))
            .map_err(sock_err("cannot set a read timeout"))?;
        let reader = BufReader::new(stream.try_clone().map_err(sock_err("cannot clone"))?);
        Ok(ControlClient {
            path: path.into(),
            writer: stream,
            reader,
        })
    }

    /// Sends `request` and returns the response, failing unless it says `"ok":true`.
    pub fn request(&mut self, request: &Value) -> Result<Value> {
        let line = request.to_string();
        let sock_err = |action: &str| {
            let path = self.path.clone();
            let action = format!("{action} (request {line})");
            move |source| PerfError::Socket {
                path,
                action,
                source,
            }
        };
        self.writer
            .write_all(format!("{line}\n").as_bytes())
            .map_err(sock_err("cannot send"))?;
        let mut answer = String::new();
        let n = self
            .reader
            .read_line(&mut answer)
            .map_err(sock_err("cannot read the answer"))?;
        if n == 0 {
            return Err(PerfError::Control {
                request: line,
                message: "the vmm closed the control socket without answering".into(),
            });
        }
        let value: Value = serde_json::from_str(answer.trim()).map_err(|e| PerfError::Control {
            request: line.clone(),
            message: format!("answer {:?} is not JSON: {e}", answer.trim()),
        })?;
        if value.get("ok") == Some(&Value::Bool(true)) {
            Ok(value)
        } else {
            let message = value
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| value.to_string());
            Err(PerfError::Control {
                request: line,
                message,
            })
        }
    }
}
