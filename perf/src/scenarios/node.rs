//! A real host-agent for the session scenarios: the release `host-agent`
//! next to this perf binary, serving gRPC on a loopback port over a state
//! directory of its own, with the vmm under test, as a node runs it (each
//! vmm jailed when perf runs as root, unjailed otherwise). perf is its
//! client, as a control plane is.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{PerfError, Result};
use crate::runner::Context;

/// Awaits a host-agent gRPC call and takes its message out of the
/// response, or gives a [`PerfError::Rpc`] naming `$call`. (A macro: the
/// tonic types it handles come with `proto`'s generated clients, which perf
/// uses without naming them.)
macro_rules! rpc {
    ($call:literal, $fut:expr) => {
        $fut.await
            .map(|r| r.into_inner())
            .map_err(|s| $crate::error::PerfError::Rpc {
                call: $call,
                code: i32::from(s.code()),
                code_name: format!("{:?}", s.code()),
                message: s.message().to_string(),
            })
    };
}
pub(crate) use rpc;

/// Registers `image_id` (the test guest `kernel`, `cmdline`, `mem_mib`,
/// 1 vCPU) and builds its golden snapshot (50 ms settle), as the session
/// scenarios all start; returns the built image.
pub async fn register_with_golden(
    images: &mut proto::hostagent::images_client::ImagesClient<tonic::transport::Channel>,
    image_id: &str,
    kernel: &Path,
    cmdline: &str,
    mem_mib: u32,
) -> Result<proto::hostagent::Image> {
    rpc!(
        "RegisterImage",
        images.register_image(proto::hostagent::RegisterImageRequest {
            image_id: image_id.into(),
            kernel_path: kernel.display().to_string(),
            cmdline: cmdline.into(),
            mem_mib,
            vcpus: 1,
            ..Default::default()
        })
    )?;
    rpc!(
        "BuildGoldenSnapshot",
        images.build_golden_snapshot(proto::hostagent::BuildGoldenSnapshotRequest {
            image_id: image_id.into(),
            settle_ms: 50,
            ..Default::default()
        })
    )
}

/// Stops session `$id` and deletes it, through the Sessions client
/// `$sessions`.
macro_rules! dispose {
    ($sessions:expr, $id:expr) => {
        async {
            let call = || proto::hostagent::SessionCall {
                session_id: $id.to_string(),
                idempotency_key: String::new(),
            };
            $crate::scenarios::node::rpc!("StopSession", $sessions.stop_session(call()))?;
            $crate::scenarios::node::rpc!("DeleteSession", $sessions.delete_session(call()))?;
            Ok::<(), $crate::error::PerfError>(())
        }
    };
}
pub(crate) use dispose;

/// Polls GetSession through the Sessions client `$sessions` until session
/// `$id` is RUNNING, from `$state`, the state an answer already gave; an
/// error when it is FAILED or STOPPED instead, or still not RUNNING at
/// `$deadline`. `$node` is the [`Node`], for its log.
macro_rules! wait_running {
    ($sessions:expr, $node:expr, $id:expr, $state:expr, $deadline:expr) => {
        async {
            use proto::hostagent::SessionState as S;
            let mut state: i32 = $state;
            while state != S::Running as i32 {
                if std::time::Instant::now() > $deadline
                    || state == S::Failed as i32
                    || state == S::Stopped as i32
                {
                    return Err($crate::error::PerfError::HostAgent(format!(
                        "session {} is {} instead of RUNNING; host-agent's log ends: {}",
                        $id,
                        S::try_from(state).map_or("unknown", |s| s.as_str_name()),
                        $node.log_tail()
                    )));
                }
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                state = $crate::scenarios::node::rpc!(
                    "GetSession",
                    $sessions.get_session(proto::hostagent::SessionRef {
                        session_id: $id.to_string(),
                    })
                )?
                .state;
            }
            Ok::<(), $crate::error::PerfError>(())
        }
    };
}
pub(crate) use wait_running;

/// The gRPC status code UNIMPLEMENTED: the host-agent has no such call.
pub const UNIMPLEMENTED: i32 = 12;

/// `host-agent` next to this perf binary (`target/<profile>/`).
pub fn binary() -> Option<PathBuf> {
    let p = std::env::current_exe().ok()?.parent()?.join("host-agent");
    p.is_file().then_some(p)
}

/// Why the session scenarios cannot run here, if they cannot.
pub fn unavailable(ctx: &Context) -> Option<String> {
    // host-agent restores every session from a snapshot.
    if let Some(why) = ctx.backends.first().and_then(|b| b.restore_unsupported()) {
        return Some(why);
    }
    // host-agent drives the vmm of its own release (vmm-api's protocol and
    // command lines), not a stand-in or another release's.
    let want = format!("vmm {}", env!("CARGO_PKG_VERSION"));
    let said = Command::new(&ctx.vmm)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout);
            text.lines().next().map(|l| l.trim().to_string())
        })
        .unwrap_or_default();
    if said != want {
        return Some(format!(
            "skipped: host-agent drives the vmm of its own release ({want}); {} says {said:?}",
            ctx.vmm.display()
        ));
    }
    if binary().is_none() {
        return Some(
            "skipped: host-agent is not built next to perf (cargo build --release -p \
             host-agent, the same profile as perf)"
                .into(),
        );
    }
    if std::fs::metadata("/dev/kvm").is_err() {
        return Some("skipped: no /dev/kvm".into());
    }
    None
}

/// Whether this process runs as root (host-agent jails its vmms then).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A running host-agent; stopped (with every session it runs) when dropped.
pub struct Node {
    child: Child,
    /// Its gRPC address, `http://127.0.0.1:PORT`.
    pub addr: String,
    state: PathBuf,
    log: PathBuf,
}

impl Node {
    /// Starts host-agent on a new state directory under `dir`, allowing
    /// images from `image_root`.
    pub fn start(ctx: &Context, dir: &Path, image_root: &Path) -> Result<Node> {
        Node::start_with(ctx, dir, image_root, &[])
    }

    /// As [`Node::start`], with more `serve` flags (`--nats URL`, ...).
    pub fn start_with(
        ctx: &Context,
        dir: &Path,
        image_root: &Path,
        extra: &[String],
    ) -> Result<Node> {
        let Some(bin) = binary() else {
            return Err(PerfError::HostAgent("no host-agent next to perf".into()));
        };
        let state = dir.join("state");
        let log = dir.join("host-agent.log");
        let log_file = std::fs::File::create(&log).map_err(PerfError::io("cannot create", &log))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--state-dir")
            .arg(&state)
            .arg("--vmm")
            .arg(&ctx.vmm)
            .arg("--allow-unauthenticated-local")
            .arg("--allowed-image-root")
            .arg(image_root)
            .arg("--stop-sessions-on-shutdown")
            .args(extra);
        if !is_root() {
            // The jail needs root; host-agent refuses to start without it
            // unless told to run its vmms unjailed.
            cmd.arg("--no-jail");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .map_err(|source| PerfError::Spawn { path: bin, source })?;
        let Some(stdout) = child.stdout.take() else {
            return Err(PerfError::HostAgent("no stdout pipe".into()));
        };
        // Reads the address line, then keeps the pipe drained.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for _ in lines {}
        });
        let mut node = Node {
            child,
            addr: String::new(),
            state,
            log,
        };
        let first = rx.recv_timeout(Duration::from_secs(60));
        match first {
            Ok(Some(Ok(line))) if line.starts_with("host-agent listening on ") => {
                node.addr = format!("http://{}", &line["host-agent listening on ".len()..]);
                Ok(node)
            }
            _ => Err(PerfError::HostAgent(format!(
                "host-agent serve did not start; its log ends: {}",
                node.log_tail()
            ))),
        }
    }

    /// The serial log of session `id`'s vmm (in its jail when jailed).
    pub fn serial_log(&self, id: &str) -> PathBuf {
        let dir = self.state.join("sessions").join(id);
        let jailed = dir.join("jail/run/serial.log");
        if jailed.exists() {
            jailed
        } else {
            dir.join("serial.log")
        }
    }

    /// The last lines of host-agent's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(5).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SIGTERM: host-agent stops every session and exits.
        // SAFETY: kill(2) on the child this harness started.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_processes_naming(&self.state);
    }
}

/// SIGKILLs every process whose command line names `dir` (vmm processes a
/// killed host-agent left behind).
fn kill_processes_naming(dir: &Path) {
    let needle = dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(&needle) {
                // SAFETY: kill(2) has no memory-safety preconditions; the
                // process names this run's own state directory.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// Lines of `path` from byte `from` on that contain `needle`.
pub fn count_lines(path: &Path, from: usize, needle: &str) -> usize {
    let bytes = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(bytes.get(from..).unwrap_or_default())
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Waits until `path` holds `n` lines containing `needle` after byte `from`.
pub async fn wait_lines(
    path: &Path,
    from: usize,
    needle: &str,
    n: usize,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while count_lines(path, from, needle) < n {
        if Instant::now() > deadline {
            return Err(PerfError::HostAgent(format!(
                "{} did not show {n} {needle:?} lines within {} s (raise --timeout-secs if the \
                 machine is slow)",
                path.display(),
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Length of the file at `path` (0 when it does not exist).
pub fn len(path: &Path) -> usize {
    std::fs::metadata(path).map_or(0, |m| m.len() as usize)
}

/// The test guest `name` (`guests::COUNTER`, ...) and the folder it lies
/// in, which host-agent is given as its image root so the guest can be
/// registered as an image.
pub fn guest_and_image_root(name: &str) -> Result<(PathBuf, PathBuf)> {
    let kernel = crate::guests::path(name)?;
    let root = kernel
        .parent()
        .ok_or_else(|| PerfError::HostAgent(format!("the {name} guest has no folder")))?
        .to_path_buf();
    Ok((kernel, root))
}

/// A tokio runtime for one scenario's gRPC calls.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| PerfError::HostAgent(format!("tokio runtime: {e}")))
}
