//! What the host prepared for the scenario runner: paths (on the host's
//! tree, which the outer VM sees read-only at the same places) written as
//! JSON into the work directory.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One kernel the scenarios boot, with its initramfs images.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GuestKernel {
    /// Package and version, for messages.
    pub version: String,
    /// The ELF vmlinux (PVH entry), when there is one.
    pub vmlinux: Option<PathBuf>,
    /// The bzImage.
    pub bzimage: PathBuf,
    /// Probe initramfs (busybox, the kernel's virtio modules, probe-init.sh).
    pub probe_initrd: PathBuf,
}

/// Everything the runner needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InnerEnv {
    /// The vmm binary.
    pub vmm: PathBuf,
    /// The host-agent binary.
    pub host_agent: PathBuf,
    /// Debian's cloud kernel (no MP table parser, no VMGENID driver).
    pub cloud: GuestKernel,
    /// Debian's generic kernel (the outer VM's own; has the VMGENID driver).
    pub generic: GuestKernel,
    /// The image the node scenarios serve (prepared only for a run with a
    /// group that needs it: see [`InnerEnv::node_image`]).
    pub node_image: Option<NodeImage>,
    /// The virtiofsd the share scenarios run (the host's, installed by
    /// `prepare` if missing).
    pub virtiofsd: PathBuf,
    /// A small ext4 image holding `hello.txt`, copied for each VM that writes it.
    pub test_disk: PathBuf,
    /// Read-write scratch directory shared with the host (results, logs).
    pub work: PathBuf,
}

/// The project's image for host-agent: kernel, optional initramfs, rootfs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeImage {
    /// Kernel to register.
    pub kernel: PathBuf,
    /// Initramfs that mounts the root filesystem (for kernels with modular drivers).
    pub initrd: Option<PathBuf>,
    /// The root filesystem with guest-init as /sbin/init.
    pub rootfs: PathBuf,
    /// Where the kernel came from, for messages.
    pub kernel_origin: String,
}

impl InnerEnv {
    /// Reads the environment file.
    pub fn load(path: &Path) -> Result<InnerEnv, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{} is not valid: {e}", path.display()))
    }

    /// The node image, or why there is none.
    pub fn node_image(&self) -> Result<&NodeImage, String> {
        self.node_image.as_ref().ok_or_else(|| {
            "the node image was not prepared: its group is missing `node_image: true` in the catalogue"
                .to_string()
        })
    }

    /// Writes the environment file.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}
