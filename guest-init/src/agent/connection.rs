//! One connection from host-agent: the Hello exchange, reading frames
//! and dispatching them, and the messages that start, resume or end the
//! connection's session (StartSession and the repository bundle,
//! ResumeSession, ForkSession, Shutdown).

use super::*;

/// A StartSession whose bundle is still arriving.
pub(super) struct PendingStart {
    req: StartSession,
    path: PathBuf,
    file: tokio::fs::File,
    received: u64,
}

/// Serves one connection. `detached` is a session an earlier connection left;
/// it can be resumed here. `superseded` fires when a newer connection from
/// the host takes over: this one then ends as if it had closed. Returns why
/// guest-init should stop (if it should), and the session to keep for the
/// next connection if this one closed or was superseded.
pub(super) async fn handle_connection(
    conn: Connection,
    cfg: Arc<Config>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    detached: Option<Arc<Session>>,
    superseded: tokio::sync::oneshot::Receiver<()>,
) -> (Option<Stop>, Option<Arc<Session>>) {
    let (rd, wr) = tokio::io::split(conn);
    let (tx, mut rx) = mpsc::channel::<GuestMessage>(1024);
    let max = cfg.max_frame;
    let writer = tokio::spawn(async move {
        let mut w = FrameWriter::new(wr, max);
        while let Some(m) = rx.recv().await {
            if let Err(e) = w.send(&m).await {
                tracing::warn!(error = %e, "dropping connection: write failed");
                break;
            }
        }
    });
    let mut reader = FrameReader::new(rd, cfg.max_frame);
    let mut conn = Conn {
        cfg,
        out: tx,
        hello: false,
        pending: None,
        session: None,
        detached,
        files: Default::default(),
    };
    let mut was_superseded = false;
    let stop = tokio::select! {
        s = conn.run(&mut reader) => s,
        _ = stop.wait_for(|s| *s) => Some(Stop::Signalled),
        Ok(()) = superseded => {
            was_superseded = true;
            None
        }
    };
    let kept = match stop {
        Some(Stop::Shutdown) => {
            conn.end_session("shutdown").await;
            None
        }
        Some(Stop::Signalled) => {
            conn.end_session("guest-init stopping (SIGTERM)").await;
            None
        }
        None => conn.detach_session().await,
    };
    drop(conn);
    if was_superseded {
        // Nobody reads the old connection any more: what it still has
        // queued is audited and goes out again on the new one.
        writer.abort();
    } else {
        // Let queued messages go out, then drop the connection.
        let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    }
    (stop, kept)
}

pub(super) struct Conn {
    cfg: Arc<Config>,
    pub(super) out: Outbox,
    hello: bool,
    pending: Option<PendingStart>,
    session: Option<Arc<Session>>,
    /// A session an earlier connection left, until resumed or replaced.
    detached: Option<Arc<Session>>,
    /// Open file requests (see `files`).
    pub(super) files: super::files::FileOps,
}

impl Conn {
    pub(super) async fn send(&self, m: impl Into<GuestMessage>) {
        let _ = self.out.send(m.into()).await;
    }

    pub(super) async fn run<R: AsyncRead + Unpin>(
        &mut self,
        reader: &mut FrameReader<R>,
    ) -> Option<Stop> {
        loop {
            let incoming = match reader.next().await {
                Ok(Some(i)) => i,
                Ok(None) => return None,
                Err(e) => {
                    tracing::warn!(error = %e, "connection read failed");
                    return None;
                }
            };
            let m = match incoming {
                Ok(HostMessage { kind: Some(k) }) => k,
                Ok(HostMessage { kind: None }) => {
                    self.send(error(Code::Malformed, "message has no known kind (empty frame, or a message type this guest does not know)", "")).await;
                    continue;
                }
                Err(e @ FrameError::Oversize { .. }) => {
                    self.send(error(
                        Code::Oversize,
                        format!("{e}; the frame was discarded"),
                        "",
                    ))
                    .await;
                    continue;
                }
                Err(e) => {
                    self.send(error(
                        Code::Malformed,
                        format!("{e}; the frame was discarded"),
                        "",
                    ))
                    .await;
                    continue;
                }
            };
            if !self.hello {
                match m {
                    In::Hello(h) if h.protocol_version == PROTOCOL_VERSION => {
                        self.hello = true;
                        self.send(msg(Out::Hello(Hello {
                            protocol_version: PROTOCOL_VERSION,
                            software: format!("guest-init {}", env!("CARGO_PKG_VERSION")),
                        })))
                        .await;
                    }
                    In::Hello(h) => {
                        self.send(error(
                            Code::UnsupportedVersion,
                            format!("host speaks protocol version {}, this guest speaks {PROTOCOL_VERSION}; closing", h.protocol_version),
                            "",
                        ))
                        .await;
                        return None;
                    }
                    _ => {
                        self.send(error(
                            Code::Protocol,
                            format!("send Hello with protocol_version {PROTOCOL_VERSION} first"),
                            "",
                        ))
                        .await
                    }
                }
                continue;
            }
            if let Some(stop) = self.dispatch(m).await {
                return Some(stop);
            }
        }
    }

    pub(super) fn session(&self) -> Result<Arc<Session>, Failure> {
        self.session.clone().ok_or_else(|| {
            error(
                Code::Protocol,
                "no session: send StartSession and the repository bundle first",
                "",
            )
        })
    }

    pub(super) async fn dispatch(&mut self, m: In) -> Option<Stop> {
        match m {
            In::Error(e) => {
                tracing::warn!(code = e.code, message = %e.message, "the host refused a message of this guest");
            }
            In::Hello(_) => {
                self.send(error(Code::Protocol, "Hello was already exchanged", ""))
                    .await
            }
            In::ForkSession(f) => {
                if let Err(e) = self.fork(&f).await {
                    self.send(e).await;
                }
            }
            In::StartSession(req) => {
                if let Err(e) = self.start(req).await {
                    self.send(e).await;
                }
            }
            In::RepoChunk(c) => {
                if let Err(e) = self.repo_chunk(c.data, c.last).await {
                    self.send(e).await;
                }
            }
            In::Exec(e) => match self.session() {
                Ok(s) => {
                    tokio::spawn(s.exec(e));
                }
                Err(mut m) => {
                    m.exec_id = e.exec_id;
                    self.send(m).await
                }
            },
            In::Stdin(d) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.stdin(&d.exec_id, d.data, d.eof).await {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::Signal(sig) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.signal(&sig.exec_id, sig.signal).await {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::Resize(r) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.resize(&r.exec_id, r.size) {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::EndTurn(t) => match self.session() {
                Ok(s) => {
                    tokio::spawn(async move { s.end_turn(&t.turn_id).await });
                }
                Err(m) => self.send(m).await,
            },
            In::Answer(a) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.answer(&a.ask_id, a.reply) {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::FetchBranch(_) => match self.session() {
                Ok(s) => {
                    tokio::spawn(async move { s.fetch_branch().await });
                }
                Err(m) => self.send(m).await,
            },
            In::File(r) => self.file(r).await,
            In::ResumeSession(r) => {
                if let Err(e) = self.resume(&r).await {
                    self.send(e).await;
                }
            }
            In::Shutdown(_) => {
                self.end_session("shutdown").await;
                self.send(msg(Out::ShutdownStarted(ShutdownStarted {})))
                    .await;
                return Some(Stop::Shutdown);
            }
        }
        None
    }

    pub(super) async fn start(&mut self, req: StartSession) -> Result<(), Failure> {
        if self.session.is_some() || self.pending.is_some() {
            return Err(error(
                Code::Protocol,
                "a session is already active or starting on this connection",
                "",
            ));
        }
        if let Some(old) = self.detached.take() {
            // The host starts over instead of resuming: the kept session's work goes.
            old.end("replaced by a new session; workspace cleared")
                .await;
            session::clear_dir(&self.cfg.workspace);
        }
        let bad = |m: String| error(Code::InvalidArgument, m, "");
        session::branch_for(&req.session_id).map_err(|e| bad(e.to_string()))?;
        session::check_ref(&req.base_ref).map_err(|e| bad(e.to_string()))?;
        crate::policy::rules_path(&req.agent).map_err(|e| bad(e.to_string()))?;
        if req.bundle_size == 0 || req.bundle_size > session::MAX_BUNDLE_BYTES {
            return Err(bad(format!(
                "bundle_size {} must be between 1 and {} bytes",
                req.bundle_size,
                session::MAX_BUNDLE_BYTES
            )));
        }
        // The same rule as host-agent's at CreateSession: these variables
        // reach every command without a policy decision.
        for (field, map) in [("env", &req.env), ("secrets", &req.secrets)] {
            for (k, v) in map.iter() {
                if let Some(why) = crate::policy::risky_env::session_name_problem(k) {
                    return Err(bad(format!("{field}: the name {k:?} {why}")));
                }
                if v.contains('\0') {
                    return Err(bad(format!("{field}[{k:?}]: the value holds a NUL byte")));
                }
            }
        }
        if let Some(k) = req.secrets.keys().find(|k| req.env.contains_key(*k)) {
            return Err(bad(format!("{k:?} is both in env and in secrets")));
        }
        let path = session::bundle_path(&self.cfg.state_dir, &req.session_id);
        let file = tokio::fs::File::create(&path).await.map_err(|e| {
            error(
                Code::Internal,
                format!("cannot store the bundle at {}: {e}", path.display()),
                "",
            )
        })?;
        self.pending = Some(PendingStart {
            req,
            path,
            file,
            received: 0,
        });
        Ok(())
    }

    pub(super) async fn repo_chunk(&mut self, data: Vec<u8>, last: bool) -> Result<(), Failure> {
        let Some(p) = self.pending.as_mut() else {
            return Err(error(
                Code::Protocol,
                "RepoChunk without a StartSession",
                "",
            ));
        };
        let fail = |pending: PendingStart, m: String| {
            let _ = std::fs::remove_file(&pending.path);
            error(Code::Repository, m, "")
        };
        p.received += data.len() as u64;
        if p.received > p.req.bundle_size {
            let got = p.received;
            let pending = self
                .pending
                .take()
                .ok_or_else(|| error(Code::Internal, "pending start vanished", ""))?;
            let want = pending.req.bundle_size;
            return Err(fail(pending, format!("repository bundle is larger than the declared {want} bytes (got {got}); session not started")));
        }
        if let Err(e) = p.file.write_all(&data).await {
            let pending = self
                .pending
                .take()
                .ok_or_else(|| error(Code::Internal, "pending start vanished", ""))?;
            return Err(fail(pending, format!("cannot store the bundle: {e}")));
        }
        if !last {
            return Ok(());
        }
        let pending = self
            .pending
            .take()
            .ok_or_else(|| error(Code::Internal, "pending start vanished", ""))?;
        if pending.received != pending.req.bundle_size {
            let m = format!(
                "repository bundle truncated: got {} of {} bytes; session not started",
                pending.received, pending.req.bundle_size
            );
            return Err(fail(pending, m));
        }
        let PendingStart {
            req,
            path,
            mut file,
            ..
        } = pending;
        let _ = file.flush().await;
        drop(file);
        let result = Session::open(req, &path, self.cfg.clone(), self.out.clone()).await;
        let _ = std::fs::remove_file(&path);
        let s = result?;
        self.session = Some(s);
        Ok(())
    }

    /// Re-attaches the session an earlier connection left to this one.
    pub(super) async fn resume(&mut self, req: &ResumeSession) -> Result<(), Failure> {
        let session_id = req.session_id.as_str();
        if self.session.is_some() || self.pending.is_some() {
            return Err(error(
                Code::Protocol,
                "a session is already active or starting on this connection",
                "",
            ));
        }
        match self.detached.take() {
            Some(s) if s.id == session_id => {
                s.reattach(self.out.clone(), req).await;
                self.session = Some(s);
                Ok(())
            }
            kept => {
                let what = match &kept {
                    Some(s) => format!("the kept session is {:?}", s.id),
                    None => "no session is kept".to_string(),
                };
                self.detached = kept;
                Err(error(
                    Code::Protocol,
                    format!("cannot resume session {session_id:?}: {what}"),
                    "",
                ))
            }
        }
    }

    /// Makes the session an earlier connection left (the parent, as
    /// restored from its snapshot) the new session `req.session_id` on this
    /// connection.
    pub(super) async fn fork(&mut self, req: &ForkSession) -> Result<(), Failure> {
        let parent = req.parent_session_id.as_str();
        if self.session.is_some() || self.pending.is_some() {
            return Err(error(
                Code::Protocol,
                "a session is already active or starting on this connection: ForkSession \
                 must be the first message after Hello",
                "",
            ));
        }
        match self.detached.take() {
            Some(s) if s.id == parent => match s.fork(self.out.clone(), req).await {
                Ok(child) => {
                    self.session = Some(child);
                    Ok(())
                }
                Err(e) => {
                    self.detached = Some(s);
                    Err(e)
                }
            },
            kept => {
                let what = match &kept {
                    Some(s) => format!("this guest's session is {:?}", s.id),
                    None => "this guest has no session".to_string(),
                };
                self.detached = kept;
                Err(error(
                    Code::Protocol,
                    format!("cannot fork session {parent:?}: {what}"),
                    "",
                ))
            }
        }
    }

    pub(super) async fn end_session(&mut self, why: &str) {
        if let Some(p) = self.pending.take() {
            let _ = std::fs::remove_file(&p.path);
        }
        if let Some(s) = self.session.take() {
            s.end(why).await;
        }
        if let Some(s) = self.detached.take() {
            s.end(why).await;
        }
    }

    /// The connection closed: a started session is kept for a resume (its
    /// turns killed); a half-received start is dropped.
    pub(super) async fn detach_session(&mut self) -> Option<Arc<Session>> {
        if let Some(p) = self.pending.take() {
            let _ = std::fs::remove_file(&p.path);
        }
        match self.session.take() {
            Some(s) => {
                s.detach().await;
                Some(s)
            }
            // Nobody resumed the earlier session on this connection; keep it.
            None => self.detached.take(),
        }
    }
}
