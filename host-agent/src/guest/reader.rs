//! The reader task of a guest channel: decodes the guest's frames and
//! routes each message (exec output, asks, audit, bundle chunks, control).

use super::*;

fn exec_id_of(m: &GuestMessage) -> Option<&str> {
    Some(match m.kind.as_ref()? {
        Out::ExecStarted(e) => &e.exec_id,
        Out::Output(o) => &o.exec_id,
        Out::ExecExited(e) => &e.exec_id,
        Out::ExecRejected(e) => &e.exec_id,
        Out::Error(e) if !e.exec_id.is_empty() => &e.exec_id,
        _ => return None,
    })
}

/// The reader task: decodes frames and routes messages.
pub(super) struct Reader {
    pub(super) shared: Arc<Shared>,
    pub(super) control: broadcast::Sender<GuestMessage>,
    pub(super) out: mpsc::WeakSender<HostMessage>,
    pub(super) audit: Option<AuditChain>,
    pub(super) session_id: String,
    /// What becomes of asks, for the session's events.
    pub(super) notices: mpsc::Sender<AskNotice>,
}

impl Reader {
    pub(super) async fn run(mut self, mut r: tokio::net::unix::OwnedReadHalf) {
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            loop {
                match dec.next_frame() {
                    Ok(Some(payload)) => match decode_payload::<GuestMessage>(&payload) {
                        Ok(m) => self.route(m).await,
                        Err(_) => metrics::guest_dropped("malformed"),
                    },
                    Ok(None) => break,
                    Err(FrameError::Oversize { .. }) => metrics::guest_dropped("oversize"),
                    Err(FrameError::Malformed(_)) => metrics::guest_dropped("malformed"),
                }
            }
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => dec.push(&buf[..n]),
            }
        }
        let mut g = self.shared.routes();
        g.closed = true;
        g.execs.clear();
        g.bundle = None;
        g.files = Default::default();
    }

    /// Tells the guest something without waiting: a guest that does not read
    /// its channel only loses these messages.
    fn reply(&self, m: In) {
        let sent = self
            .out
            .upgrade()
            .is_some_and(|out| out.try_send(kind(m)).is_ok());
        if !sent {
            metrics::guest_dropped("reply_not_sent");
        }
    }

    fn refuse(&self, code: Code, message: String) {
        self.reply(In::Error(GuestError {
            code: code as i32,
            message,
            exec_id: String::new(),
        }));
    }

    async fn route(&mut self, m: GuestMessage) {
        if let Some(id) = exec_id_of(&m).map(str::to_string) {
            return self.route_exec(id, m).await;
        }
        match m.kind {
            Some(Out::AskRequest(a)) => {
                // Accepted, it is also shown in the Exec stream of the
                // command waiting on it.
                if let Some(exec_id) = self.route_ask(a.clone()) {
                    let m = GuestMessage {
                        kind: Some(Out::AskRequest(a)),
                    };
                    self.route_exec(exec_id, m).await;
                }
            }
            Some(Out::AuditEvent(a)) => {
                let Some(chain) = self.audit.as_mut() else {
                    metrics::guest_dropped("unexpected");
                    return;
                };
                if let Some(v) = chain.accept(&self.session_id, a) {
                    tracing::warn!(session = %self.session_id, reason = v.reason, detail = %v.detail, "guest audit refused");
                    self.refuse(Code::Protocol, v.detail.clone());
                    self.shared.violation.send_if_modified(|cur| {
                        cur.is_none() && {
                            *cur = Some(v);
                            true
                        }
                    });
                }
            }
            Some(Out::File(f)) => self.route_file(f),
            Some(Out::BundleChunk(c)) => {
                let tx = self.shared.routes().bundle.clone();
                match tx {
                    Some(tx) => {
                        if tx.send(c).await.is_err() {
                            metrics::guest_dropped("bundle_unrequested");
                        }
                    }
                    None => metrics::guest_dropped("bundle_unrequested"),
                }
            }
            kind => {
                let m = GuestMessage { kind };
                if m.encoded_len() > limits::MAX_CONTROL_BYTES {
                    metrics::guest_dropped("control_too_large");
                } else {
                    // Keeps the newest CONTROL_QUEUE; a waiter sees the older ones as lost.
                    let _ = self.control.send(m);
                }
            }
        }
    }

    async fn route_exec(&mut self, id: String, m: GuestMessage) {
        let ends = matches!(
            m.kind,
            Some(Out::ExecExited(_) | Out::ExecRejected(_) | Out::Error(_))
        );
        // Why the command ended, for an ask it leaves unanswered: taken
        // only from the message that ends it (not on every output chunk).
        let ended_why = ends.then(|| match &m.kind {
            Some(Out::ExecRejected(r)) => r.reason.clone(),
            Some(Out::Error(e)) => e.message.clone(),
            _ => "the command ended".to_string(),
        });
        let tx = self.shared.routes().execs.get(&id).cloned();
        match tx {
            Some(tx) => {
                if !self.deliver(&tx, m).await {
                    self.shared.routes().execs.remove(&id);
                }
            }
            None => metrics::guest_dropped("unexpected"),
        }
        if ends {
            // An ask still held here was never answered (an answer takes it).
            let unanswered: Vec<PendingAsk> = {
                let mut g = self.shared.routes();
                g.execs.remove(&id);
                let (gone, kept): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut g.asks)
                    .into_iter()
                    .partition(|(_, a)| a.ask.exec_id == id);
                g.asks = kept;
                gone.into_values().collect()
            };
            for ask in unanswered {
                self.notice(AskNotice::Unanswered {
                    ask,
                    why: ended_why.clone().unwrap_or_default(),
                });
            }
        }
    }

    /// Hands `m` to an exec's client, waiting (not reading the channel) while
    /// its queue is full. False when the client is gone.
    async fn deliver(&self, tx: &mpsc::Sender<GuestMessage>, m: GuestMessage) -> bool {
        let m = match tx.try_send(m) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(m)) => m,
        };
        let mut draining = self.shared.draining.subscribe();
        if *draining.borrow() {
            metrics::guest_dropped("exec_output_after_stop");
            return false;
        }
        self.shared.backpressured.store(true, Ordering::Relaxed);
        let sent = tokio::select! {
            r = tx.send(m) => r.is_ok(),
            _ = draining.wait_for(|d| *d) => {
                metrics::guest_dropped("exec_output_after_stop");
                false
            }
        };
        self.shared.backpressured.store(false, Ordering::Relaxed);
        sent
    }

    /// Hands `n` to whoever records the session's events, never waiting.
    fn notice(&self, n: AskNotice) {
        if self.notices.try_send(n).is_err() {
            metrics::guest_dropped("ask_notice");
        }
    }

    /// Holds `a` for an answer; returns its command's exec id when it was
    /// accepted (a refused ask is rejected to the guest at once).
    fn route_ask(&mut self, a: AskRequest) -> Option<String> {
        let refused = {
            let mut g = self.shared.routes();
            if !g.execs.contains_key(&a.exec_id) {
                Some("unexpected")
            } else if a.encoded_len() > limits::MAX_ASK_BYTES {
                Some("ask_too_large")
            } else if g.asks.len() >= limits::MAX_PENDING_ASKS && !g.asks.contains_key(&a.ask_id) {
                Some("asks_full")
            } else {
                let pending = PendingAsk {
                    ask: a.clone(),
                    asked_at: now_ms(),
                };
                let new = g.asks.insert(a.ask_id.clone(), pending.clone()).is_none();
                drop(g);
                if new {
                    self.notice(AskNotice::Asked(pending));
                }
                None
            }
        };
        if let Some(why) = refused {
            metrics::guest_dropped(why);
            // The command waiting for it is not left hanging.
            if a.ask_id.len() <= 128 {
                self.reply(In::Answer(Answer {
                    ask_id: a.ask_id,
                    reply: Reply::Reject as i32,
                }));
            }
            return None;
        }
        Some(a.exec_id)
    }
}
