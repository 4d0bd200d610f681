//! CreateSession: the checks, the session row, and getting it a VM (a warm
//! VM, or a restore of the golden snapshot, with the fallbacks and the one
//! retry described on `start_vm`).

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

impl Manager {
    /// Creates a session from an image's golden snapshot (or a warm VM) and
    /// returns it RUNNING. A retry with the same idempotency key returns the
    /// same session.
    pub async fn create(self: &Arc<Self>, p: CreateParams) -> Result<SessionRow> {
        let image = match self.store.image(&p.image_id)? {
            Some(image) => image,
            // An image this node lacks comes from the fleet's image store.
            None => match self.fleet.get().filter(|f| f.has_image_store()) {
                Some(fleet) => fleet.image_or_pull(self, &p.image_id).await?,
                None => return Err(Error::not_found("image", &p.image_id)),
            },
        };
        let fp = p.fingerprint();
        // The session's limits: the image's, with its overrides. A VM of the
        // warm pool runs with the image's, so a session that changes them
        // is restored cold.
        let limits = crate::io_limits::IoLimits::decode(&image.io_limits)?
            .overridden_by(&p.io_limits, p.may_loosen_limits)?;
        let disk_bytes = crate::launch::golden_disk_bytes(&image);
        let size = resources::Resources::requested(
            p.resources.as_ref(),
            &image,
            disk_bytes,
            self.cfg.jailed(),
        )?;
        // The session's shares: the image's (checked again: the roots or
        // the directories may have changed) with its own.
        let image_shares = self.image_shares(&image);
        let mut checked = image_shares.clone();
        crate::shares::resolve(
            self.share_roots.as_ref(),
            "the image's shares",
            &mut checked,
        )?;
        let shares = crate::shares::merge(&checked, &p.shares)?;
        // The golden snapshot has the image's shares' devices: a session
        // with other tags boots the image instead.
        let boot = !crate::shares::same_devices(&shares, &image_shares);
        if boot && !image.source_session.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "image {:?} was made from session {}: its sessions start from its snapshot, \
                 whose shares are {:?}; a session cannot change them",
                image.id,
                image.source_session,
                crate::shares::tags(&image_shares)
            )));
        }
        // Warm VMs are restored with the image's limits, size and shares
        // (an image made from a session has none).
        let warm = limits.encode() == image.io_limits
            && size.is_image_default(&image, disk_bytes)
            && image.source_session.is_empty()
            && shares == image_shares;
        let image = ImageRow {
            io_limits: limits.encode(),
            ..image
        };
        let sess = {
            let _g = self.create_lock.lock().await;
            if !p.idempotency_key.is_empty() {
                if let Some((method, f, resp)) = self.store.idempotent(&p.idempotency_key)? {
                    if method != "CreateSession" || f != fp {
                        return Err(Error::invalid(format!(
                            "idempotency key {:?} was used for a different request ({method})",
                            p.idempotency_key
                        )));
                    }
                    let id = String::from_utf8_lossy(&resp).to_string();
                    drop(_g);
                    return self.settled(&id).await;
                }
            }
            if image.golden_dir.is_empty() {
                return Err(Error::FailedPrecondition(format!(
                    "image {:?} has no golden snapshot yet; call BuildGoldenSnapshot first",
                    image.id
                )));
            }
            if image.guest_init
                && (p.repository.is_empty() || p.agent.is_empty() || p.base_ref.is_empty())
            {
                return Err(Error::invalid(format!(
                    "image {:?} runs guest-init: repository_path, agent and base_ref are required",
                    image.id
                )));
            }
            if image.guest_init
                && !std::path::Path::new(&p.repository).join(".git").exists()
                && !std::path::Path::new(&p.repository).join("HEAD").exists()
            {
                return Err(Error::invalid(format!(
                    "repository_path {:?} is not a git repository on this node",
                    p.repository
                )));
            }
            let live = self.live_count();
            if live >= self.cfg.max_sessions as usize {
                return Err(Error::ResourceExhausted(format!(
                    "node is at its limit of {} live sessions; stop or delete one first",
                    self.cfg.max_sessions
                )));
            }
            let (_, mem_used) = self.used_resources();
            let mem_limit = self.memory_limit_mib();
            if mem_limit > 0 && mem_used + u64::from(size.mem_mib) > mem_limit {
                return Err(Error::ResourceExhausted(format!(
                    "node memory: {mem_used} MiB of {mem_limit} MiB (the node's memory x \
                     memory_overcommit_ratio {}) are committed to live sessions; this session \
                     needs {} MiB more",
                    self.cfg.memory_overcommit_ratio, size.mem_mib
                )));
            }
            let id = uuid::Uuid::new_v4().to_string();
            let now = now_ms();
            // The session holds the layer its memory descends from, so the
            // golden snapshot stays while the session may need it (a pause
            // to disk writes a diff over it). A booted one descends from none.
            let golden = match boot {
                true => None,
                false => self.layers.golden(&image)?,
            };
            let base = match golden {
                Some(g) => {
                    self.layers
                        .hold(&g.id, &crate::layers::session_holder(&id))?;
                    g.id
                }
                None => String::new(),
            };
            let row = SessionRow {
                id: id.clone(),
                image_id: image.id.clone(),
                state: S::Unspecified as i32,
                execution_id: uuid::Uuid::new_v4().to_string(),
                created_at: now,
                dir: self.session_dir(&id),
                ttl_s: if p.ttl_s > 0 {
                    p.ttl_s
                } else {
                    self.cfg.default_ttl_seconds
                },
                idle_s: if p.idle_s > 0 {
                    p.idle_s
                } else {
                    self.cfg.default_idle_timeout_seconds
                },
                labels: p.labels.clone(),
                last_activity: now,
                repository: p.repository.clone(),
                agent: p.agent.clone(),
                base_ref: p.base_ref.clone(),
                owner: p.owner.clone(),
                io_limits: image.io_limits.clone(),
                resources: size.encode(),
                base_layer: base,
                auto_resume: p.auto_resume,
                shares: crate::shares::encode(&shares),
                ..Default::default()
            };
            if !p.idempotency_key.is_empty() {
                self.store.put_idempotent(
                    &p.idempotency_key,
                    "CreateSession",
                    &fp,
                    id.as_bytes(),
                    now,
                )?;
            }
            // Made from a session's snapshot: its chain of layers (checked
            // before anything is recorded), and the guest becomes this
            // session as a fork does.
            let template = match image.source_session.is_empty() {
                true => None,
                false => Some(self.layers.chain(&row.base_layer).inspect_err(|_| {
                    let holder = crate::layers::session_holder(&row.id);
                    let _ = self.layers.release(Some(&row.base_layer), &holder);
                })?),
            };
            let sess = self.insert_session(row, image.clone());
            sess.lock().boot = boot;
            if let Some(chain) = template {
                let mut i = sess.lock();
                i.restore_from = Some(chain);
                i.fork_of = Some(super::fork::ForkOrigin {
                    parent_session_id: image.source_session.clone(),
                    ..Default::default()
                });
                i.row.parent_session = image.source_session.clone();
            }
            sess.hold_session_env(p.session_env.clone());
            self.transition(&sess, S::Pending, "created", "")?;
            sess
        };
        let _op = sess.op.lock().await;
        let started = self.start(&sess, &image, warm).await;
        // Its secrets were for StartSession only; guest-init keeps them now.
        sess.forget_session_env();
        started?;
        Ok(sess.row())
    }

    /// Waits until the session `id` is past restoring, then returns it.
    pub(super) async fn settled(&self, id: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        sess.wait_until(
            |s| s != S::Pending as i32 && s != S::Restoring as i32 && s != S::Unspecified as i32,
            Duration::from_secs(120),
        )
        .await;
        Ok(sess.row())
    }

    pub(super) async fn start(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        warm: bool,
    ) -> Result<()> {
        self.transition(sess, S::Restoring, "restore", "")?;
        let t0 = Instant::now();
        let dir = PathBuf::from(sess.row().dir);
        let result = self.start_vm(sess, image, &dir, warm).await;
        let source = match result {
            Ok(source) => source,
            Err(e) => {
                if let Some(v) = sess.vmm() {
                    v.kill();
                }
                let _ = self.transition(sess, S::Failed, reason::RESTORE_FAILED, &e.to_string());
                return Err(e);
            }
        };
        metrics::restore_latency(t0.elapsed());
        self.transition(sess, S::Ready, "guest_running", &source)?;
        self.transition(sess, S::Running, "started", &source)?;
        Ok(())
    }

    /// Gets the session a running VM whose guest is ready: a warm VM if the
    /// pool has one (and `warm`: the session runs with the image's limits),
    /// else one restored from the golden snapshot. Returns
    /// where it came from, for the READY and RUNNING events.
    ///
    /// For an image with a network, the session's egress is read first, once
    /// (a manifest that does not parse fails the session without costing a
    /// VM), and said once in its events (`network_granted`), whichever VM
    /// it ends up on.
    ///
    /// A warm VM is prepared ahead on speculation; one that fails when taken
    /// (killed, out of memory, a guest that does not come back, a network
    /// that cannot be handed over) costs the session a restore from the
    /// golden snapshot, not its start. A VM
    /// restored from the golden snapshot whose vmm exits before its guest is
    /// ready (a guest fault) is restored once more. Each such failure is
    /// logged with the vmm's last lines, counted, and said in the result;
    /// any other failure (no disk, no uid, no vmm binary, a guest that
    /// refuses the session) ends the attempt at once.
    pub(super) async fn start_vm(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        dir: &Path,
        warm: bool,
    ) -> Result<String> {
        let grant = match self.network_for(image)? {
            Some(node) => Some(Grant {
                node,
                egress: self.initial_egress(&sess.row()).await?,
                noted: AtomicBool::new(false),
            }),
            None => None,
        };
        let mut failures = Vec::new();
        let taken = if warm {
            self.pool.take(&image.id, dir)
        } else {
            None
        };
        if let Some(taken) = taken {
            let network = taken.network.map(crate::pool::WarmNetwork::into_vm);
            if let Some(vm) = &network {
                // The session owns it from here: after a failure, the
                // restore that follows replaces it, or the session's end
                // releases it.
                sess.lock().network = Some(vm.clone());
            }
            // Handed over while the warm VM resumes.
            let hand_over = async {
                match (&grant, network) {
                    (None, _) => Ok(()),
                    (Some(grant), Some(vm)) => self
                        .hand_over_network(sess, dir, grant, vm)
                        .await
                        .map_err(|e| {
                            Error::Network(format!("its network could not be handed over: {e}"))
                        }),
                    (Some(_), None) => {
                        Err(Error::Network("it was restored without a network".into()))
                    }
                }
            };
            match self.try_vm(sess, image, taken.vmm, true, hand_over).await {
                Ok(()) => return Ok("from a warm VM".into()),
                Err((e, _)) => {
                    metrics::warm_fallback();
                    tracing::warn!(
                        session = %sess.id,
                        error = %e,
                        "the warm VM failed when taken; restoring from the golden snapshot"
                    );
                    failures.push(format!("the warm VM failed: {e}"));
                }
            }
        }
        let mut retried = false;
        loop {
            let vm = self.spawn_cold(sess, image, dir, grant.as_ref()).await?;
            let ready = std::future::ready(Ok(()));
            match self.try_vm(sess, image, vm, false, ready).await {
                Ok(()) => break,
                Err((e, true)) if !retried => {
                    retried = true;
                    metrics::restore_retry();
                    tracing::warn!(
                        session = %sess.id,
                        error = %e,
                        "the restored VM or its guest went away before the guest was ready; restoring once more"
                    );
                    failures.push(format!("a restore failed: {e}"));
                }
                Err((e, _)) => return Err(e),
            }
        }
        let (top, booted) = {
            let i = sess.lock();
            let top = i
                .restore_from
                .as_ref()
                .and_then(|c| c.last())
                .map(|l| l.id.clone());
            (top, i.boot)
        };
        let from = match top {
            Some(id) => format!("from snapshot layer {id}"),
            None if booted => "booted (its shares are not the golden snapshot's devices)".into(),
            None => "from the golden snapshot".into(),
        };
        Ok(if failures.is_empty() {
            from
        } else {
            format!("{from} ({})", failures.join("; "))
        })
    }

    /// Records `grant` as session `sess`'s policy, kept in `dir` (again for
    /// each VM tried: a failed VM's directory is emptied), and says what it
    /// was granted in its events the first time only.
    fn keep_grant(&self, sess: &Session, dir: &Path, grant: &Grant) -> Result<()> {
        self.start_policy(sess, dir, &grant.egress)?;
        self.note_grant_once(sess, grant)
    }

    /// Says in session `sess`'s events what it was granted
    /// (`network_granted`), unless that is said already.
    fn note_grant_once(&self, sess: &Session, grant: &Grant) -> Result<()> {
        if !grant.noted.load(Ordering::Acquire) {
            self.note_granted(sess, &grant.egress)?;
            grant.noted.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Gives session `sess` the network `vm` of the warm VM it took (made
    /// ahead with an empty allowlist, kept under the name it was made with,
    /// and already recorded as the session's): its policy kept in `dir`,
    /// then, at the same time, loaded into the namespace (one nft
    /// transaction) and its resolver started.
    ///
    /// Runs while the warm VM resumes: until the policy is in, its guest
    /// reaches nothing (the namespace's rules allow nothing yet), and the
    /// session is RUNNING only once both are done (`try_vm`).
    async fn hand_over_network(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        dir: &Path,
        grant: &Grant,
        vm: VmNetwork,
    ) -> Result<()> {
        let t0 = Instant::now();
        self.start_policy(sess, dir, &grant.egress)?;
        let mut policy = grant.node.policy().clone();
        policy.allow = grant.egress.allow.clone();
        // Started first, on the blocking pool: the longest part.
        let applied = vm.clone();
        let rules = tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            applied.update_policy(&policy, true).map(|()| t.elapsed())
        });
        let t1 = Instant::now();
        let resolver = async {
            self.attach_network(sess, vm)?;
            self.note_grant_once(sess, grant)?;
            self.start_resolver(sess).await?;
            Ok::<_, Error>(t1.elapsed())
        };
        let (rules, resolver) = tokio::join!(rules, resolver);
        let nft = rules.map_err(|e| Error::Network(format!("the network task failed: {e}")))??;
        let dns = resolver?;
        tracing::debug!(
            session = %sess.id,
            elapsed_us = t0.elapsed().as_micros() as u64,
            nft_us = nft.as_micros() as u64,
            resolver_us = dns.as_micros() as u64,
            "the warm VM's network is the session's"
        );
        Ok(())
    }

    /// Makes `vmm` the session's and records it.
    pub(super) fn adopt_vmm(&self, sess: &Session, vmm: &Arc<VmmProcess>) -> Result<()> {
        let mut i = sess.lock();
        i.vmm = Some(vmm.clone());
        i.row.vmm_pid = vmm.pid;
        i.row.vmm_start_ticks = vmm.start_ticks;
        i.row.jail_uid = vmm.jail_uid.unwrap_or(0);
        i.row.fs_daemons = vmm.fs.encode();
        self.store.put_session(&i.row)
    }

    /// Brings up the session on `vm` (`resume` for a warm VM restored
    /// paused), then its guest channel, while `alongside` runs (a warm VM's
    /// network hand-over): it has worked when both have. The vmm is watched
    /// only then. If either fails, the other is abandoned, the VM killed,
    /// its directory emptied and its uid given back, so the caller can try
    /// another; the flag says whether the VM or its guest went away by
    /// itself (exited, or closed the channel) rather than refused or timed
    /// out: another VM from the same snapshot may do.
    pub(super) async fn try_vm(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        vm: VmmProcess,
        resume: bool,
        alongside: impl std::future::Future<Output = Result<()>>,
    ) -> std::result::Result<(), (Error, bool)> {
        let vmm = Arc::new(vm);
        let bring_up = async {
            self.adopt_vmm(sess, &vmm)?;
            if resume {
                vmm.resume().await?;
            }
            supervisor::wait_for_state(&vmm, VmState::Running, Duration::from_secs(60)).await?;
            if image.guest_init {
                let conn = self.start_guest(sess).await?;
                sess.lock().guest = Some(Arc::new(conn));
            }
            Ok::<(), Error>(())
        };
        // The first error ends both (`alongside` first: it starts its
        // longest part at once).
        let attempt = async { tokio::try_join!(alongside, bring_up).map(|_| ()) };
        let result = tokio::select! {
            r = attempt => r,
            status = vmm.wait() => Err(Error::Vmm(format!("{status}: {}", vmm.log_tail()))),
        };
        let Err(e) = result else {
            self.watch_exit(sess.clone(), vmm);
            return Ok(());
        };
        // A VM that ended closes its guest's channel before its exit is
        // reaped, and a guest whose init died reboots (panic=1) a moment
        // after: give the exit that long, so that the error is the VM's.
        let guest_gone = matches!(e, Error::GuestGone(_));
        let e = match e {
            Error::GuestGone(_) => match tokio::time::timeout(EXIT_GRACE, vmm.wait()).await {
                Ok(status) => Error::Vmm(format!("{status}: {}", vmm.log_tail())),
                Err(_) => e,
            },
            e => e,
        };
        let lost = guest_gone || vmm.exit_status().is_some();
        // The VM's directory goes below: a guest that went away or never
        // answered is explained by its console, so the error keeps its end.
        let e = with_console(e, &vmm.console_tail());
        {
            let mut i = sess.lock();
            i.vmm = None;
            i.guest = None;
            i.row.vmm_pid = 0;
            i.row.vmm_start_ticks = 0;
            i.row.fs_daemons.clear();
            // The uid goes back to the range below, not with the session
            // (were it to fail, it would be released twice).
            i.row.jail_uid = 0;
        }
        vmm.kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), vmm.wait()).await;
        let _ = std::fs::remove_dir_all(&vmm.dir);
        if let Some(uid) = vmm.jail_uid {
            self.jail_uids.release(uid);
        }
        Err((e, lost))
    }

    /// A new vmm restoring the golden snapshot into `dir` (or booting the
    /// image, for a session whose shares are not the snapshot's devices),
    /// its shares' virtiofsd started first; not yet adopted.
    pub(super) async fn spawn_cold(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        dir: &Path,
        grant: Option<&Grant>,
    ) -> Result<VmmProcess> {
        if sess.lock().boot {
            return self.spawn_boot(sess, image, dir, grant).await;
        }
        let uid = self.allocate_jail_uid()?;
        // Recorded at once: a failure before the vmm is adopted fails the
        // session, which gives the uid back.
        {
            let mut i = sess.lock();
            i.row.jail_uid = uid.unwrap_or(0);
            self.store.put_session(&i.row)?;
        }
        let size = resources::Resources::decode(&sess.row().resources);
        let grow_to = size.map_or(0, |s| s.disk_mib << 20);
        // A fork's VM (or one of an image made from a session) restores a
        // chain of layers, its disk the one kept with the top layer.
        let chain = sess.lock().restore_from.clone();
        let disk_from = match chain.as_ref().and_then(|c| c.last()) {
            Some(top) => PathBuf::from(&top.dir),
            None => PathBuf::from(&image.golden_dir),
        };
        crate::launch::prepare_disk_from(image, &disk_from, dir, uid, grow_to).await?;
        let netns = match grant {
            Some(grant) => Some(self.session_network(sess, dir, uid, grant).await?),
            None => None,
        };
        let (args, mut jail) = restore_launch(
            &self.cfg,
            image,
            dir,
            false,
            match &chain {
                Some(chain) => Source::Chain(chain),
                None => Source::Golden,
            },
            uid,
            netns.as_deref(),
        );
        if let (Some(jail), Some(size)) = (jail.as_mut(), size) {
            jail.cpu_max = size.cpu_max();
        }
        let mut command = args.into();
        let fs = self
            .launch_shares(dir, uid, &self.shares_of(sess), &mut command)
            .await?;
        supervisor::spawn(
            &self.vmm_path,
            dir,
            command,
            jail.as_ref(),
            netns.as_deref(),
            fs,
        )
    }

    /// Makes the network of the session's VM in `dir`, with the policy of
    /// `grant` (the tap owned by the jail's `uid`); returns the namespace.
    /// Kept with the session, released when it ends.
    pub(super) async fn session_network(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        dir: &Path,
        uid: Option<u32>,
        grant: &Grant,
    ) -> Result<String> {
        let id = vmm_api::command::jail_id(dir);
        // Kept before the network exists, so a restarted host-agent finds
        // the policy of every network it finds.
        self.keep_grant(sess, dir, grant)?;
        // A retried restore (its vmm is gone), or one after a warm VM that
        // failed, gets a fresh network: the tap's owner is the new vmm's uid.
        let earlier = sess.lock().network.take();
        let node = grant.node.clone();
        let allow = grant.egress.allow.clone();
        let vm = tokio::task::spawn_blocking(move || {
            if let Some(old) = earlier {
                node.release(&old);
            }
            node.make(&id, uid.map(|u| (u, u)), &allow)
        })
        .await
        .map_err(|e| Error::Network(format!("the network task failed: {e}")))??;
        let netns = vm.netns.clone();
        self.attach_network(sess, vm)?;
        self.start_resolver(sess).await?;
        Ok(netns)
    }
}

/// What a session being started is granted (its egress, read once) on the
/// node's network, and whether its events say so yet.
pub(super) struct Grant {
    node: Arc<NodeNetwork>,
    egress: crate::network::grants::SessionEgress,
    noted: AtomicBool,
}

/// How long a bring-up whose guest went away waits for the vmm's exit: a
/// guest kernel that panicked reboots after a second (`panic=1`).
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// A guest error, vmm exit or time-out with the end of the guest's console added
/// (the same kind of error, so its gRPC code is unchanged).
fn with_console(e: Error, console: &str) -> Error {
    if console.is_empty() {
        return e;
    }
    let add = |m: String| format!("{m}; the guest's console ends: {console}");
    match e {
        Error::Guest(m) => Error::Guest(add(m)),
        Error::GuestGone(m) => Error::GuestGone(add(m)),
        Error::Timeout(m) => Error::Timeout(add(m)),
        Error::Vmm(m) => Error::Vmm(add(m)),
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_errors_carry_the_console_and_keep_their_kind() {
        let console = "Kernel panic - not syncing";
        let Error::Guest(m) = with_console(Error::Guest("closed".into()), console) else {
            panic!("not a guest error");
        };
        assert_eq!(
            m,
            "closed; the guest's console ends: Kernel panic - not syncing"
        );
        assert!(matches!(
            with_console(Error::Timeout("late".into()), console),
            Error::Timeout(m) if m.ends_with(console)
        ));
        assert!(matches!(
            with_console(Error::Vmm("exited".into()), console),
            Error::Vmm(m) if m.ends_with(console)
        ));
        assert!(matches!(
            with_console(Error::Network("no tap".into()), console),
            Error::Network(m) if m == "no tap"
        ));
        assert!(matches!(
            with_console(Error::Guest("closed".into()), ""),
            Error::Guest(m) if m == "closed"
        ));
    }
}
