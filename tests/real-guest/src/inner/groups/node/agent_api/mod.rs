//! Scenario `node-agent-api`: host-agent's Files service and terminal
//! execs against the real guest (guest-init as PID 1). An 8 MiB file of
//! pseudo-random bytes is streamed into the workspace, stat'ed, read back
//! and compared by SHA-256, and listed at the root; a path with `..` and a
//! path through a symbolic link to `/etc` are refused (INVALID_ARGUMENT
//! naming `path`); a watch of the root sees a command's `touch`; the guest's
//! audit holds the `file.write`. Then `bash -i` on a 24x80 pseudo-terminal
//! is typed at and exits 0, ListExecs shows it so, and a `sleep 600` with a
//! 2 s timeout is killed with a timeout reason. The session is stopped and
//! deleted afterwards.

use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::files_client::FilesClient;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Code;

use super::sizing::open_repository;
use super::{agent, create_running, delete_stopped, exec, expect_ok, keep_logs, HostAgent};
use crate::inner::{Check, Ctx};

mod terminal;

use terminal::terminal_checks;

/// The bound of every gRPC wait that has no tighter one (nested emulation
/// is slow).
const BOUND: Duration = Duration::from_secs(300);
/// How long a watched change, or a timed-out command's end, may take.
const SHORT: Duration = Duration::from_secs(60);
/// The written file: its name, size and the size of its data messages.
const FILE: &str = "agent-api.bin";
const FILE_BYTES: usize = 8 << 20;
const CHUNK: usize = 256 << 10;
/// The shell's prompt, set through the environment.
const PROMPT: &str = "prompt$ ";
/// The timed-out command's limit.
const TIMEOUT_MS: u64 = 2000;

/// The Files service and terminal execs on a session of the real guest.
pub fn agent_api(ctx: &mut Ctx, name: &str) -> Check {
    let result = agent_api_flow(ctx);
    keep_logs(ctx);
    let note = result?;
    ctx.info(name, &note);
    Ok(note)
}

/// Creates the session, runs the checks, then stops and deletes it (passed
/// or not: the outer VM's tmpfs holds only so many session disks).
fn agent_api_flow(ctx: &mut Ctx) -> Check {
    let repo = open_repository(ctx)?;
    agent(ctx)?;
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let ch = a.channel()?;
    let (s, _) = create_running(a, &ch, &repo)?;
    let checked = a.block_on(async {
        let files = files_checks(&ch, &s).await?;
        let terminal = terminal_checks(&ch, &s).await?;
        Ok::<_, String>(format!("{files}; {terminal}"))
    });
    // The session's console and vmm log, before its directory goes.
    keep_logs(ctx);
    let removed = stop_and_delete(a, &ch, &s.session_id);
    let note = checked?;
    removed?;
    Ok(note)
}

/// StopSession then DeleteSession; a failed stop is reported after the
/// delete was tried.
fn stop_and_delete(a: &HostAgent, ch: &Channel, id: &str) -> Result<(), String> {
    let stopped = a.block_on(async {
        let mut client = pb::sessions_client::SessionsClient::new(ch.clone());
        let call = client.stop_session(pb::SessionCall {
            session_id: id.into(),
            idempotency_key: String::new(),
        });
        match tokio::time::timeout(BOUND, call).await {
            Ok(r) => r
                .map(|_| ())
                .map_err(|e| format!("StopSession {id}: {}", e.message())),
            Err(_) => Err(format!("StopSession {id}: no answer in 300 s")),
        }
    });
    let deleted = delete_stopped(a, ch, id);
    stopped?;
    deleted
}

// ----------------------------------------------------------------- files --

/// A Files client bound to one session.
struct Files {
    cl: FilesClient<Channel>,
    session_id: String,
    execution_id: String,
}

impl Files {
    fn new(ch: &Channel, s: &pb::Session) -> Files {
        Files {
            cl: FilesClient::new(ch.clone()),
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
        }
    }

    /// Writes `data` to the new file `path` (WRITE_MODE_CREATE): the start
    /// message, then `data` in CHUNK-sized messages.
    async fn write(&mut self, path: &str, data: &[u8]) -> Result<pb::WriteFileResponse, String> {
        let mut msgs = vec![pb::WriteFileRequest {
            kind: Some(pb::write_file_request::Kind::Start(pb::WriteFileStart {
                session_id: self.session_id.clone(),
                execution_id: self.execution_id.clone(),
                path: path.into(),
                mode: pb::WriteMode::Create as i32,
                permissions: 0,
            })),
        }];
        msgs.extend(data.chunks(CHUNK).map(|d| pb::WriteFileRequest {
            kind: Some(pb::write_file_request::Kind::Data(d.to_vec())),
        }));
        tokio::time::timeout(BOUND, self.cl.write(tokio_stream::iter(msgs)))
            .await
            .map_err(|_| format!("Write {path}: no answer in 300 s"))?
            .map(|r| r.into_inner())
            .map_err(|e| format!("Write {path}: {:?} {}", e.code(), e.message()))
    }

    async fn stat(&mut self, path: &str) -> Result<pb::FileInfo, String> {
        let call = self.cl.stat(pb::StatFileRequest {
            session_id: self.session_id.clone(),
            execution_id: self.execution_id.clone(),
            path: path.into(),
        });
        tokio::time::timeout(BOUND, call)
            .await
            .map_err(|_| format!("Stat {path}: no answer in 300 s"))?
            .map(|r| r.into_inner())
            .map_err(|e| format!("Stat {path}: {:?} {}", e.code(), e.message()))
    }

    /// The whole file `path`; a wait past BOUND is DEADLINE_EXCEEDED.
    async fn read(&mut self, path: &str) -> Result<Vec<u8>, tonic::Status> {
        let late = || tonic::Status::deadline_exceeded(format!("Read {path}: nothing for 300 s"));
        let call = self.cl.read(pb::ReadFileRequest {
            session_id: self.session_id.clone(),
            execution_id: self.execution_id.clone(),
            path: path.into(),
            offset: 0,
            length: 0,
        });
        let mut st = tokio::time::timeout(BOUND, call)
            .await
            .map_err(|_| late())??
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = tokio::time::timeout(BOUND, st.message())
            .await
            .map_err(|_| late())??
        {
            out.extend(m.data);
        }
        Ok(out)
    }

    /// The paths of `path`'s entries (one level).
    async fn list(&mut self, path: &str) -> Result<Vec<String>, String> {
        let what = |e: tonic::Status| format!("List {path}: {:?} {}", e.code(), e.message());
        let call = self.cl.list(pb::ListFilesRequest {
            session_id: self.session_id.clone(),
            execution_id: self.execution_id.clone(),
            path: path.into(),
            depth: 1,
        });
        let mut st = tokio::time::timeout(BOUND, call)
            .await
            .map_err(|_| format!("List {path}: no answer in 300 s"))?
            .map_err(what)?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = tokio::time::timeout(BOUND, st.message())
            .await
            .map_err(|_| format!("List {path}: nothing for 300 s"))?
            .map_err(what)?
        {
            out.extend(m.entries.into_iter().map(|e| e.path));
        }
        Ok(out)
    }

    /// A watch of `path` (not recursive), once its WATCHING message came.
    async fn watch(&mut self, path: &str) -> Result<tonic::Streaming<pb::FileChange>, String> {
        let what = |e: tonic::Status| format!("Watch {path}: {:?} {}", e.code(), e.message());
        let call = self.cl.watch(pb::WatchFilesRequest {
            session_id: self.session_id.clone(),
            execution_id: self.execution_id.clone(),
            path: path.into(),
            recursive: false,
        });
        let mut st = tokio::time::timeout(BOUND, call)
            .await
            .map_err(|_| format!("Watch {path}: no answer in 300 s"))?
            .map_err(what)?
            .into_inner();
        let first = tokio::time::timeout(BOUND, st.message())
            .await
            .map_err(|_| format!("Watch {path}: no WATCHING in 300 s"))?
            .map_err(what)?
            .ok_or_else(|| format!("Watch {path}: ended before WATCHING"))?;
        if first.kind != pb::file_change::Kind::Watching as i32 {
            return Err(format!("Watch {path}: first {first:?}, not WATCHING"));
        }
        Ok(st)
    }
}

/// `len` pseudo-random bytes (splitmix64 from `seed`).
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Every Files check; one line saying what was seen.
async fn files_checks(ch: &Channel, s: &pb::Session) -> Check {
    let mut f = Files::new(ch, s);
    let round_trip = round_trip(&mut f).await?;
    let refused = escapes_refused(&mut f, ch, s).await?;
    let seen = watch_sees_touch(&mut f, ch, s).await?;
    let audited = write_audited(ch, s).await?;
    Ok(format!("{round_trip}; {refused}; {seen}; {audited}"))
}

/// 8 MiB written, stat'ed, read back with the same SHA-256, and listed.
async fn round_trip(f: &mut Files) -> Check {
    let data = pseudo_random(FILE_BYTES, 0x5EED_A6E7_A710);
    let want = sha256_hex(&data);
    let t0 = Instant::now();
    let w = f.write(FILE, &data).await?;
    let up = t0.elapsed().as_secs_f64();
    if w.bytes_written != FILE_BYTES as u64 {
        return Err(format!("Write {FILE}: {} bytes written", w.bytes_written));
    }
    let info = f.stat(FILE).await?;
    if info.kind != pb::file_info::Kind::File as i32 || info.size != FILE_BYTES as u64 {
        return Err(format!("Stat {FILE}: {info:?}"));
    }
    let t0 = Instant::now();
    let back = f
        .read(FILE)
        .await
        .map_err(|e| format!("Read {FILE}: {:?} {}", e.code(), e.message()))?;
    let down = t0.elapsed().as_secs_f64();
    let got = sha256_hex(&back);
    if back.len() != FILE_BYTES || got != want {
        return Err(format!(
            "Read {FILE}: {} bytes, SHA-256 {got}; written {FILE_BYTES} bytes, {want}",
            back.len()
        ));
    }
    let root = f.list(".").await?;
    if !root.iter().any(|p| p == FILE) {
        return Err(format!("List . does not show {FILE}: {root:?}"));
    }
    Ok(format!(
        "8 MiB written in {up:.1} s, stat size {}, read back in {down:.1} s with the same \
         SHA-256 {}…, listed at the root",
        info.size,
        &want[..12]
    ))
}

/// `..` and a link to /etc are refused; what each refusal said.
async fn escapes_refused(f: &mut Files, ch: &Channel, s: &pb::Session) -> Check {
    let dotdot = refused("../etc/passwd", f.read("../etc/passwd").await)?;
    let r = exec(ch.clone(), s, &["ln", "-s", "/etc", "outside"]).await?;
    expect_ok("ln -s /etc outside", &r)?;
    let link = refused("outside/passwd", f.read("outside/passwd").await)?;
    Ok(format!(
        "Read ../etc/passwd refused ({dotdot}), Read outside/passwd through outside -> /etc \
         refused ({link})"
    ))
}

/// Ok with the refusal's code when `r` is INVALID_ARGUMENT naming `path`
/// (as tests/e2e/tests/files.rs expects of every escape).
fn refused(path: &str, r: Result<Vec<u8>, tonic::Status>) -> Result<String, String> {
    match r {
        Ok(d) => Err(format!(
            "Read {path} escaped the workspace: {} bytes",
            d.len()
        )),
        Err(e) if e.code() == Code::InvalidArgument && e.message().contains("path") => {
            Ok("INVALID_ARGUMENT".into())
        }
        Err(e) => Err(format!(
            "Read {path}: {:?} {:?}, not INVALID_ARGUMENT naming path",
            e.code(),
            e.message()
        )),
    }
}

/// A watch of the root sees `touch watched.txt` (run by Exec) as CREATED.
async fn watch_sees_touch(f: &mut Files, ch: &Channel, s: &pb::Session) -> Check {
    let mut w = f.watch(".").await?;
    let r = exec(ch.clone(), s, &["touch", "watched.txt"]).await?;
    expect_ok("touch watched.txt", &r)?;
    let deadline = Instant::now() + SHORT;
    let mut seen = Vec::new();
    loop {
        let c = tokio::time::timeout_at(deadline, w.message())
            .await
            .map_err(|_| format!("no CREATED watched.txt within 60 s; saw {seen:?}"))?
            .map_err(|e| format!("Watch .: {:?} {}", e.code(), e.message()))?
            .ok_or_else(|| format!("the watch ended before CREATED watched.txt; saw {seen:?}"))?;
        if c.kind == pb::file_change::Kind::Created as i32 && c.path == "watched.txt" {
            return Ok("Watch . saw CREATED watched.txt".into());
        }
        seen.push(c);
    }
}

/// The guest's audit (Approvals.ListAudit, every page) holds a `file.write`
/// record of FILE_BYTES bytes for FILE; waits for it up to BOUND.
async fn write_audited(ch: &Channel, s: &pb::Session) -> Check {
    let mut ap = pb::approvals_client::ApprovalsClient::new(ch.clone());
    let deadline = Instant::now() + BOUND;
    let mut since = 0;
    let mut other = Vec::new();
    loop {
        let page = tokio::time::timeout_at(
            deadline,
            ap.list_audit(pb::ListAuditRequest {
                session_id: s.session_id.clone(),
                since_guest_seq: since,
            }),
        )
        .await
        .map_err(|_| "ListAudit: no answer in 300 s".to_string())?
        .map_err(|e| format!("ListAudit: {}", e.message()))?
        .into_inner();
        for r in &page.records {
            if let Some(result) = file_write_result(&r.json) {
                if result.contains(&format!("wrote {FILE_BYTES} bytes")) {
                    return Ok(format!("audited: file.write {FILE} {result:?}"));
                }
                other.push(result);
            }
            since = r.guest_seq;
        }
        if page.more {
            continue;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no file.write record of {FILE_BYTES} bytes for {FILE} in the audit \
                 (file.write results for it: {other:?})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The `result` of an audit record that is the `file.write` of FILE.
fn file_write_result(json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    if v["action"] != "file.write" || v["resource"] != FILE {
        return None;
    }
    Some(v["result"].as_str().unwrap_or_default().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pseudo_random_bytes_are_sized_and_vary() {
        let a = pseudo_random(FILE_BYTES, 1);
        assert_eq!(a.len(), FILE_BYTES);
        assert_eq!(pseudo_random(13, 1), a[..13]);
        assert_ne!(pseudo_random(64, 2), a[..64]);
        assert!(a[..4096].iter().filter(|b| **b == 0).count() < 64);
    }

    #[test]
    fn the_write_record_of_the_file_is_found() {
        let rec = format!(
            r#"{{"seq":7,"action":"file.write","resource":"{FILE}","result":"create: wrote 8388608 bytes"}}"#
        );
        assert_eq!(
            file_write_result(&rec).as_deref(),
            Some("create: wrote 8388608 bytes")
        );
        let other = r#"{"action":"file.write","resource":"x","result":"create: wrote 1 bytes"}"#;
        assert_eq!(file_write_result(other), None);
        assert_eq!(file_write_result("not json"), None);
    }

    #[test]
    fn only_invalid_argument_naming_path_is_a_refusal() {
        let status = |c: Code, m: &str| Err(tonic::Status::new(c, m));
        assert!(refused("p", status(Code::InvalidArgument, "path: leads out")).is_ok());
        assert!(refused("p", status(Code::InvalidArgument, "mode: bad")).is_err());
        assert!(refused("p", status(Code::PermissionDenied, "path: no")).is_err());
        assert!(refused("p", Ok(b"root:x:0:0".to_vec())).is_err());
    }
}
