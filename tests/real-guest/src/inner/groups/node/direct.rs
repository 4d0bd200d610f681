//! Scenario `guest-init-direct`: the path from the node image to a session
//! with nothing of host-agent in it, as `images` and a hand-driven vmm take
//! it. The node image's kernel (with its initramfs) boots a copy of its root
//! filesystem; `images::capture`, the golden-snapshot code of `images
//! golden` (and of host-agent), waits for guest-init's Hello on vsock and
//! takes the full snapshot. A new vmm restores it with the session's own
//! copy of the golden disk and its own vsock socket; over vsock
//! (`images::guest_channel`) the scenario opens a session on a small
//! repository and checks an allowed command's output, a command the rules
//! deny (reason and rule), a commit, a turn ended with a command still
//! running (killed), the session branch fetched back (its commit message),
//! and Shutdown (the guest powers off, the vmm exits 0).
//!
//! This was `images/tests/e2e.rs`, which needs a KVM that runs a Linux
//! kernel and so skipped on every CI machine.
//! (Over 700 lines, about half of it the unit tests of its message
//! handling; the scenario is one sequence of steps, kept in one file.)

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use images::capture::{capture, Capture, Ready as GuestReady};
use images::golden::{copy_disk, GUEST_CID};
use images::guest_channel::GuestChannel;
use proto::guest::guest_message::Kind as Out;
use proto::guest::host_message::Kind as In;
use proto::guest::{
    exec_exited, EndTurn, Exec, FetchBranch, GuestMessage, HostMessage, Ready, RepoChunk, Shutdown,
    StartSession, TurnEnded, DEFAULT_VSOCK_PORT,
};
use vmm_api::command::{DiskSpec, RestoreSpec, RunSpec, Serial, VsockSpec};

use super::{git, image_request, scratch_repository};
use crate::inner::vm::Guest;
use crate::inner::{Check, Ctx};

/// The session's id, and its agent (`agents/direct.md`).
const SESSION: &str = "direct";
const AGENT: &str = "direct";
/// The turn every command runs in.
const TURN: &str = "t1";
/// The rules of `images/tests/e2e.rs`: everything denied but `echo`, `git`
/// (not `git push`) and `sleep`.
const RULES: &str = r#"---
description: the guest-init-direct scenario's agent
permission:
  bash:
    "*": deny
    "echo *": allow
    "git *": allow
    "git push *": deny
    "sleep *": allow
---
# direct
"#;
/// Allowed; its output is checked.
const ECHO: &[&str] = &["echo", "hello from the guest"];
/// Denied by `"git push *": deny`.
const PUSH: &[&str] = &["git", "push", "origin", "main"];
/// The commit's message, checked on the branch fetched back.
const SUBJECT: &str = "work from the guest";
const COMMIT: &[&str] = &["git", "commit", "--allow-empty", "-q", "-m", SUBJECT];
/// Still running when the turn ends.
const SLEEP: &[&str] = &["sleep", "600"];
/// What the Hello says we are.
const SOFTWARE: &str = "real-guest guest-init-direct";

/// The golden boot until guest-init answers (about 40 s under nested
/// emulation on two cores).
const BOOT_LIMIT: Duration = Duration::from_secs(600);
/// From the restore until guest-init answers the Hello.
const HELLO_LIMIT: Duration = Duration::from_secs(300);
/// Any one message from the guest (a clone, a command, a bundle).
const MESSAGE_WAIT: Duration = Duration::from_secs(300);
/// From ShutdownStarted until the vmm exits.
const POWEROFF_LIMIT: Duration = Duration::from_secs(120);

/// The golden snapshot, the restore and a session over vsock, without
/// host-agent.
pub fn guest_init_direct(ctx: &mut Ctx, name: &str) -> Check {
    let golden = ctx.scratch.join(format!("{name}-golden"));
    let result = flow(ctx, name, &golden);
    // The golden boot's console and vmm log (the restored vmm's are kept
    // by `Guest`); then the snapshot (512 MiB of memory) and disk copies
    // leave the scratch space, which is the outer VM's memory.
    for (file, kept) in [
        ("console.log", "golden.console"),
        ("vmm.log", "golden.vmm.log"),
    ] {
        let _ = std::fs::copy(golden.join(file), ctx.out.join(format!("{name}-{kept}")));
    }
    let _ = std::fs::remove_dir_all(&golden);
    for f in [".ext4", ".bundle", "-branch.bundle"] {
        let _ = std::fs::remove_file(ctx.scratch.join(format!("{name}{f}")));
    }
    result
}

fn flow(ctx: &mut Ctx, name: &str, golden: &Path) -> Check {
    let repo = scratch_repository(
        ctx,
        "direct-repo",
        &[
            (&format!("agents/{AGENT}.md"), RULES),
            ("README.md", "hello\n"),
        ],
    )?;
    let main = git(&repo, &["rev-parse", "refs/heads/main"])?;
    let bundle_path = ctx.scratch.join(format!("{name}.bundle"));
    let _ = std::fs::remove_file(&bundle_path);
    git(
        &repo,
        &[
            "bundle",
            "create",
            &bundle_path.display().to_string(),
            "--all",
        ],
    )?;
    let bundle = std::fs::read(&bundle_path).map_err(|e| format!("reading the bundle: {e}"))?;

    let boot_secs = take_golden(ctx, name, golden)?;
    let mut notes = vec![format!(
        "golden snapshot: guest-init answered {boot_secs:.0} s after boot"
    )];

    // The session's own copy of the golden disk and its own vsock socket.
    let disk = ctx.scratch.join(format!("{name}.ext4"));
    copy_disk(&golden.join("rootfs.ext4"), &disk)
        .map_err(|e| format!("copying the golden disk: {e}"))?;
    let uds = ctx.scratch.join(format!("{name}.vsock"));
    let _ = std::fs::remove_file(&uds);
    let mut spec = RestoreSpec::new(golden.join("snapshot"));
    spec.devices.disks.push(DiskSpec::rw(&disk));
    spec.devices.vsock = Some(VsockSpec {
        cid: GUEST_CID,
        uds: uds.clone(),
    });
    // The golden boot's device set: a restore takes the same.
    spec.devices.rng = true;
    let restored = Instant::now();
    let mut g = Guest::start(ctx, name, spec)?;
    match session(
        &mut g,
        &uds,
        &repo,
        &main,
        &bundle,
        restored,
        &ctx.scratch,
        name,
    ) {
        Ok(more) => {
            notes.extend(more);
            let note = notes.join("; ");
            ctx.info(name, &note);
            Ok(note)
        }
        Err(why) => Err(with_vmm_state(&mut g, why)),
    }
}

/// Boots the node image as host-agent registers it (kernel, initramfs,
/// command line, memory; rng and vsock for guest-init) on a copy of its
/// root disk and takes the golden snapshot with `images::capture`, in
/// `dir`: `snapshot/`, `rootfs.ext4`, `console.log`, `vmm.log`. Returns
/// how long guest-init took to answer.
fn take_golden(ctx: &Ctx, name: &str, dir: &Path) -> Result<f64, String> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let image = image_request(ctx, AGENT, 1)?;
    let disk = dir.join("rootfs.ext4");
    copy_disk(Path::new(&image.rootfs_path), &disk)
        .map_err(|e| format!("copying the node image's root disk: {e}"))?;
    let mut boot = RunSpec::new(&image.kernel_path);
    boot.initrd = (!image.initrd_path.is_empty()).then(|| PathBuf::from(&image.initrd_path));
    boot.mem_mib = u64::from(image.mem_mib);
    boot.vcpus = u64::from(image.vcpus);
    boot.cmdline = Some(image.cmdline);
    boot.devices.serial = Serial::File(dir.join("console.log"));
    boot.devices.control_socket = Some(dir.join("control.sock"));
    boot.devices.disks.push(DiskSpec::rw(&disk));
    let uds = dir.join("vsock.sock");
    boot.devices.vsock = Some(VsockSpec {
        cid: GUEST_CID,
        uds: uds.clone(),
    });
    boot.devices.rng = true;
    let job = Capture {
        vmm: ctx.env.vmm.clone(),
        boot,
        ready: GuestReady::GuestInit {
            uds,
            port: DEFAULT_VSOCK_PORT,
            served_by_vmm: true,
            // As `images golden`: the guest closes its side of the Hello.
            settle: Duration::from_millis(500),
            software: SOFTWARE.into(),
        },
        snapshot_dir: dir.join("snapshot"),
        boot_timeout: BOOT_LIMIT,
        vmm_log: Some(dir.join("vmm.log")),
        netns: None,
    };
    let mut progress = Vec::new();
    let captured = capture(&job, &mut |line| progress.push(line.to_string()));
    let _ = std::fs::write(
        ctx.out.join(format!("{name}-golden.progress")),
        progress.join("\n") + "\n",
    );
    let captured = captured.map_err(|e| format!("the golden snapshot (images::capture): {e}"))?;
    for f in [
        "snapshot/state",
        "snapshot/memory",
        "snapshot/manifest",
        "rootfs.ext4",
    ] {
        if !dir.join(f).exists() {
            return Err(format!("{f} is missing from the golden snapshot"));
        }
    }
    if captured.guest_software.is_none() {
        return Err("the golden snapshot was taken without guest-init's Hello".into());
    }
    Ok(captured.boot_seconds)
}

/// The session on the restored guest `g`, to its Shutdown; notes on what
/// it showed.
#[allow(clippy::too_many_arguments)]
fn session(
    g: &mut Guest,
    uds: &Path,
    repo: &Path,
    main: &str,
    bundle: &[u8],
    restored: Instant,
    scratch: &Path,
    name: &str,
) -> Result<Vec<String>, String> {
    let (c, software) = hello(g, uds, restored)?;
    let mut notes = vec![format!(
        "restored; guest-init ({software}) answered the Hello in {:.1} s",
        restored.elapsed().as_secs_f64()
    )];
    let mut ch = Channel { c, audit: 0 };

    let t0 = Instant::now();
    ch.send(In::StartSession(StartSession {
        session_id: SESSION.into(),
        agent: AGENT.into(),
        base_ref: "main".into(),
        bundle_size: bundle.len() as u64,
        env: [
            ("GIT_AUTHOR_NAME", "Agent"),
            ("GIT_AUTHOR_EMAIL", "agent@example.com"),
            ("GIT_COMMITTER_NAME", "Agent"),
            ("GIT_COMMITTER_EMAIL", "agent@example.com"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect(),
        ..Default::default()
    }))?;
    let chunks: Vec<&[u8]> = bundle.chunks(64 * 1024).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        ch.send(In::RepoChunk(RepoChunk {
            data: chunk.to_vec(),
            last: i + 1 == chunks.len(),
        }))?;
    }
    let branch = format!("session/{SESSION}");
    expect_ready(&ch.next()?, &branch, main)?;
    notes.push(format!(
        "Ready on {branch} at main in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));

    // Allowed: runs, its output comes back.
    let r = ch.exec("a1", ECHO)?;
    if r.code != Some(0) || r.stdout != format!("{}\n", ECHO[1]).as_bytes() {
        return Err(format!("`echo` (allowed): {}", r.describe()));
    }
    // Denied: never started.
    let rule = expect_denied(&ch.exec("d1", PUSH)?)?;
    // A commit on the session branch.
    let r = ch.exec("a2", COMMIT)?;
    if r.code != Some(0) {
        return Err(format!("`git commit` (allowed): {}", r.describe()));
    }
    notes.push(format!(
        "echo's output right, git push denied ({rule}), commit made"
    ));

    // The turn ends with a command still running: it is killed.
    ch.send(exec("long", SLEEP))?;
    match ch.next()? {
        Out::ExecStarted(s) if s.exec_id == "long" => {}
        other => return Err(format!("`sleep 600`: expected ExecStarted, got {other:?}")),
    }
    ch.send(In::EndTurn(EndTurn {
        turn_id: TURN.into(),
    }))?;
    let ended = turn_ended(&mut || ch.next(), TURN)?;
    expect_killed(&ended, "sleep")?;
    notes.push("EndTurn killed the running sleep".into());

    // The session branch, fetched back as a bundle.
    ch.send(In::FetchBranch(FetchBranch {}))?;
    let fetched = branch_bundle(&mut || ch.next())?;
    let back = scratch.join(format!("{name}-branch.bundle"));
    std::fs::write(&back, &fetched).map_err(|e| format!("writing {}: {e}", back.display()))?;
    let remote = format!("refs/remotes/guest/{SESSION}");
    git(
        repo,
        &[
            "fetch",
            "-q",
            &back.display().to_string(),
            &format!("+{branch}:{remote}"),
        ],
    )
    .map_err(|e| format!("fetching {branch} from the guest's bundle: {e}"))?;
    let subject = git(repo, &["log", "-1", "--format=%s", &remote])?;
    let parent = git(repo, &["rev-parse", &format!("{remote}^")])?;
    if subject != SUBJECT || parent != main {
        return Err(format!(
            "{branch} fetched back has {subject:?} on {parent}, not {SUBJECT:?} on main ({main})"
        ));
    }
    notes.push(format!(
        "{branch} fetched back ({} bytes) with the guest's commit",
        fetched.len()
    ));

    // Shutdown: the guest powers off and the vmm exits.
    let t0 = Instant::now();
    ch.send(In::Shutdown(Shutdown {}))?;
    shutdown_started(&mut || ch.next())?;
    g.expect_clean_exit(POWEROFF_LIMIT)
        .map_err(|e| format!("after ShutdownStarted: {e}"))?;
    notes.push(format!(
        "Shutdown: the vmm exited 0 after {:.1} s; {} audit events",
        t0.elapsed().as_secs_f64(),
        ch.audit
    ));
    Ok(notes)
}

/// Connects to guest-init through the restored vmm's vsock socket and
/// exchanges Hellos, retrying until [`HELLO_LIMIT`] after the restore;
/// the channel and guest-init's software.
fn hello(g: &mut Guest, uds: &Path, restored: Instant) -> Result<(GuestChannel, String), String> {
    let mut last = String::from("the vsock socket is not there yet");
    loop {
        if vmm_exited(g.pid()) {
            return Err(format!(
                "the vmm exited before guest-init answered the Hello (last: {last})"
            ));
        }
        let hello = GuestChannel::connect_checked(
            uds,
            DEFAULT_VSOCK_PORT,
            Some(g.pid()),
            Duration::from_secs(10),
        )
        .and_then(|mut c| c.hello(SOFTWARE, Duration::from_secs(60)).map(|h| (c, h)));
        match hello {
            Ok((c, h)) => return Ok((c, h.software)),
            Err(e) => last = e.to_string(),
        }
        if restored.elapsed() >= HELLO_LIMIT {
            return Err(format!(
                "guest-init did not answer the Hello within {} s of the restore (last: {last})",
                HELLO_LIMIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The guest channel, counting (and passing over) audit events.
struct Channel {
    c: GuestChannel,
    audit: usize,
}

impl Channel {
    fn send(&mut self, kind: In) -> Result<(), String> {
        self.c
            .send(&HostMessage { kind: Some(kind) })
            .map_err(|e| format!("sending to guest-init: {e}"))
    }

    /// The next message that is not an audit event; a guest Error fails.
    fn next(&mut self) -> Result<Out, String> {
        loop {
            let m = self
                .c
                .recv(MESSAGE_WAIT)
                .map_err(|e| format!("waiting for guest-init: {e}"))?;
            match m {
                GuestMessage {
                    kind: Some(Out::AuditEvent(_)),
                } => self.audit += 1,
                GuestMessage {
                    kind: Some(Out::Error(e)),
                } => return Err(format!("guest-init sent an Error: {e:?}")),
                GuestMessage { kind: Some(k) } => return Ok(k),
                GuestMessage { kind: None } => {
                    return Err("guest-init sent an empty message".into())
                }
            }
        }
    }

    /// Runs `argv` as `id` in the turn, to its end.
    fn exec(&mut self, id: &str, argv: &[&str]) -> Result<Ran, String> {
        self.send(exec(id, argv))?;
        ran(&mut || self.next(), id, argv)
    }
}

fn exec(id: &str, argv: &[&str]) -> In {
    In::Exec(Exec {
        exec_id: id.into(),
        turn_id: TURN.into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
}

/// How one command ended.
#[derive(Debug, Default, PartialEq)]
struct Ran {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    code: Option<i32>,
    signal: Option<i32>,
    /// Reason and rule, when it was not run.
    rejected: Option<(String, String)>,
}

impl Ran {
    fn describe(&self) -> String {
        match &self.rejected {
            Some((reason, rule)) => format!("rejected: {reason} ({rule})"),
            None => format!(
                "exit {:?} signal {:?}, stdout {:?}, stderr {:?}",
                self.code,
                self.signal,
                String::from_utf8_lossy(&self.stdout),
                String::from_utf8_lossy(&self.stderr)
            ),
        }
    }
}

/// The messages of command `id` until it exited or was rejected.
fn ran(
    next: &mut dyn FnMut() -> Result<Out, String>,
    id: &str,
    argv: &[&str],
) -> Result<Ran, String> {
    let mut r = Ran::default();
    loop {
        match next()? {
            Out::ExecStarted(_) => {}
            Out::Output(o) if o.exec_id == id => match o.stream {
                1 => r.stdout.extend(o.data),
                _ => r.stderr.extend(o.data),
            },
            Out::Output(_) => {}
            Out::ExecExited(e) if e.exec_id == id => {
                match e.status {
                    Some(exec_exited::Status::Code(c)) => r.code = Some(c),
                    Some(exec_exited::Status::Signal(s)) => r.signal = Some(s),
                    None => {}
                }
                return Ok(r);
            }
            Out::ExecRejected(e) if e.exec_id == id => {
                r.rejected = Some((e.reason, e.rule));
                return Ok(r);
            }
            other => return Err(format!("unexpected while running {argv:?}: {other:?}")),
        }
    }
}

/// Ready for `branch`, cut at `base` (main's commit).
fn expect_ready(m: &Out, branch: &str, base: &str) -> Result<(), String> {
    match m {
        Out::Ready(Ready {
            branch: b,
            base_commit,
            ..
        }) if b == branch && base_commit == base => Ok(()),
        Out::Ready(r) => Err(format!(
            "Ready on {:?} at {:?}, not {branch} at main ({base})",
            r.branch, r.base_commit
        )),
        other => Err(format!("expected Ready after StartSession, got {other:?}")),
    }
}

/// `git push` rejected by the rules; the rule.
fn expect_denied(r: &Ran) -> Result<String, String> {
    match &r.rejected {
        Some((reason, rule)) if reason == "denied by policy" && rule.contains("git push *") => {
            Ok(rule.clone())
        }
        _ => Err(format!(
            "`git push` must be denied by policy under \"git push *\": {}",
            r.describe()
        )),
    }
}

/// TurnEnded for `turn`, passing over what the turn's commands still send.
fn turn_ended(
    next: &mut dyn FnMut() -> Result<Out, String>,
    turn: &str,
) -> Result<TurnEnded, String> {
    loop {
        match next()? {
            Out::TurnEnded(t) if t.turn_id == turn => return Ok(t),
            Out::ExecExited(_) | Out::Output(_) => {}
            other => return Err(format!("expected TurnEnded, got {other:?}")),
        }
    }
}

/// The turn's end killed a command containing `what`.
fn expect_killed(t: &TurnEnded, what: &str) -> Result<(), String> {
    if t.killed.iter().any(|k| k.command.contains(what)) {
        Ok(())
    } else {
        Err(format!(
            "EndTurn did not kill the running `{what}`: killed {:?}",
            t.killed
        ))
    }
}

/// The bundle FetchBranch sends, to its last chunk.
fn branch_bundle(next: &mut dyn FnMut() -> Result<Out, String>) -> Result<Vec<u8>, String> {
    let mut data = Vec::new();
    loop {
        match next()? {
            Out::BundleChunk(b) => {
                data.extend(b.data);
                if b.last {
                    return Ok(data);
                }
            }
            Out::ExecExited(_) | Out::Output(_) => {}
            other => {
                return Err(format!(
                    "expected BundleChunk after FetchBranch, got {other:?}"
                ))
            }
        }
    }
}

/// ShutdownStarted after Shutdown.
fn shutdown_started(next: &mut dyn FnMut() -> Result<Out, String>) -> Result<(), String> {
    loop {
        match next()? {
            Out::ShutdownStarted(_) => return Ok(()),
            Out::ExecExited(_) | Out::Output(_) => {}
            other => {
                return Err(format!(
                    "expected ShutdownStarted after Shutdown, got {other:?}"
                ))
            }
        }
    }
}

/// Whether process `pid` has ended (gone, or a zombie not yet reaped).
fn vmm_exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| matches!(stat_state(&s), Some('Z' | 'X') | None))
        .unwrap_or(true)
}

/// The state letter of a `/proc/PID/stat` line (after the command name,
/// which may hold spaces and parentheses).
fn stat_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// `why` with what became of the restored vmm: its exit status and last
/// lines, or, still running, the record of its threads and KVM counters
/// (then it is killed).
fn with_vmm_state(g: &mut Guest, why: String) -> String {
    if vmm_exited(g.pid()) {
        let status = match g.wait_exit(Duration::from_secs(5)) {
            Ok(s) => s.to_string(),
            Err(e) => e,
        };
        let lines = g.lines();
        let tail = &lines[lines.len().saturating_sub(5)..];
        return format!(
            "{why}; the vmm exited ({status}); {}; console tail: {}",
            g.stderr_tail(),
            tail.join(" | ")
        );
    }
    match g.wait_exit(Duration::ZERO) {
        Ok(s) => format!("{why}; the vmm exited ({s}); {}", g.stderr_tail()),
        // "the vmm did not exit within 0 s; <where the record is>; <console tail>"
        Err(record) => match record.split_once("; ") {
            Some((_, rest)) => format!("{why}; {rest}"),
            None => format!("{why}; {record}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    use guest_init::policy::rules::Action;
    use guest_init::policy::{ExecContext, Policy};
    use proto::guest::{BundleChunk, ExecExited, ExecRejected, ExecStarted, KilledProcess, Output};

    /// The rules decide each of the scenario's commands as it expects.
    #[test]
    fn the_rules_allow_and_deny_the_scenarios_commands() {
        let path = format!("agents/{AGENT}.md");
        let p = Policy::load(
            AGENT,
            "base",
            |f| Ok((f == path).then(|| RULES.to_string())),
        )
        .expect("the rules load");
        let env = std::collections::BTreeMap::new();
        let ctx = ExecContext {
            workspace: Path::new("/workspace"),
            cwd: Path::new("/workspace"),
            env: &env,
        };
        let decide = |argv: &[&str]| {
            let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
            p.decide_exec(&argv, &ctx, &Default::default()).unwrap()
        };
        for argv in [ECHO, COMMIT, SLEEP] {
            assert_eq!(decide(argv).action, Action::Allow, "{argv:?}");
        }
        let push = decide(PUSH);
        assert_eq!(push.action, Action::Deny);
        assert!(push.rule.contains("git push *"), "{}", push.rule);
        assert_eq!(decide(&["ls"]).action, Action::Deny);
    }

    fn feed(messages: Vec<Out>) -> impl FnMut() -> Result<Out, String> {
        let mut q: VecDeque<Out> = messages.into();
        move || q.pop_front().ok_or_else(|| "no more messages".to_string())
    }

    fn output(id: &str, stream: i32, data: &str) -> Out {
        Out::Output(Output {
            exec_id: id.into(),
            stream,
            data: data.as_bytes().to_vec(),
        })
    }

    fn exited(id: &str, code: i32) -> Out {
        Out::ExecExited(ExecExited {
            exec_id: id.into(),
            status: Some(exec_exited::Status::Code(code)),
            reason: String::new(),
        })
    }

    #[test]
    fn a_command_collects_its_own_output_until_it_exits() {
        let mut next = feed(vec![
            Out::ExecStarted(ExecStarted {
                exec_id: "a1".into(),
                ..Default::default()
            }),
            output("a1", 1, "hello "),
            output("other", 1, "not ours"),
            output("a1", 2, "warning"),
            output("a1", 1, "there\n"),
            exited("a1", 0),
        ]);
        let r = ran(&mut next, "a1", ECHO).unwrap();
        assert_eq!(r.stdout, b"hello there\n");
        assert_eq!(r.stderr, b"warning");
        assert_eq!((r.code, r.signal, r.rejected), (Some(0), None, None));
    }

    #[test]
    fn a_rejection_is_checked_by_reason_and_rule() {
        let rejected = |reason: &str, rule: &str| {
            let mut next = feed(vec![Out::ExecRejected(ExecRejected {
                exec_id: "d1".into(),
                reason: reason.into(),
                rule: rule.into(),
            })]);
            ran(&mut next, "d1", PUSH).unwrap()
        };
        let rule = "bash: \"git push *\" = deny";
        assert_eq!(
            expect_denied(&rejected("denied by policy", rule)).unwrap(),
            rule
        );
        assert!(expect_denied(&rejected("denied by policy", "bash: \"*\" = deny")).is_err());
        assert!(expect_denied(&rejected("rejected by the user", rule)).is_err());
        let mut next = feed(vec![exited("d1", 1)]);
        let e = expect_denied(&ran(&mut next, "d1", PUSH).unwrap()).unwrap_err();
        assert!(e.contains("exit Some(1)"), "{e}");
    }

    #[test]
    fn an_unexpected_message_fails_the_command() {
        let mut next = feed(vec![Out::ShutdownStarted(Default::default())]);
        let e = ran(&mut next, "a1", ECHO).unwrap_err();
        assert!(e.contains("unexpected while running"), "{e}");
        let mut next = feed(vec![]);
        assert_eq!(ran(&mut next, "a1", ECHO).unwrap_err(), "no more messages");
    }

    #[test]
    fn ready_must_name_the_branch_and_base() {
        let ready = |branch: &str, base: &str| {
            Out::Ready(Ready {
                session_id: SESSION.into(),
                branch: branch.into(),
                base_commit: base.into(),
                turn_backend: "cgroup2".into(),
            })
        };
        assert!(expect_ready(&ready("session/direct", "abc"), "session/direct", "abc").is_ok());
        assert!(expect_ready(&ready("main", "abc"), "session/direct", "abc").is_err());
        assert!(expect_ready(&ready("session/direct", "def"), "session/direct", "abc").is_err());
        assert!(expect_ready(&exited("x", 0), "session/direct", "abc").is_err());
    }

    #[test]
    fn the_turn_end_passes_over_late_output_and_names_the_killed() {
        let killed = |command: &str| TurnEnded {
            turn_id: TURN.into(),
            killed: vec![KilledProcess {
                pid: 42,
                command: command.into(),
            }],
        };
        let mut next = feed(vec![
            output("long", 1, ""),
            exited("long", 137),
            Out::TurnEnded(killed("sleep 600")),
        ]);
        let t = turn_ended(&mut next, TURN).unwrap();
        assert!(expect_killed(&t, "sleep").is_ok());
        assert!(expect_killed(&killed("bash"), "sleep").is_err());
        let mut next = feed(vec![Out::BundleChunk(BundleChunk::default())]);
        assert!(turn_ended(&mut next, TURN).is_err());
    }

    #[test]
    fn the_branch_bundle_is_its_chunks_up_to_the_last() {
        let chunk = |data: &str, last: bool| {
            Out::BundleChunk(BundleChunk {
                data: data.as_bytes().to_vec(),
                last,
            })
        };
        let mut next = feed(vec![
            chunk("ab", false),
            exited("long", 137),
            chunk("cd", true),
            chunk("ef", true),
        ]);
        assert_eq!(branch_bundle(&mut next).unwrap(), b"abcd");
        let mut next = feed(vec![
            exited("long", 137),
            Out::ShutdownStarted(Default::default()),
        ]);
        assert!(shutdown_started(&mut next).is_ok());
        let mut next = feed(vec![chunk("ab", true)]);
        assert!(shutdown_started(&mut next).is_err());
    }

    #[test]
    fn the_process_state_comes_after_the_command_name() {
        assert_eq!(stat_state("1234 (vmm) S 1 1234 0"), Some('S'));
        assert_eq!(stat_state("1234 (a) (b) Z 1 1234"), Some('Z'));
        assert_eq!(stat_state("garbage"), None);
        assert!(!vmm_exited(std::process::id()));
    }
}
