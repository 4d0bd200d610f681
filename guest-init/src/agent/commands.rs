//! The session's commands: Exec decided by the policy and run, their
//! output pumped back, stdin and signals, and the turns they belong to
//! (ended with every process killed and reported).

use super::*;

impl Session {
    pub(super) async fn reject(&self, exec_id: &str, turn_id: &str, reason: &str, rule: &str) {
        let reason = self.secrets.redactor().redact(reason);
        self.audit(Entry {
            turn_id,
            actor: "guest-init",
            action: "exec.rejected",
            resource: exec_id,
            decision: "deny",
            result: &reason,
        })
        .await;
        self.send(msg(Out::ExecRejected(ExecRejected {
            exec_id: exec_id.to_string(),
            reason,
            rule: rule.to_string(),
        })))
        .await;
    }

    pub(super) async fn exec(self: Arc<Self>, e: Exec) {
        if e.exec_id.is_empty() || e.turn_id.is_empty() {
            self.send(error(
                Code::InvalidArgument,
                "Exec needs a non-empty exec_id and turn_id",
                &e.exec_id,
            ))
            .await;
            return;
        }
        if let Some(size) = &e.pty {
            if let Err(err) = crate::pty::check_size(size.rows, size.cols) {
                self.send(error(
                    Code::InvalidArgument,
                    format!("pty: {err}"),
                    &e.exec_id,
                ))
                .await;
                return;
            }
        }
        if !lock(&self.exec_ids).insert(e.exec_id.clone()) {
            self.send(error(
                Code::InvalidArgument,
                format!("exec_id {:?} was already used in this session", e.exec_id),
                &e.exec_id,
            ))
            .await;
            return;
        }
        let cwd = match workspace::resolve_dir(&self.cfg.workspace, &e.cwd) {
            Ok(c) => c,
            Err(err) => {
                self.send(error(Code::InvalidArgument, err.to_string(), &e.exec_id))
                    .await;
                return;
            }
        };
        let always = lock(&self.always).clone();
        // The Exec's env is decided with its argv: PATH, LD_PRELOAD, GIT_* and
        // the like change what the command runs.
        let exec_env: BTreeMap<String, String> = e.env.clone().into_iter().collect();
        let ctx = crate::policy::ExecContext {
            workspace: &self.cfg.workspace,
            cwd: &cwd,
            env: &exec_env,
        };
        let decision = match self.policy.decide_exec(&e.argv, &ctx, &always) {
            Ok(d) => d,
            Err(err) => {
                self.send(error(
                    Code::InvalidArgument,
                    format!("cannot decide this command: {err}"),
                    &e.exec_id,
                ))
                .await;
                return;
            }
        };
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "agent",
            action: "exec.decided",
            resource: &decision.subject,
            decision: decision.action.as_str(),
            result: &decision.rule,
        })
        .await;
        match decision.action {
            Action::Allow => {}
            Action::Deny => {
                self.reject(&e.exec_id, &e.turn_id, "denied by policy", &decision.rule)
                    .await;
                return;
            }
            Action::Ask => {
                if !self.ask(&e, &decision).await {
                    return;
                }
            }
        }
        self.run(e, cwd).await;
    }

    pub(super) async fn run(&self, e: Exec, cwd: PathBuf) {
        let prepared = lock(&self.turns).prepare(&e.turn_id);
        let placement = match prepared {
            Ok(p) => p,
            Err(err) => {
                self.reject(
                    &e.exec_id,
                    &e.turn_id,
                    &format!("cannot create the turn's cgroup: {err}"),
                    "",
                )
                .await;
                return;
            }
        };
        let mut env = self.env.clone();
        env.extend(e.env.clone());
        for (k, v) in self.secrets.env() {
            env.insert(k.clone(), v.clone());
        }
        env.insert(crate::turn::TURN_ENV.to_string(), placement.tag.to_string());
        let spec = Spec {
            argv: e.argv.clone(),
            cwd,
            env,
            home: self.cfg.workspace.clone(),
            identity: self.cfg.identity,
            cgroup_procs: placement.cgroup_procs,
        };
        let (master, slave) = match e.pty.as_ref().map(|p| crate::pty::open(p.rows, p.cols)) {
            None => (None, None),
            Some(Ok((m, s))) => (Some(Arc::new(m)), Some(s)),
            Some(Err(err)) => {
                self.reject(&e.exec_id, &e.turn_id, &err.to_string(), "")
                    .await;
                return;
            }
        };
        let mut child = match exec::spawn_on(&spec, slave) {
            Ok(c) => c,
            Err(err) => {
                self.reject(&e.exec_id, &e.turn_id, &err.to_string(), "")
                    .await;
                return;
            }
        };
        let pid = child.id().unwrap_or(0);
        lock(&self.turns).add_root(&e.turn_id, pid);
        for name in self.secrets.names() {
            self.audit(Entry {
                turn_id: &e.turn_id,
                actor: "guest-init",
                action: "secret.delivered",
                resource: &name,
                decision: "allow",
                result: &e.exec_id,
            })
            .await;
        }
        let stdin_tx = match &master {
            // A terminal's input stays open; its EOF is a character.
            Some(m) => Some(terminal::feed(
                crate::pty::Shared(m.clone()),
                e.stdin.clone(),
                true,
                Some(crate::pty::EOF_CHAR),
            )),
            None => child.stdin.take().and_then(|w| {
                let tx = terminal::feed(w, e.stdin.clone(), e.keep_stdin_open, None);
                e.keep_stdin_open.then_some(tx)
            }),
        };
        lock(&self.running).insert(
            e.exec_id.clone(),
            Running {
                pid,
                stdin: stdin_tx,
                pty: master.clone(),
            },
        );
        let redactor = self.secrets.redactor();
        self.send(msg(Out::ExecStarted(ExecStarted {
            exec_id: e.exec_id.clone(),
            pid,
            argv: e.argv.iter().map(|a| redactor.redact(a)).collect(),
        })))
        .await;
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "agent",
            action: "exec.started",
            resource: &e.argv.join(" "),
            decision: "",
            result: &format!("pid {pid}"),
        })
        .await;
        let pumps = [
            master.map(|m| {
                tokio::spawn(pump(
                    crate::pty::Shared(m),
                    output::Stream::Stdout,
                    e.exec_id.clone(),
                    self.secrets.redactor().clone(),
                    self.outbox(),
                ))
            }),
            child.stdout.take().map(|r| {
                tokio::spawn(pump(
                    r,
                    output::Stream::Stdout,
                    e.exec_id.clone(),
                    self.secrets.redactor().clone(),
                    self.outbox(),
                ))
            }),
            child.stderr.take().map(|r| {
                tokio::spawn(pump(
                    r,
                    output::Stream::Stderr,
                    e.exec_id.clone(),
                    self.secrets.redactor().clone(),
                    self.outbox(),
                ))
            }),
        ];
        let (status, reason) = terminal::wait(&mut child, pid, e.timeout_ms).await;
        reaper::release(Some(pid));
        // A daemonised descendant may keep the pipes open: wait briefly for
        // the output that is already there, then report the exit.
        for p in pumps.into_iter().flatten() {
            let abort = p.abort_handle();
            if tokio::time::timeout(Duration::from_millis(500), p)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        lock(&self.running).remove(&e.exec_id);
        let (status, text) = match status {
            Ok(s) => {
                use std::os::unix::process::ExitStatusExt;
                match (s.code(), s.signal()) {
                    (Some(c), _) => (Some(exec_exited::Status::Code(c)), format!("exit {c}")),
                    (None, Some(sig)) => (
                        Some(exec_exited::Status::Signal(sig)),
                        format!("signal {sig}"),
                    ),
                    _ => (None, "unknown".to_string()),
                }
            }
            Err(err) => (None, format!("wait failed: {err}")),
        };
        let text = if reason.is_empty() {
            text
        } else {
            format!("{text} ({reason})")
        };
        self.send(msg(Out::ExecExited(ExecExited {
            exec_id: e.exec_id.clone(),
            status,
            reason,
        })))
        .await;
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "agent",
            action: "exec.exited",
            resource: &e.exec_id,
            decision: "",
            result: &text,
        })
        .await;
    }

    pub(super) async fn stdin(
        &self,
        exec_id: &str,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<(), Failure> {
        let tx = lock(&self.running)
            .get(exec_id)
            .map(|r| r.stdin.clone())
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    format!("no running command {exec_id:?}"),
                    exec_id,
                )
            })?
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    "stdin of this command is closed (start it with keep_stdin_open)",
                    exec_id,
                )
            })?;
        tx.send((data, eof)).await.map_err(|_| {
            error(
                Code::InvalidArgument,
                "stdin of this command is closed",
                exec_id,
            )
        })
    }

    pub(super) async fn signal(&self, exec_id: &str, sig: i32) -> Result<(), Failure> {
        if !(1..=64).contains(&sig) {
            return Err(error(
                Code::InvalidArgument,
                format!("signal {sig} is not between 1 and 64"),
                exec_id,
            ));
        }
        let (pid, pty) = lock(&self.running)
            .get(exec_id)
            .map(|r| (r.pid, r.pty.clone()))
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    format!("no running command {exec_id:?}"),
                    exec_id,
                )
            })?;
        terminal::signal(pid, pty.as_deref(), sig).map_err(|e| {
            error(
                Code::Internal,
                format!("cannot signal {exec_id}: {e}"),
                exec_id,
            )
        })?;
        self.audit(Entry {
            actor: "host",
            action: "exec.signal",
            resource: exec_id,
            result: &format!("signal {sig}"),
            ..Default::default()
        })
        .await;
        Ok(())
    }

    pub(super) async fn end_turn(&self, turn_id: &str) {
        // Commands of this turn still waiting for approval never run.
        lock(&self.asks).retain(|_, (turn, _)| turn != turn_id);
        let taken = lock(&self.turns).take(turn_id);
        let killed = match taken {
            Some((turn, others)) => {
                let managed: HashSet<u32> = reaper::managed().lock().clone();
                tokio::task::spawn_blocking(move || turn.kill(&managed, &others))
                    .await
                    .unwrap_or_default()
            }
            None => Vec::new(),
        };
        self.audit(Entry {
            turn_id,
            actor: "guest-init",
            action: "turn.killed",
            resource: &killed
                .iter()
                .map(|k| format!("{} {}", k.pid, k.command))
                .collect::<Vec<_>>()
                .join("; "),
            decision: "",
            result: &format!("killed {}", killed.len()),
        })
        .await;
        self.report_egress_denials(turn_id).await;
        self.send(msg(Out::TurnEnded(TurnEnded {
            turn_id: turn_id.to_string(),
            killed: killed
                .into_iter()
                .map(|k| KilledProcess {
                    pid: k.pid,
                    command: self.secrets.redactor().redact(&k.command),
                })
                .collect(),
        })))
        .await;
    }

    /// Ends every turn (killing its processes), sweeps orphans and drops pending asks.
    pub(super) async fn stop_turns(&self) {
        let ids = lock(&self.turns).ids();
        for id in ids {
            self.end_turn(&id).await;
        }
        lock(&self.turns).remove_parent_if_idle();
        if *lock(&self.turns).backend() == Backend::ProcessTree {
            let managed: HashSet<u32> = reaper::managed().lock().clone();
            let swept = tokio::task::spawn_blocking(move || crate::turn::sweep_orphans(&managed))
                .await
                .unwrap_or_default();
            if !swept.is_empty() {
                self.audit(Entry {
                    actor: "guest-init",
                    action: "session.orphans_killed",
                    resource: &swept
                        .iter()
                        .map(|k| format!("{} {}", k.pid, k.command))
                        .collect::<Vec<_>>()
                        .join("; "),
                    result: &format!("killed {}", swept.len()),
                    ..Default::default()
                })
                .await;
            }
        }
        lock(&self.asks).clear();
    }
}

pub(super) async fn pump(
    mut r: impl AsyncRead + Unpin,
    stream: output::Stream,
    exec_id: String,
    redactor: Redactor,
    out: Outbox,
) {
    let mut buf = vec![0u8; CHUNK];
    let mut red = redactor.stream();
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let data = red.push(&buf[..n]);
        if !data.is_empty() {
            let _ = out
                .send(msg(Out::Output(Output {
                    exec_id: exec_id.clone(),
                    stream: stream as i32,
                    data,
                })))
                .await;
        }
    }
    let rest = red.finish();
    if !rest.is_empty() {
        let _ = out
            .send(msg(Out::Output(Output {
                exec_id,
                stream: stream as i32,
                data: rest,
            })))
            .await;
    }
}
