//! The local terminal for `exec --tty`: its size, raw mode (restored when
//! the guard drops), and following its size (SIGWINCH) with resizes.

use proto::hostagent as pb;
use tokio::sync::mpsc;

/// The size of the terminal on stdin (or stdout), 24x80 when neither is one.
pub fn size() -> pb::TerminalSize {
    for fd in [0, 1] {
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes a winsize to the valid pointer given.
        let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
        if rc == 0 && ws.ws_row > 0 && ws.ws_col > 0 {
            return pb::TerminalSize {
                rows: ws.ws_row.into(),
                cols: ws.ws_col.into(),
            };
        }
    }
    pb::TerminalSize { rows: 24, cols: 80 }
}

/// Puts the terminal on stdin in raw mode until dropped.
pub struct RawMode(libc::termios);

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: tcsetattr reads the termios saved from this descriptor.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.0) };
    }
}

/// Raw mode on stdin when it is a terminal (None otherwise).
pub fn raw_mode() -> Option<RawMode> {
    // SAFETY: isatty takes a descriptor only.
    if unsafe { libc::isatty(0) } != 1 {
        return None;
    }
    // SAFETY: termios is plain data; tcgetattr fills it.
    let mut saved: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes to the valid termios given.
    if unsafe { libc::tcgetattr(0, &mut saved) } != 0 {
        return None;
    }
    let mut raw = saved;
    // SAFETY: cfmakeraw changes the valid termios given; tcsetattr reads it.
    unsafe {
        libc::cfmakeraw(&mut raw);
        if libc::tcsetattr(0, libc::TCSANOW, &raw) != 0 {
            return None;
        }
    }
    Some(RawMode(saved))
}

/// Sends a resize whenever the local terminal's size changes, until the
/// stream's input closes.
pub fn follow_size(tx: mpsc::Sender<pb::ExecRequest>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut winch) = signal(SignalKind::window_change()) else {
        return;
    };
    tokio::spawn(async move {
        while winch.recv().await.is_some() {
            let m = pb::ExecRequest {
                kind: Some(pb::exec_request::Kind::Resize(size())),
            };
            if tx.send(m).await.is_err() {
                return;
            }
        }
    });
}
