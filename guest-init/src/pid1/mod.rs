//! PID 1 duties: mounts, hostname, network, orphan reaping, and shutdown.
//!
//! Boot: mount the pseudo file systems ([`mounts`]), set the hostname and
//! bring up `lo` and `eth0` from the kernel command line ([`cmdline`],
//! [`net`]), start the reaper, then serve the session channel on vsock.
//! Shutdown (the host's Shutdown message or SIGTERM): SIGTERM to every
//! process, SIGKILL to what is left after a grace period, sync, power off.
//! Everything is logged to the console (stderr of PID 1).

pub mod cmdline;
pub mod mounts;
pub mod net;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::agent::{self, Config};
use crate::channel::ListenAddr;
use crate::reaper;

/// Gives PID 1 the standard PATH when it has none: the kernel starts init
/// with almost no environment, and the tools guest-init runs itself (`nft`
/// in /usr/sbin) must be found. Call before any thread is started.
pub fn set_default_path() {
    if std::env::var_os("PATH").is_none() {
        // set_var is sound while no other thread reads the environment: this
        // runs first thing in main, before the runtime or any thread exists.
        std::env::set_var("PATH", crate::exec::BASE_PATH);
    }
}

/// How PID 1 runs; the defaults are a guest's, tests override them.
#[derive(Debug, Clone)]
pub struct Options {
    /// Directory the pseudo file systems are mounted under ("/" in a guest).
    pub root: PathBuf,
    /// Mount the pseudo file systems.
    pub mounts: bool,
    /// Configure lo and eth0.
    pub network: bool,
    /// Where to serve the session channel (`None`: vsock, at the port the
    /// kernel command line names, read once /proc is mounted).
    pub listen: Option<ListenAddr>,
    /// Session workspace.
    pub workspace: PathBuf,
    /// State directory.
    pub state_dir: PathBuf,
    /// Power off at the end (else exit, for tests in a PID namespace).
    pub poweroff: bool,
    /// Install egress rules.
    pub apply_egress: bool,
    /// Hosts file for allowed names.
    pub hosts_file: PathBuf,
    /// Hostname to set, if any.
    pub hostname: Option<String>,
    /// Set the clock from the host's time (a guest; off where the "guest"
    /// shares the host's clock, as in tests).
    pub set_clock: bool,
    /// The machine is guest-init's: a session's size may take vCPUs
    /// offline and grow the root filesystem (off for PID 1 in a test's PID
    /// namespace, whose CPUs and disks are the test machine's).
    pub own_machine: bool,
}

impl Options {
    /// A guest's settings; the kernel command line's overrides (vsock
    /// port, hostname, `ip=`) are applied by [`run`] once it can read them.
    pub fn guest() -> Self {
        Self {
            root: PathBuf::from("/"),
            mounts: true,
            network: true,
            listen: None,
            workspace: PathBuf::from("/workspace"),
            state_dir: PathBuf::from("/run/guest-init"),
            poweroff: true,
            apply_egress: true,
            hosts_file: PathBuf::from("/etc/hosts"),
            hostname: None,
            set_clock: true,
            own_machine: true,
        }
    }
}

/// Runs PID 1 until shutdown; returns only when `poweroff` is false.
pub fn run(opts: Options) -> std::io::Result<()> {
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "guest-init starting");
    if opts.mounts {
        for e in mounts::mount_all(&opts.root) {
            tracing::warn!(error = %e, "mount failed");
        }
    }
    // Read once /proc is mounted: the kernel starts init without it (and an
    // initramfs unmounts its own before switch_root), so a command line read
    // before the mounts is empty, and `ip=` (and its hostname) would be lost.
    let cmd = cmdline::Cmdline::read();
    let hostname = opts.hostname.clone().or_else(|| cmd.hostname.clone());
    if let Some(h) = &hostname {
        if let Err(e) = net::set_hostname(h) {
            tracing::warn!(error = %e, hostname = %h, "cannot set hostname");
        }
    }
    if opts.network {
        net::configure(&cmd, &opts.root);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        tokio::spawn(reaper::run());
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let cfg = Config {
            workspace: opts.workspace.clone(),
            state_dir: opts.state_dir.clone(),
            identity: crate::privilege::agent_identity(
                std::fs::read_to_string("/etc/passwd")
                    .ok()
                    .and_then(|p| crate::privilege::lookup_user(&p, crate::privilege::AGENT_USER)),
            ),
            turn_backend: crate::turn::detect(),
            apply_egress: opts.apply_egress,
            hosts_file: opts.hosts_file.clone(),
            max_frame: proto::framing::DEFAULT_MAX_FRAME,
            set_clock: opts.set_clock,
            own_machine: opts.own_machine,
        };
        let listen = opts
            .listen
            .clone()
            .unwrap_or(ListenAddr::Vsock(cmd.vsock_port));
        let mut transport = listen.bind()?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            if term.recv().await.is_some() {
                tracing::info!("SIGTERM: shutting down");
                let _ = stop_tx.send(true);
            }
        });
        let why = agent::serve_until(transport.as_mut(), cfg, stop_rx).await?;
        tracing::info!(?why, "session agent stopped");
        Ok::<(), std::io::Error>(())
    })?;
    stop_everything(Duration::from_secs(2));
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    if opts.poweroff {
        tracing::info!("powering off");
        // SAFETY: reboot(2) with a valid command; returns only on failure.
        unsafe { libc::reboot(libc::RB_POWER_OFF) };
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// SIGTERM to every other process, then SIGKILL after `grace`; reaps them.
pub fn stop_everything(grace: Duration) {
    let me = reaper::self_pid();
    let others = || {
        reaper::all_processes()
            .into_iter()
            .filter(|p| p.pid != me && p.state != 'Z' && p.pid != 1)
            .count()
    };
    // SAFETY: kill(2) with pid -1 signals every process we may signal, except ourselves.
    unsafe { libc::kill(-1, libc::SIGTERM) };
    let until = Instant::now() + grace;
    while others() > 0 && Instant::now() < until {
        reap_all();
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: as above, with SIGKILL.
    unsafe { libc::kill(-1, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(50));
    reap_all();
}

fn reap_all() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid(2) for any child without blocking; `status` is a valid out pointer.
        let rc = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if rc <= 0 {
            break;
        }
    }
}
