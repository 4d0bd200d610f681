//! Building an image's golden snapshot: boot it on a copy of its root disk
//! (and with its shares' virtio-fs devices, their virtiofsd started for the
//! build) in a fresh build directory, capture it (`images::capture`, shared
//! with the `images golden` command), keep the disk and console with the
//! snapshot, record it and replace the image's warm VMs.

use ::images::capture::{capture, Capture, CaptureError, Ready};
use vmm_api::command::{DiskSpec, RunSpec, Serial};

use super::*;
use crate::images::resolve_files;
use crate::launch::{guest_nic, GOLDEN_DISK, NETWORK_MARKER};
use crate::network::addressing::{guest_kernel_ip6_param, guest_kernel_ip_param};

/// The `vmm run` that boots `image` for its golden snapshot in `build`
/// (the vsock device, disk and control socket are added by the caller).
fn boot_spec(image: &ImageRow, build: &Path) -> RunSpec {
    let mut spec = RunSpec::new(&image.kernel);
    spec.mem_mib = u64::from(image.mem_mib);
    spec.vcpus = u64::from(image.vcpus);
    spec.devices.serial = Serial::File(build.join("serial.log"));
    if !image.initrd.is_empty() {
        spec.initrd = Some(PathBuf::from(&image.initrd));
    }
    if !image.cmdline.is_empty() {
        spec.cmdline = Some(image.cmdline.clone());
    }
    // A Linux guest gets entropy from the host (virtio-rng) from its first boot.
    spec.devices.rng = image.guest_init;
    spec
}

impl Manager {
    /// Boots image `id`, lets it settle, pauses it and writes its golden
    /// snapshot, through the same capture as the `images golden` command
    /// (`images::capture`), in a blocking task.
    pub async fn build_golden(&self, id: &str, settle_ms: u32) -> Result<ImageRow> {
        let mgr = self;
        let _g = mgr.golden_lock.lock().await;
        let mut image = mgr
            .store
            .image(id)?
            .ok_or_else(|| Error::not_found("image", id))?;
        if !image.source_session.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "image {id:?} was made from session {}: its golden snapshot is that session's; \
                 register a new image to boot one",
                image.source_session
            )));
        }
        // The files are read now: check them again (the roots may have changed
        // since registration, or a path in them been replaced by a link).
        // A pulled image's files are its own, in its image directory.
        if !crate::fleet::images::is_pulled_file(mgr, id, &image.kernel) {
            resolve_files(&mut image, &mgr.image_roots)?;
        }
        let settle = if settle_ms == 0 { 200 } else { settle_ms };
        let dir = mgr.image_dir(id);
        let build = dir.join(format!("build-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&build)
            .map_err(|e| Error::io(format!("creating {}", build.display()), e))?;
        let mut boot = boot_spec(&image, &build);
        boot.globals.log_max_bytes = Some(mgr.cfg.logs.max_file_bytes);
        boot.devices.vsock = mgr.cfg.vsock_device(image.guest_init, &build);
        boot.devices.control_socket = Some(build.join("control.sock"));
        // The image boots on a copy of its rootfs; the copy, as the snapshot
        // leaves it, goes with the golden snapshot (the registered file stays as it is).
        let build_disk = build.join(GOLDEN_DISK);
        let golden = dir.join(format!("golden-{}", now_ms()));
        let result = async {
            if !image.rootfs.is_empty() {
                // The operator's path may be a link; the copy is made from what it names.
                let rootfs = std::fs::canonicalize(&image.rootfs)
                    .map_err(|e| Error::io(format!("resolving rootfs {}", image.rootfs), e))?;
                copy_disk(&rootfs, &build_disk, None).await?;
                boot.devices.disks.push(DiskSpec::rw(&build_disk));
            }
            let ready = if image.guest_init {
                // Idle guest-init answering on vsock is what the snapshot keeps.
                Ready::GuestInit {
                    uds: mgr.cfg.vsock_path(&build),
                    port: mgr.cfg.guest_port,
                    served_by_vmm: mgr.cfg.vsock_device,
                    settle: Duration::ZERO,
                    software: format!("host-agent {}", env!("CARGO_PKG_VERSION")),
                }
            } else {
                Ready::Settle(Duration::from_millis(u64::from(settle)))
            };
            let boot_timeout = if image.guest_init {
                Duration::from_secs(60 + mgr.cfg.guest_ready_timeout_seconds)
            } else {
                Duration::from_secs(60)
            };
            // On a node with a network, the image boots with a virtio-net
            // device on a tap of its own namespace, configured at boot with
            // the addresses every clone keeps (IPv6 too: whether it is
            // forwarded is the node's, so one snapshot serves either); the
            // namespace goes after the build.
            let node = mgr.network.clone();
            let build_id = format!("build{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            if node.is_some() {
                boot.devices.net = Some(guest_nic());
                let cmdline = boot.cmdline.take().unwrap_or_default();
                boot.cmdline = Some(
                    format!(
                        "{cmdline} {} {}",
                        guest_kernel_ip_param(),
                        guest_kernel_ip6_param()
                    )
                    .trim()
                    .to_string(),
                );
            }
            // The image's shares: the snapshot keeps their devices (guest-init
            // mounts nothing before a session); their daemons end with the
            // build (dropped below).
            let launched = crate::shares::virtiofsd::launch(
                mgr.fs_settings(),
                &build,
                None,
                &mgr.image_shares(&image),
            )
            .await?;
            boot.devices.fs = launched.specs;
            let _fs = launched.daemons;
            let job = Capture {
                vmm: mgr.vmm_path.clone(),
                boot,
                ready,
                snapshot_dir: golden.clone(),
                boot_timeout,
                vmm_log: Some(build.join("vmm.log")),
                netns: None,
            };
            let image_id = id.to_string();
            tokio::task::spawn_blocking(move || {
                // The build VM reaches nothing: a golden snapshot must not
                // carry connections, nor anything fetched by one image's boot.
                let build_net = match &node {
                    Some(n) => Some(n.make(&build_id, None, &[])?),
                    None => None,
                };
                let job = Capture {
                    netns: build_net.as_ref().map(|n| n.netns.clone()),
                    ..job
                };
                let captured = capture(&job, &mut |line| {
                    tracing::info!(image = %image_id, "golden build: {line}");
                });
                if let (Some(n), Some(vm)) = (&node, &build_net) {
                    n.release(vm);
                }
                captured.map_err(|e| match e {
                    CaptureError::NotReady { .. } => Error::Timeout(e.to_string()),
                    other => Error::Vmm(other.to_string()),
                })
            })
            .await
            .map_err(|e| Error::Vmm(format!("the golden build task failed: {e}")))??;
            if mgr.network.is_some() {
                // Sessions of this snapshot need a network to be restored.
                std::fs::write(golden.join(NETWORK_MARKER), "virtio-net on tap0\n").map_err(
                    |e| Error::io(format!("marking {} as networked", golden.display()), e),
                )?;
            }
            // The boot's console goes with the snapshot, for whoever has to
            // find out what the golden guest did.
            let _ = std::fs::rename(build.join("serial.log"), golden.join("console.log"));
            if !image.rootfs.is_empty() {
                std::fs::rename(&build_disk, golden.join(GOLDEN_DISK)).map_err(|e| {
                    Error::io(
                        format!("keeping the golden disk in {}", golden.display()),
                        e,
                    )
                })?;
            }
            Ok::<_, Error>(())
        }
        .await;
        let _ = std::fs::remove_dir_all(&build);
        if let Err(e) = result {
            let _ = std::fs::remove_dir_all(&golden);
            return Err(e);
        }
        let old = PathBuf::from(&image.golden_dir);
        let old_layer = match image.golden_dir.as_str() {
            "" => None,
            dir => mgr.store.layer_by_dir(dir)?,
        };
        mgr.store
            .set_golden(id, &golden.display().to_string(), now_ms())?;
        mgr.pool.drain(id);
        let image = mgr
            .store
            .image(id)?
            .ok_or_else(|| Error::not_found("image", id))?;
        mgr.layers.golden(&image)?;
        match old_layer {
            // The old snapshot stays while sessions that may pause to disk
            // (diffs over it) hold it; it goes when the last lets go.
            Some(l) => mgr
                .layers
                .release(Some(&l.id), &crate::layers::image_holder(id))?,
            None if !old.as_os_str().is_empty() && old != golden => {
                let _ = std::fs::remove_dir_all(&old);
            }
            None => {}
        }
        Ok(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> ImageRow {
        ImageRow {
            id: "img".into(),
            kernel: "/k/vmlinux".into(),
            cmdline: "console=ttyS0".into(),
            mem_mib: 512,
            vcpus: 2,
            guest_init: true,
            ..Default::default()
        }
    }

    #[test]
    fn the_golden_boot_takes_the_image_initrd_when_it_has_one() {
        let build = Path::new("/state/images/img/build-1");
        let without = boot_spec(&image(), build);
        assert_eq!(without.initrd, None);
        let with = boot_spec(
            &ImageRow {
                initrd: "/k/initrd.gz".into(),
                ..image()
            },
            build,
        );
        assert_eq!(with.initrd.as_deref(), Some(Path::new("/k/initrd.gz")));
        assert_eq!(with.kernel, Path::new("/k/vmlinux"));
        assert_eq!(with.cmdline.as_deref(), Some("console=ttyS0"));
        assert_eq!((with.mem_mib, with.vcpus), (512, 2));
        assert!(with.devices.rng, "guest-init images get entropy");
        assert_eq!(with.devices.serial, Serial::File(build.join("serial.log")));
        let args = with.args();
        let at = args.iter().position(|a| a == "--initrd").expect("--initrd");
        assert_eq!(args[at + 1], "/k/initrd.gz");
    }
}
