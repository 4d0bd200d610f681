//! Scenario `node-fork`: ForkSession of a running session into two. The
//! source commits a file on its branch; both forks come back RUNNING, each
//! is a machine of its own (`hostname` its session id, /etc/machine-id its
//! id without dashes, a first /dev/urandom read unlike the other's and the
//! source's next one), holds the file, works on `session/<its id>` at the
//! source's commit, and its audit chain begins with `session.forked`
//! naming the source. The source runs on. Every session is stopped and
//! deleted afterwards, passed or not.

use proto::hostagent as pb;
use tonic::transport::Channel;

use super::persist::{bounded, record_vmm, remove_sessions};
use super::sizing::open_repository;
use super::{agent, create_running, exec, expect_ok, keep_logs, HostAgent};
use crate::inner::{Check, Ctx};

/// New sessions per fork.
const FORKS: u32 = 2;
/// The file the source commits, and what it holds.
const FILE: &str = "forked.txt";
const TEXT: &str = "committed by the source before the fork";
/// A command that prints 32 bytes of /dev/urandom as 64 hex digits.
const URANDOM: &str = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";

/// Fork a session of the real guest into two.
pub fn fork(ctx: &mut Ctx, name: &str) -> Check {
    let result = fork_flow(ctx);
    keep_logs(ctx);
    let note = result?;
    ctx.info(name, &note);
    Ok(note)
}

/// Creates the source, forks it, runs the checks, then stops and deletes
/// every session the scenario made.
fn fork_flow(ctx: &mut Ctx) -> Check {
    let repo = open_repository(ctx)?;
    agent(ctx)?;
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let ch = a.channel()?;
    let (source, _) = create_running(a, &ch, &repo)?;
    let mut made = vec![source.session_id.clone()];
    let checked = fork_checks(a, &ch, &source, &mut made, &ctx.out);
    keep_logs(ctx);
    let removed = remove_sessions(a, &ch, &made);
    let note = checked?;
    removed?;
    Ok(note)
}

/// Writes `text` to `file` in session `s`'s workspace and commits it with
/// `message`; the new HEAD.
pub(super) async fn commit_file(
    ch: &Channel,
    s: &pb::Session,
    file: &str,
    text: &str,
    message: &str,
) -> Result<String, String> {
    let script = format!("printf '%s\\n' '{text}' > {file}");
    run(ch, s, &["sh", "-c", &script]).await?;
    run(ch, s, &["git", "add", file]).await?;
    run(
        ch,
        s,
        &[
            "git",
            "-c",
            "user.name=Agent",
            "-c",
            "user.email=agent@example.com",
            "commit",
            "-q",
            "-m",
            message,
        ],
    )
    .await?;
    run(ch, s, &["git", "rev-parse", "HEAD"]).await
}

/// `argv` in session `s`; its standard output, trimmed, if it exited 0.
pub(super) async fn run(ch: &Channel, s: &pb::Session, argv: &[&str]) -> Result<String, String> {
    let r = exec(ch.clone(), s, argv).await?;
    expect_ok(&format!("{argv:?} in session {}", s.session_id), &r)?;
    Ok(r.stdout.trim().to_string())
}

/// A 64-hex-digit read of /dev/urandom in session `s`.
async fn urandom(ch: &Channel, s: &pb::Session) -> Result<String, String> {
    let read = run(ch, s, &["sh", "-c", URANDOM]).await?;
    if read.len() != 64 || !read.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "`{URANDOM}` in session {} printed {read:?}",
            s.session_id
        ));
    }
    Ok(read)
}

/// The whole check on the RUNNING session `source`; the forks' ids are
/// added to `made` as soon as they exist.
fn fork_checks(
    a: &HostAgent,
    ch: &Channel,
    source: &pb::Session,
    made: &mut Vec<String>,
    out: &std::path::Path,
) -> Check {
    let src = source.session_id.clone();
    let head = a.block_on(commit_file(ch, source, FILE, TEXT, "before the fork"))?;
    let forked = a.block_on(bounded(
        &format!("ForkSession {src} count {FORKS}"),
        pb::sessions_client::SessionsClient::new(ch.clone()).fork_session(pb::ForkSessionRequest {
            session_id: src.clone(),
            count: FORKS,
            ..Default::default()
        }),
    ))?;
    made.extend(forked.sessions.iter().map(|f| f.session_id.clone()));
    if forked.sessions.len() != FORKS as usize {
        return Err(format!(
            "ForkSession of {FORKS} answered {} session(s)",
            forked.sessions.len()
        ));
    }
    for f in &forked.sessions {
        if f.state != pb::SessionState::Running as i32 {
            return Err(format!(
                "fork {} is {:?}, not RUNNING ({}: {})",
                f.session_id,
                pb::SessionState::try_from(f.state),
                f.reason,
                f.detail
            ));
        }
        if f.parent_session_id != src {
            return Err(format!(
                "fork {} names parent {:?}, not the source {src}",
                f.session_id, f.parent_session_id
            ));
        }
    }
    let src_state = forked.source.as_ref().map(|s| s.state);
    if src_state != Some(pb::SessionState::Running as i32) {
        return Err(format!(
            "the source is {:?} after the fork, not RUNNING",
            src_state.map(pb::SessionState::try_from)
        ));
    }
    // Each fork's first command reads the CRNG, before anything else runs
    // in either; then the source's next read.
    let mut reads = Vec::new();
    for f in &forked.sessions {
        let read = a.block_on(urandom(ch, f)).map_err(|e| {
            format!(
                "the first command in fork {} (RUNNING): {e}{}",
                f.session_id,
                record_vmm(out, &format!("node-fork-{}", f.session_id), f.vmm_pid)
            )
        })?;
        reads.push(read);
    }
    let source_read = a.block_on(urandom(ch, source))?;
    if reads[0] == reads[1] {
        return Err(format!(
            "both forks read {} first from /dev/urandom: they share the source's CRNG state",
            reads[0]
        ));
    }
    if let Some(same) = reads.iter().position(|r| *r == source_read) {
        return Err(format!(
            "fork {} read {source_read} first from /dev/urandom, as the source's next read did",
            forked.sessions[same].session_id
        ));
    }
    for f in &forked.sessions {
        fork_is_its_own(a, ch, f, &src, &head)?;
    }
    // The source runs on, as itself.
    let host = a.block_on(run(ch, source, &["hostname"]))?;
    if host != src {
        return Err(format!(
            "after the fork the source's hostname is {host:?}, not {src}"
        ));
    }
    Ok(format!(
        "{FORKS} forks RUNNING, each named after itself, on session/<its id> at {}, \
         with {FILE} and a session.forked audit record naming the source; first urandom \
         reads {}…, {}… and the source's {}… differ; the source runs on",
        &head[..head.len().min(12)],
        &reads[0][..16],
        &reads[1][..16],
        &source_read[..16]
    ))
}

/// Fork `f` of source `src` (at commit `head`) is a session of its own.
fn fork_is_its_own(
    a: &HostAgent,
    ch: &Channel,
    f: &pb::Session,
    src: &str,
    head: &str,
) -> Result<(), String> {
    let id = &f.session_id;
    let (host, machine_id, text, branch, commit, audit) = a.block_on(async {
        let host = run(ch, f, &["hostname"]).await?;
        let machine_id = run(ch, f, &["cat", "/etc/machine-id"]).await?;
        let text = run(ch, f, &["cat", FILE]).await?;
        let branch = run(ch, f, &["git", "rev-parse", "--abbrev-ref", "HEAD"]).await?;
        let commit = run(ch, f, &["git", "rev-parse", "HEAD"]).await?;
        let audit = bounded(
            &format!("ListAudit {id}"),
            pb::approvals_client::ApprovalsClient::new(ch.clone()).list_audit(
                pb::ListAuditRequest {
                    session_id: id.clone(),
                    since_guest_seq: 0,
                },
            ),
        )
        .await?
        .records;
        Ok::<_, String>((host, machine_id, text, branch, commit, audit))
    })?;
    if host != *id {
        return Err(format!("fork {id}: hostname is {host:?}, not its id"));
    }
    let want_id = id.replace('-', "");
    if machine_id != want_id {
        return Err(format!(
            "fork {id}: /etc/machine-id is {machine_id:?}, not {want_id}"
        ));
    }
    if text != TEXT {
        return Err(format!(
            "fork {id}: {FILE} holds {text:?}, not the source's {TEXT:?}"
        ));
    }
    let want_branch = format!("session/{id}");
    if branch != want_branch {
        return Err(format!(
            "fork {id}: the workspace is on {branch:?}, not {want_branch}"
        ));
    }
    if commit != head {
        return Err(format!(
            "fork {id}: HEAD is {commit}, not the source's {head}"
        ));
    }
    let first = audit.first().ok_or_else(|| {
        format!("fork {id}: ListAudit has no records (want session.forked first)")
    })?;
    if first.guest_seq != 1
        || !first.json.contains("\"session.forked\"")
        || !first.json.contains(&format!("parent_session_id={src}"))
    {
        return Err(format!(
            "fork {id}: the first audit record (guest seq {}) is not session.forked naming \
             parent_session_id={src}: {}",
            first.guest_seq, first.json
        ));
    }
    Ok(())
}
