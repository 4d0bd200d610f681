//! Initramfs images: a busybox tree, a kernel's modules in load order
//! (`/mods/order`), extra files and an `/init`, packed as a gzip'd newc
//! cpio archive and cached by the hash of all of it.

use std::path::{Path, PathBuf};
use std::process::Command;

use images::cache::{Built, Entry};
use images::error::IoContext;
use images::manifest::Inputs;

use super::kernels::{module_order, KernelPackage};
use super::{run, Result};

/// Where busybox-static installs its binary.
const BUSYBOX: &str = "/bin/busybox";
/// Version of this builder; part of every initramfs's input hash.
const BUILDER_VERSION: &str = "1";

/// What goes into one initramfs.
pub struct Spec<'a> {
    /// Name (cache entry and messages).
    pub name: &'a str,
    /// The `/init` script.
    pub init: &'a [u8],
    /// Whose modules to include.
    pub kernel: Option<&'a KernelPackage>,
    /// Modules to load, by name; their dependencies come along.
    pub modules: &'a [&'a str],
    /// Extra files: (host path, path inside the image).
    pub files: Vec<(PathBuf, String)>,
}

/// Builds (or finds in the cache) the initramfs for `spec`; returns its path.
pub fn build(cache: &Path, spec: &Spec<'_>) -> Result<PathBuf> {
    let busybox = Path::new(BUSYBOX);
    if !busybox.is_file() {
        return Err(super::PrepareError::Missing(format!(
            "{BUSYBOX} is missing: apt-get install busybox-static"
        )));
    }
    let order = match spec.kernel {
        Some(k) => module_order(&k.modules_dir(), spec.modules)?,
        None => Vec::new(),
    };
    let mut inputs = Inputs::default();
    inputs
        .set("builder", BUILDER_VERSION)
        .set("init", images::hash::bytes_sha256(spec.init))
        .set("busybox", images::hash::file_sha256(busybox)?)
        .set("modules", order.join(" "));
    if let Some(k) = spec.kernel {
        inputs.set("kernel", k.to_string());
    }
    for (src, dst) in &spec.files {
        inputs.set(&format!("file:{dst}"), images::hash::file_sha256(src)?);
    }
    let step = format!("initramfs {}", spec.name);
    let kind = format!("initramfs-{}", spec.name);
    let out = Entry::in_cache(cache, &kind, inputs).get_or_build(&step, |dir| {
        let tree = dir.join("tree");
        busybox_tree(&tree, busybox)?;
        if let Some(k) = spec.kernel {
            let mut names = String::new();
            for rel in &order {
                let src = k.modules_dir().join(rel);
                let file = rel.rsplit('/').next().unwrap_or(rel);
                let dst = tree.join("mods").join(file);
                std::fs::copy(&src, &dst).at(&src, "copy a module")?;
                names.push_str(file);
                names.push('\n');
            }
            let list = tree.join("mods/order");
            std::fs::write(&list, names).at(&list, "write the module order")?;
        }
        for (src, dst) in &spec.files {
            let to = tree.join(dst);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).at(parent, "create a directory")?;
            }
            std::fs::copy(src, &to).at(src, "copy a file into the initramfs")?;
        }
        write_executable(&tree.join("init"), spec.init)?;
        let archive = dir.join("initrd.cpio.gz");
        run(
            &step,
            Command::new("bash")
                .arg("-o")
                .arg("pipefail")
                .arg("-c")
                .arg("cd \"$1\" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -1 > \"$2\"")
                .arg("pack")
                .arg(&tree)
                .arg(&archive),
            dir,
        )?;
        std::fs::remove_dir_all(&tree).at(&tree, "remove the staging tree")?;
        Ok(Built {
            outputs: vec!["initrd.cpio.gz".into()],
            ..Default::default()
        })
    })?;
    Ok(out.path("initrd.cpio.gz"))
}

fn write_executable(path: &Path, content: &[u8]) -> images::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, content).at(path, "write a file")?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .at(path, "make it executable")
}

/// `/bin/busybox` with a link per applet, and the directories init uses.
fn busybox_tree(tree: &Path, busybox: &Path) -> images::Result<()> {
    for d in [
        "bin", "proc", "sys", "dev", "mods", "tmp", "run", "etc", "mnt",
    ] {
        let p = tree.join(d);
        std::fs::create_dir_all(&p).at(&p, "create the initramfs tree")?;
    }
    let target = tree.join("bin/busybox");
    std::fs::copy(busybox, &target).at(busybox, "copy busybox")?;
    let list = run("busybox applets", Command::new(busybox).arg("--list"), tree)?;
    for applet in list
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox")
    {
        let link = tree.join("bin").join(applet);
        std::os::unix::fs::symlink("busybox", &link).at(&link, "link a busybox applet")?;
    }
    Ok(())
}
