//! Terminals and reattach (issue 15, parts 3 and 4), against guest-init run
//! as a host process (see `guest_init.rs`): `bash -i` on a pseudo-terminal
//! typed at, resized and interrupted; a command outliving its dropped Exec
//! stream, replayed by Attach from offset 0 and from the middle, listed by
//! ListExecs running then exited; a timeout that kills with a reason; more
//! than the 1 MiB buffer of output replayed from the buffer's start; bad
//! input refused naming the field.

use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use test_harness::agent::Agent;
use test_harness::bin::host_agent_path;
use tokio::sync::mpsc;
use tonic::Code;

mod common;

use common::*;

/// Everything runs, but shells reading their input still ask (the policy
/// escalates them); the tests answer those asks.
const OPEN_RULES: &str = r#"---
description: terminal tests
permission:
  bash:
    "*": allow
---
# Coder
"#;

/// The failure bound of every wait.
const BOUND: Duration = Duration::from_secs(60);

/// A host-agent with a guest-init session whose rules allow everything.
async fn setup() -> (Guest, Agent, pb::Session) {
    let guest = start_guest_with_rules(OPEN_RULES).await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = guest_init_session(&agent, &guest).await;
    (guest, agent, s)
}

/// A live Exec or Attach stream: its input, its responses, the output
/// seen so far; asks are answered ONCE as they come.
struct Live {
    input: mpsc::Sender<pb::ExecRequest>,
    stream: tonic::Streaming<pb::ExecResponse>,
    session: pb::Session,
    channel: tonic::transport::Channel,
    exec_id: String,
    pid: u32,
    output: Vec<u8>,
    /// Next output offset expected.
    offset: u64,
    /// Responses other than output, in order.
    others: Vec<Resp>,
    ended: bool,
}

impl Live {
    async fn exec(agent: &Agent, s: &pb::Session, start: pb::ExecStart) -> Live {
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
            .unwrap();
        let channel = agent.channel().await;
        let stream = pb::exec_client::ExecClient::new(channel.clone())
            .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("exec")
            .into_inner();
        let mut live = Live {
            input,
            stream,
            session: s.clone(),
            channel,
            exec_id: String::new(),
            pid: 0,
            output: Vec::new(),
            offset: 0,
            others: Vec::new(),
            ended: false,
        };
        // Until it started (answering its ask, if any).
        while live.pid == 0 {
            assert!(
                live.next().await,
                "ended before it started: {:?}",
                live.others
            );
        }
        live
    }

    /// Attaches to `exec_id` from `from`; Err is the call's status.
    async fn attach(
        agent: &Agent,
        s: &pb::Session,
        exec_id: &str,
        from: u64,
    ) -> Result<(Live, pb::ExecAttached), tonic::Status> {
        let (input, rx) = mpsc::channel(16);
        input
            .send(pb::ExecRequest {
                kind: Some(Req::Attach(pb::ExecAttach {
                    session_id: s.session_id.clone(),
                    exec_id: exec_id.into(),
                    from_offset: from,
                })),
            })
            .await
            .unwrap();
        let channel = agent.channel().await;
        let stream = pb::exec_client::ExecClient::new(channel.clone())
            .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let mut live = Live {
            input,
            stream,
            session: s.clone(),
            channel,
            exec_id: exec_id.into(),
            pid: 0,
            output: Vec::new(),
            offset: 0,
            others: Vec::new(),
            ended: false,
        };
        let first = tokio::time::timeout(BOUND, live.stream.message())
            .await
            .expect("attached in time")?
            .expect("not the end");
        assert_eq!(first.exec_id, exec_id);
        let Some(Resp::Attached(a)) = first.kind else {
            panic!("attached first, got {first:?}");
        };
        live.pid = a.pid;
        live.offset = a.start_offset;
        Ok((live, a))
    }

    async fn send(&self, kind: Req) {
        self.input
            .send(pb::ExecRequest { kind: Some(kind) })
            .await
            .expect("the stream takes input");
    }

    /// Takes one response; false at the end of the stream.
    async fn next(&mut self) -> bool {
        let m = tokio::time::timeout(BOUND, self.stream.message())
            .await
            .expect("a response in time")
            .expect("no stream error");
        let Some(m) = m else {
            self.ended = true;
            return false;
        };
        match m.kind.expect("a kind") {
            Resp::Stdout(d) | Resp::Stderr(d) => {
                assert_eq!(m.offset, self.offset, "output is contiguous");
                self.offset += d.len() as u64;
                self.output.extend_from_slice(&d);
            }
            Resp::Started(s) => {
                self.exec_id = m.exec_id.clone();
                self.pid = m.pid;
                assert_eq!(s, format!("{} {}", m.exec_id, m.pid));
            }
            Resp::Ask(a) => {
                pb::approvals_client::ApprovalsClient::new(self.channel.clone())
                    .answer(pb::AnswerRequest {
                        session_id: self.session.session_id.clone(),
                        execution_id: self.session.execution_id.clone(),
                        ask_id: a.ask_id.clone(),
                        reply: pb::Reply::Once as i32,
                    })
                    .await
                    .expect("answer the ask");
                self.others.push(Resp::Ask(a));
            }
            other => self.others.push(other),
        }
        true
    }

    /// Reads until the output after `from` holds `needle`; returns the
    /// offset in `output` after it.
    async fn until(&mut self, from: usize, needle: &str) -> usize {
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            if let Some(i) = find(&self.output[from.min(self.output.len())..], needle) {
                return from + i + needle.len();
            }
            let more = tokio::time::timeout_at(deadline, self.next()).await;
            assert!(
                more == Ok(true),
                "no {needle:?} in time (or the end came first): {:?}",
                String::from_utf8_lossy(&self.output)
            );
        }
    }

    /// Reads to the end; returns the exit.
    async fn finish(&mut self) -> pb::ExecExit {
        while self.next().await {}
        self.others
            .iter()
            .find_map(|k| match k {
                Resp::Exit(e) => Some(e.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no exit: {:?}", self.others))
    }
}

fn find(hay: &[u8], needle: &str) -> Option<usize> {
    hay.windows(needle.len())
        .position(|w| w == needle.as_bytes())
}

fn bash() -> Option<&'static str> {
    ["/bin/bash", "/usr/bin/bash"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

async fn list(agent: &Agent, s: &pb::Session) -> Vec<pb::ExecInfo> {
    pb::exec_client::ExecClient::new(agent.channel().await)
        .list_execs(pb::ListExecsRequest {
            session_id: s.session_id.clone(),
        })
        .await
        .expect("ListExecs")
        .into_inner()
        .execs
}

fn code(c: i32) -> Option<pb::exec_exit::Status> {
    Some(pb::exec_exit::Status::Code(c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_on_a_terminal_is_typed_at_resized_and_interrupted() {
    let Some(bash) = bash() else {
        println!("SKIPPED: no bash on this machine (looked in /bin and /usr/bin)");
        return;
    };
    let (_guest, agent, s) = setup().await;
    let mut env = std::collections::HashMap::new();
    env.insert("PS1".to_string(), "prompt$ ".to_string());
    env.insert("TERM".to_string(), "xterm".to_string());
    let mut sh = Live::exec(
        &agent,
        &s,
        pb::ExecStart {
            argv: vec![
                bash.into(),
                "--norc".into(),
                "--noprofile".into(),
                "-i".into(),
            ],
            env,
            pty: Some(pb::TerminalSize { rows: 24, cols: 80 }),
            ..Default::default()
        },
    )
    .await;
    let at = sh.until(0, "prompt$ ").await;

    // Typed: the shell echoes the line, runs it, and prompts again.
    sh.send(Req::Stdin(b"echo hi-$((6*7))\n".to_vec())).await;
    let at = sh.until(at, "hi-42").await;
    let at = sh.until(at, "prompt$ ").await;

    // Resized: the terminal's size changes.
    sh.send(Req::Resize(pb::TerminalSize {
        rows: 30,
        cols: 100,
    }))
    .await;
    sh.send(Req::Stdin(b"stty size\n".to_vec())).await;
    let at = sh.until(at, "30 100").await;
    let at = sh.until(at, "prompt$ ").await;

    // Interrupted by the Ctrl-C byte, then by Signal (SIGINT to the
    // terminal's foreground process group): the job says it runs once it
    // is the foreground process group (bash's child takes the terminal
    // before it execs), then sleeps; interrupted, the shell prompts again
    // (the sleep would outlast the bound).
    let mut at = at;
    for (n, interrupt) in [(5, Req::Stdin(vec![0x03])), (9, Req::Signal(2))] {
        let line = format!("sh -c 'echo sleeping-$((2+{})); exec sleep 1000'\n", n - 2);
        sh.send(Req::Stdin(line.into_bytes())).await;
        let after = sh.until(at, &format!("sleeping-{n}")).await;
        sh.send(interrupt).await;
        at = sh.until(after, "prompt$ ").await;
    }
    sh.send(Req::Stdin(b"echo back-$((3+4))\n".to_vec())).await;
    sh.until(at, "back-7").await;

    sh.send(Req::Stdin(b"exit 3\n".to_vec())).await;
    let exit = sh.finish().await;
    assert_eq!(exit.status, code(3), "{exit:?}");
    let info = list(&agent, &s).await;
    let me = info
        .iter()
        .find(|i| i.exec_id == sh.exec_id)
        .expect("listed");
    assert!(me.pty);
    assert_eq!(me.state, pb::ExecState::Exited as i32);

    // Bad terminals are refused naming the field; a resize of a command
    // without a terminal ends that stream, not the command.
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    for (rows, cols, field) in [
        (0, 80, "pty.rows"),
        (24, 0, "pty.cols"),
        (100_000, 80, "pty.rows"),
    ] {
        let start = pb::ExecRequest {
            kind: Some(Req::Start(pb::ExecStart {
                session_id: s.session_id.clone(),
                execution_id: s.execution_id.clone(),
                argv: vec!["true".into()],
                pty: Some(pb::TerminalSize { rows, cols }),
                ..Default::default()
            })),
        };
        let e = ex.exec(tokio_stream::iter(vec![start])).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(field), "{field}: {}", e.message());
    }
    let mut cat = Live::exec(
        &agent,
        &s,
        pb::ExecStart {
            argv: vec!["cat".into()],
            keep_stdin_open: true,
            ..Default::default()
        },
    )
    .await;
    cat.send(Req::Resize(pb::TerminalSize { rows: 5, cols: 5 }))
        .await;
    let e = tokio::time::timeout(BOUND, async {
        loop {
            match cat.stream.message().await {
                Err(e) => return e,
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without an error"),
            }
        }
    })
    .await
    .expect("refused in time");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("resize"), "{}", e.message());
    let listed = list(&agent, &s).await;
    let c = listed.iter().find(|i| i.exec_id == cat.exec_id).unwrap();
    assert_eq!(c.state, pb::ExecState::Running as i32, "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_outlives_its_stream_and_attach_replays_it() {
    let (_guest, agent, s) = setup().await;
    let mut cat = Live::exec(
        &agent,
        &s,
        pb::ExecStart {
            argv: vec!["cat".into()],
            keep_stdin_open: true,
            turn_id: "turn-cat".into(),
            ..Default::default()
        },
    )
    .await;
    cat.send(Req::Stdin(b"line-1\n".to_vec())).await;
    cat.until(0, "line-1\n").await;
    let exec_id = cat.exec_id.clone();
    drop(cat);

    // Running, listed, its output kept.
    let info = list(&agent, &s).await;
    let me = info.iter().find(|i| i.exec_id == exec_id).expect("listed");
    assert_eq!(me.state, pb::ExecState::Running as i32, "{me:?}");
    assert_eq!(me.argv, ["cat"]);
    assert_eq!(me.turn_id, "turn-cat");
    assert_eq!((me.output_bytes, me.output_start_offset), (7, 0));
    assert!(me.started_at > 0 && me.ended_at == 0, "{me:?}");

    // Attach from 0: the output so far, then live output from new input.
    let (mut a, at) = Live::attach(&agent, &s, &exec_id, 0).await.expect("attach");
    assert_eq!(
        (
            at.from_offset,
            at.start_offset,
            at.lost_bytes,
            at.end_offset
        ),
        (0, 0, 0, 7)
    );
    assert_eq!(at.state, pb::ExecState::Running as i32);
    assert!(at.pid > 0);
    a.until(0, "line-1\n").await;
    a.send(Req::Stdin(b"line-2\n".to_vec())).await;
    a.until(0, "line-2\n").await;
    a.send(Req::StdinEof(true)).await;
    let exit = a.finish().await;
    assert_eq!(exit.status, code(0));
    assert_eq!(a.output, b"line-1\nline-2\n");

    // After the end, from the middle: the rest and the exit.
    let (mut m, at) = Live::attach(&agent, &s, &exec_id, 3).await.expect("attach");
    assert_eq!((at.start_offset, at.lost_bytes, at.end_offset), (3, 0, 14));
    assert_eq!(at.state, pb::ExecState::Exited as i32);
    assert_eq!(m.finish().await.status, code(0));
    assert_eq!(m.output, b"e-1\nline-2\n");
    let info = list(&agent, &s).await;
    let me = info.iter().find(|i| i.exec_id == exec_id).unwrap();
    assert_eq!(me.state, pb::ExecState::Exited as i32);
    assert_eq!(me.exit.as_ref().unwrap().status, code(0));
    assert!(me.ended_at >= me.started_at, "{me:?}");
    assert_eq!(me.output_bytes, 14);

    // A timeout kills the command with a reason, in its stream and listing.
    let mut slow = Live::exec(
        &agent,
        &s,
        pb::ExecStart {
            argv: vec!["sleep".into(), "1000".into()],
            timeout_ms: 300,
            ..Default::default()
        },
    )
    .await;
    let exit = slow.finish().await;
    assert_eq!(
        exit.status,
        Some(pb::exec_exit::Status::Signal(9)),
        "{exit:?}"
    );
    assert_eq!(exit.reason, "timeout after 300 ms");
    let info = list(&agent, &s).await;
    let me = info.iter().find(|i| i.exec_id == slow.exec_id).unwrap();
    assert_eq!(me.exit.as_ref().unwrap().reason, "timeout after 300 ms");
    assert_eq!(me.timeout_ms, 300);

    // Bad input.
    let e = Live::attach(&agent, &s, "no-such-exec", 0)
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = Live::attach(&agent, &s, &exec_id, 15).await.err().unwrap();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(e.message().contains("from_offset"), "{}", e.message());
    let e = Live::attach(&agent, &s, "", 0).await.err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("exec_id"), "{}", e.message());
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let start = pb::ExecRequest {
        kind: Some(Req::Start(pb::ExecStart {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            argv: vec!["true".into()],
            ..Default::default()
        })),
    };
    let e = ex
        .attach(tokio_stream::iter(vec![start.clone()]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("attach"), "{}", e.message());
    let mut too_long = start.clone();
    if let Some(Req::Start(st)) = too_long.kind.as_mut() {
        st.timeout_ms = u64::MAX;
    }
    let e = ex
        .exec(tokio_stream::iter(vec![too_long]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("timeout_ms"), "{}", e.message());
    let e = ex
        .list_execs(pb::ListExecsRequest {
            session_id: "00000000-0000-0000-0000-000000000000".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = ex
        .list_execs(pb::ListExecsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("session_id"), "{}", e.message());

    // The CLI: list, attach from an offset, a timeout, a terminal.
    let listed = cli(&agent, &["--output", "json", "exec", "list", &s.session_id]);
    let listed = String::from_utf8_lossy(&listed.stdout);
    let line = listed
        .lines()
        .find(|l| l.contains(&exec_id))
        .expect("the command listed");
    assert!(
        line.contains("\"EXITED\"") && line.contains("code 0"),
        "{line}"
    );
    let out = cli(
        &agent,
        &["exec", "attach", &s.session_id, &exec_id, "--from", "3"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"e-1\nline-2\n");
    let out = cli(
        &agent,
        &[
            "exec",
            &s.session_id,
            "--timeout-ms",
            "200",
            "--",
            "sleep",
            "100",
        ],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("timeout after 200 ms"), "{stderr}");
    // Not on a terminal here: the command's terminal is 24x80.
    let out = cli(
        &agent,
        &["exec", &s.session_id, "--tty", "--", "stty", "size"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"24 80\r\n");
}

/// Runs the operator CLI against `agent` (stdin closed).
fn cli(agent: &Agent, args: &[&str]) -> std::process::Output {
    std::process::Command::new(host_agent_path())
        .args(["--addr", &agent.addr])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("host-agent runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_past_the_buffer_replays_from_its_start() {
    let (_guest, agent, s) = setup().await;
    const TOTAL: u64 = 3 * 1024 * 1024;
    let big = Live::exec(
        &agent,
        &s,
        pb::ExecStart {
            argv: vec![
                "head".into(),
                "-c".into(),
                TOTAL.to_string(),
                "/dev/zero".into(),
            ],
            ..Default::default()
        },
    )
    .await;
    let exec_id = big.exec_id.clone();
    drop(big);
    // Follow it to its end (this stream keeps up: nothing it has not read
    // is dropped), to know it ended.
    let (mut follow, at) = Live::attach(&agent, &s, &exec_id, 0).await.expect("attach");
    assert_eq!(at.lost_bytes, at.start_offset);
    assert_eq!(follow.finish().await.status, code(0));
    assert_eq!(follow.offset, TOTAL, "the follower read to the end");

    // Replay after the end: the newest 1 MiB (and at most a chunk more).
    let (mut replay, at) = Live::attach(&agent, &s, &exec_id, 0).await.expect("attach");
    assert_eq!(at.end_offset, TOTAL);
    let kept = TOTAL - at.start_offset;
    assert!(
        (1024 * 1024..=1024 * 1024 + 64 * 1024).contains(&kept),
        "{kept} bytes kept"
    );
    assert_eq!(at.lost_bytes, at.start_offset);
    assert_eq!(replay.finish().await.status, code(0));
    assert_eq!(replay.output.len() as u64, kept);
    assert!(replay.output.iter().all(|b| *b == 0));
    let info = list(&agent, &s).await;
    let me = info.iter().find(|i| i.exec_id == exec_id).unwrap();
    assert_eq!(
        (me.output_bytes, me.output_start_offset),
        (TOTAL, at.start_offset)
    );
}
