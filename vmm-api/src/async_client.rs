//! The async (tokio) control-socket client used by host-agent: one
//! connection per request, each bounded by a timeout, optionally required
//! to be served by the VM's own vmm process.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::error::ControlError;
use crate::protocol::{
    ChecksumReply, Request, SnapshotKind, SnapshotReply, StatusReply, MAX_ANSWER_LEN,
};

const WHAT: &str = "control socket";

/// How to reach one vmm's control socket.
#[derive(Debug, Clone)]
pub struct AsyncClient {
    path: PathBuf,
    peer: Option<u32>,
    timeout: Duration,
}

impl AsyncClient {
    /// A client of the socket at `path`, each request bounded by 30 s.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            peer: None,
            timeout: Duration::from_secs(30),
        }
    }

    /// Requires the socket to be served by process `pid` (`None`: any).
    pub fn peer(mut self, pid: Option<u32>) -> Self {
        self.peer = pid;
        self
    }

    /// Bounds each request (connect, send, answer) by `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends `request` on a new connection and decodes the answer as `T`.
    pub async fn call<T: DeserializeOwned>(&self, request: &Request) -> Result<T, ControlError> {
        let op = request.op();
        let io = |source| ControlError::Io {
            what: WHAT,
            path: self.path.clone(),
            source,
        };
        let exchange = async {
            let stream = UnixStream::connect(&self.path).await.map_err(io)?;
            crate::peer::check(&stream, self.peer, WHAT, &self.path)?;
            let (r, mut w) = stream.into_split();
            let mut line = request.to_line();
            line.push('\n');
            w.write_all(line.as_bytes()).await.map_err(io)?;
            let mut answer = String::new();
            let n = BufReader::new(r)
                .take(MAX_ANSWER_LEN as u64 + 1)
                .read_line(&mut answer)
                .await
                .map_err(io)?;
            crate::client::decode_line(op, n, &answer)
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ControlError::Timeout {
                op,
                after: self.timeout,
            })?
    }

    /// The VM's state.
    pub async fn status(&self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Status).await
    }

    /// Parks every vCPU.
    pub async fn pause(&self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Pause).await
    }

    /// Lets the parked vCPUs run.
    pub async fn resume(&self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Resume).await
    }

    /// Ends the VM (the answer comes before the process exits).
    pub async fn stop(&self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Stop).await
    }

    /// Writes a snapshot of the paused VM into `dir` (which must not exist).
    pub async fn snapshot(
        &self,
        dir: &Path,
        kind: SnapshotKind,
    ) -> Result<SnapshotReply, ControlError> {
        self.call(&Request::Snapshot {
            dir: dir.to_path_buf(),
            kind,
        })
        .await
    }

    /// CRC-64 of the paused VM's memory.
    pub async fn memory_checksum(&self) -> Result<ChecksumReply, ControlError> {
        self.call(&Request::MemoryChecksum).await
    }

    /// Loads `snapshot` into a vmm on standby (`vmm restore --standby`) and
    /// runs it, or leaves it paused; answers once the VM is restored.
    pub async fn restore(
        &self,
        snapshot: &std::path::Path,
        paused: bool,
    ) -> Result<StatusReply, ControlError> {
        self.call(&Request::Restore {
            snapshot: snapshot.to_path_buf(),
            paused,
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    #[tokio::test]
    async fn requests_are_typed_bounded_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("c.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let server = tokio::spawn(async move {
            for answer in [
                &b"{\"ok\":true,\"state\":\"running\",\"vcpus\":2}\n"[..],
                b"{\"ok\":false,\"error\":\"no parent\"}\n",
                b"",
            ] {
                let (s, _) = l.accept().await.unwrap();
                let (r, mut w) = s.into_split();
                let mut line = String::new();
                BufReader::new(r).read_line(&mut line).await.unwrap();
                w.write_all(answer).await.unwrap();
            }
            // A silent vmm.
            let (_s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let me = std::process::id();
        let c = AsyncClient::new(&sock).peer(Some(me));
        assert_eq!(c.status().await.unwrap().vcpus, 2);
        let e = c
            .snapshot(Path::new("/s"), SnapshotKind::Diff)
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "vmm refused snapshot: no parent");
        assert!(matches!(
            c.pause().await.unwrap_err(),
            ControlError::Closed { op: "pause" }
        ));
        let e = c
            .clone()
            .timeout(Duration::from_millis(100))
            .resume()
            .await
            .unwrap_err();
        assert!(
            matches!(e, ControlError::Timeout { op: "resume", .. }),
            "{e}"
        );
        // A socket served by another process (the listener is still open).
        let e = AsyncClient::new(&sock)
            .peer(Some(me + 1))
            .status()
            .await
            .unwrap_err();
        assert!(matches!(e, ControlError::WrongPeer { .. }), "{e}");
        server.abort();
    }
}
