//! `hostagent.v1.Approvals`: pending asks, answers, and the audit stream.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::approvals_server::Approvals;
use tonic::{Request, Response, Status};

use super::check_session_id;
use super::exec::check_execution;
use super::owned_session;
use crate::auth::layer::caller_of;
use crate::error::Error;
use crate::sessions::Manager;
use proto::guest::{host_message::Kind as In, Answer as GAnswer};

/// About how much audit JSON one ListAudit answer carries (tonic clients
/// decode at most 4 MiB per message by default).
const AUDIT_PAGE_BYTES: usize = 2 << 20;

/// The Approvals service.
pub struct ApprovalsApi(pub Arc<Manager>);

#[tonic::async_trait]
impl Approvals for ApprovalsApi {
    async fn list_asks(
        &self,
        req: Request<pb::ListAsksRequest>,
    ) -> Result<Response<pb::ListAsksResponse>, Status> {
        let caller = caller_of(&req)?;
        let id = req.into_inner().session_id;
        let sess = owned_session(&self.0, &caller, &id)?;
        let asks = sess
            .guest()
            .map(|g| g.asks())
            .unwrap_or_default()
            .into_iter()
            .map(|a| pb::Ask {
                ask_id: a.ask.ask_id,
                session_id: id.clone(),
                exec_id: a.ask.exec_id,
                turn_id: a.ask.turn_id,
                tool: a.ask.tool,
                subject: a.ask.subject,
                rule: a.ask.rule,
                asked_at: a.asked_at,
            })
            .collect();
        Ok(Response::new(pb::ListAsksResponse { asks }))
    }

    async fn answer(
        &self,
        req: Request<pb::AnswerRequest>,
    ) -> Result<Response<pb::AnswerResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        if r.ask_id.is_empty() || r.ask_id.len() > 128 {
            return Err(Error::invalid("ask_id must be 1..=128 bytes").into());
        }
        match pb::Reply::try_from(r.reply) {
            Ok(pb::Reply::Once | pb::Reply::Always | pb::Reply::Reject) => {}
            _ => {
                return Err(Error::invalid(format!(
                    "reply {} is not ONCE, ALWAYS or REJECT",
                    r.reply
                ))
                .into())
            }
        }
        check_execution(&self.0, &caller, &r.session_id, &r.execution_id).await?;
        let sess = self.0.session(&r.session_id)?;
        let Some(conn) = sess.guest() else {
            return Err(Error::not_found("ask", r.ask_id).into());
        };
        if !conn.take_ask(&r.ask_id) {
            return Err(Error::not_found("ask", r.ask_id).into());
        }
        conn.send(In::Answer(GAnswer {
            ask_id: r.ask_id.clone(),
            reply: r.reply,
        }))
        .await?;
        let word = match pb::Reply::try_from(r.reply) {
            Ok(pb::Reply::Once) => "once",
            Ok(pb::Reply::Always) => "always",
            _ => "reject",
        };
        self.0.note_answer(&sess, &r.ask_id, word)?;
        Ok(Response::new(pb::AnswerResponse {}))
    }

    async fn list_audit(
        &self,
        req: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_session_id(&r.session_id)?;
        // Another client's session is as absent as a missing one.
        if !self
            .0
            .store
            .session(&r.session_id)?
            .is_some_and(|s| caller.owns(&s.owner))
        {
            return Err(Error::not_found("session", &r.session_id).into());
        }
        let (page, more) =
            self.0
                .store
                .audit_page(&r.session_id, r.since_guest_seq, AUDIT_PAGE_BYTES)?;
        let records = page
            .into_iter()
            .map(|a| pb::AuditRecord {
                session_id: a.session_id,
                guest_seq: a.guest_seq,
                json: a.json,
                host_hash: a.host_hash,
                received_at: a.received_at,
            })
            .collect();
        Ok(Response::new(pb::ListAuditResponse { records, more }))
    }
}
