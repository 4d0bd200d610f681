//! `Exec.Attach` and `Exec.ListExecs`, and the checks of ExecStart's
//! terminal and timeout.

use proto::hostagent as pb;
use tokio_stream::StreamExt;
use tonic::{Request, Status, Streaming};

use super::owned_session;
use crate::auth::layer::caller_of;
use crate::error::Error;
use crate::execs::attach::{self, check_terminal, Opening, Responses};
use crate::sessions::Manager;

/// Longest `timeout_ms` accepted: 7 days.
pub const MAX_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;

/// Checks what ExecStart adds to a command: its terminal and its timeout.
pub fn check_start(start: &pb::ExecStart) -> Result<(), Error> {
    if let Some(p) = &start.pty {
        check_terminal(p, "pty").map_err(Error::invalid)?;
    }
    if start.timeout_ms > MAX_TIMEOUT_MS {
        return Err(Error::invalid(format!(
            "timeout_ms is {}; at most {MAX_TIMEOUT_MS} (7 days), or 0 for none",
            start.timeout_ms
        )));
    }
    Ok(())
}

/// Checks an exec id from a client (host-agent makes them as UUIDs).
fn check_exec_id(id: &str) -> Result<(), Error> {
    if id.is_empty() {
        return Err(Error::invalid("exec_id is required"));
    }
    if id.len() > 64 {
        return Err(Error::invalid(format!(
            "exec_id is {} bytes; exec ids are at most 64",
            id.len()
        )));
    }
    Ok(())
}

/// Attach: `attach` first, then input as in Exec.
pub async fn attach(
    mgr: &std::sync::Arc<Manager>,
    req: Request<Streaming<pb::ExecRequest>>,
) -> Result<Responses, Status> {
    let caller = caller_of(&req)?;
    let mut input = req.into_inner();
    let first = match input.next().await {
        Some(Ok(m)) => m,
        Some(Err(e)) => return Err(e),
        None => return Err(Error::invalid("empty attach stream: send attach first").into()),
    };
    let Some(pb::exec_request::Kind::Attach(at)) = first.kind else {
        return Err(Error::invalid("the first message of Attach must be attach").into());
    };
    let sess = owned_session(mgr, &caller, &at.session_id)?;
    check_exec_id(&at.exec_id)?;
    let rec = sess
        .execs
        .get(&at.exec_id)
        .ok_or_else(|| Error::not_found("exec", &at.exec_id))?;
    let attached = {
        let st = rec.lock();
        let (start, end) = (st.ring.start(), st.ring.end());
        if at.from_offset > end {
            return Err(Status::out_of_range(format!(
                "from_offset {} is past the end of exec {}'s output ({end} bytes so far)",
                at.from_offset, at.exec_id
            )));
        }
        let info_state = match (&st.end, st.pid) {
            (None, None) => pb::ExecState::Starting,
            (None, Some(_)) => pb::ExecState::Running,
            (Some(crate::execs::record::End::Exited(_)), _) => pb::ExecState::Exited,
            (Some(crate::execs::record::End::Rejected(_)), _) => pb::ExecState::Rejected,
            (Some(_), _) => pb::ExecState::Lost,
        };
        let start_offset = at.from_offset.max(start);
        pb::ExecAttached {
            exec_id: at.exec_id.clone(),
            from_offset: at.from_offset,
            start_offset,
            lost_bytes: start_offset - at.from_offset,
            end_offset: end,
            state: info_state as i32,
            pid: st.pid.unwrap_or(0),
        }
    };
    mgr.touch(&sess);
    let (out, fail) = attach::open(rec.clone(), Opening::Attach(attached));
    if !rec.ended() {
        // Input goes to the guest only while the session's channel is open.
        if let Some(conn) = sess.guest().filter(|c| !c.is_closed()) {
            tokio::spawn(attach::forward_input(rec, conn, input, fail));
        }
    }
    Ok(out)
}

/// ListExecs: the session's commands, running and the last ended.
pub fn list_execs(
    mgr: &Manager,
    req: Request<pb::ListExecsRequest>,
) -> Result<pb::ListExecsResponse, Status> {
    let caller = caller_of(&req)?;
    let r = req.into_inner();
    let sess = owned_session(mgr, &caller, &r.session_id)?;
    Ok(pb::ListExecsResponse {
        execs: sess.execs.list(),
    })
}
