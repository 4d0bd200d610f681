//! Turns: every process an Exec starts belongs to its turn, and EndTurn kills
//! them all, including ones that daemonised or left their process group.
//!
//! Two backends, detected at start ([`detect`]):
//!
//! * **cgroup2** (preferred; what a guest uses, since PID 1 mounts cgroup2 at
//!   /sys/fs/cgroup): each turn gets a cgroup `turn-<n>` under
//!   `<our cgroup>/guest-init-<pid>-<nanos>`; a command joins it between fork and
//!   exec, so nothing it starts can leave. Killing writes `cgroup.kill`
//!   (Linux 5.14+) or freezes the group and SIGKILLs every member.
//!   Works on hybrid hosts too, where a writable cgroup2 is mounted beside
//!   v1 controllers (e.g. /sys/fs/cgroup/unified).
//! * **process-tree** (fallback where no cgroup2 is writable): guest-init is
//!   PID 1 or a child subreaper, so orphans re-parent to it. A turn's
//!   processes are the descendants of its commands plus re-parented orphans
//!   whose environment carries the turn's number ([`TURN_ENV`], set on every
//!   command and inherited), or, for orphans that cleared their environment,
//!   that started after the turn's first command (attributed to the latest
//!   turn started before them). An agent can defeat this fallback by
//!   clearing or forging the variable; such a process is still killed when
//!   the session ends. cgroup2 has no such gap. Killing repeats until a scan finds nothing,
//!   to catch processes forked meanwhile.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::reaper::{self, ProcStat};

/// How turns are tracked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// Turn cgroups are created under this directory.
    Cgroup2(PathBuf),
    /// Process-tree tracking.
    ProcessTree,
}

impl Backend {
    /// "cgroup2" or "process-tree".
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cgroup2(_) => "cgroup2",
            Self::ProcessTree => "process-tree",
        }
    }
}

/// Finds a writable cgroup2 hierarchy, else falls back to process-tree.
pub fn detect() -> Backend {
    match cgroup2_parent() {
        Ok(dir) => Backend::Cgroup2(dir),
        Err(why) => {
            tracing::info!(%why, "no writable cgroup2: turns use process-tree tracking");
            Backend::ProcessTree
        }
    }
}

fn cgroup2_parent() -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    let mount = mountinfo
        .lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split_whitespace().next()? == "cgroup2")
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .ok_or("no cgroup2 mount in /proc/self/mountinfo")?;
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("no cgroup2 entry in /proc/self/cgroup")?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    // Unique per run: a stale directory from a crashed run never collides.
    let dir = mount
        .join(rel.trim_start_matches('/'))
        .join(format!("guest-init-{}-{nanos:09}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    // Prove that a turn cgroup can be made; the directories are created
    // again on first use and removed when the session's turns are dropped.
    let probe = dir.join("probe");
    let ok = std::fs::create_dir(&probe).is_ok() && probe.join("cgroup.procs").exists();
    let _ = std::fs::remove_dir(&probe);
    let _ = std::fs::remove_dir(&dir);
    if !ok {
        return Err(format!(
            "cannot create a usable cgroup under {}",
            dir.display()
        ));
    }
    Ok(dir)
}

/// A process that EndTurn killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Killed {
    /// Its pid.
    pub pid: u32,
    /// Its command line.
    pub command: String,
}

/// Next turn number; 0 is reserved for the session-end sweep.
static NEXT_TAG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Environment variable naming a command's turn (its number), which
/// process-tree tracking uses to attribute re-parented orphans.
pub const TURN_ENV: &str = "GUEST_INIT_TURN";

/// Where a new command of a turn goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// `cgroup.procs` of the turn's cgroup, with the cgroup2 backend.
    pub cgroup_procs: Option<PathBuf>,
    /// The turn's number, exported as [`TURN_ENV`].
    pub tag: u64,
}

/// One turn's tracking state.
#[derive(Debug)]
pub struct Turn {
    cgroup: Option<PathBuf>,
    tag: u64,
    roots: HashSet<u32>,
    start: Option<u64>,
}

/// All live turns.
#[derive(Debug)]
pub struct Turns {
    backend: Backend,
    turns: HashMap<String, Turn>,
    /// memory.max of the turns' parent cgroup (the session's memory).
    memory_max: Option<u64>,
}

impl Turns {
    /// Turns tracked with `backend`.
    pub fn new(backend: Backend) -> Self {
        Self {
            backend,
            turns: HashMap::new(),
            memory_max: None,
        }
    }

    /// Caps the memory of all turns together at `bytes`: memory.max of the
    /// turns' parent cgroup, written whenever that is made (past it the
    /// kernel reclaims, then its OOM killer stops a command of the session,
    /// never guest-init). Needs the cgroup2 backend and the memory
    /// controller where the parent is made (enabled there if it is not).
    pub fn limit_memory(&mut self, bytes: u64) -> std::io::Result<()> {
        let Backend::Cgroup2(parent) = &self.backend else {
            return Err(std::io::Error::other(
                "turns are tracked by process tree here (no writable cgroup2), and a memory \
                 limit needs a cgroup",
            ));
        };
        let above = parent
            .parent()
            .ok_or_else(|| std::io::Error::other("the turns' cgroup has no parent"))?;
        let controllers = std::fs::read_to_string(above.join("cgroup.controllers"))?;
        if !controllers.split_whitespace().any(|c| c == "memory") {
            return Err(std::io::Error::other(format!(
                "the memory controller is not available in {}",
                above.display()
            )));
        }
        let control = above.join("cgroup.subtree_control");
        let enabled = std::fs::read_to_string(&control).unwrap_or_default();
        if !enabled.split_whitespace().any(|c| c == "memory") {
            std::fs::write(&control, "+memory").map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot enable the memory controller in {}: {e}",
                        control.display()
                    ),
                )
            })?;
        }
        self.memory_max = Some(bytes);
        if parent.exists() {
            std::fs::write(parent.join("memory.max"), bytes.to_string())?;
        }
        Ok(())
    }

    /// The memory limit of the turns, if any.
    pub fn memory_limit(&self) -> Option<u64> {
        self.memory_max
    }

    /// The backend in use.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Makes sure `turn_id` exists; returns where a new command of it goes.
    pub fn prepare(&mut self, turn_id: &str) -> std::io::Result<Placement> {
        if !self.turns.contains_key(turn_id) {
            // Unique in the process, so turns of different sessions (tests
            // run several in one process) never share a tag.
            let tag = NEXT_TAG.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let cgroup = match &self.backend {
                Backend::Cgroup2(parent) => {
                    std::fs::create_dir_all(parent)?;
                    // Again each time: the parent goes when no turn is left.
                    if let Some(bytes) = self.memory_max {
                        std::fs::write(parent.join("memory.max"), bytes.to_string())?;
                    }
                    let dir = parent.join(format!("turn-{tag}"));
                    std::fs::create_dir(&dir)?;
                    Some(dir)
                }
                Backend::ProcessTree => None,
            };
            self.turns.insert(
                turn_id.to_string(),
                Turn {
                    cgroup,
                    tag,
                    roots: HashSet::new(),
                    start: None,
                },
            );
        }
        let t = &self.turns[turn_id];
        Ok(Placement {
            cgroup_procs: t.cgroup.as_ref().map(|d| d.join("cgroup.procs")),
            tag: t.tag,
        })
    }

    /// Records a command started in `turn_id`.
    pub fn add_root(&mut self, turn_id: &str, pid: u32) {
        if let Some(t) = self.turns.get_mut(turn_id) {
            t.roots.insert(pid);
            if let Some(s) = reaper::stat(pid) {
                t.start = Some(t.start.map_or(s.start, |x| x.min(s.start)));
            }
        }
    }

    /// Removes `turn_id` for killing; also returns the start times of the
    /// other live turns (for orphan attribution).
    pub fn take(&mut self, turn_id: &str) -> Option<(Turn, Vec<u64>)> {
        let t = self.turns.remove(turn_id)?;
        let others = self.turns.values().filter_map(|t| t.start).collect();
        Some((t, others))
    }

    /// Removes the turns' parent cgroup once no turn is left.
    pub fn remove_parent_if_idle(&self) {
        if let Backend::Cgroup2(parent) = &self.backend {
            if self.turns.is_empty() {
                let _ = std::fs::remove_dir(parent);
            }
        }
    }

    /// Ids of every live turn.
    pub fn ids(&self) -> Vec<String> {
        self.turns.keys().cloned().collect()
    }
}

impl Drop for Turns {
    /// The session is gone: kill what its turns left (cgroup2) and remove
    /// the directories, so nothing outlives the session on a shared host.
    fn drop(&mut self) {
        if let Backend::Cgroup2(parent) = &self.backend {
            for t in self.turns.values() {
                if let Some(dir) = &t.cgroup {
                    let members = cgroup_members(dir);
                    if !members.is_empty() {
                        kill_cgroup(dir, &members);
                    }
                    for _ in 0..20 {
                        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            let _ = std::fs::remove_dir(parent);
        }
    }
}

impl Turn {
    /// Kills every process of the turn (blocking; call off the async
    /// runtime). `managed` holds pids guest-init spawned itself (never
    /// mistaken for orphans); `other_starts` the start times of other turns.
    pub fn kill(self, managed: &HashSet<u32>, other_starts: &[u64]) -> Vec<Killed> {
        let mut killed = Vec::new();
        let mut seen = HashSet::new();
        for _ in 0..100 {
            let members: Vec<u32> = match &self.cgroup {
                Some(dir) => cgroup_members(dir),
                None => self
                    .tree_members(managed, other_starts)
                    .into_iter()
                    .filter(|p| !seen.contains(p))
                    .collect(),
            };
            if members.is_empty() {
                break;
            }
            for pid in &members {
                if seen.insert(*pid) {
                    killed.push(Killed {
                        pid: *pid,
                        command: reaper::cmdline(*pid),
                    });
                }
            }
            match &self.cgroup {
                Some(dir) => kill_cgroup(dir, &members),
                None => {
                    // Stop them all first, so that no parent sees a child die
                    // and exits (or forks) before its own SIGKILL arrives.
                    for sig in [libc::SIGSTOP, libc::SIGKILL] {
                        for pid in &members {
                            // SAFETY: kill(2) with a pid we found in this turn; no pointers.
                            unsafe { libc::kill(*pid as libc::pid_t, sig) };
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(dir) = &self.cgroup {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        killed
    }

    fn tree_members(&self, managed: &HashSet<u32>, other_starts: &[u64]) -> Vec<u32> {
        let me = reaper::self_pid();
        let procs: Vec<ProcStat> = reaper::all_processes()
            .into_iter()
            .filter(|p| p.state != 'Z' && p.pid != me && p.pid != 1)
            .collect();
        let mut members: HashSet<u32> = HashSet::new();
        for p in &procs {
            if self.roots.contains(&p.pid) {
                members.insert(p.pid);
            } else if p.ppid == me && !managed.contains(&p.pid) {
                // A re-parented orphan: ours if its environment names this
                // turn; without the tag, if it started after this turn did and
                // no other turn started between the two.
                if self.tag == 0 {
                    // The session-end sweep takes every orphan.
                    members.insert(p.pid);
                } else if let Some(tag) = turn_tag(p.pid) {
                    if tag == self.tag {
                        members.insert(p.pid);
                    }
                } else if let Some(start) = self.start {
                    let later_turn = other_starts.iter().any(|&o| o > start && o <= p.start);
                    if p.start >= start && !later_turn {
                        members.insert(p.pid);
                    }
                }
            }
        }
        // Descendants of everything found so far.
        let mut grew = true;
        while grew {
            grew = false;
            for p in &procs {
                if !members.contains(&p.pid) && members.contains(&p.ppid) {
                    members.insert(p.pid);
                    grew = true;
                }
            }
        }
        members.into_iter().collect()
    }
}

/// Process-tree backend, session end: kills every re-parented orphan (and
/// its descendants) that guest-init did not spawn itself, whatever turn it
/// claims. Returns what was killed.
pub fn sweep_orphans(managed: &HashSet<u32>) -> Vec<Killed> {
    let sweep = Turn {
        cgroup: None,
        tag: 0,
        roots: HashSet::new(),
        start: None,
    };
    sweep.kill(managed, &[])
}

fn turn_tag(pid: u32) -> Option<u64> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{TURN_ENV}=");
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

fn cgroup_members(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

fn kill_cgroup(dir: &Path, members: &[u32]) {
    if std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    let _ = std::fs::write(dir.join("cgroup.freeze"), "1");
    for pid in members {
        // SAFETY: kill(2) with a pid listed in the turn's cgroup; no pointers.
        unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
    }
    let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cgroup2 tree as plain files: enough for the limit's bookkeeping
    /// (this test machine need not have cgroup2's memory controller).
    fn fake_tree(controllers: &str) -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.controllers"), controllers).unwrap();
        std::fs::write(t.path().join("cgroup.subtree_control"), "cpu\n").unwrap();
        let parent = t.path().join("guest-init-1-000000001");
        (t, parent)
    }

    #[test]
    fn the_memory_limit_is_written_on_the_turns_parent_whenever_it_is_made() {
        let (t, parent) = fake_tree("cpu io memory pids\n");
        let mut turns = Turns::new(Backend::Cgroup2(parent.clone()));
        turns.limit_memory(512 << 20).unwrap();
        assert_eq!(
            std::fs::read_to_string(t.path().join("cgroup.subtree_control")).unwrap(),
            "+memory",
            "the controller is enabled where the parent is made"
        );
        assert_eq!(turns.memory_limit(), Some(512 << 20));
        turns.prepare("t1").unwrap();
        assert_eq!(
            std::fs::read_to_string(parent.join("memory.max")).unwrap(),
            (512u64 << 20).to_string()
        );
        // Made again after it went away.
        std::fs::remove_file(parent.join("memory.max")).unwrap();
        turns.prepare("t2").unwrap();
        assert!(parent.join("memory.max").exists());
    }

    #[test]
    fn a_memory_limit_needs_cgroup2_and_its_memory_controller() {
        let e = Turns::new(Backend::ProcessTree)
            .limit_memory(1 << 30)
            .unwrap_err();
        assert!(e.to_string().contains("needs a cgroup"), "{e}");
        let (_t, parent) = fake_tree("cpu pids\n");
        let e = Turns::new(Backend::Cgroup2(parent))
            .limit_memory(1 << 30)
            .unwrap_err();
        assert!(
            e.to_string().contains("memory controller is not available"),
            "{e}"
        );
    }
}
