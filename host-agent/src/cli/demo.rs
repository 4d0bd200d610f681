//! `host-agent demo`: the main job on built-in defaults, for a first look.
//!
//! Starts a host-agent of its own on a temporary state directory, registers
//! a test guest as an image, builds its golden snapshot, creates a session
//! from it, prints the lifecycle events and the per-second usage records as
//! they arrive, pauses, resumes, snapshots and stops the session, and ends
//! with a short summary. Everything goes through the gRPC API, as a control
//! plane's calls would.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, images_client::ImagesClient, sessions_client::SessionsClient,
    usage_client::UsageClient,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::transport::Channel;

/// Options of `host-agent demo`.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// The guest kernel to register (the bundled counting test guest:
    /// `cargo run --release -q -p test-guests -- counter` prints its path).
    #[arg(long)]
    kernel: PathBuf,
    /// The vmm binary (default: `vmm` beside this executable).
    #[arg(long)]
    vmm: Option<PathBuf>,
    /// How long the session runs between steps, seconds.
    #[arg(long, default_value_t = 2)]
    step_seconds: u64,
    /// Keep the state directory (database, logs, snapshots) afterwards.
    #[arg(long)]
    keep: bool,
}

const IMAGE: &str = "demo";

/// The daemon this demo started; killed with the demo.
struct Daemon {
    child: tokio::process::Child,
    state: PathBuf,
    keep: bool,
}

impl Daemon {
    async fn start(vmm: &Path, kernel: &Path, keep: bool) -> Result<(Daemon, String), String> {
        let state = std::env::temp_dir().join(format!("agentvm-demo-{}", std::process::id()));
        std::fs::create_dir_all(&state).map_err(|e| format!("{}: {e}", state.display()))?;
        let log_path = state.join("host-agent.log");
        let log =
            std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let exe = std::env::current_exe().map_err(|e| format!("finding host-agent itself: {e}"))?;
        let kernel_dir = kernel.parent().unwrap_or(Path::new("/"));
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("serve")
            .arg("--state-dir")
            .arg(state.join("state"))
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--vmm")
            .arg(vmm)
            .arg("--allow-unauthenticated-local")
            .arg("--allowed-image-root")
            .arg(kernel_dir);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            // The jail needs root; without it the demo runs unjailed, as
            // `serve` refuses to do unless told.
            cmd.arg("--no-jail");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting host-agent serve: {e}"))?;
        let stdout = child.stdout.take().ok_or("host-agent's stdout")?;
        let mut daemon = Daemon { child, state, keep };
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        let addr = match first {
            Ok(Ok(Some(line))) => line
                .strip_prefix("host-agent listening on ")
                .map(|a| format!("http://{a}")),
            _ => None,
        };
        let Some(addr) = addr else {
            let _ = daemon.child.kill().await;
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            return Err(format!(
                "host-agent serve did not start: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ));
        };
        // Keep reading its stdout so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok((daemon, addr))
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on the child this demo started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await;
        let _ = self.child.kill().await;
        if self.keep {
            println!("state kept in {}", self.state.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.state);
        }
    }
}

fn status(e: tonic::Status) -> String {
    format!("{:?}: {}", e.code(), e.message())
}

fn step(what: &str) {
    println!("==> {what}");
}

/// Prints every lifecycle event of the node as it arrives, until aborted
/// (an open Watch stream would hold up the daemon's graceful shutdown).
fn follow_events(ch: Channel) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(resp) = EventsClient::new(ch)
            .watch(pb::WatchRequest {
                since_seq: 0,
                ..Default::default()
            })
            .await
        else {
            return;
        };
        let mut stream = resp.into_inner();
        while let Ok(Some(e)) = stream.message().await {
            let detail = if e.detail.is_empty() {
                String::new()
            } else {
                format!("  ({})", e.detail)
            };
            println!(
                "    event  #{:<3} {:>9} -> {:<9} {}{detail}",
                e.seq,
                state_name(e.from),
                state_name(e.to),
                e.reason
            );
        }
    })
}

fn state_name(s: i32) -> &'static str {
    host_agent::sessions::state_name(s)
}

/// The session's usage records, printed as they are recorded.
struct UsageFeed<'a> {
    ch: &'a Channel,
    session: String,
    /// Newest record printed so far.
    last: Option<pb::UsageRecord>,
}

impl UsageFeed<'_> {
    /// Prints the records newer than the last one printed.
    async fn poll(&mut self) -> Result<(), String> {
        let since = self.last.as_ref().map_or(0, |r| r.seq);
        let recs = UsageClient::new(self.ch.clone())
            .list_usage(pb::ListUsageRequest {
                session_id: self.session.clone(),
                since_seq: since,
                ..Default::default()
            })
            .await
            .map_err(status)?
            .into_inner()
            .records;
        for r in recs {
            println!(
                "    usage  #{:<3} billed {:>6.2} s   vCPU {:>6.2} s   memory {:>7.4} GiB·s{}",
                r.seq,
                r.billed_seconds,
                r.vcpu_seconds,
                r.memory_allocated_gib_seconds,
                if r.r#final { "   (final)" } else { "" }
            );
            self.last = Some(r);
        }
        Ok(())
    }

    /// Lets the session run for `secs`, printing usage as it is recorded.
    async fn run_for(&mut self, secs: u64) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(500)).await;
            self.poll().await?;
        }
        Ok(())
    }
}

/// Runs the demo.
pub async fn run_demo(a: DemoArgs) -> Result<(), String> {
    let kernel = std::fs::canonicalize(&a.kernel)
        .map_err(|e| format!("--kernel {}: {e}", a.kernel.display()))?;
    let vmm = match a.vmm {
        Some(v) => v,
        None => std::env::current_exe()
            .map_err(|e| format!("finding host-agent itself: {e}"))?
            .with_file_name("vmm"),
    };
    if !vmm.is_file() {
        return Err(format!(
            "no vmm at {} (build it: cargo build --release -p vmm, or pass --vmm)",
            vmm.display()
        ));
    }
    step("starting host-agent on a temporary state directory");
    let (daemon, addr) = Daemon::start(&vmm, &kernel, a.keep).await?;
    println!(
        "    listening on {addr}; its log: {}",
        daemon.state.join("host-agent.log").display()
    );
    let result = demo_steps(&addr, &kernel, a.step_seconds).await;
    step("stopping host-agent");
    daemon.stop().await;
    result
}

async fn demo_steps(addr: &str, kernel: &Path, secs: u64) -> Result<(), String> {
    let ch = host_agent::connect(addr, None).await?;
    let mut images = ImagesClient::new(ch.clone());

    step(&format!(
        "registering image {IMAGE:?}: {}",
        kernel.display()
    ));
    images
        .register_image(pb::RegisterImageRequest {
            image_id: IMAGE.into(),
            kernel_path: kernel.display().to_string(),
            cmdline: "interval=100000000".into(),
            mem_mib: 64,
            vcpus: 1,
            ..Default::default()
        })
        .await
        .map_err(status)?;

    step("building its golden snapshot (boot, settle, pause, full snapshot)");
    let t = Instant::now();
    let image = images
        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: IMAGE.into(),
            ..Default::default()
        })
        .await
        .map_err(status)?
        .into_inner();
    let golden_s = t.elapsed().as_secs_f64();
    println!(
        "    golden snapshot in {golden_s:.2} s: {}",
        image.golden_snapshot_dir
    );

    let events = follow_events(ch.clone());
    let result = session_steps(&ch, golden_s, secs).await;
    events.abort();
    result
}

async fn session_steps(ch: &Channel, golden_s: f64, secs: u64) -> Result<(), String> {
    let mut sessions = SessionsClient::new(ch.clone());
    step("creating a session (restored from the golden snapshot)");
    let t = Instant::now();
    let s = sessions
        .create_session(pb::CreateSessionRequest {
            image_id: IMAGE.into(),
            ..Default::default()
        })
        .await
        .map_err(status)?
        .into_inner();
    let create_ms = t.elapsed().as_secs_f64() * 1000.0;
    println!(
        "    session {} is {} in {create_ms:.0} ms (vmm pid {})",
        s.session_id,
        state_name(s.state),
        s.vmm_pid
    );
    let id = s.session_id.clone();
    let call = || pb::SessionCall {
        session_id: id.clone(),
        idempotency_key: String::new(),
    };
    let mut usage = UsageFeed {
        ch,
        session: id.clone(),
        last: None,
    };
    usage.run_for(secs).await?;

    step("pausing (billing stops while paused)");
    sessions
        .pause_session(pb::PauseSessionRequest {
            session_id: id.clone(),
            ..Default::default()
        })
        .await
        .map_err(status)?;
    usage.run_for(secs.min(1)).await?;
    step("resuming");
    sessions.resume_session(call()).await.map_err(status)?;
    usage.run_for(secs).await?;

    step("taking a full snapshot of the session");
    let snap = sessions
        .snapshot_session(call())
        .await
        .map_err(status)?
        .into_inner();
    println!(
        "    {} ({} pages written)",
        snap.snapshot_dir, snap.pages_written
    );
    usage.run_for(secs.min(1)).await?;

    step("stopping the session");
    let stopped = sessions
        .stop_session(call())
        .await
        .map_err(status)?
        .into_inner();
    // The final usage record follows the stop.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !usage.last.as_ref().is_some_and(|r| r.r#final) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        usage.poll().await?;
    }
    // Let the last events print.
    tokio::time::sleep(Duration::from_millis(300)).await;

    step("summary");
    let (billed, vcpu) = usage
        .last
        .as_ref()
        .map_or((0.0, 0.0), |r| (r.billed_seconds, r.vcpu_seconds));
    println!("    golden snapshot build   {golden_s:>8.2} s");
    println!("    create to RUNNING       {create_ms:>8.0} ms");
    println!("    billed                  {billed:>8.2} s");
    println!("    vCPU                    {vcpu:>8.2} s");
    println!(
        "    final state             {:>8} ({})",
        state_name(stopped.state),
        stopped.reason
    );
    Ok(())
}
