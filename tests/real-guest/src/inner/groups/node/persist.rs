//! Scenario `node-persist`: a session paused to disk and resumed. A session
//! writes a file in its workspace and starts nothing else; PauseSession
//! with `persist` leaves it PAUSED and `persisted`, its vmm gone, its
//! memory a diff snapshot layer far smaller than the guest's memory. After
//! about three seconds ResumeSession restores it (RUNNING, a new
//! execution id); the file is there, CLOCK_MONOTONIC (the first field of
//! /proc/uptime) did not count the time on disk, and CLOCK_REALTIME was
//! stepped by guest-init to the host's time. The session is stopped and
//! deleted afterwards, passed or not.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use proto::hostagent as pb;
use tonic::transport::Channel;

use super::sizing::open_repository;
use super::{agent, create_running, delete_stopped, exec, expect_ok, keep_logs, HostAgent};
use crate::inner::{Check, Ctx};

/// How long the session stays on disk, at least.
const ON_DISK: Duration = Duration::from_secs(3);
/// The bound of each lifecycle call (nested emulation is slow).
pub(super) const CALL_BOUND: Duration = Duration::from_secs(300);
/// The file the session writes, and what it holds (with its id after).
const FILE: &str = "persisted.txt";
const TEXT: &str = "written before the pause by";
/// /proc/uptime's resolution and the guest's read between the host's marks.
const CLOCK_SLACK: f64 = 0.1;
/// guest-init leaves a wall clock within this of the host's alone.
const STEP_TOLERANCE: f64 = 1.0;

/// Pause to disk and resume, on the real guest.
pub fn persist(ctx: &mut Ctx, name: &str) -> Check {
    let result = persist_flow(ctx);
    keep_logs(ctx);
    let note = result?;
    ctx.info(name, &note);
    Ok(note)
}

/// Creates the session, runs the checks, then stops and deletes it.
fn persist_flow(ctx: &mut Ctx) -> Check {
    let repo = open_repository(ctx)?;
    agent(ctx)?;
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let ch = a.channel()?;
    let (s, _) = create_running(a, &ch, &repo)?;
    let checked = persist_checks(a, &ch, &s, &ctx.out);
    // The consoles and vmm logs (the old vmm's and the restored one's)
    // before the session's directory goes.
    keep_logs(ctx);
    let removed = remove_sessions(a, &ch, std::slice::from_ref(&s.session_id));
    let note = checked?;
    removed?;
    Ok(note)
}

/// The guest's clocks as one command read them.
struct Clocks {
    /// CLOCK_BOOTTIME (= CLOCK_MONOTONIC: the guest never suspends), s.
    uptime: f64,
    /// CLOCK_REALTIME, Unix seconds.
    realtime: f64,
}

/// Reads /proc/uptime and `date +%s.%N` in one command.
async fn read_clocks(ch: &Channel, s: &pb::Session) -> Result<Clocks, String> {
    let script = "cat /proc/uptime && date +%s.%N";
    let r = exec(ch.clone(), s, &["sh", "-c", script]).await?;
    expect_ok(script, &r)?;
    let mut lines = r.stdout.lines();
    let uptime = lines
        .next()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|f| f.parse::<f64>().ok());
    let realtime = lines.next().and_then(|l| l.trim().parse::<f64>().ok());
    match (uptime, realtime) {
        (Some(uptime), Some(realtime)) => Ok(Clocks { uptime, realtime }),
        _ => Err(format!("`{script}` printed {:?}", r.stdout)),
    }
}

/// Unix seconds on the node (the outer VM: host-agent's clock).
fn node_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Whether process `pid` exists on the node.
fn alive(pid: u32) -> bool {
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Awaits a gRPC call for at most [`CALL_BOUND`]; its answer, or what
/// went wrong with `what` named.
pub(super) async fn bounded<T>(
    what: &str,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_BOUND, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(e)) => Err(format!("{what}: {:?}: {}", e.code(), e.message())),
        Err(_) => Err(format!("{what}: no answer in {} s", CALL_BOUND.as_secs())),
    }
}

/// The whole check on the RUNNING session `s`.
fn persist_checks(a: &HostAgent, ch: &Channel, s: &pb::Session, out: &Path) -> Check {
    let id = s.session_id.clone();
    let token = format!("{TEXT} {id}");
    let mem_mib = s.resources.as_ref().map_or(512, |r| r.mem_mib);
    // The file, then the clocks, timed by the node.
    let (before, t0) = a.block_on(async {
        let script = format!("printf '%s\\n' '{token}' > {FILE} && sync");
        let r = exec(ch.clone(), s, &["sh", "-c", &script]).await?;
        expect_ok(&script, &r)?;
        let t0 = Instant::now();
        Ok::<_, String>((read_clocks(ch, s).await?, t0))
    })?;
    let old_pid = a.block_on(async {
        pb::sessions_client::SessionsClient::new(ch.clone())
            .get_session(pb::SessionRef {
                session_id: id.clone(),
            })
            .await
            .map(|r| r.into_inner().vmm_pid)
            .map_err(|e| format!("GetSession: {}", e.message()))
    })?;
    if !alive(old_pid) {
        return Err(format!(
            "the RUNNING session's vmm_pid {old_pid} is no process on the node"
        ));
    }
    let mut se = pb::sessions_client::SessionsClient::new(ch.clone());
    let paused = a.block_on(bounded(
        &format!("PauseSession(persist) {id}"),
        se.pause_session(pb::PauseSessionRequest {
            session_id: id.clone(),
            idempotency_key: String::new(),
            persist: true,
        }),
    ))?;
    let on_disk_from = Instant::now();
    if paused.state != pb::SessionState::Paused as i32 || !paused.persisted {
        return Err(format!(
            "after PauseSession(persist): state {:?}, persisted {} (want PAUSED, persisted): {paused:?}",
            pb::SessionState::try_from(paused.state),
            paused.persisted
        ));
    }
    if paused.vmm_pid != 0 {
        return Err(format!(
            "the persisted session still names vmm pid {}",
            paused.vmm_pid
        ));
    }
    // PauseSession waits for the vmm's exit; a moment for the jail's reaping.
    let gone_by = Instant::now() + Duration::from_secs(10);
    while alive(old_pid) && Instant::now() < gone_by {
        std::thread::sleep(Duration::from_millis(100));
    }
    if alive(old_pid) {
        return Err(format!(
            "the session's vmm (pid {old_pid}) still runs 10 s after PauseSession(persist) returned"
        ));
    }
    let mem_bytes = u64::from(mem_mib) << 20;
    let layer = paused.snapshot_bytes;
    if layer == 0 || layer * 4 > mem_bytes {
        return Err(format!(
            "snapshot_bytes {layer} after the pause to disk: want a diff layer above 0 and at \
             most a quarter of the guest's {mem_mib} MiB"
        ));
    }
    std::thread::sleep(ON_DISK);
    let gap = on_disk_from.elapsed().as_secs_f64();
    let resumed = a.block_on(bounded(
        &format!("ResumeSession {id}"),
        se.resume_session(pb::SessionCall {
            session_id: id.clone(),
            idempotency_key: String::new(),
        }),
    ))?;
    if resumed.state != pb::SessionState::Running as i32 || resumed.persisted {
        return Err(format!(
            "after ResumeSession: state {:?}, persisted {} (want RUNNING, not persisted): {resumed:?}",
            pb::SessionState::try_from(resumed.state),
            resumed.persisted
        ));
    }
    if resumed.execution_id == s.execution_id || resumed.execution_id.is_empty() {
        return Err(format!(
            "ResumeSession kept execution id {:?}; a restore must give a new one",
            resumed.execution_id
        ));
    }
    if !alive(resumed.vmm_pid) || resumed.vmm_pid == old_pid {
        return Err(format!(
            "the resumed session's vmm_pid {} is no new process on the node (old {old_pid})",
            resumed.vmm_pid
        ));
    }
    let (kept, after, elapsed, wall) = a.block_on(async {
        let r = exec(ch.clone(), &resumed, &["cat", FILE])
            .await
            .map_err(|e| {
                format!(
                    "the first command after ResumeSession (RUNNING, restored from disk): {e}{}",
                    record_vmm(out, "node-persist-resumed-vmm", resumed.vmm_pid)
                )
            })?;
        expect_ok(&format!("cat {FILE} after the resume"), &r)?;
        let from = node_now();
        let after = read_clocks(ch, &resumed).await?;
        let elapsed = t0.elapsed().as_secs_f64();
        Ok::<_, String>((r.stdout, after, elapsed, (from, node_now())))
    })?;
    if kept.trim() != token {
        return Err(format!(
            "{FILE} after the resume holds {kept:?}, not {token:?}"
        ));
    }
    let mono = after.uptime - before.uptime;
    let real = after.realtime - before.realtime;
    // Both guest reads lie within the node's `elapsed`, which holds `gap`
    // on disk: a clock that excludes it advanced at most elapsed - gap.
    if mono < 0.0 || mono + gap > elapsed + CLOCK_SLACK {
        return Err(format!(
            "CLOCK_MONOTONIC (/proc/uptime) advanced {mono:.2} s across a pause to disk; the \
             node's clock advanced {elapsed:.2} s, {gap:.2} s of it with the session on disk: \
             the guest's monotonic clock must exclude that time (at most {:.2} s)",
            elapsed - gap
        ));
    }
    // The step guest-init takes on ResumeSession: the wall clock advances by
    // the guest's own running time plus the time it missed.
    if real < gap || real - mono < gap - STEP_TOLERANCE {
        return Err(format!(
            "CLOCK_REALTIME (date +%s.%N) advanced {real:.2} s, CLOCK_MONOTONIC {mono:.2} s, \
             across {gap:.2} s on disk: the wall clock was not stepped to the host's time \
             on resume (want at least {gap:.2} s, and {:.2} s more than the monotonic clock)",
            gap - STEP_TOLERANCE
        ));
    }
    // The read lies between the node's two marks; guest-init leaves a
    // second's difference alone.
    let (from, to) = wall;
    if after.realtime < from - STEP_TOLERANCE - CLOCK_SLACK
        || after.realtime > to + STEP_TOLERANCE + CLOCK_SLACK
    {
        return Err(format!(
            "after the resume the guest's wall clock read {:.2}, outside the node's {from:.2} \
             ..{to:.2} (by more than guest-init's {STEP_TOLERANCE} s tolerance)",
            after.realtime
        ));
    }

    Ok(format!(
        "persisted in a {:.1} MiB layer (guest {mem_mib} MiB), vmm gone; resumed after {gap:.1} s \
         with a new execution id, {FILE} kept; over {elapsed:.1} s the guest's monotonic clock \
         advanced {mono:.2} s and its wall clock {real:.2} s, to the node's time",
        layer as f64 / f64::from(1 << 20)
    ))
}

/// Records what the session's vmm `pid` and its descendants (a jailed vmm
/// runs under the process host-agent names) are doing: threads, kernel
/// stacks, KVM exits ([`crate::inner::hang::report`]), in `out/<name>.hang`;
/// says where, for a failure message.
pub(super) fn record_vmm(out: &Path, name: &str, pid: u32) -> String {
    let path = out.join(format!("{name}.hang"));
    let mut report = String::new();
    for p in std::iter::once(pid).chain(descendants(pid)) {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        report.push_str(&format!("== process {p} ({})\n", comm.trim()));
        report.push_str(&crate::inner::hang::report(p));
    }
    match std::fs::write(&path, report) {
        Ok(()) => format!(
            "; vmm {pid}'s (and its children's) threads and KVM exits in {}",
            path.display()
        ),
        Err(e) => format!("; vmm {pid} not recorded: {e}"),
    }
}

/// The processes under `pid`, parents before children.
fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // The parent is the second field after the parenthesised name.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.split_off(1)
}

/// Stops (unless STOPPED or FAILED) and deletes each session in `ids`,
/// every one tried; the first failure is returned.
pub(super) fn remove_sessions(a: &HostAgent, ch: &Channel, ids: &[String]) -> Result<(), String> {
    let mut first = None;
    for id in ids {
        let stopped = a.block_on(async {
            let mut se = pb::sessions_client::SessionsClient::new(ch.clone());
            let state = se
                .get_session(pb::SessionRef {
                    session_id: id.clone(),
                })
                .await
                .map(|r| r.into_inner().state)
                .map_err(|e| format!("GetSession {id}: {}", e.message()))?;
            if [
                pb::SessionState::Stopped as i32,
                pb::SessionState::Failed as i32,
            ]
            .contains(&state)
            {
                return Ok(());
            }
            let call = se.stop_session(pb::SessionCall {
                session_id: id.clone(),
                idempotency_key: String::new(),
            });
            bounded(&format!("StopSession {id}"), call)
                .await
                .map(|_| ())
        });
        let deleted = stopped.and_then(|()| delete_stopped(a, ch, id));
        if let Err(e) = deleted {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}
