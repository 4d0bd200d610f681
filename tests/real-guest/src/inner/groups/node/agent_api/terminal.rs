//! The terminal half of `node-agent-api`: `bash -i` on a pseudo-terminal
//! typed at, ListExecs showing it exited, and a command killed by its
//! `timeout_ms`.

use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::transport::Channel;

use super::{exec, BOUND, PROMPT, SHORT, TIMEOUT_MS};
use crate::inner::Check;

/// A live Exec stream: its input, its responses, the output so far; asks
/// are answered ONCE as they come (shells reading their input are asked
/// even when the rules allow everything).
struct Live {
    input: mpsc::Sender<pb::ExecRequest>,
    stream: tonic::Streaming<pb::ExecResponse>,
    approvals: pb::approvals_client::ApprovalsClient<Channel>,
    session: pb::Session,
    exec_id: String,
    started: bool,
    asks: usize,
    output: Vec<u8>,
    exit: Option<pb::ExecExit>,
    rejected: Option<String>,
}

impl Live {
    /// Starts `start` in session `s` and reads until it started.
    async fn exec(ch: &Channel, s: &pb::Session, start: pb::ExecStart) -> Result<Live, String> {
        let argv = start.argv.join(" ");
        let start = pb::ExecStart {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            ..start
        };
        let (input, rx) = mpsc::channel(16);
        input
            .send(pb::ExecRequest {
                kind: Some(Req::Start(start)),
            })
            .await
            .map_err(|_| format!("Exec {argv}: the request stream closed"))?;
        let mut client = pb::exec_client::ExecClient::new(ch.clone());
        let call = client.exec(tokio_stream::wrappers::ReceiverStream::new(rx));
        let stream = tokio::time::timeout(BOUND, call)
            .await
            .map_err(|_| format!("Exec {argv}: no answer in 300 s"))?
            .map_err(|e| format!("Exec {argv}: {:?} {}", e.code(), e.message()))?
            .into_inner();
        let mut live = Live {
            input,
            stream,
            approvals: pb::approvals_client::ApprovalsClient::new(ch.clone()),
            session: s.clone(),
            exec_id: String::new(),
            started: false,
            asks: 0,
            output: Vec::new(),
            exit: None,
            rejected: None,
        };
        let deadline = Instant::now() + BOUND;
        while !live.started {
            if !live.next(deadline).await? {
                return Err(format!(
                    "Exec {argv}: ended before it started (rejected: {:?})",
                    live.rejected
                ));
            }
        }
        Ok(live)
    }

    /// Types `bytes` at the command.
    async fn send(&self, bytes: &[u8]) -> Result<(), String> {
        self.input
            .send(pb::ExecRequest {
                kind: Some(Req::Stdin(bytes.to_vec())),
            })
            .await
            .map_err(|_| "the Exec stream no longer takes input".to_string())
    }

    /// Takes one response by `deadline`; false at the end of the stream.
    async fn next(&mut self, deadline: Instant) -> Result<bool, String> {
        let m = tokio::time::timeout_at(deadline, self.stream.message())
            .await
            .map_err(|_| {
                format!(
                    "Exec {}: no response in time; output so far {:?}",
                    self.exec_id,
                    String::from_utf8_lossy(&self.output)
                )
            })?
            .map_err(|e| format!("Exec {}: {:?} {}", self.exec_id, e.code(), e.message()))?;
        let Some(m) = m else { return Ok(false) };
        if !m.exec_id.is_empty() {
            self.exec_id = m.exec_id.clone();
        }
        match m.kind {
            Some(Resp::Stdout(d) | Resp::Stderr(d)) => self.output.extend_from_slice(&d),
            Some(Resp::Started(_)) => self.started = true,
            Some(Resp::Ask(a)) => self.answer(a).await?,
            Some(Resp::Exit(e)) => self.exit = Some(e),
            Some(Resp::Rejected(r)) => self.rejected = Some(r),
            Some(Resp::Attached(_)) | None => {}
        }
        Ok(true)
    }

    /// Answers the ask ONCE.
    async fn answer(&mut self, a: pb::Ask) -> Result<(), String> {
        let call = self.approvals.answer(pb::AnswerRequest {
            session_id: self.session.session_id.clone(),
            execution_id: self.session.execution_id.clone(),
            ask_id: a.ask_id.clone(),
            reply: pb::Reply::Once as i32,
        });
        tokio::time::timeout(BOUND, call)
            .await
            .map_err(|_| format!("Answer {}: no answer in 300 s", a.ask_id))?
            .map_err(|e| format!("Answer {}: {}", a.ask_id, e.message()))?;
        self.asks += 1;
        Ok(())
    }

    /// Reads until the output after `from` holds `needle` (by BOUND);
    /// returns the offset in `output` after it.
    async fn until(&mut self, from: usize, needle: &str) -> Result<usize, String> {
        let deadline = Instant::now() + BOUND;
        loop {
            let rest = &self.output[from.min(self.output.len())..];
            if let Some(i) = rest
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
            {
                return Ok(from + i + needle.len());
            }
            if !self.next(deadline).await? {
                return Err(format!(
                    "the command ended before printing {needle:?}: {:?}",
                    String::from_utf8_lossy(&self.output)
                ));
            }
        }
    }

    /// Reads to the end of the stream by `deadline`; returns the exit.
    async fn finish(&mut self, deadline: Instant) -> Result<pb::ExecExit, String> {
        while self.next(deadline).await? {}
        self.exit.clone().ok_or_else(|| {
            format!(
                "Exec {} ended without an exit (rejected: {:?})",
                self.exec_id, self.rejected
            )
        })
    }
}

/// The exit's code, if it exited by itself.
fn exit_code(e: &pb::ExecExit) -> Option<i32> {
    match e.status {
        Some(pb::exec_exit::Status::Code(c)) => Some(c),
        _ => None,
    }
}

/// The interactive shell, ListExecs, and a command's timeout.
pub(super) async fn terminal_checks(ch: &Channel, s: &pb::Session) -> Check {
    let (shell, exec_id, asks) = interactive_shell(ch, s).await?;
    let listed = listed_exited(ch, s, &exec_id).await?;
    let timed_out = timed_out(ch, s).await?;
    Ok(format!(
        "{shell} on a 24x80 pty ({asks} ask(s) answered) printed hi-42 and exited 0; \
         {listed}; {timed_out}"
    ))
}

/// `bash -i` (or `sh -i` where the guest has no bash) on a 24x80 terminal:
/// `echo hi-$((6*7))` typed prints hi-42, `exit` ends it with code 0. The
/// shell, its exec id and the asks answered.
async fn interactive_shell(
    ch: &Channel,
    s: &pb::Session,
) -> Result<(String, String, usize), String> {
    let which = exec(ch.clone(), s, &["sh", "-c", "command -v bash"]).await?;
    let bash = which.stdout.trim().to_string();
    let (shell, argv) = if which.code() == Some(0) && !bash.is_empty() {
        let argv = [bash.as_str(), "--norc", "--noprofile", "-i"];
        ("bash -i", argv.map(String::from).to_vec())
    } else {
        ("sh -i", vec!["sh".to_string(), "-i".to_string()])
    };
    let env = [("PS1", PROMPT), ("TERM", "xterm")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut sh = Live::exec(
        ch,
        s,
        pb::ExecStart {
            argv,
            env,
            pty: Some(pb::TerminalSize { rows: 24, cols: 80 }),
            ..Default::default()
        },
    )
    .await?;
    let at = sh.until(0, PROMPT).await?;
    sh.send(b"echo hi-$((6*7))\n").await?;
    let at = sh.until(at, "hi-42").await?;
    sh.until(at, PROMPT).await?;
    sh.send(b"exit\n").await?;
    let exit = sh.finish(Instant::now() + BOUND).await?;
    if exit_code(&exit) != Some(0) {
        return Err(format!(
            "{shell} ended {exit:?}; output {:?}",
            String::from_utf8_lossy(&sh.output)
        ));
    }
    Ok((shell.to_string(), sh.exec_id.clone(), sh.asks))
}

/// ListExecs shows `exec_id` EXITED with code 0 (within SHORT).
async fn listed_exited(ch: &Channel, s: &pb::Session, exec_id: &str) -> Check {
    let mut ex = pb::exec_client::ExecClient::new(ch.clone());
    let deadline = Instant::now() + SHORT;
    loop {
        let execs = tokio::time::timeout_at(
            deadline,
            ex.list_execs(pb::ListExecsRequest {
                session_id: s.session_id.clone(),
            }),
        )
        .await
        .map_err(|_| "ListExecs: no answer in 60 s".to_string())?
        .map_err(|e| format!("ListExecs: {}", e.message()))?
        .into_inner()
        .execs;
        let me = execs.into_iter().find(|i| i.exec_id == exec_id);
        let done = me.as_ref().is_some_and(|i| {
            i.state == pb::ExecState::Exited as i32
                && i.pty
                && i.exit.as_ref().and_then(exit_code) == Some(0)
        });
        if done {
            return Ok(format!("ListExecs shows {exec_id} EXITED with code 0"));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "ListExecs: {exec_id} is not a pty exec EXITED with code 0 within 60 s: {me:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `sleep 600` with a 2 s timeout ends (within SHORT of starting) with an
/// exit whose reason says timeout.
async fn timed_out(ch: &Channel, s: &pb::Session) -> Check {
    let mut slow = Live::exec(
        ch,
        s,
        pb::ExecStart {
            argv: vec!["sleep".into(), "600".into()],
            timeout_ms: TIMEOUT_MS,
            ..Default::default()
        },
    )
    .await?;
    let t0 = Instant::now();
    let exit = slow
        .finish(t0 + SHORT)
        .await
        .map_err(|e| format!("sleep 600 with timeout_ms {TIMEOUT_MS}: {e}"))?;
    if !exit.reason.contains("timeout") {
        return Err(format!(
            "sleep 600 with timeout_ms {TIMEOUT_MS} ended without a timeout reason: {exit:?}"
        ));
    }
    Ok(format!(
        "sleep 600 with timeout_ms {TIMEOUT_MS} ended after {:.1} s: {:?}",
        t0.elapsed().as_secs_f64(),
        exit.reason
    ))
}
