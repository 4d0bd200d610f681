//! The Unix-socket transport (tests, debugging, and the host side of vsock).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use tokio::net::UnixListener;

use super::{Connection, Transport};

/// Listens on a Unix stream socket.
pub struct UnixTransport {
    listener: UnixListener,
    path: PathBuf,
}

impl UnixTransport {
    /// Binds `path`, replacing a stale socket file left by an earlier run.
    pub fn bind(path: &Path) -> std::io::Result<Self> {
        if std::fs::symlink_metadata(path).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        }) {
            std::fs::remove_file(path)?;
        }
        Ok(Self {
            listener: UnixListener::bind(path)?,
            path: path.to_path_buf(),
        })
    }
}

impl Transport for UnixTransport {
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = std::io::Result<Connection>> + Send + '_>> {
        Box::pin(async move {
            let (s, _) = self.listener.accept().await?;
            Ok(Box::new(s) as Connection)
        })
    }

    fn describe(&self) -> String {
        format!("unix:{}", self.path.display())
    }
}
