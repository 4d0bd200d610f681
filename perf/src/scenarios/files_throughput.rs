//! files-throughput: MB/s of the Files service's upload (Write) and
//! download (Read) through the guest channel, with the stand-in guest.
//!
//! guest-init runs as a host process (`guest-init serve` on a Unix socket,
//! as in the e2e tests; a real guest needs hardware KVM) and host-agent's
//! guest channel library talks to it exactly as the Files service does: a
//! [`FileCall`] per transfer, chunks of 256 KiB sent with the guest's
//! credit, read pieces taken with the host's. What is left out is the gRPC
//! hop between a client and host-agent (measured by the e2e test's 1 GiB
//! transfer only as a bound). Each run writes a new file of the size
//! (1 GiB; 256 MiB with --quick) and reads it back; vmm only (Firecracker
//! has no guest agent to compare).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use host_agent::guest::{FileCall, GuestConn, MAX_FILE_WINDOW};
use proto::guest::{
    file_request::Op, file_response::Result as R, file_write::Mode, guest_message::Kind as Out,
    host_message::Kind as In, FileCredit, FileRead, FileWrite, RepoChunk, StartSession,
};

use crate::backend::Subject;
use crate::error::{PerfError, Result};
use crate::results::{Metric, ScenarioResult};
use crate::runner::Context;

/// Scenario name.
pub const NAME: &str = "files-throughput";
/// Pieces the upload is handed to the channel in (as a gRPC client's messages).
const PIECE: usize = 4 << 20;

fn runs(ctx: &Context) -> u32 {
    ctx.runs(3, 1)
}

fn size_mib(ctx: &Context) -> u64 {
    if ctx.settings.quick {
        256
    } else {
        1024
    }
}

/// Progress steps: one per run.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(ctx.warmup() + runs(ctx))
}

/// guest-init next to this perf binary (`target/<profile>/`).
fn guest_init() -> Option<PathBuf> {
    let p = std::env::current_exe().ok()?.parent()?.join("guest-init");
    p.exists().then_some(p)
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    let Some(gi) = guest_init() else {
        return ScenarioResult::skipped(
            NAME,
            "skipped: guest-init is not built next to perf (cargo build -p guest-init)",
        );
    };
    if Command::new("git").arg("--version").output().is_err() {
        return ScenarioResult::skipped(NAME, "skipped: git is not installed");
    }
    super::guarded(NAME, |result| measure(ctx, &gi, result))
}

fn fail(what: impl std::fmt::Display) -> PerfError {
    PerfError::Guest(format!("files-throughput: {what}"))
}

fn git(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("git")
        .args(["-c", "user.name=perf", "-c", "user.email=perf@localhost"])
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| fail(format!("running git {}: {e}", args.join(" "))))?;
    if !out.status.success() {
        return Err(fail(format!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// A repository with an agent and its manifest, as a bundle of `main`.
fn bundle(dir: &Path) -> Result<PathBuf> {
    let repo = dir.join("repo");
    let write = |p: &str, text: &str| {
        let path = repo.join(p);
        std::fs::create_dir_all(path.parent().unwrap_or(&repo))
            .and_then(|()| std::fs::write(&path, text))
            .map_err(|e| fail(format!("writing {}: {e}", path.display())))
    };
    write("agents/perf.md", "---\ndescription: perf\n---\n")?;
    write("agent-manifest.yaml", "version: 1\nagents:\n  perf: {}\n")?;
    git(&repo, &["init", "-q", "-b", "main"])?;
    git(&repo, &["add", "."])?;
    git(&repo, &["commit", "-q", "-m", "perf"])?;
    let out = dir.join("repo.bundle");
    git(
        &repo,
        &["bundle", "create", "-q", &out.display().to_string(), "main"],
    )?;
    Ok(out)
}

/// guest-init, killed when dropped.
struct Stand(Child);

impl Drop for Stand {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn measure(ctx: &Context, gi: &Path, result: &mut ScenarioResult) -> Result<()> {
    let scratch = ctx.scratch()?;
    let dir = scratch.path();
    let bundle = bundle(dir)?;
    let sock = dir.join("guest-init.sock");
    let child = Command::new(gi)
        .arg("serve")
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--workspace")
        .arg(dir.join("workspace"))
        .args(["--turns", "process-tree"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|source| PerfError::Spawn {
            path: gi.to_path_buf(),
            source,
        })?;
    let _stand = Stand(child);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| fail(format!("tokio runtime: {e}")))?;
    let size = size_mib(ctx) << 20;
    result.notes.push(format!(
        "stand-in guest: guest-init as a host process on a Unix socket, driven by host-agent's \
         guest channel as the Files service drives it (gRPC hop not included); {} MiB per \
         transfer, 256 KiB chunks, credit window {MAX_FILE_WINDOW}; vmm only",
        size >> 20
    ));
    let metric = |id: &str, label: &str| {
        Metric::new(format!("{NAME}.{id}"), label, "MB/s", Subject::Vmm)
            .param("mib", size >> 20)
            .higher_is_better()
    };
    let mut up = metric("upload", "files: Write through the guest channel");
    let mut down = metric("download", "files: Read through the guest channel");
    let timeout = ctx.timeout();
    rt.block_on(async {
        let conn = start(&sock, &bundle, timeout).await?;
        let data = vec![0x5au8; PIECE];
        let mut n = 0u32;
        let mut samples = Vec::new();
        for _ in 0..ctx.warmup() + runs(ctx) {
            n += 1;
            let path = format!("blob-{n}");
            let t = Instant::now();
            upload(&conn, &path, &data, size).await?;
            let u = t.elapsed();
            let t = Instant::now();
            let got = download(&conn, &path).await?;
            let d = t.elapsed();
            if got != size {
                return Err(fail(format!("read {got} bytes of {size}")));
            }
            samples.push((u, d));
        }
        Ok::<_, PerfError>(samples)
    })?
    .into_iter()
    .enumerate()
    .for_each(|(i, (u, d))| {
        let warmup = (i as u32) < ctx.warmup();
        let mbs = |t: Duration| size as f64 / 1e6 / t.as_secs_f64();
        up.push(mbs(u), warmup);
        down.push(mbs(d), warmup);
        ctx.progress.inc(1);
    });
    result.metrics.extend([up.finish(), down.finish()]);
    Ok(())
}

/// Connects, starts the session from `bundle` and waits for Ready.
async fn start(sock: &Path, bundle: &Path, timeout: Duration) -> Result<GuestConn> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match tokio::net::UnixStream::connect(sock).await {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(fail(format!("guest-init did not listen: {e}")))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let conn = GuestConn::open(stream, "perf-files", None, Duration::from_secs(30))
        .await
        .map_err(fail)?;
    let bytes = std::fs::read(bundle).map_err(|e| fail(format!("reading the bundle: {e}")))?;
    conn.send(In::StartSession(StartSession {
        session_id: "perf-files".into(),
        agent: "perf".into(),
        base_ref: "main".into(),
        bundle_size: bytes.len() as u64,
        ..Default::default()
    }))
    .await
    .map_err(fail)?;
    conn.send(In::RepoChunk(RepoChunk {
        data: bytes,
        last: true,
    }))
    .await
    .map_err(fail)?;
    loop {
        match conn.next_control(timeout).await.map_err(fail)?.kind {
            Some(Out::Ready(_)) => return Ok(conn),
            Some(Out::Error(e)) => return Err(fail(format!("session refused: {}", e.message))),
            _ => continue,
        }
    }
}

async fn upload(conn: &GuestConn, path: &str, data: &[u8], size: u64) -> Result<()> {
    let mut call: FileCall = conn
        .file_call(Op::Write(FileWrite {
            path: path.as_bytes().to_vec(),
            mode: Mode::Truncate as i32,
            permissions: 0,
        }))
        .await
        .map_err(fail)?;
    let mut left = size;
    while left > 0 {
        let n = left.min(data.len() as u64) as usize;
        call.write(&data[..n], false).await.map_err(fail)?;
        left -= n as u64;
    }
    call.write(&[], true).await.map_err(fail)?;
    call.write_result().await.map_err(fail)?;
    Ok(())
}

async fn download(conn: &GuestConn, path: &str) -> Result<u64> {
    let mut call = conn
        .file_call(Op::Read(FileRead {
            path: path.as_bytes().to_vec(),
            offset: 0,
            length: 0,
            window: MAX_FILE_WINDOW,
        }))
        .await
        .map_err(fail)?;
    let mut got = 0u64;
    loop {
        match call
            .next(Some(Duration::from_secs(60)))
            .await
            .map_err(fail)?
            .result
        {
            Some(R::Data(d)) => {
                got += d.data.len() as u64;
                if d.last {
                    call.finished();
                    return Ok(got);
                }
                call.send(Op::Credit(FileCredit { messages: 1 }))
                    .await
                    .map_err(fail)?;
            }
            Some(R::Error(e)) => return Err(fail(format!("read refused: {}", e.message))),
            _ => return Err(fail("unexpected answer to a read")),
        }
    }
}
