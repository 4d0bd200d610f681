//! Warm pool: per image, N vmm processes restored from the golden snapshot
//! and left paused, so Create is an assignment plus a `resume`.
//!
//! Warm VMs live in `<state>/pool/<uuid>/` with a `pid` file. They are not
//! persisted as sessions: a host-agent that restarts kills the leftovers it
//! finds there and fills the pool anew. A jailed warm VM holds a uid of its
//! own ([`JailUids`]); the session that takes it keeps that uid, a warm VM
//! dropped gives it back. This module is the pool itself; filling it is
//! the session manager's ([`crate::sessions`], `warm.rs`), and how a VM is
//! restored is [`crate::launch`].

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::accounting::process_start_ticks;
use crate::jail_uids::JailUids;
use crate::supervisor::VmmProcess;

/// The warm VMs of every image.
pub struct Pool {
    warm: Mutex<HashMap<String, VecDeque<VmmProcess>>>,
    uids: Arc<JailUids>,
}

impl Pool {
    /// An empty pool whose jailed VMs take their uids from `uids`.
    pub fn new(uids: Arc<JailUids>) -> Pool {
        Pool {
            warm: Mutex::new(HashMap::new()),
            uids,
        }
    }

    /// Kills a warm VM that is not wanted, removes its directory and gives
    /// its uid back.
    /// Kills a warm VM, removes its directory and gives back its uid.
    pub fn discard(&self, vm: &VmmProcess) {
        vm.kill();
        let _ = std::fs::remove_dir_all(&vm.dir);
        if let Some(uid) = vm.jail_uid {
            self.uids.release(uid);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<VmmProcess>>> {
        self.warm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a live warm VM of `image`, moved into `dest` (its directory is
    /// renamed; the vmm's open files and bound sockets follow the inode).
    pub fn take(&self, image: &str, dest: &Path) -> Option<VmmProcess> {
        loop {
            let vm = self.lock().get_mut(image)?.pop_front()?;
            if vm.exit_status().is_some() {
                self.discard(&vm);
                continue;
            }
            if let Some(parent) = dest.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            if std::fs::rename(&vm.dir, dest).is_err() {
                self.discard(&vm);
                continue;
            }
            let _ = std::fs::remove_file(dest.join("pid"));
            return Some(vm.moved_to(dest));
        }
    }

    /// Number of live warm VMs (all images).
    pub fn ready(&self) -> usize {
        self.lock()
            .values()
            .map(|q| q.iter().filter(|v| v.exit_status().is_none()).count())
            .sum()
    }

    /// How many warm VMs of `image` are alive.
    pub fn count(&self, image: &str) -> usize {
        let mut map = self.lock();
        let Some(q) = map.get_mut(image) else {
            return 0;
        };
        let (alive, dead): (VecDeque<_>, VecDeque<_>) =
            q.drain(..).partition(|v| v.exit_status().is_none());
        *q = alive;
        let n = q.len();
        drop(map);
        for vm in &dead {
            self.discard(vm);
        }
        n
    }

    /// Drops (kills) the warm VMs of `image`.
    pub fn drain(&self, image: &str) {
        let removed = self.lock().remove(image);
        for vm in removed.into_iter().flatten() {
            self.discard(&vm);
        }
    }

    /// Kills every warm VM (on shutdown).
    pub fn drain_all(&self) {
        let all: Vec<VmmProcess> = self.lock().drain().flat_map(|(_, q)| q).collect();
        for vm in all {
            self.discard(&vm);
        }
    }

    /// Adds a warm VM of `image` (restored and paused).
    pub fn push(&self, image: &str, vm: VmmProcess) {
        self.lock()
            .entry(image.to_string())
            .or_default()
            .push_back(vm);
    }

    /// Kills warm VMs left by an earlier run and removes their directories.
    pub fn clean_leftovers(dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if let Ok(text) = std::fs::read_to_string(path.join("pid")) {
                let mut it = text.split_whitespace();
                let pid: Option<u32> = it.next().and_then(|v| v.parse().ok());
                let ticks: Option<u64> = it.next().and_then(|v| v.parse().ok());
                if let (Some(pid), Some(ticks)) = (pid, ticks) {
                    if process_start_ticks(pid) == Some(ticks) {
                        // SAFETY: kill(2) on a pid verified by its start time.
                        unsafe {
                            libc::kill(pid as libc::pid_t, libc::SIGKILL);
                        }
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}
