//! The session's guest channel: connecting to guest-init over vsock,
//! starting the session in it (the base-ref bundle, Ready), opening the
//! channel again later, and fetching the branch back at Stop.

use super::*;

impl Manager {
    /// Connects to the session's guest-init over vsock and exchanges Hello,
    /// within `timeout`. A connection whose Hello has not come in
    /// [`guest::limits::HELLO_ATTEMPT`] is given up for a new one: the guest
    /// may have dropped it without a word (a vsock reset on the guest's side
    /// tells the host nothing), and guest-init takes a new connection over
    /// from an old one.
    pub(super) async fn connect_guest(
        &self,
        sess: &Session,
        timeout: Duration,
    ) -> Result<GuestConn> {
        guest::open_retrying(timeout, guest::limits::HELLO_ATTEMPT, |left, hello| {
            self.connect_guest_once(sess, left, hello)
        })
        .await
    }

    /// One connection to the session's guest-init: connecting retries for
    /// up to `timeout`, the guest's Hello is awaited for `hello_timeout`.
    async fn connect_guest_once(
        &self,
        sess: &Session,
        timeout: Duration,
        hello_timeout: Duration,
    ) -> Result<GuestConn> {
        // A socket of the vmm's own vsock device must be served by that vmm.
        // Without that process (exited, not started yet) nothing is connected to.
        let peer = if self.cfg.vsock_device {
            Some(sess.vmm().and_then(|v| v.sample_pid()).ok_or_else(|| {
                Error::Guest(format!(
                    "session {} has no running vmm to reach its guest through",
                    sess.id
                ))
            })?)
        } else {
            None
        };
        let stream = guest::connect_retry(
            &self.cfg.vsock_path(&self.run_dir(sess)),
            self.cfg.guest_port,
            peer,
            timeout,
        )
        .await?;
        let audit = guest::AuditSink {
            store: self.store.clone(),
            max_bytes: self.cfg.max_audit_bytes_per_session,
        };
        let conn = GuestConn::open(stream, &sess.id, Some(audit), hello_timeout).await?;
        if let Some(notices) = conn.take_ask_notices() {
            self.record_asks(sess, notices);
        }
        Ok(conn)
    }

    /// Opens the guest channel and starts the session in guest-init:
    /// StartSession, the repository as a git bundle, then waits for Ready.
    pub(super) async fn start_guest(&self, sess: &Session) -> Result<GuestConn> {
        let fork_of = sess.lock().fork_of.clone();
        if let Some(origin) = fork_of {
            return self.fork_guest(sess, &origin).await;
        }
        let row = sess.row();
        let (secret_allowlist, secrets, env) = self.session_env_for(sess, &row).await?;
        let timeout = Duration::from_secs(self.cfg.guest_ready_timeout_seconds);
        let conn = self.connect_guest(sess, timeout).await?;
        // Only the base ref (and what it needs) goes in: never the other
        // branches of the repository, other sessions' among them.
        let repo = Repo::open(&row.repository)?;
        let dir = PathBuf::from(&row.dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let path = dir.join("repo.bundle");
        let sizing = guest_sizing(&sess.lock().image, &row.resources);
        let sent = async {
            let base = repo.write_base_bundle(&row.base_ref, &path).await?;
            conn.send(In::StartSession(StartSession {
                host_time_unix_ns: unix_now_ns(),
                session_id: sess.id.clone(),
                agent: row.agent.clone(),
                base_ref: base.base_ref.clone(),
                bundle_size: base.size,
                secret_allowlist,
                secrets,
                env,
                // At most 86400 s (Config::validate): fits in u32 ms.
                ask_timeout_ms: (self.cfg.ask_timeout_seconds * 1000) as u32,
                entropy: fresh_entropy()?,
                mounts: self.shares_of(sess).iter().map(|s| s.to_mount()).collect(),
                ..sizing
            }))
            .await?;
            send_file_chunks(&conn, &path).await
        }
        .await;
        let _ = std::fs::remove_file(&path);
        sent?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match conn.next_control_before(deadline).await?.kind {
                Some(Out::Ready(_)) => return Ok(conn),
                Some(Out::Error(e)) => {
                    return Err(Error::Guest(format!(
                        "guest-init refused the session: {}",
                        e.message
                    )))
                }
                _ => continue,
            }
        }
    }

    /// What the session's StartSession carries of its environment and
    /// secrets: (secret_allowlist, secrets, env). Only the requested secrets
    /// that the repository's manifest (at the base ref) grants the agent
    /// are sent, so the others never leave the host; guest-init applies
    /// the grant again from its own copy of the manifest.
    async fn session_env_for(
        &self,
        sess: &Session,
        row: &SessionRow,
    ) -> Result<(
        Vec<String>,
        HashMap<String, String>,
        HashMap<String, String>,
    )> {
        let Some(se) = sess.lock().session_env.clone() else {
            return Ok(Default::default());
        };
        let env = se.env.clone().into_iter().collect();
        if se.secrets().is_empty() {
            return Ok((vec![], HashMap::new(), env));
        }
        let grant = super::network::manifest_of(row)
            .await?
            .map(|m| m.grant(&row.agent).secrets)
            .unwrap_or_default();
        let (names, values) = se.granted(&grant);
        let withheld: Vec<&String> = se
            .secrets()
            .names()
            .filter(|n| !names.contains(n))
            .collect();
        if !withheld.is_empty() {
            // Names only, never a value.
            tracing::info!(
                session = %sess.id,
                agent = %row.agent,
                withheld = ?withheld,
                "secrets the manifest does not grant the agent are not sent to the guest"
            );
        }
        Ok((names, values, env))
    }

    /// The session's guest channel. One this process did not open (host-agent
    /// restarted) or one that closed is opened again: guest-init keeps the
    /// session across connections and takes it back on ResumeSession.
    pub async fn guest_channel(&self, sess: &Session) -> Result<Arc<GuestConn>> {
        if let Some(c) = sess.guest().filter(|c| !c.is_closed()) {
            return Ok(c);
        }
        if !sess.guest_init() {
            return Err(Error::FailedPrecondition(format!(
                "session {} runs no guest-init, so it has no guest channel",
                sess.id
            )));
        }
        let _open = sess.guest_open.lock().await;
        if let Some(c) = sess.guest().filter(|c| !c.is_closed()) {
            return Ok(c);
        }
        let state = sess.row().state;
        if state != S::Running as i32 && state != S::Ready as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; its guest channel is opened again only while RUNNING",
                sess.id,
                state_name(state)
            )));
        }
        self.reopen_guest(sess, Duration::from_secs(10)).await
    }

    /// Opens session `sess`'s guest channel again, whatever its state (the
    /// caller has checked it may): connects, sends ResumeSession and waits
    /// up to `timeout` for Ready; the channel is the session's from then.
    /// Restores from a snapshot use it before READY; [`Self::guest_channel`]
    /// for a channel found closed.
    pub(super) async fn reopen_guest(
        &self,
        sess: &Session,
        timeout: Duration,
    ) -> Result<Arc<GuestConn>> {
        let conn = self.connect_guest(sess, timeout).await?;
        // The last event held, by seq and by the guest's own hash of it, so a
        // guest rolled back to an older snapshot can tell.
        let last = self.store.last_audit(&sess.id)?;
        let audit_seq_seen = last.as_ref().map_or(0, |a| a.guest_seq);
        let audit_hash_seen = last
            .and_then(|a| serde_json::from_str::<serde_json::Value>(&a.json).ok())
            .and_then(|v| v.get("hash").and_then(|h| h.as_str()).map(str::to_string))
            .unwrap_or_default();
        conn.send(In::ResumeSession(ResumeSession {
            session_id: sess.id.clone(),
            audit_seq_seen,
            audit_hash_seen,
            host_time_unix_ns: unix_now_ns(),
            entropy: fresh_entropy()?,
        }))
        .await?;
        // One deadline for the whole wait: other messages do not extend it.
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match conn.next_control_before(deadline).await?.kind {
                Some(Out::Ready(_)) => break,
                Some(Out::Error(e)) => {
                    return Err(Error::Guest(format!(
                        "guest-init could not resume session {}: {}",
                        sess.id, e.message
                    )))
                }
                _ => continue,
            }
        }
        let conn = Arc::new(conn);
        sess.lock().guest = Some(conn.clone());
        tracing::info!(session = %sess.id, "guest channel opened again (ResumeSession)");
        Ok(conn)
    }

    /// Fetches the session branch back into the host repository under
    /// `refs/heads/session/<id>`, then shuts the guest session down.
    /// Returns (branch, head commit).
    pub(super) async fn finish_guest(
        &self,
        sess: &Session,
        conn: &GuestConn,
    ) -> Result<(String, String)> {
        let row = sess.row();
        let branch = format!("session/{}", sess.id);
        // Clients that stopped reading their exec's output hold the channel no longer.
        conn.drop_exec_output();
        let path = PathBuf::from(&row.dir).join("branch.bundle");
        let fetched = async {
            let mut file = crate::repo::create_new(&path).await?;
            conn.fetch_branch(
                &mut file,
                self.cfg.max_branch_bundle_bytes,
                Duration::from_secs(60),
            )
            .await?;
            drop(file);
            let repo = Repo::open(&row.repository)?;
            let full = format!("refs/heads/{branch}");
            repo.fetch_bundle(&path, &full, &full).await?;
            let head = repo.run(&["rev-parse", "--verify", &full]).await?;
            Ok::<_, Error>(String::from_utf8_lossy(&head).trim().to_string())
        }
        .await;
        let _ = std::fs::remove_file(&path);
        let head = fetched?;
        let _ = conn.send(In::Shutdown(Shutdown {})).await;
        let _ = conn.next_control(Duration::from_secs(5)).await;
        Ok((branch, head))
    }
}

/// This host's wall clock, Unix nanoseconds, for the guest to set its own.
/// What StartSession tells guest-init of a session's size (`resources`, as
/// stored) within its image's VM: only what differs from the image's.
fn guest_sizing(image: &ImageRow, resources: &str) -> StartSession {
    let Some(size) = super::resources::Resources::decode(resources) else {
        return StartSession::default();
    };
    let disk = size.disk_mib << 20;
    StartSession {
        vcpus: if size.vcpus < image.vcpus {
            size.vcpus
        } else {
            0
        },
        mem_mib: if size.mem_mib < image.mem_mib {
            size.mem_mib
        } else {
            0
        },
        root_disk_bytes: if disk > crate::launch::golden_disk_bytes(image) {
            disk
        } else {
            0
        },
        ..StartSession::default()
    }
}

/// Bytes of host randomness sent with each StartSession and ResumeSession.
const ENTROPY_BYTES: usize = 64;

/// Fresh random bytes for a guest's kernel CRNG: every VM is a restore of a
/// snapshot, and guest-init reseeds from these before Ready.
pub(super) fn fresh_entropy() -> Result<Vec<u8>> {
    let mut buf = vec![0u8; ENTROPY_BYTES];
    getrandom::fill(&mut buf).map_err(|e| {
        Error::io(
            "reading the host's random bytes for the guest",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(buf)
}

pub(super) fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// Sends the file at `path` to the guest as RepoChunks, the last one marked.
pub(super) async fn send_file_chunks(conn: &GuestConn, path: &std::path::Path) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let size = file
        .metadata()
        .await
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
        .len();
    let mut left = size;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        file.read_exact(&mut buf[..want])
            .await
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        left -= want as u64;
        conn.send(In::RepoChunk(RepoChunk {
            data: buf[..want].to_vec(),
            last: left == 0,
        }))
        .await?;
        if left == 0 {
            return Ok(());
        }
    }
}
