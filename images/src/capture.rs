//! Capturing a golden snapshot, the one way this project does it: start a
//! vmm that boots the image, wait until the guest is ready (guest-init
//! answers the Hello exchange on its vsock port, or, for guests without
//! guest-init, the VM runs and a settle time passes), pause, write a full
//! snapshot, stop the vmm. The `images golden` command and host-agent's
//! `BuildGoldenSnapshot` both call [`capture`]; what differs between them
//! (where the files go, caching, the jail-free build directory) stays with
//! each caller.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use vmm_api::command::{RunSpec, Serial};
use vmm_api::process::{file_tail, VmmChild};
use vmm_api::{Client, ControlError, SnapshotKind, SnapshotReply, VmState};

use crate::guest_channel::GuestChannel;

/// How to tell that the booted guest is ready to be snapshotted.
#[derive(Debug, Clone)]
pub enum Ready {
    /// guest-init answers the Hello exchange on `port` through the vsock
    /// socket `uds`; then `settle` passes (the guest closes its side).
    GuestInit {
        /// The host side of the guest's vsock (the vmm's, or a stand-in's).
        uds: PathBuf,
        /// guest-init's port.
        port: u32,
        /// `uds` is served by the vmm itself (its vsock device): refuse a
        /// socket served by any other process.
        served_by_vmm: bool,
        /// Time after the Hello before the pause.
        settle: Duration,
        /// Our name in the Hello.
        software: String,
    },
    /// The VM runs; then `settle` passes (guests without guest-init).
    Settle(Duration),
}

/// A boot to snapshot.
#[derive(Debug, Clone)]
pub struct Capture {
    /// The vmm binary.
    pub vmm: PathBuf,
    /// The boot; its control socket must be set.
    pub boot: RunSpec,
    /// When the guest is ready.
    pub ready: Ready,
    /// The snapshot directory to write (must not exist).
    pub snapshot_dir: PathBuf,
    /// How long the boot may take until the guest is ready.
    pub boot_timeout: Duration,
    /// Where the vmm's standard output and error go (`None`: stdout
    /// discarded, stderr inherited).
    pub vmm_log: Option<PathBuf>,
    /// Run the vmm in this network namespace (`ip netns exec`, which execs
    /// the vmm in the same process): where the boot's tap is.
    pub netns: Option<String>,
}

/// What a capture produced.
#[derive(Debug, Clone)]
pub struct Captured {
    /// The vmm's report of the snapshot.
    pub snapshot: SnapshotReply,
    /// guest-init's software string, when it answered the Hello.
    pub guest_software: Option<String>,
    /// Seconds from the vmm's start until the guest was ready.
    pub boot_seconds: f64,
}

/// Why a capture failed.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The boot has no control socket to drive it through.
    #[error("the golden boot needs a control socket")]
    NoControlSocket,
    /// The vmm could not be started.
    #[error("cannot start {vmm}: {source}")]
    Spawn {
        /// The binary.
        vmm: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The vmm's log file could not be made.
    #[error("cannot create the vmm log {path}: {source}")]
    Log {
        /// The log file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The vmm exited before the guest was ready.
    #[error("the vmm exited ({status}) before the guest was ready; {tail}")]
    Exited {
        /// Its exit status.
        status: String,
        /// The end of the console or log, to see why.
        tail: String,
    },
    /// The guest did not become ready in time.
    #[error("{what} within {timeout:?} (last: {last}); {tail}")]
    NotReady {
        /// What did not happen.
        what: String,
        /// The limit.
        timeout: Duration,
        /// The last error seen while waiting.
        last: String,
        /// The end of the console or log.
        tail: String,
    },
    /// Pausing, snapshotting or stopping failed.
    #[error("{0}")]
    Control(#[from] ControlError),
}

/// Boots `c.boot`, waits for `c.ready`, writes a full snapshot to
/// `c.snapshot_dir` and stops the vmm (killed if it does not exit). `note`
/// hears progress lines (every ten seconds while waiting).
pub fn capture(c: &Capture, note: &mut dyn FnMut(&str)) -> Result<Captured, CaptureError> {
    let control = c
        .boot
        .devices
        .control_socket
        .clone()
        .ok_or(CaptureError::NoControlSocket)?;
    let (stdout, stderr) = match &c.vmm_log {
        Some(log) => {
            let f = std::fs::File::create(log).map_err(|source| CaptureError::Log {
                path: log.clone(),
                source,
            })?;
            let f2 = f.try_clone().map_err(|source| CaptureError::Log {
                path: log.clone(),
                source,
            })?;
            (Stdio::from(f), Stdio::from(f2))
        }
        None => (Stdio::null(), Stdio::inherit()),
    };
    let (program, args) = match &c.netns {
        Some(ns) => {
            let mut a = vec!["netns".to_string(), "exec".into(), ns.clone()];
            a.push(c.vmm.display().to_string());
            a.extend(c.boot.args());
            (PathBuf::from("ip"), a)
        }
        None => (c.vmm.clone(), c.boot.args()),
    };
    let mut vm = VmmChild::spawn_with(&program, &args, stdout, stderr).map_err(|source| {
        CaptureError::Spawn {
            vmm: c.vmm.clone(),
            source,
        }
    })?;
    let tail = |lines| match (&c.boot.devices.serial, &c.vmm_log) {
        (Serial::File(console), log) => {
            let mut t = format!("console tail:\n{}", file_tail(console, lines));
            if let Some(log) = log {
                t.push_str(&format!("\nvmm log tail:\n{}", file_tail(log, 5)));
            }
            t
        }
        (_, Some(log)) => format!("vmm log tail:\n{}", file_tail(log, lines)),
        (_, None) => "the console is not kept".to_string(),
    };
    let started = Instant::now();
    let deadline = started + c.boot_timeout;
    let mut last = String::from("the vmm has not created its control socket yet");
    let mut last_note = Instant::now();
    let mut client = None;
    let mut guest_software = None;
    let settle = loop {
        if let Some(status) = vm.exited() {
            return Err(CaptureError::Exited {
                status,
                tail: tail(30),
            });
        }
        if client.is_none() {
            match Client::connect_checked(&control, Some(vm.pid()), Duration::from_secs(120)) {
                Ok(cl) => client = Some(cl),
                Err(e) => last = e.to_string(),
            }
        }
        let running = match client.as_mut().map(Client::status) {
            Some(Ok(s)) => s.state == VmState::Running,
            Some(Err(e)) => {
                last = e.to_string();
                client = None;
                false
            }
            None => false,
        };
        if running {
            match &c.ready {
                Ready::Settle(settle) => break *settle,
                Ready::GuestInit {
                    uds,
                    port,
                    served_by_vmm,
                    settle,
                    software,
                } => {
                    let peer = served_by_vmm.then(|| vm.pid());
                    let hello =
                        GuestChannel::connect_checked(uds, *port, peer, Duration::from_secs(5))
                            .and_then(|mut ch| ch.hello(software, Duration::from_secs(10)));
                    match hello {
                        Ok(h) => {
                            guest_software = Some(h.software);
                            break *settle;
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            let what = match &c.ready {
                Ready::GuestInit { port, .. } => {
                    format!("guest-init did not answer on vsock port {port}")
                }
                Ready::Settle(_) => "the VM was not running".to_string(),
            };
            return Err(CaptureError::NotReady {
                what,
                timeout: c.boot_timeout,
                last,
                tail: tail(30),
            });
        }
        if last_note.elapsed() >= Duration::from_secs(10) {
            note(&format!(
                "waiting for the guest ({}s; last: {last})",
                started.elapsed().as_secs()
            ));
            last_note = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(if running { 200 } else { 20 }));
    };
    let boot_seconds = started.elapsed().as_secs_f64();
    note(&match &guest_software {
        Some(s) => format!("guest-init ready after {boot_seconds:.1}s ({s})"),
        None => format!("running after {boot_seconds:.1}s"),
    });
    std::thread::sleep(settle);
    let result = match client.as_mut() {
        Some(cl) => cl
            .pause()
            .and_then(|_| cl.snapshot(&c.snapshot_dir, SnapshotKind::Full)),
        // The loop only ends with a client that saw the VM running.
        None => Err(ControlError::Closed { op: "pause" }),
    };
    if let Some(cl) = client.as_mut() {
        // Stop even after a failed snapshot; the kill below covers a vmm
        // that does not answer.
        let _ = cl.stop();
    }
    if vm.wait_exit(Duration::from_secs(10)).is_none() {
        note("the vmm did not exit within 10s of stop; killing it");
        vm.kill();
    }
    Ok(Captured {
        snapshot: result?,
        guest_software,
        boot_seconds,
    })
}
