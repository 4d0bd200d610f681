//! Starting a VM's virtiofsd processes, one per share, before its vmm:
//!
//! ```text
//! virtiofsd --shared-dir DIR --socket-path N.sock --sandbox namespace
//!           --cache C [--readonly] --tag TAG --migration-on-error guest-error
//!           --log-level error
//! ```
//!
//! run as host-agent's user (root on a jailed node), outside the vmm's jail
//! (`vmm jail` runs only the vmm), in virtiofsd's own sandbox: new mount,
//! PID and network namespaces with the shared directory as its root, and
//! its seccomp filter. Each runs in the VM's socket directory (its working
//! directory; the socket name is relative, so a long state directory never
//! passes the 108 bytes of a socket address), its output in
//! `<vm dir>/virtiofsd-N.log`. host-agent waits until the daemon listens on
//! its socket (or fails naming its last log lines), and for a jailed VM
//! gives the socket to the jail's uid: the directory is inside the jail
//! (`<vm dir>/jail/fs`, seen as `/fs`), owned by root, so the vmm can
//! connect but not replace what is there.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;
use vmm_api::command::FsSpec;

use super::daemons::{listens, Daemon, Started};
use super::Share;
use crate::accounting::process_start_ticks;
use crate::error::{Error, Result};
use crate::path_roots::PathRoots;

pub use super::daemons::{find_under, kill_orphans};

/// The environment variable that names the virtiofsd binary, over the
/// configuration (for tests and development).
pub const ENV_VIRTIOFSD: &str = "AGENTVM_VIRTIOFSD";

/// How long a virtiofsd may take to listen on its socket.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// virtiofsd's `--cache`: how much the guest's kernel may cache of the
/// shared files (`virtiofs_cache`).
///
/// `auto` (the default) keeps what the guest read until the file's
/// attributes change or a timeout (about a second) passes: close to native
/// speed for the usual use, read-mostly caches of registries and
/// toolchains, while changes made on the host are still seen soon.
/// `always` caches without timeouts (fastest; only for directories nobody
/// changes while VMs run), `metadata` caches attributes but not data, and
/// `never` caches nothing (every read goes to the host: for directories the
/// host and guests write at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum VirtiofsCache {
    /// Cache until attributes change or a short timeout.
    #[default]
    Auto,
    /// Cache without timeouts.
    Always,
    /// Cache nothing.
    Never,
    /// Cache attributes, not data.
    Metadata,
}

impl VirtiofsCache {
    /// The value virtiofsd's `--cache` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            VirtiofsCache::Auto => "auto",
            VirtiofsCache::Always => "always",
            VirtiofsCache::Never => "never",
            VirtiofsCache::Metadata => "metadata",
        }
    }
}

/// The virtiofsd to run: `$AGENTVM_VIRTIOFSD`, else the configured path,
/// else `virtiofsd` from PATH.
pub fn binary(configured: Option<&Path>) -> PathBuf {
    match std::env::var_os(ENV_VIRTIOFSD) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => configured
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("virtiofsd")),
    }
}

/// How the node runs its virtiofsd processes.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    /// The binary ([`binary`]).
    pub binary: &'a Path,
    /// `--cache`.
    pub cache: VirtiofsCache,
    /// Where shared directories may lie (`None`: nowhere).
    pub roots: Option<&'a PathRoots>,
}

/// Where a VM in `dir` keeps its share sockets: as the host sees it and as
/// its vmm does (inside the jail for a jailed one).
pub fn socket_dirs(dir: &Path, jailed: bool) -> (PathBuf, PathBuf) {
    if jailed {
        (dir.join("jail").join("fs"), PathBuf::from("/fs"))
    } else {
        (dir.join("fs"), dir.join("fs"))
    }
}

/// The socket of the VM's share number `index`, relative to its socket
/// directory.
fn socket_name(index: usize) -> String {
    format!("{index}.sock")
}

/// virtiofsd's arguments for `share` on `socket`.
pub fn args(share: &Share, socket: &str, cache: VirtiofsCache) -> Vec<String> {
    let mut a: Vec<String> = [
        "--shared-dir",
        share.host_path.as_str(),
        "--socket-path",
        socket,
        "--sandbox",
        "namespace",
        "--cache",
        cache.as_str(),
    ]
    .map(String::from)
    .to_vec();
    if share.read_only {
        a.push("--readonly".into());
    }
    a.extend([
        "--tag".into(),
        share.tag.clone(),
        // A restore hands the new daemon the old one's inodes by path (the
        // vmm keeps virtiofsd's state in the snapshot): one gone from the
        // directory meanwhile answers the guest with errors, rather than
        // failing the whole restore.
        "--migration-on-error".into(),
        "guest-error".into(),
        // Its log is a file in the VM's directory: only what goes wrong.
        "--log-level".into(),
        "error".into(),
    ]);
    a
}

/// A VM's shares, launched: the vmm's `--fs` devices (in share order) and
/// the daemons serving them (killed if dropped before a vmm adopts them).
#[derive(Debug, Default)]
pub struct FsLaunch {
    /// The devices, as the vmm sees their sockets.
    pub specs: Vec<FsSpec>,
    /// The daemons.
    pub daemons: Started,
}

/// Starts a virtiofsd for each of `shares` for the VM in `dir`, jailed as
/// `uid` if given, and waits until each listens. Each share's directory is
/// checked against the node's roots again (they may have changed, or the
/// directory gone, since the share was accepted). On failure the daemons
/// started are killed.
pub async fn launch(
    settings: Settings<'_>,
    dir: &Path,
    uid: Option<u32>,
    shares: &[Share],
) -> Result<FsLaunch> {
    let mut out = FsLaunch::default();
    if shares.is_empty() {
        return Ok(out);
    }
    let mut checked = shares.to_vec();
    super::resolve(settings.roots, "shares", &mut checked)?;
    let (host_dir, inside) = socket_dirs(dir, uid.is_some());
    prepare_dir(&host_dir)?;
    for (i, share) in checked.iter().enumerate() {
        let name = socket_name(i);
        let log = dir.join(format!("virtiofsd-{i}.log"));
        let socket = host_dir.join(&name);
        let daemon = spawn(settings, &host_dir, &name, &log, share)?;
        let pid = daemon.pid;
        let listening = wait_listening(&daemon, &socket, &log, share).await;
        // Held from here: a failure kills it with the others.
        out.daemons.list.push(daemon);
        listening?;
        if let Some(uid) = uid {
            std::os::unix::fs::lchown(&socket, Some(uid), Some(uid)).map_err(|e| {
                Error::io(
                    format!(
                        "giving share {:?}'s socket {} to the jail's uid {uid}",
                        share.tag,
                        socket.display()
                    ),
                    e,
                )
            })?;
        }
        let spec = FsSpec::new(share.tag.as_str(), inside.join(&name))
            .map_err(|e| Error::invalid(format!("shares: {e}")))?;
        tracing::debug!(tag = %share.tag, pid, socket = %socket.display(), "virtiofsd listening");
        out.specs.push(spec);
    }
    Ok(out)
}

/// Makes the socket directory `dir` (with its parents), a real directory
/// owned by host-agent's user, and clears what an earlier daemon left there.
fn prepare_dir(dir: &Path) -> Result<()> {
    let what = |e| {
        Error::io(
            format!("preparing the share socket directory {}", dir.display()),
            e,
        )
    };
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(what)?;
    }
    crate::safe_fs::ensure_dir(dir, None).map_err(what)?;
    for entry in std::fs::read_dir(dir).map_err(what)?.flatten() {
        // Sockets and pid files of daemons gone (a restore replacing a VM).
        let _ = std::fs::remove_file(entry.path());
    }
    Ok(())
}

/// Starts one virtiofsd in `socket_dir`.
fn spawn(
    settings: Settings<'_>,
    socket_dir: &Path,
    socket: &str,
    log_path: &Path,
    share: &Share,
) -> Result<Daemon> {
    let log = std::fs::File::create(log_path)
        .map_err(|e| Error::io(format!("creating {}", log_path.display()), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| Error::io(format!("duplicating {}", log_path.display()), e))?;
    let mut child = tokio::process::Command::new(settings.binary)
        .args(args(share, socket, settings.cache))
        .current_dir(socket_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        // Its own group: it outlives a host-agent that is killed (its VM
        // goes on), and is killed with its sandboxed child as one.
        .process_group(0)
        .kill_on_drop(false)
        .spawn()
        .map_err(|e| {
            Error::Virtiofsd(format!(
                "cannot start {} for share {:?}: {e} (install virtiofsd, or set \
                 virtiofsd_path in the config, --virtiofsd, or ${ENV_VIRTIOFSD})",
                settings.binary.display(),
                share.tag
            ))
        })?;
    let pid = child
        .id()
        .ok_or_else(|| Error::Virtiofsd("virtiofsd exited before its pid was read".into()))?;
    let start_ticks = process_start_ticks(pid).unwrap_or(0);
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let status = match child.wait().await {
            Ok(s) => s.to_string(),
            Err(e) => format!("unknown status ({e})"),
        };
        let _ = tx.send(Some(status));
    });
    Ok(Daemon {
        pid,
        start_ticks,
        tag: share.tag.clone(),
        exited: Some(rx),
    })
}

/// Waits until `daemon` listens on `socket`; fails with its log's last
/// lines if it exits first or does not listen within [`LISTEN_TIMEOUT`].
async fn wait_listening(daemon: &Daemon, socket: &Path, log: &Path, share: &Share) -> Result<()> {
    let deadline = tokio::time::Instant::now() + LISTEN_TIMEOUT;
    let mut delay = Duration::from_millis(2);
    loop {
        if let Some(status) = daemon.exit_status() {
            return Err(Error::Virtiofsd(format!(
                "the virtiofsd of share {:?} ({}) exited ({status}) before listening on {}: {}",
                share.tag,
                share.host_path,
                socket.display(),
                tail_or_nothing(log)
            )));
        }
        let is_socket = std::fs::symlink_metadata(socket).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        });
        if is_socket && listens(daemon.pid) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Virtiofsd(format!(
                "the virtiofsd of share {:?} ({}, pid {}) did not listen on {} within {:?}: {}",
                share.tag,
                share.host_path,
                daemon.pid,
                socket.display(),
                LISTEN_TIMEOUT,
                tail_or_nothing(log)
            )));
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(50));
    }
}

/// The log's last lines, or a note that it said nothing.
fn tail_or_nothing(log: &Path) -> String {
    match crate::supervisor::log_tail(log) {
        t if t.is_empty() => format!("its log {} is empty", log.display()),
        t => t,
    }
}

#[cfg(test)]
mod tests {
    use super::super::Daemons;
    use super::*;

    fn share(ro: bool) -> Share {
        Share {
            tag: "cargo".into(),
            host_path: "/srv/cache/cargo".into(),
            read_only: ro,
            mount_path: "/mnt/cargo".into(),
        }
    }

    #[test]
    fn the_command_line_names_the_directory_socket_cache_and_tag() {
        assert_eq!(
            args(&share(true), "0.sock", VirtiofsCache::Auto).join(" "),
            "--shared-dir /srv/cache/cargo --socket-path 0.sock --sandbox namespace \
             --cache auto --readonly --tag cargo --migration-on-error guest-error \
             --log-level error"
        );
        let rw = args(&share(false), "1.sock", VirtiofsCache::Never);
        assert!(!rw.contains(&"--readonly".to_string()));
        assert!(rw.join(" ").contains("--cache never"));
        for (c, s) in [
            (VirtiofsCache::Always, "always"),
            (VirtiofsCache::Metadata, "metadata"),
        ] {
            assert_eq!(c.as_str(), s);
        }
    }

    #[test]
    fn jailed_vms_see_their_sockets_inside_the_jail() {
        let dir = Path::new("/state/sessions/s1");
        assert_eq!(
            socket_dirs(dir, true),
            (
                PathBuf::from("/state/sessions/s1/jail/fs"),
                PathBuf::from("/fs")
            )
        );
        assert_eq!(
            socket_dirs(dir, false),
            (
                PathBuf::from("/state/sessions/s1/fs"),
                PathBuf::from("/state/sessions/s1/fs")
            )
        );
    }

    #[test]
    fn the_binary_is_the_configured_one_unless_the_environment_names_one() {
        // The variable is read, not set, here: tests run in parallel.
        if std::env::var_os(ENV_VIRTIOFSD).is_none() {
            assert_eq!(binary(None), PathBuf::from("virtiofsd"));
            assert_eq!(
                binary(Some(Path::new("/opt/virtiofsd"))),
                PathBuf::from("/opt/virtiofsd")
            );
        }
    }

    #[tokio::test]
    async fn a_daemon_that_exits_fails_the_launch_with_its_log() {
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        let script = t.path().join("fake-virtiofsd");
        std::fs::write(
            &script,
            "#!/bin/sh\necho 'bad option --frobnicate' >&2\nexit 3\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let roots = PathRoots::new("allowed_share_roots", "x", &[t.path().to_path_buf()]).unwrap();
        let settings = Settings {
            binary: &script,
            cache: VirtiofsCache::Auto,
            roots: Some(&roots),
        };
        let mut s = share(true);
        s.host_path = shared.display().to_string();
        let vm = t.path().join("vm");
        std::fs::create_dir(&vm).unwrap();
        let err = launch(settings, &vm, None, &[s]).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Virtiofsd(_)), "{err:?}");
        assert!(text.contains("share \"cargo\""), "{text}");
        assert!(text.contains("exit status: 3"), "{text}");
        assert!(text.contains("bad option --frobnicate"), "{text}");
        // No roots: refused before anything runs.
        let none = Settings {
            roots: None,
            ..settings
        };
        let err = launch(none, &vm, None, &[share(true)]).await.unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err:?}");
    }

    /// With a real virtiofsd (`$AGENTVM_VIRTIOFSD`, or `virtiofsd` on PATH)
    /// and root (its namespace sandbox): it listens through its sandboxed
    /// child, and ending it takes both. Skipped (saying so) without them.
    #[tokio::test]
    async fn a_real_virtiofsd_listens_and_goes_when_ended() {
        let bin = binary(None);
        let runs = std::process::Command::new(&bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        if !runs || unsafe { libc::geteuid() } != 0 {
            println!(
                "skipped: no virtiofsd to run ({}), or not root",
                bin.display()
            );
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        let roots = PathRoots::new("allowed_share_roots", "x", &[t.path().to_path_buf()]).unwrap();
        let settings = Settings {
            binary: &bin,
            cache: VirtiofsCache::Auto,
            roots: Some(&roots),
        };
        let mut s = share(true);
        s.host_path = shared.display().to_string();
        let vm = t.path().join("vm");
        std::fs::create_dir(&vm).unwrap();
        let launched = launch(settings, &vm, Some(2_000_123_456), &[s])
            .await
            .unwrap();
        assert_eq!(launched.specs[0].to_string(), "cargo:/fs/0.sock");
        let socket = vm.join("jail/fs/0.sock");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            std::fs::symlink_metadata(&socket).unwrap().uid(),
            2_000_123_456
        );
        let pid = launched.daemons.pids()[0];
        let daemons = Daemons::default();
        daemons.adopt(launched.daemons);
        daemons.end();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while process_start_ticks(pid).is_some() && !crate::accounting::is_zombie(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "virtiofsd {pid} still runs"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
