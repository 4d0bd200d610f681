//! What differs for a command on a terminal (`Exec.pty`), and its timeout:
//! feeding its input, resizing it, signalling the right process group, and
//! waiting for it with a time limit.

use super::*;
use proto::guest::TerminalSize;
use tokio::io::AsyncWrite;

/// Starts the task that writes a command's input: `initial` first, then,
/// when `keep`, what comes on the returned sender (data, eof). On eof the
/// task ends, closing the input, or, with `eof_char` (a terminal), writes
/// that character and goes on.
pub(super) fn feed(
    mut w: impl AsyncWrite + Unpin + Send + 'static,
    initial: Vec<u8>,
    keep: bool,
    eof_char: Option<u8>,
) -> mpsc::Sender<(Vec<u8>, bool)> {
    let (tx, mut rx) = mpsc::channel::<(Vec<u8>, bool)>(64);
    tokio::spawn(async move {
        if !initial.is_empty() && w.write_all(&initial).await.is_err() {
            return;
        }
        if !keep {
            return;
        }
        while let Some((data, eof)) = rx.recv().await {
            if w.write_all(&data).await.is_err() {
                return;
            }
            if eof {
                match eof_char {
                    Some(c) => {
                        if w.write_all(&[c]).await.is_err() {
                            return;
                        }
                    }
                    None => return,
                }
            }
        }
    });
    tx
}

/// Waits for `child` (pid `pid`); with `timeout_ms` > 0, kills its process
/// group once that has passed. Returns its status and why guest-init ended
/// it (empty: it ended by itself).
pub(super) async fn wait(
    child: &mut tokio::process::Child,
    pid: u32,
    timeout_ms: u64,
) -> (std::io::Result<std::process::ExitStatus>, String) {
    if timeout_ms == 0 {
        return (child.wait().await, String::new());
    }
    tokio::select! {
        s = child.wait() => (s, String::new()),
        _ = tokio::time::sleep(Duration::from_millis(timeout_ms)) => {
            if let Err(e) = exec::signal_group(pid, libc::SIGKILL) {
                tracing::warn!(pid, error = %e, "cannot kill a command past its timeout");
            }
            (child.wait().await, format!("timeout after {timeout_ms} ms"))
        }
    }
}

/// Sends `sig` to a command: without a terminal, to its process group; on
/// a terminal, to the terminal's foreground process group (as a key would),
/// and SIGKILL, SIGTERM and SIGHUP to the command's own group as well, so
/// they end it even while a job of it is in the foreground.
pub(super) fn signal(pid: u32, pty: Option<&crate::pty::Master>, sig: i32) -> std::io::Result<()> {
    let Some(pty) = pty else {
        return exec::signal_group(pid, sig);
    };
    let fg = pty.foreground_group();
    if let Some(fg) = fg {
        exec::signal_group(fg, sig)?;
    }
    if fg != Some(pid)
        && (fg.is_none() || [libc::SIGKILL, libc::SIGTERM, libc::SIGHUP].contains(&sig))
    {
        exec::signal_group(pid, sig)?;
    }
    Ok(())
}

impl Session {
    /// Resizes the terminal of running command `exec_id`.
    pub(super) fn resize(&self, exec_id: &str, size: Option<TerminalSize>) -> Result<(), Failure> {
        let bad = |m: String| error(Code::InvalidArgument, m, exec_id);
        let size = size.ok_or_else(|| bad("Resize needs a size".into()))?;
        let pty = lock(&self.running)
            .get(exec_id)
            .map(|r| r.pty.clone())
            .ok_or_else(|| bad(format!("no running command {exec_id:?}")))?
            .ok_or_else(|| {
                bad(format!(
                    "command {exec_id:?} has no terminal (start it with pty)"
                ))
            })?;
        pty.resize(size.rows, size.cols)
            .map_err(|e| bad(format!("resize: {e}")))
    }
}
