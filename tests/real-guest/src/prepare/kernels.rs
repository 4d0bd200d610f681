//! Debian's kernel packages, downloaded with apt and unpacked into the
//! cache with their modules (and a modules.dep from depmod): the generic
//! kernel runs the outer VM and is a guest kernel with the VMGENID driver;
//! the cloud kernel is the guest kernel the product targets.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use images::cache::{Built, Entry};
use images::error::IoContext;
use images::manifest::Inputs;

use super::{run, PrepareError, Result};

/// The metapackage that names the current cloud kernel.
const CLOUD_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// An unpacked kernel package.
#[derive(Debug, Clone)]
pub struct KernelPackage {
    /// e.g. `linux-image-6.1.0-57-cloud-amd64`.
    pub package: String,
    /// The Debian version, e.g. `6.1.192-3`.
    pub version: String,
    /// The kernel release, e.g. `6.1.0-57-cloud-amd64`.
    pub release: String,
    /// Where the package is unpacked.
    pub root: PathBuf,
}

impl fmt::Display for KernelPackage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.package, self.version)
    }
}

impl KernelPackage {
    /// The bzImage.
    pub fn vmlinuz(&self) -> PathBuf {
        self.root.join(format!("boot/vmlinuz-{}", self.release))
    }

    /// `lib/modules/<release>`.
    pub fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }
}

/// The versioned cloud kernel package the metapackage depends on now.
pub fn cloud_package() -> Result<String> {
    let cache = std::env::temp_dir();
    let text = run(
        "kernel packages",
        Command::new("apt-cache").args(["depends", CLOUD_METAPACKAGE]),
        &cache,
    )?;
    parse_depends(&text).ok_or_else(|| {
        PrepareError::Missing(format!(
            "apt knows no kernel behind {CLOUD_METAPACKAGE}; run `apt-get update` first"
        ))
    })
}

/// The first `Depends: linux-image-<digit>...` of `apt-cache depends` output.
fn parse_depends(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let p = l.trim().strip_prefix("Depends: ")?.trim();
        let rest = p.strip_prefix("linux-image-")?;
        rest.starts_with(|c: char| c.is_ascii_digit())
            .then(|| p.to_string())
    })
}

/// The generic kernel of the same ABI as a cloud kernel package.
pub fn generic_package_for(cloud: &str) -> Result<String> {
    cloud
        .strip_suffix("-cloud-amd64")
        .map(|base| format!("{base}-amd64"))
        .ok_or_else(|| PrepareError::Missing(format!("{cloud} is not a -cloud-amd64 package")))
}

/// Downloads and unpacks `package` (its candidate version) into the cache.
pub fn fetch(cache: &Path, package: &str) -> Result<KernelPackage> {
    let version = images::debian::candidate_version(package)?;
    let release = package
        .strip_prefix("linux-image-")
        .ok_or_else(|| PrepareError::Missing(format!("{package} is not a linux-image package")))?
        .to_string();
    let mut inputs = Inputs::default();
    inputs
        .set("package", package)
        .set("version", version.as_str());
    let step = "kernel package";
    let entry = Entry::in_cache(cache, "kernel-package", inputs);
    let rel = release.clone();
    let out = entry.get_or_build(step, |dir| {
        let deb = images::debian::download(package, &version, "amd64", dir)?;
        let root = dir.join("root");
        run(
            step,
            Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root),
            dir,
        )?;
        std::fs::remove_file(&deb).at(&deb, "remove the downloaded package")?;
        run(
            step,
            Command::new("depmod").arg("-b").arg(&root).arg(&rel),
            dir,
        )?;
        Ok(Built {
            outputs: vec![
                format!("root/boot/vmlinuz-{rel}"),
                format!("root/lib/modules/{rel}/modules.dep"),
            ],
            ..Default::default()
        })
    })?;
    Ok(KernelPackage {
        package: package.to_string(),
        version,
        release,
        root: out.dir.join("root"),
    })
}

/// The cloud kernel's ELF vmlinux (PVH entry), taken out of its bzImage by
/// the project's own `scripts/fetch-debian-kernel.sh`.
pub fn cloud_vmlinux(cache: &Path, cloud: &KernelPackage) -> Result<PathBuf> {
    let dir = cache
        .join("cloud-vmlinux")
        .join(format!("{}_{}", cloud.package, cloud.version));
    let script = super::workspace_root().join("scripts/fetch-debian-kernel.sh");
    run("cloud vmlinux", Command::new(&script).arg(&dir), cache)?;
    let version = std::fs::read_to_string(dir.join("version")).unwrap_or_default();
    if !version.contains(&cloud.package) {
        return Err(PrepareError::Missing(format!(
            "{} holds {version:?}, not {}; remove the directory and run again",
            dir.display(),
            cloud.package
        )));
    }
    Ok(dir.join("vmlinux"))
}

/// `names` and everything they depend on, in load order, as paths relative
/// to the modules directory (from its modules.dep).
pub fn module_order(modules_dir: &Path, names: &[&str]) -> Result<Vec<String>> {
    let dep = modules_dir.join("modules.dep");
    let text = std::fs::read_to_string(&dep).map_err(|e| images::Error::io(&dep, "read", e))?;
    resolve(&text, names).map_err(PrepareError::Missing)
}

/// The load order for `names` from modules.dep text.
fn resolve(modules_dep: &str, names: &[&str]) -> std::result::Result<Vec<String>, String> {
    let mut deps = std::collections::HashMap::new();
    for line in modules_dep.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        deps.insert(
            module_name(path),
            (
                path.to_string(),
                rest.split_whitespace()
                    .map(String::from)
                    .collect::<Vec<_>>(),
            ),
        );
    }
    let mut order: Vec<String> = Vec::new();
    fn visit(
        name: &str,
        deps: &std::collections::HashMap<String, (String, Vec<String>)>,
        order: &mut Vec<String>,
        depth: usize,
    ) -> std::result::Result<(), String> {
        if depth > 64 {
            return Err(format!("module dependencies loop at {name}"));
        }
        let (path, needs) = deps
            .get(&normalize(name))
            .ok_or_else(|| format!("no module {name} in modules.dep"))?;
        if !path.ends_with(".ko") {
            return Err(format!(
                "{path} is compressed; busybox insmod takes plain .ko files"
            ));
        }
        for d in needs {
            visit(&module_name(d), deps, order, depth + 1)?;
        }
        if !order.contains(path) {
            order.push(path.clone());
        }
        Ok(())
    }
    for n in names {
        visit(n, &deps, &mut order, 0)?;
    }
    Ok(order)
}

/// A module's name from its path, as the kernel spells it (`-` as `_`).
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    normalize(stem)
}

fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/virtio/virtio_ring.ko: kernel/drivers/virtio/virtio.ko
kernel/drivers/virtio/virtio.ko:
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/x/zipped.ko.xz:
";

    #[test]
    fn dependencies_load_first_and_once() {
        let order = resolve(DEP, &["virtio_mmio", "virtio-rng"]).unwrap();
        assert_eq!(
            order,
            [
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
                "kernel/drivers/virtio/virtio_mmio.ko",
                "kernel/drivers/char/hw_random/virtio-rng.ko",
            ]
        );
    }

    #[test]
    fn unknown_and_compressed_modules_are_named() {
        assert!(resolve(DEP, &["nope"])
            .unwrap_err()
            .contains("no module nope"));
        assert!(resolve(DEP, &["zipped"])
            .unwrap_err()
            .contains("compressed"));
    }

    #[test]
    fn the_versioned_image_is_found_in_apt_output() {
        let text = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(
            parse_depends(text).as_deref(),
            Some("linux-image-6.1.0-57-cloud-amd64")
        );
        assert_eq!(parse_depends("x\n  Depends: linux-image-amd64\n"), None);
        assert_eq!(
            generic_package_for("linux-image-6.1.0-57-cloud-amd64").unwrap(),
            "linux-image-6.1.0-57-amd64"
        );
    }
}
