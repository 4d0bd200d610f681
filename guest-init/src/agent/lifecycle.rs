//! A session's life in guest-init: opening it (clone onto its branch,
//! policy, audit log), reattaching a new connection, auditing, fetching the
//! branch back, and ending or detaching it.

use super::*;

impl Session {
    pub(super) async fn open(
        req: StartSession,
        bundle: &std::path::Path,
        cfg: Arc<Config>,
        out: Outbox,
    ) -> Result<Arc<Self>, Failure> {
        // First, so the clone, the branch and the audit log carry the right time.
        let clock = cfg
            .set_clock
            .then(|| crate::clock::sync_to(req.host_time_unix_ns));
        let redactor = Redactor::new(
            &req.secrets
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        // Before the clone: a grown disk has room for it.
        let (turns, size_note) = size_session(&req, &cfg).await?;
        // Before anything runs: this restore's own random state and name.
        let fresh = fresh_machine(&cfg, &req.session_id, &req.entropy, true)
            .map_err(|e| error(Code::Internal, format!("session not started: {e}"), ""))?;
        let branch = session::branch_for(&req.session_id)
            .map_err(|e| error(Code::InvalidArgument, e.to_string(), ""))?;
        // Before the clone: the shares the session's commands (and its
        // build) read from are there when the first one runs.
        let shares_note = mount_shares(&req, &cfg).await?;
        let ws = cfg.workspace.clone();
        let commit = session::clone_and_branch(bundle, &ws, &req.base_ref, &branch)
            .await
            .map_err(|e| {
                error(
                    Code::Repository,
                    redactor.redact(&format!("session not started: {e}")),
                    "",
                )
            })?;
        let fail = |code: Code, m: String| {
            session::clear_dir(&ws);
            error(
                code,
                redactor.redact(&format!("session not started: {m}")),
                "",
            )
        };
        // Policy comes from the base commit's objects, never the working tree.
        let mut files = HashMap::new();
        let rules_path =
            crate::policy::rules_path(&req.agent).map_err(|e| fail(Code::Policy, e.to_string()))?;
        for p in [rules_path.as_str(), crate::policy::manifest::MANIFEST_PATH] {
            let text = session::read_at(&ws, &commit, p)
                .await
                .map_err(|e| fail(Code::Policy, e.to_string()))?;
            files.insert(p.to_string(), text);
        }
        let policy = Policy::load(&req.agent, &commit, |p| Ok(files.get(p).cloned().flatten()))
            .map_err(|e| fail(Code::Policy, e.to_string()))?;
        let apply = cfg.apply_egress;
        let entries = policy.grant.egress.clone();
        let plan = tokio::task::spawn_blocking(move || {
            egress::plan(
                &entries,
                |host| if apply { resolve(host) } else { Vec::new() },
            )
        })
        .await
        .map_err(|e| fail(Code::Internal, e.to_string()))?
        .map_err(|e| fail(Code::Policy, e.to_string()))?;
        if let Some(id) = cfg.identity {
            privilege::chown_tree(&ws, id).map_err(|e| {
                fail(
                    Code::Internal,
                    format!("cannot give the workspace to uid {}: {e}", id.uid),
                )
            })?;
        }
        let audit = open_audit(&cfg, &req.session_id, redactor.clone())
            .map_err(|e| fail(Code::Internal, e.to_string()))?;
        let secrets = Secrets::scope(
            &policy.grant.secrets,
            &req.secret_allowlist,
            &req.secrets.into_iter().collect(),
        );
        let ask_timeout = match req.ask_timeout_ms {
            0 => DEFAULT_ASK_TIMEOUT,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let s = Arc::new(Self {
            id: req.session_id.clone(),
            branch: branch.clone(),
            policy,
            secrets,
            env: req.env.into_iter().collect(),
            ask_timeout,
            turns: Mutex::new(turns),
            base_commit: commit.clone(),
            cfg: cfg.clone(),
            out: Mutex::new(out),
            audit: tokio::sync::Mutex::new(audit),
            always: Mutex::new(HashSet::new()),
            asks: Mutex::new(HashMap::new()),
            exec_ids: Mutex::new(HashSet::new()),
            running: Mutex::new(HashMap::new()),
            egress_denied: Mutex::new(0),
        });
        s.audit(Entry {
            actor: "host",
            action: "session.start",
            resource: &format!("{} agent={} base={}", branch, req.agent, req.base_ref),
            decision: "",
            result: &format!("base commit {commit}"),
            turn_id: "",
        })
        .await;
        s.audit_clock(clock).await;
        s.audit_fresh(fresh).await;
        if !size_note.is_empty() {
            s.audit(Entry {
                actor: "host",
                action: "session.size",
                resource: &branch,
                result: &size_note,
                ..Default::default()
            })
            .await;
        }
        if !shares_note.is_empty() {
            s.audit(Entry {
                actor: "host",
                action: "session.shares",
                resource: &branch,
                result: &shares_note,
                ..Default::default()
            })
            .await;
        }
        if let Err(m) = s.apply_egress(&plan).await {
            s.audit(Entry {
                actor: "guest-init",
                action: "session.end",
                resource: &branch,
                result: &format!("egress rules could not be applied: {m}"),
                ..Default::default()
            })
            .await;
            session::clear_dir(&ws);
            return Err(error(Code::Policy, format!("session not started: {m}"), ""));
        }
        s.send_ready().await;
        Ok(s)
    }

    pub(super) fn outbox(&self) -> Outbox {
        lock(&self.out).clone()
    }

    pub(super) async fn send_ready(&self) {
        let backend = lock(&self.turns).backend().name().to_string();
        self.send(msg(Out::Ready(Ready {
            session_id: self.id.clone(),
            branch: self.branch.clone(),
            base_commit: self.base_commit.clone(),
            turn_backend: backend,
        })))
        .await;
    }

    /// Sends to a resumed session's new connection from now on: first the
    /// audit events after `audit_seen` (the host missed them), then Ready.
    pub(super) async fn reattach(&self, out: Outbox, req: &ResumeSession) {
        let audit_seen = req.audit_seq_seen;
        let clock = self
            .cfg
            .set_clock
            .then(|| crate::clock::sync_to(req.host_time_unix_ns));
        let mut rolled_back = None;
        {
            // The new outbox is set while the log is held, so no new event can
            // reach the host before the ones it missed.
            let mut log = self.audit.lock().await;
            *lock(&self.out) = out;
            let own = log.seq();
            let lines = match log.lines() {
                Ok(lines) => lines,
                Err(e) => {
                    tracing::error!(error = %e, "cannot read the audit log back for the host");
                    self.send(error(
                        Code::Internal,
                        format!("audit events after seq {audit_seen} cannot be sent again: {e}"),
                        "",
                    ))
                    .await;
                    Vec::new()
                }
            };
            let at_host = lines.iter().find(|l| l.seq == audit_seen);
            let diverged = audit_seen > own
                || (audit_seen > 0
                    && !req.audit_hash_seen.is_empty()
                    && at_host.map(|l| l.hash.as_str()) != Some(req.audit_hash_seen.as_str()));
            if diverged {
                // Restored from a snapshot older than what the host has seen.
                rolled_back = Some(own);
                log.skip_to(audit_seen);
            } else {
                for l in lines.into_iter().filter(|l| l.seq > audit_seen) {
                    let _ = self
                        .outbox()
                        .send(msg(Out::AuditEvent(AuditEvent {
                            seq: l.seq,
                            json: l.json,
                        })))
                        .await;
                }
            }
        }
        if let Some(own) = rolled_back {
            self.audit(Entry {
                actor: "guest-init",
                action: "session.rolled_back",
                resource: &self.branch,
                result: &format!(
                    "resumed from a snapshot: the host holds events up to seq {audit_seen} that \
                     this guest's log (at seq {own}) does not have; this guest's events after the \
                     fork stay in its log only, numbering goes on after both"
                ),
                ..Default::default()
            })
            .await;
        }
        self.audit(Entry {
            actor: "host",
            action: "session.resumed",
            resource: &self.branch,
            ..Default::default()
        })
        .await;
        self.audit_clock(clock).await;
        // A resume may be a restore of this session's snapshot: a clone.
        match fresh_machine(&self.cfg, &self.id, &req.entropy, false) {
            Ok(fresh) => self.audit_fresh(fresh).await,
            Err(e) => {
                tracing::error!(error = %e, "the restored guest's random state was not reseeded");
                self.audit(Entry {
                    actor: "guest-init",
                    action: "machine.fresh",
                    resource: &self.branch,
                    result: &e,
                    ..Default::default()
                })
                .await;
            }
        }
        tracing::info!(session = %self.id, "session resumed on a new connection");
        self.send_ready().await;
    }

    /// Records what [`fresh_machine`] did, if anything.
    pub(super) async fn audit_fresh(&self, done: Vec<String>) {
        if done.is_empty() {
            return;
        }
        self.audit(Entry {
            actor: "guest-init",
            action: "machine.fresh",
            resource: &self.branch,
            result: &done.join("; "),
            ..Default::default()
        })
        .await;
    }

    /// Records a clock step (or a failed one) from [`crate::clock::sync_to`].
    pub(super) async fn audit_clock(
        &self,
        clock: Option<Result<Option<i128>, crate::clock::ClockError>>,
    ) {
        let result = match clock {
            Some(Ok(Some(delta))) => {
                format!("moved {} to the host's time", crate::clock::describe(delta))
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "guest clock not set");
                e.to_string()
            }
            Some(Ok(None)) | None => return,
        };
        self.audit(Entry {
            actor: "guest-init",
            action: "clock.set",
            resource: "CLOCK_REALTIME",
            result: &result,
            ..Default::default()
        })
        .await;
    }

    /// Sends `m`; error messages are redacted, since they may quote input.
    pub(super) async fn send(&self, m: impl Into<GuestMessage>) {
        let mut m = m.into();
        if let Some(Out::Error(e)) = &mut m.kind {
            e.message = self.secrets.redactor().redact(&e.message);
        }
        let _ = self.outbox().send(m).await;
    }

    /// Appends to the audit log and streams the line to the host, in order.
    pub(super) async fn audit(&self, e: Entry<'_>) {
        let mut log = self.audit.lock().await;
        match log.append(e) {
            Ok((seq, json)) => {
                let _ = self
                    .outbox()
                    .send(msg(Out::AuditEvent(AuditEvent { seq, json })))
                    .await;
            }
            Err(err) => {
                tracing::error!(error = %err, "audit write failed");
                let _ = self
                    .outbox()
                    .send(
                        error(Code::Internal, format!("audit log write failed: {err}"), "").into(),
                    )
                    .await;
            }
        }
    }

    pub(super) async fn fetch_branch(&self) {
        let mut child =
            match session::bundle_branch(&self.cfg.workspace, &self.branch, self.cfg.identity) {
                Ok(c) => c,
                Err(e) => {
                    self.send(error(
                        Code::Repository,
                        format!("cannot run git bundle: {e}"),
                        "",
                    ))
                    .await;
                    return;
                }
            };
        let bundle_pid = child.id();
        let mut stderr = child.stderr.take();
        let err_task = tokio::spawn(async move {
            let mut s = Vec::new();
            if let Some(r) = stderr.as_mut() {
                let _ = r.read_to_end(&mut s).await;
            }
            s
        });
        let mut data = Vec::new();
        if let Some(mut r) = child.stdout.take() {
            let _ = r.read_to_end(&mut data).await;
        }
        let status = child.wait().await;
        reaper::release(bundle_pid);
        let stderr = err_task.await.unwrap_or_default();
        if !status.is_ok_and(|s| s.success()) {
            self.send(error(
                Code::Repository,
                format!(
                    "git bundle create {} failed: {}",
                    self.branch,
                    String::from_utf8_lossy(&stderr).trim()
                ),
                "",
            ))
            .await;
            return;
        }
        let mut chunks = data.chunks(CHUNK).peekable();
        if chunks.peek().is_none() {
            self.send(msg(Out::BundleChunk(BundleChunk {
                data: Vec::new(),
                last: true,
            })))
            .await;
        }
        while let Some(c) = chunks.next() {
            let last = chunks.peek().is_none();
            self.send(msg(Out::BundleChunk(BundleChunk {
                data: c.to_vec(),
                last,
            })))
            .await;
        }
        self.audit(Entry {
            actor: "host",
            action: "branch.fetched",
            resource: &self.branch,
            result: &format!("{} bytes", data.len()),
            ..Default::default()
        })
        .await;
    }

    /// Kills every turn and records the end of the session.
    pub(super) async fn end(&self, why: &str) {
        self.stop_turns().await;
        self.audit(Entry {
            actor: "guest-init",
            action: "session.end",
            resource: &self.branch,
            result: why,
            ..Default::default()
        })
        .await;
        tracing::info!(session = %self.id, why, "session ended");
    }

    /// The connection closed: kills every turn (nobody is left to read its
    /// output or answer its asks) and keeps the rest for a resume.
    pub(super) async fn detach(&self) {
        self.stop_turns().await;
        self.audit(Entry {
            actor: "guest-init",
            action: "session.detached",
            resource: &self.branch,
            result: "connection closed; turns killed, session kept for ResumeSession",
            ..Default::default()
        })
        .await;
        // Let go of the closed connection's outbox, so its writer ends now; what is
        // audited until a resume stays in the log and is sent again then.
        *lock(&self.out) = mpsc::channel(1).0;
        tracing::info!(session = %self.id, "connection closed; session kept for a resume");
    }
}

/// A new audit chain for session `id`: `<state-dir>/audit-<id>.jsonl`,
/// created empty, whose first record will be seq 1 after the genesis hash.
pub(super) fn open_audit(
    cfg: &Config,
    id: &str,
    redactor: Redactor,
) -> Result<AuditLog, crate::audit::AuditError> {
    let path = cfg.state_dir.join(format!("audit-{id}.jsonl"));
    AuditLog::open(Some(&path), id, redactor)
}

/// Gives the session its size within the VM (StartSession's `vcpus`,
/// `mem_mib`, `root_disk_bytes`; see [`crate::sizing`]): returns its turns
/// (with the memory limit) and what was done, for the audit log. The vCPUs
/// and the disk are the machine's: they change only where guest-init runs
/// it (`own_machine`); elsewhere they are left as they are, and said so.
async fn size_session(req: &StartSession, cfg: &Config) -> Result<(Turns, String), Failure> {
    let mut turns = Turns::new(cfg.turn_backend.clone());
    let mut done = Vec::new();
    if req.mem_mib > 0 {
        let bytes = u64::from(req.mem_mib) << 20;
        turns.limit_memory(bytes).map_err(|e| {
            error(
                Code::InvalidArgument,
                format!("session not started: mem_mib {}: {e}", req.mem_mib),
                "",
            )
        })?;
        done.push(format!("mem_mib={}", req.mem_mib));
    }
    if req.vcpus == 0 && req.root_disk_bytes == 0 {
        return Ok((turns, done.join(" ")));
    }
    if !cfg.own_machine {
        tracing::warn!(
            vcpus = req.vcpus,
            root_disk_bytes = req.root_disk_bytes,
            "not PID 1: the machine's vCPUs and disk are left as they are"
        );
        done.push("vcpus and disk left as they are (not PID 1)".into());
        return Ok((turns, done.join(" ")));
    }
    let (vcpus, disk) = (req.vcpus, req.root_disk_bytes);
    let machine = tokio::task::spawn_blocking(move || {
        let mut done = Vec::new();
        if vcpus > 0 {
            let n = crate::sizing::offline_cpus(
                std::path::Path::new("/sys/devices/system/cpu"),
                vcpus,
            )?;
            done.push(format!("vcpus={vcpus} ({n} offline)"));
        }
        if disk > 0 {
            let dev = crate::sizing::grow_root(disk, DISK_GROW_TIMEOUT)?;
            done.push(format!("root_disk_bytes={disk} ({dev})"));
        }
        Ok::<_, crate::sizing::SizingError>(done)
    })
    .await
    .map_err(|e| error(Code::Internal, e.to_string(), ""))?
    .map_err(|e| error(Code::Internal, format!("session not started: {e}"), ""))?;
    done.extend(machine);
    Ok((turns, done.join(" ")))
}

/// Mounts the session's virtio-fs shares (StartSession's `mounts`; see
/// [`crate::shares`]): returns what was done, for the audit log. They are
/// checked in every mode, but mounted only where guest-init runs the
/// machine (`own_machine`); elsewhere (a host process in tests) they are
/// left out, and said so.
async fn mount_shares(req: &StartSession, cfg: &Config) -> Result<String, Failure> {
    if req.mounts.is_empty() {
        return Ok(String::new());
    }
    let keep = [cfg.workspace.as_path(), cfg.state_dir.as_path()];
    let plan = crate::shares::plan(&req.mounts, &keep).map_err(|e| {
        error(
            Code::InvalidArgument,
            format!("session not started: {e}"),
            "",
        )
    })?;
    let what = crate::shares::describe(&plan);
    if !cfg.own_machine {
        tracing::warn!(shares = %what, "not PID 1: the session's shares are not mounted");
        return Ok(format!("not mounted (not PID 1): {what}"));
    }
    tokio::task::spawn_blocking(move || crate::shares::apply(&plan))
        .await
        .map_err(|e| error(Code::Internal, e.to_string(), ""))?
        .map_err(|e| error(Code::Internal, format!("session not started: {e}"), ""))?;
    tracing::info!(shares = %what, "shares mounted");
    Ok(format!("mounted {what}"))
}

/// How long a grown root disk may take to show its size in the guest.
const DISK_GROW_TIMEOUT: Duration = Duration::from_secs(10);

/// Makes this restore its own machine (see [`crate::clone_safety`]) where
/// guest-init runs it: reseeds the kernel's CRNG with the host's `entropy`
/// (none given: nothing to mix) and, for a new session (`identity`), names
/// the machine after session `id`. Returns what was done, for the audit
/// log; an error when the random state could not be reseeded (a clone
/// that shares its randomness with others must not run).
pub(super) fn fresh_machine(
    cfg: &Config,
    id: &str,
    entropy: &[u8],
    identity: bool,
) -> Result<Vec<String>, String> {
    use crate::clone_safety as cs;
    let mut done = Vec::new();
    if !cfg.own_machine {
        return Ok(done);
    }
    if !entropy.is_empty() {
        cs::reseed(std::path::Path::new("/dev/random"), entropy)
            .map_err(|e| format!("cannot reseed the kernel's random state: {e}"))?;
        done.push(format!(
            "CRNG reseeded with {} bytes from the host",
            entropy.len()
        ));
    }
    if !identity {
        return Ok(done);
    }
    if let Some(name) = cs::hostname_for(id) {
        match crate::pid1::net::set_hostname(&name) {
            Ok(()) => done.push(format!("hostname {name}")),
            Err(e) => tracing::warn!(error = %e, "cannot set the session's hostname"),
        }
    }
    if let Some(line) = cs::machine_id_for(id) {
        match std::fs::write("/etc/machine-id", &line) {
            Ok(()) => done.push(format!("machine-id {}", line.trim())),
            Err(e) => tracing::warn!(error = %e, "cannot write /etc/machine-id"),
        }
    }
    Ok(done)
}
