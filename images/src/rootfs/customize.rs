//! Turns the Debian base tree into the guest's root: guest-init as
//! /sbin/init, the unprivileged `agent` user, hostname, fstab. Works on the
//! tree's files directly (no chroot), so nothing runs from the tree.

use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, IoContext, Result};

/// Name of the unprivileged user for the agent's commands.
pub const AGENT_USER: &str = "agent";
/// Its uid and gid.
pub const AGENT_ID: u32 = 1000;
/// The guest's hostname until a session sets one.
pub const HOSTNAME: &str = "agentvm";

const STEP: &str = "customize the root filesystem";

/// Resolves `rel` inside `root` the way the guest would, following
/// symlinks (absolute ones relative to `root`), never leaving `root`.
pub fn resolve_in(root: &Path, rel: &str) -> Result<PathBuf> {
    let mut cur = root.to_path_buf();
    let mut pending: Vec<String> = rel
        .split('/')
        .filter(|s| !s.is_empty())
        .rev()
        .map(str::to_string)
        .collect();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        let next = cur.join(&part);
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > 40 {
                    return Err(Error::BadArtifact {
                        path: next,
                        message: "too many symlinks".into(),
                    });
                }
                let target = std::fs::read_link(&next).at(&next, STEP)?;
                if target.is_absolute() {
                    cur = root.to_path_buf();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(s) => pending.push(s.to_string_lossy().into_owned()),
                        Component::ParentDir => pending.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ if part == ".." => {
                if cur != root {
                    cur.pop();
                }
            }
            _ => cur = next,
        }
    }
    Ok(cur)
}

/// Installs `guest_init` as `/sbin/init` (mode 0755, owned by root).
pub fn install_init(root: &Path, guest_init: &Path) -> Result<PathBuf> {
    let dest = resolve_in(root, "sbin/init")?;
    if std::fs::symlink_metadata(&dest).is_ok() {
        std::fs::remove_file(&dest).at(&dest, STEP)?;
    }
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).at(parent, STEP)?;
    }
    std::fs::copy(guest_init, &dest).at(&dest, STEP)?;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755)).at(&dest, STEP)?;
    Ok(dest)
}

/// Appends `line` to `etc/<file>` unless an entry for `name` is there.
fn add_entry(root: &Path, file: &str, name: &str, line: &str) -> Result<()> {
    let p = root.join("etc").join(file);
    let mut text = std::fs::read_to_string(&p).at(&p, STEP)?;
    if text.lines().any(|l| l.split(':').next() == Some(name)) {
        return Ok(());
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
    std::fs::write(&p, text).at(&p, STEP)
}

/// Adds the `agent` user and group (locked password, bash, home
/// /home/agent owned by it).
pub fn add_agent_user(root: &Path) -> Result<()> {
    let id = AGENT_ID;
    add_entry(
        root,
        "passwd",
        AGENT_USER,
        &format!("{AGENT_USER}:x:{id}:{id}:agent session commands:/home/{AGENT_USER}:/bin/bash"),
    )?;
    add_entry(root, "group", AGENT_USER, &format!("{AGENT_USER}:x:{id}:"))?;
    add_entry(
        root,
        "shadow",
        AGENT_USER,
        &format!("{AGENT_USER}:!:19000:0:99999:7:::"),
    )?;
    let home = root.join("home").join(AGENT_USER);
    std::fs::create_dir_all(&home).at(&home, STEP)?;
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o750)).at(&home, STEP)?;
    std::os::unix::fs::chown(&home, Some(id), Some(id)).at(&home, STEP)?;
    Ok(())
}

/// Programs guest-init runs by bare name without setting `PATH`. The kernel
/// starts init with no `PATH`, so glibc searches only `/bin:/usr/bin`, and
/// `nft` lives in `/usr/sbin`: link it into `/usr/bin` as well.
const SBIN_PROGRAMS_FOR_INIT: &[&str] = &["nft"];

/// Links [`SBIN_PROGRAMS_FOR_INIT`] into `/usr/bin` (relative links).
pub fn link_sbin_programs(root: &Path) -> Result<()> {
    for name in SBIN_PROGRAMS_FOR_INIT {
        let target = root.join("usr/sbin").join(name);
        let link = root.join("usr/bin").join(name);
        if target.exists() && std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("../sbin/{name}"), &link).at(&link, STEP)?;
        }
    }
    Ok(())
}

/// Hostname, hosts, fstab and an empty machine-id.
pub fn write_system_files(root: &Path) -> Result<()> {
    let files = [
        ("etc/hostname", format!("{HOSTNAME}\n")),
        (
            "etc/hosts",
            format!("127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n::1 localhost ip6-localhost\n"),
        ),
        ("etc/fstab", "/dev/vda / ext4 defaults 0 1\n".to_string()),
        // Empty: each guest gets its own id, never one baked into the image.
        ("etc/machine-id", String::new()),
    ];
    for (rel, content) in files {
        let p = root.join(rel);
        std::fs::write(&p, content).at(&p, STEP)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_merged_usr_symlinks_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("usr/sbin")).unwrap();
        std::os::unix::fs::symlink("usr/sbin", r.join("sbin")).unwrap();
        assert_eq!(resolve_in(r, "sbin/init").unwrap(), r.join("usr/sbin/init"));
        std::fs::remove_file(r.join("sbin")).unwrap();
        std::os::unix::fs::symlink("/usr/sbin", r.join("sbin")).unwrap();
        assert_eq!(resolve_in(r, "sbin/init").unwrap(), r.join("usr/sbin/init"));
        std::os::unix::fs::symlink("../../../../../etc", r.join("usr/escape")).unwrap();
        assert_eq!(
            resolve_in(r, "usr/escape/passwd").unwrap(),
            r.join("etc/passwd")
        );
    }

    #[test]
    fn links_nft_where_a_pathless_init_finds_it() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("usr/sbin")).unwrap();
        std::fs::create_dir_all(r.join("usr/bin")).unwrap();
        std::fs::write(r.join("usr/sbin/nft"), "").unwrap();
        link_sbin_programs(r).unwrap();
        link_sbin_programs(r).unwrap();
        assert_eq!(
            std::fs::read_link(r.join("usr/bin/nft")).unwrap(),
            Path::new("../sbin/nft")
        );
        assert!(r.join("usr/bin/nft").exists());
    }

    #[test]
    fn adds_the_agent_user_once() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("etc")).unwrap();
        std::fs::write(r.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash").unwrap();
        std::fs::write(r.join("etc/group"), "root:x:0:\n").unwrap();
        std::fs::write(r.join("etc/shadow"), "root:*:19000:0:99999:7:::\n").unwrap();
        // chown to another uid needs root; skip the user part elsewhere.
        if !crate::tools::is_root() {
            eprintln!("skipped chown part: not root");
            add_entry(
                r,
                "passwd",
                AGENT_USER,
                "agent:x:1000:1000::/home/agent:/bin/bash",
            )
            .unwrap();
        } else {
            add_agent_user(r).unwrap();
            add_agent_user(r).unwrap();
        }
        let passwd = std::fs::read_to_string(r.join("etc/passwd")).unwrap();
        assert_eq!(
            passwd.lines().filter(|l| l.starts_with("agent:")).count(),
            1,
            "{passwd}"
        );
        assert!(passwd.starts_with("root:x:0:0:root:/root:/bin/bash\n"));
    }
}
