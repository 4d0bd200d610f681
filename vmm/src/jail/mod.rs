//! `vmm jail`: starts a vmm confined to a per-VM directory. The jailer (this
//! process, running as root) prepares the directory, a cgroup with CPU and
//! memory limits, and new mount, PID, IPC, UTS and network namespaces; the
//! child pivots into the directory, applies resource limits,
//! drops to an unprivileged uid/gid and execs the vmm copied into it. The
//! jailer waits, forwards SIGTERM/SIGINT/SIGHUP, and exits with the vmm's code.
//!
//! Paths given to the jailed vmm are paths inside the jail: bring files in
//! with `--bind HOST_PATH:JAIL_PATH[:ro]`.
//!
//! The network namespace is not optional: a jailed vmm always gets its own,
//! with only loopback up (plus the taps given with `--tap`), so a compromised
//! device model cannot reach the host's loopback services, the cloud metadata
//! address or abstract Unix sockets of the host's namespace.

pub mod cgroup;
mod network;
mod setup;

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use cgroup::{Cgroup, CgroupLimits};

/// A file or directory made visible inside the jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// Host path.
    pub source: PathBuf,
    /// Absolute path inside the jail.
    pub target: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

impl std::str::FromStr for BindMount {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.splitn(3, ':');
        let source = parts.next().unwrap_or_default();
        let target = parts.next().unwrap_or_default();
        let read_only = match parts.next() {
            None => false,
            Some("ro") => true,
            Some(other) => return Err(format!("invalid bind option {other:?} in {s:?}: only ro")),
        };
        if source.is_empty() || !target.starts_with('/') || target.contains("..") {
            return Err(format!(
                "invalid bind {s:?}: expected HOST_PATH:/ABSOLUTE_JAIL_PATH[:ro] without '..'"
            ));
        }
        Ok(BindMount {
            source: source.into(),
            target: target.into(),
            read_only,
        })
    }
}

/// Everything `vmm jail` needs.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// Name of the VM (cgroup name and hostname); letters, digits, '-' and '_'.
    pub id: String,
    /// The jail's root directory (created if missing).
    pub root: PathBuf,
    /// uid the vmm runs as.
    pub uid: u32,
    /// gid the vmm runs as.
    pub gid: u32,
    /// Taps for the jail's network namespace: a host tap of that name is moved
    /// in (and back out when the VM ends), any other is created inside.
    pub taps: Vec<String>,
    /// A network namespace to join (made by the caller, holding the VM's
    /// tap) instead of a new one.
    pub netns: Option<PathBuf>,
    /// Files brought into the jail.
    pub binds: Vec<BindMount>,
    /// Host devices made available (from /dev/kvm, /dev/net/tun, /dev/urandom, /dev/userfaultfd).
    pub devices: Vec<String>,
    /// cgroup limits.
    pub limits: CgroupLimits,
    /// Where cgroups are mounted (normally /sys/fs/cgroup).
    pub cgroup_root: PathBuf,
    /// RLIMIT_NOFILE for the vmm.
    pub nofile: u64,
    /// RLIMIT_FSIZE for the vmm (largest file it may write), if any.
    pub fsize: Option<u64>,
    /// Arguments for the jailed vmm (e.g. `run --kernel /kernel ...`).
    pub vmm_args: Vec<String>,
}

/// Errors preparing or starting a jail.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// A bad option.
    #[error("{0}")]
    Invalid(String),
    /// Must run as root.
    #[error("vmm jail must run as root (it creates namespaces, device nodes and cgroups)")]
    NotRoot,
    /// A preparation step failed.
    #[error("cannot prepare the jail at {path}: {what}: {source}")]
    Prepare {
        /// The path involved.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The cgroup could not be set up.
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    /// unshare(2) failed.
    #[error("cannot create namespaces: {0}")]
    Unshare(std::io::Error),
    /// Opening or switching network namespaces failed.
    #[error("cannot set up the jail's network: {what}: {source}")]
    Network {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A link could not be moved or brought up.
    #[error("cannot {what} {tap}: {source}")]
    Tap {
        /// The interface.
        tap: String,
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A tap could not be made persistent and owned by the jail's uid.
    #[error("cannot prepare tap {tap} for the jailed vmm: {source}")]
    TapSetup {
        /// The interface.
        tap: String,
        /// The error.
        #[source]
        source: crate::devices::virtio::net::tap::TapError,
    },
    /// The jailed vmm could not be started.
    #[error("cannot start the jailed vmm: {0}")]
    Spawn(std::io::Error),
}

impl JailConfig {
    /// Checks the options before anything is created.
    pub fn validate(&self) -> Result<(), JailError> {
        let invalid = |m: String| Err(JailError::Invalid(m));
        if self.id.is_empty()
            || self.id.len() > 64
            || !self
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return invalid(format!(
                "invalid jail id {:?}: 1 to 64 letters, digits, '-' or '_'",
                self.id
            ));
        }
        if self.uid == 0 || self.gid == 0 {
            return invalid("the jailed vmm must not run as uid or gid 0".into());
        }
        if self.vmm_args.is_empty() {
            return invalid("no vmm arguments after --: e.g. -- run --kernel /kernel".into());
        }
        for (i, tap) in self.taps.iter().enumerate() {
            if !network::valid_tap_name(tap) {
                return invalid(format!(
                    "invalid tap name {tap:?}: 1 to {} letters, digits, '-', '_' or '.'",
                    network::MAX_IFNAME
                ));
            }
            if self.taps[..i].contains(tap) {
                return invalid(format!("tap {tap:?} given twice"));
            }
        }
        for d in &self.devices {
            if !setup::KNOWN_DEVICES.iter().any(|(name, ..)| name == d) {
                return invalid(format!(
                    "unknown device {d:?}: choose from {}",
                    setup::KNOWN_DEVICES
                        .iter()
                        .map(|(n, ..)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        Ok(())
    }
}

fn cstring(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| JailError::Invalid(format!("path {} contains a NUL byte", p.display())))
}

/// Host directories holding the shared libraries a dynamically linked vmm
/// needs; bound read-only into the jail (a statically linked vmm needs none).
pub(crate) const LIBRARY_DIRS: &[&str] = &["/lib", "/lib64", "/usr/lib", "/usr/lib64"];

/// Prepares the jail, starts the jailed vmm and waits for it; returns its exit code.
pub fn run(config: &JailConfig) -> Result<i32, JailError> {
    config.validate()?;
    let mut config = config.clone();
    for dir in LIBRARY_DIRS {
        let path = Path::new(dir);
        // /lib and /lib64 are often links into /usr: bind real directories only once.
        if path.is_dir() && !path.is_symlink() && !config.binds.iter().any(|b| b.target == path) {
            config.binds.push(BindMount {
                source: path.into(),
                target: path.into(),
                read_only: true,
            });
        }
    }
    if !config.taps.is_empty() && !config.devices.iter().any(|d| d == "tun") {
        config.devices.push("tun".into());
    }
    let config = &config;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(JailError::NotRoot);
    }
    let root = setup::prepare_root(config)?;
    let cgroup = Cgroup::create(&config.cgroup_root, &config.id, &config.limits)?;

    // Always a network namespace apart from the host's: a new one with only
    // loopback and the jail's taps, or the one the caller made for the VM.
    let joined = config
        .netns
        .as_deref()
        .map(|path| {
            std::fs::File::open(path).map_err(|source| JailError::Prepare {
                path: path.into(),
                what: "opening the network namespace to join",
                source,
            })
        })
        .transpose()?;
    if let Some(file) = &joined {
        let same_as_host = match (file.metadata(), std::fs::metadata("/proc/self/ns/net")) {
            (Ok(j), Ok(h)) => j.ino() == h.ino() && j.dev() == h.dev(),
            _ => false,
        };
        if same_as_host {
            return Err(JailError::Invalid(
                "--netns-path names the host's own network namespace: the vmm would reach the host's network"
                    .into(),
            ));
        }
    }
    // The VM's keeper (see `crate::keeper`), forked before the namespaces
    // exist: the vmm is init of its PID namespace, whose exit would wait
    // for a keeper inside it. Detached, so the vmm is the jailer's only
    // child. Without one the VM is torn down in the vmm's exit, as before.
    let keeper = crate::keeper::spawn(true)
        .map_err(|e| tracing::warn!("{e}; the VM will be torn down in the vmm's exit"))
        .ok();
    let mut flags =
        libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
    if joined.is_none() {
        flags |= libc::CLONE_NEWNET;
    }
    let host_netns = network::current_netns()?;
    // SAFETY: unshare only changes this process's namespaces; the jailer is single-threaded
    // here (no vmm threads exist in `vmm jail`), which CLONE_NEWNS requires.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(JailError::Unshare(std::io::Error::last_os_error()));
    }
    if let (Some(file), Some(path)) = (&joined, config.netns.as_deref()) {
        // SAFETY: setns on a namespace file this function opened; CLONE_NEWNET makes the
        // kernel refuse a file that is not a network namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(JailError::Prepare {
                path: path.into(),
                what: "joining the network namespace (is it one?)",
                source: std::io::Error::last_os_error(),
            });
        }
    }
    // Dropped after the vmm ends (or on an error below): host taps go back to the host.
    let _network = network::JailNetwork::setup(host_netns, &config.taps, config.uid)?;

    // Held until the vmm has ended: the vmm checks it is still open.
    let alive = setup::AlivePipe::new()?;
    let child_setup = setup::ChildSetup::new(config, &root, &cgroup, &alive)?;
    let mut command = Command::new("/vmm");
    command.args(&config.vmm_args);
    let keeper_fd = keeper.as_ref().map(|k| k.as_raw_fd());
    if let Some(fd) = keeper_fd {
        command.env(crate::keeper::INHERITED_ENV, fd.to_string());
    }
    // SAFETY: the closure runs in the forked child before exec; it only makes system calls
    // (mount, pivot_root, setrlimit, setuid, fcntl...) on data prepared before the fork and
    // does not allocate or take locks.
    unsafe {
        command.pre_exec(move || {
            child_setup.enter()?;
            if let Some(fd) = keeper_fd {
                // The keeper's socket is the one descriptor the vmm inherits on purpose.
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = command.spawn().map_err(JailError::Spawn)?;
    // The vmm's copy is its own now: the keeper lets go when that closes.
    drop(keeper);
    let code = setup::wait_forwarding_signals(child);
    drop(alive);
    cgroup.remove();
    Ok(code)
}

/// Makes a C string of a path for use after fork.
pub(crate) fn path_cstring(p: &Path) -> Result<CString, JailError> {
    cstring(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_parse() {
        let b: BindMount = "/srv/k.elf:/kernel:ro".parse().unwrap();
        assert_eq!(b.target, PathBuf::from("/kernel"));
        assert!(b.read_only);
        assert!("/a:relative".parse::<BindMount>().is_err());
        assert!("/a:/b/../etc".parse::<BindMount>().is_err());
        assert!("/a:/b:rw".parse::<BindMount>().is_err());
    }
}
