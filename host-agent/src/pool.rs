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
//!
//! A warm VM of an image whose golden snapshot has a network device holds
//! its network ([`WarmNetwork`]), made before its restore with an empty
//! allowlist: the session that takes it takes the network too, a warm VM
//! dropped releases it. After a restart, nothing holds a warm VM's
//! namespace: the session manager removes it with the other orphans.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::accounting::process_start_ticks;
use crate::jail_uids::JailUids;
use crate::network::namespace::VmNetwork;
use crate::network::node::NodeNetwork;
use crate::supervisor::VmmProcess;

/// The file in a warm VM's directory that names its network namespace. It
/// moves with the directory when a session takes the VM: the namespace keeps
/// the name made from the pool directory, and a restarted host-agent reads
/// the session's namespace here rather than deriving it from the session's
/// directory (see `recover.rs`).
pub const NETNS_FILE: &str = "network-namespace";

/// The network made ahead for a warm VM, with the node's network that
/// gives its addresses back when it is released.
#[derive(Debug)]
pub struct WarmNetwork {
    node: Arc<NodeNetwork>,
    vm: VmNetwork,
}

impl WarmNetwork {
    /// The network `vm`, made by `node`.
    pub fn new(node: Arc<NodeNetwork>, vm: VmNetwork) -> WarmNetwork {
        WarmNetwork { node, vm }
    }

    /// The VM's network (its namespace, veth pair and addresses).
    pub fn vm(&self) -> &VmNetwork {
        &self.vm
    }

    /// Hands the network over to its new owner (a session), which releases
    /// it when it is done with it.
    pub fn into_vm(self) -> VmNetwork {
        self.vm
    }

    /// Removes the namespace and gives its addresses back (runs `ip`: call
    /// it where blocking for a few milliseconds is fine).
    pub fn release(self) {
        self.node.release(&self.vm);
    }
}

/// One warm VM: its paused vmm and, for an image with a network, the
/// network it was restored in.
#[derive(Debug)]
pub struct WarmVm {
    /// The vmm process, restored paused.
    pub vmm: VmmProcess,
    /// Its network, made ahead with an empty allowlist.
    pub network: Option<WarmNetwork>,
}

/// The warm VMs of every image.
pub struct Pool {
    warm: Mutex<HashMap<String, VecDeque<WarmVm>>>,
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

    /// Kills a warm VM that is not wanted, removes its directory, gives
    /// its uid back and releases its network. The network is released on
    /// the blocking pool when called within the runtime (it runs `ip`), at
    /// once otherwise.
    pub fn discard(&self, w: WarmVm) {
        let network = self.discard_vmm(w);
        if let Some(n) = network {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn_blocking(move || n.release())),
                Err(_) => n.release(),
            }
        }
    }

    /// [`Pool::discard`] but for the network, which is returned.
    fn discard_vmm(&self, w: WarmVm) -> Option<WarmNetwork> {
        w.vmm.kill();
        let _ = std::fs::remove_dir_all(&w.vmm.dir);
        if let Some(uid) = w.vmm.jail_uid {
            self.uids.release(uid);
        }
        w.network
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<WarmVm>>> {
        self.warm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a live warm VM of `image`, moved into `dest` (its directory is
    /// renamed; the vmm's open files and bound sockets follow the inode).
    /// Its network, if any, comes with it under the name it was made with:
    /// the caller owns it from now on.
    pub fn take(&self, image: &str, dest: &Path) -> Option<WarmVm> {
        loop {
            let w = self.lock().get_mut(image)?.pop_front()?;
            if w.vmm.exit_status().is_some() {
                self.discard(w);
                continue;
            }
            if let Some(parent) = dest.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            if std::fs::rename(&w.vmm.dir, dest).is_err() {
                self.discard(w);
                continue;
            }
            let _ = std::fs::remove_file(dest.join("pid"));
            return Some(WarmVm {
                vmm: w.vmm.moved_to(dest),
                network: w.network,
            });
        }
    }

    /// Number of live warm VMs (all images).
    pub fn ready(&self) -> usize {
        self.lock()
            .values()
            .map(|q| q.iter().filter(|w| w.vmm.exit_status().is_none()).count())
            .sum()
    }

    /// How many warm VMs of `image` are alive (those that died are
    /// discarded).
    pub fn count(&self, image: &str) -> usize {
        let mut map = self.lock();
        let Some(q) = map.get_mut(image) else {
            return 0;
        };
        let (alive, dead): (VecDeque<_>, VecDeque<_>) =
            q.drain(..).partition(|w| w.vmm.exit_status().is_none());
        *q = alive;
        let n = q.len();
        drop(map);
        for w in dead {
            self.discard(w);
        }
        n
    }

    /// Drops (kills) the warm VMs of `image`, releasing their networks.
    pub fn drain(&self, image: &str) {
        let removed = self.lock().remove(image);
        for w in removed.into_iter().flatten() {
            self.discard(w);
        }
    }

    /// Kills every warm VM and releases their networks before returning
    /// (on shutdown: the runtime may not run what is spawned any more).
    pub fn drain_all(&self) {
        let all: Vec<WarmVm> = self.lock().drain().flat_map(|(_, q)| q).collect();
        for w in all {
            if let Some(n) = self.discard_vmm(w) {
                n.release();
            }
        }
    }

    /// Adds a warm VM of `image` (restored and paused).
    pub fn push(&self, image: &str, w: WarmVm) {
        self.lock()
            .entry(image.to_string())
            .or_default()
            .push_back(w);
    }

    /// Kills warm VMs left by an earlier run and removes their directories.
    /// Their namespaces (no session owns them) are removed with the other
    /// orphans by the session manager's recovery.
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
