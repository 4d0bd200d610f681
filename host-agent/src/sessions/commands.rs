//! Commands and files in a session's guest, for host-agent's own callers
//! as much as for the API: starting a command as a turn (its record and
//! output pump set up, the request sent to guest-init) and writing a file
//! into the workspace. The Exec and Files services check their callers and
//! then come here; the scheduler comes here for its runs.

use std::sync::Arc;

use proto::guest::{file_request::Op, host_message::Kind as In, Exec as GExec};
use proto::guest::{file_write::Mode, FileWrite};

use super::*;
use crate::execs::record::{End, ExecRecord, Meta};

/// A command to start in a session's guest.
#[derive(Debug, Clone, Default)]
pub struct CommandSpec {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Working directory in the guest (empty: the workspace).
    pub cwd: String,
    /// Environment added to the command's.
    pub env: HashMap<String, String>,
    /// Its turn (empty: a turn of its own, `turn-<exec id>`).
    pub turn_id: String,
    /// Its terminal size, when it runs on one.
    pub pty: Option<proto::guest::TerminalSize>,
    /// Whether its stdin stays open for input.
    pub keep_stdin_open: bool,
    /// Its time limit in ms (0: none).
    pub timeout_ms: u64,
}

impl Manager {
    /// Starts `spec` in session `sess` (which must be RUNNING and run
    /// guest-init): its record is begun, its output pumped into the record
    /// and the request sent. Returns the record and the channel it went on
    /// (for its input). A failure after the record was begun ends the
    /// record as lost, with the reason.
    pub async fn start_command(
        &self,
        sess: &Arc<Session>,
        spec: CommandSpec,
    ) -> Result<(Arc<ExecRecord>, Arc<GuestConn>)> {
        if !sess.guest_init() {
            return Err(Error::FailedPrecondition(format!(
                "session {} runs an image without guest-init; there is no agent to run commands",
                sess.id
            )));
        }
        let state = sess.row().state;
        if state != S::Running as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; commands run only while RUNNING",
                sess.id,
                state_name(state)
            )));
        }
        // Opens the channel again if a host-agent restart (or a broken vsock) lost it.
        let conn = self.guest_channel(sess).await?;
        let exec_id = uuid::Uuid::new_v4().to_string();
        let turn_id = if spec.turn_id.is_empty() {
            format!("turn-{exec_id}")
        } else {
            spec.turn_id.clone()
        };
        let rec = sess.execs.begin(
            Meta {
                exec_id: exec_id.clone(),
                session_id: sess.id.clone(),
                turn_id: turn_id.clone(),
                pty: spec.pty.is_some(),
                stdin_open: spec.keep_stdin_open || spec.pty.is_some(),
                timeout_ms: spec.timeout_ms,
                started_at: now_ms(),
            },
            spec.argv.clone(),
        )?;
        let rx = match conn.route_exec(&exec_id) {
            Ok(rx) => rx,
            Err(e) => {
                rec.finish(End::Lost(e.to_string()));
                return Err(e);
            }
        };
        // The command's output goes into its record, whoever reads it.
        tokio::spawn(crate::execs::pump(
            rec.clone(),
            sess.execs.clone(),
            rx,
            conn.exec_output_dropped(),
        ));
        if let Err(e) = conn
            .send(In::Exec(GExec {
                exec_id,
                turn_id,
                argv: spec.argv,
                cwd: spec.cwd.into_bytes(),
                env: spec.env,
                stdin: Vec::new(),
                keep_stdin_open: spec.keep_stdin_open,
                pty: spec.pty,
                timeout_ms: spec.timeout_ms,
            }))
            .await
        {
            rec.finish(End::Lost(format!("it could not be sent to the guest: {e}")));
            return Err(e);
        }
        Ok((rec, conn))
    }

    /// Writes `data` to `path` (relative to the workspace root) in session
    /// `sess`'s guest, replacing the file if it exists (guest-init writes
    /// beside it and renames, so a failed write leaves the old one).
    pub async fn write_workspace_file(
        &self,
        sess: &Arc<Session>,
        path: &str,
        data: &[u8],
    ) -> Result<u64> {
        let conn = self.guest_channel(sess).await?;
        let mut call = conn
            .file_call(Op::Write(FileWrite {
                path: path.as_bytes().to_vec(),
                mode: Mode::Truncate as i32,
                permissions: 0o644,
            }))
            .await?;
        let failed = |e: crate::guest::FileCallError| {
            Error::Guest(format!("writing {path} in session {}: {e}", sess.id))
        };
        call.write(data, true).await.map_err(failed)?;
        Ok(call.write_result().await.map_err(failed)?.count)
    }
}
