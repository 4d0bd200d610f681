//! `host-agent approvals list|answer` and `host-agent audit SESSION
//! [--verify]`: a session's pending asks, answering one, and its audit
//! records as host-agent holds them.

use clap::{Subcommand, ValueEnum};
use proto::hostagent as pb;
use proto::hostagent::approvals_client::ApprovalsClient;
use sha2::{Digest, Sha256};
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output};

/// An answer to an ask.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ReplyArg {
    /// Run this command, once.
    Once,
    /// Run it, and allow the same command for the rest of the session.
    Always,
    /// Do not run it.
    Reject,
}

/// The `approvals` subcommands.
#[derive(Subcommand)]
pub enum ApprovalsCmd {
    /// The asks of a session waiting for an answer.
    List {
        /// Session id.
        session: String,
    },
    /// Answer an ask.
    Answer {
        /// Session id.
        session: String,
        /// The ask's id (from `approvals list` or the Exec stream).
        ask_id: String,
        /// The answer.
        #[arg(value_enum)]
        reply: ReplyArg,
        /// Execution id (default: the session's current one).
        #[arg(long)]
        execution_id: Option<String>,
    },
}

/// Runs an `approvals` subcommand.
pub async fn run(
    ch: Channel,
    bearer: Bearer,
    out: Output,
    cmd: ApprovalsCmd,
) -> Result<(), String> {
    let mut cl = ApprovalsClient::with_interceptor(ch.clone(), bearer.clone());
    match cmd {
        ApprovalsCmd::List { session } => {
            let asks = cl
                .list_asks(pb::ListAsksRequest {
                    session_id: session,
                })
                .await
                .map_err(st)?
                .into_inner()
                .asks;
            print_all(&asks, out);
        }
        ApprovalsCmd::Answer {
            session,
            ask_id,
            reply,
            execution_id,
        } => {
            let execution_id =
                super::execution_id_or_current(&ch, &bearer, &session, execution_id).await?;
            let reply = match reply {
                ReplyArg::Once => pb::Reply::Once,
                ReplyArg::Always => pb::Reply::Always,
                ReplyArg::Reject => pb::Reply::Reject,
            };
            cl.answer(pb::AnswerRequest {
                session_id: session,
                execution_id,
                ask_id,
                reply: reply as i32,
            })
            .await
            .map_err(st)?;
        }
    }
    Ok(())
}

/// Where a host chain of audit records breaks, if it does: each record's
/// `host_hash` must be `sha256(previous host_hash || json)` (the first
/// chained to the empty string), and the guest's sequence numbers must run
/// 1, 2, 3, ... without a gap.
pub fn chain_break(records: &[pb::AuditRecord]) -> Option<String> {
    let mut prev = String::new();
    for (i, r) in records.iter().enumerate() {
        let want_seq = i as u64 + 1;
        if r.guest_seq != want_seq {
            return Some(format!(
                "record {want_seq} has guest seq {}: a record is missing or out of order",
                r.guest_seq
            ));
        }
        let mut h = Sha256::new();
        h.update(prev.as_bytes());
        h.update(r.json.as_bytes());
        let want = hex::encode(h.finalize());
        if r.host_hash != want {
            return Some(format!(
                "record {want_seq}: host_hash {} is not sha256(previous || json) = {want}: the record was changed",
                r.host_hash
            ));
        }
        prev = r.host_hash.clone();
    }
    None
}

/// Runs `audit SESSION [--verify]`: every record, page by page; with
/// `verify`, the host chain is checked and the result printed last (an
/// error when it breaks).
pub async fn audit(
    ch: Channel,
    bearer: Bearer,
    out: Output,
    session: String,
    verify: bool,
) -> Result<(), String> {
    let mut cl = ApprovalsClient::with_interceptor(ch, bearer);
    let mut all = Vec::new();
    let mut since = 0;
    loop {
        let page = cl
            .list_audit(pb::ListAuditRequest {
                session_id: session.clone(),
                since_guest_seq: since,
            })
            .await
            .map_err(st)?
            .into_inner();
        if let Some(last) = page.records.last() {
            since = last.guest_seq;
        }
        let more = page.more && !page.records.is_empty();
        all.extend(page.records);
        if !more {
            break;
        }
    }
    print_all(&all, out);
    if verify {
        match chain_break(&all) {
            Some(why) => return Err(format!("the audit chain of {session} is broken: {why}")),
            None => eprintln!(
                "the audit chain of {session} holds: {} records, last host hash {}",
                all.len(),
                all.last().map_or("-", |r| r.host_hash.as_str())
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chained(jsons: &[&str]) -> Vec<pb::AuditRecord> {
        let mut prev = String::new();
        jsons
            .iter()
            .enumerate()
            .map(|(i, j)| {
                let mut h = Sha256::new();
                h.update(prev.as_bytes());
                h.update(j.as_bytes());
                prev = hex::encode(h.finalize());
                pb::AuditRecord {
                    session_id: "s".into(),
                    guest_seq: i as u64 + 1,
                    json: j.to_string(),
                    host_hash: prev.clone(),
                    received_at: 0,
                }
            })
            .collect()
    }

    #[test]
    fn the_host_chain_is_checked() {
        let good = chained(&["{\"a\":1}", "{\"b\":2}", "{\"c\":3}"]);
        assert_eq!(chain_break(&good), None);
        assert_eq!(chain_break(&[]), None);
        let mut edited = good.clone();
        edited[1].json = "{\"b\":3}".into();
        assert!(chain_break(&edited).unwrap().contains("record 2"));
        let mut gap = good.clone();
        gap.remove(1);
        assert!(chain_break(&gap).unwrap().contains("missing"));
    }
}
