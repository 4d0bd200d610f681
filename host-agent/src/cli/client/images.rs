//! `host-agent images`: register, build (the golden snapshot), list,
//! delete, and push to / pull from the fleet's image store.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::fleet_client::FleetClient;
use proto::hostagent::images_client::ImagesClient;
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output};

/// The `images` subcommands.
#[derive(Subcommand)]
pub enum ImagesCmd {
    /// Register an image.
    Register {
        id: String,
        #[arg(long)]
        kernel: String,
        /// Root disk image (each VM gets its own copy).
        #[arg(long, default_value = "")]
        rootfs: String,
        /// Initial ramdisk (for kernels whose drivers are modules).
        #[arg(long, default_value = "")]
        initrd: String,
        #[arg(long, default_value = "")]
        cmdline: String,
        #[arg(long, default_value_t = 0)]
        mem_mib: u32,
        #[arg(long, default_value_t = 0)]
        vcpus: u32,
        #[arg(long)]
        guest_init: bool,
        /// A device rate limit of its VMs, `FIELD=RATE` (repeatable), e.g.
        /// `net_tx_bandwidth=10M`, `disk_iops=500`.
        #[arg(long = "io-limit")]
        io_limit: Vec<String>,
        /// A host directory shared into its VMs,
        /// `TAG=HOST_PATH[,ro][,mount=GUEST_PATH]` (repeatable; the
        /// directory must lie under the node's allowed_share_roots).
        #[arg(long = "share")]
        share: Vec<String>,
    },
    /// Build an image's golden snapshot.
    Build { id: String },
    /// List images.
    List,
    /// Delete an image.
    Delete { id: String },
    /// Upload an image (kernel, initrd, root disk, golden snapshot) to the
    /// fleet's image store; chunks the store has already are skipped.
    Push { id: String },
    /// Download an image from the fleet's image store and register it on
    /// this node, golden snapshot included.
    Pull { id: String },
}

/// Runs `images <cmd>`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: ImagesCmd) -> Result<(), String> {
    let mut fleet = FleetClient::with_interceptor(ch.clone(), bearer.clone());
    let mut cl = ImagesClient::with_interceptor(ch, bearer);
    match c {
        ImagesCmd::Push { id } => {
            let r = fleet
                .push_image(pb::PushImageRequest { image_id: id })
                .await
                .map_err(st)?
                .into_inner();
            match out {
                Output::Table => println!(
                    "pushed image {} to {}: {} files, {} bytes in {} chunks; uploaded {} chunks, {} bytes",
                    r.image_id, r.store, r.files, r.bytes, r.chunks, r.chunks_uploaded, r.bytes_uploaded
                ),
                Output::Json => println!(
                    "{}",
                    serde_json::json!({
                        "image_id": r.image_id, "store": r.store, "files": r.files,
                        "bytes": r.bytes, "chunks": r.chunks,
                        "chunks_uploaded": r.chunks_uploaded, "bytes_uploaded": r.bytes_uploaded,
                    })
                ),
            }
        }
        ImagesCmd::Pull { id } => {
            let r = fleet
                .pull_image(pb::PullImageRequest { image_id: id })
                .await
                .map_err(st)?
                .into_inner();
            if let Output::Table = out {
                eprintln!(
                    "pulled from {}: {} files, {} bytes in {} chunks, {} bytes fetched",
                    r.store, r.files, r.bytes, r.chunks, r.bytes_fetched
                );
            }
            print_all(&r.image.into_iter().collect::<Vec<_>>(), out);
        }
        ImagesCmd::Register {
            id,
            kernel,
            rootfs,
            initrd,
            cmdline,
            mem_mib,
            vcpus,
            guest_init,
            io_limit,
            share,
        } => {
            let i = cl
                .register_image(pb::RegisterImageRequest {
                    image_id: id,
                    kernel_path: kernel,
                    rootfs_path: rootfs,
                    initrd_path: initrd,
                    cmdline,
                    mem_mib,
                    vcpus,
                    guest_init,
                    io_limits: super::io_limits::parse(&io_limit)?,
                    shares: super::shares::parse(&share)?,
                    ..Default::default()
                })
                .await
                .map_err(st)?;
            print_all(&[i.into_inner()], out);
        }
        ImagesCmd::Build { id } => {
            let i = cl
                .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
                    image_id: id,
                    ..Default::default()
                })
                .await
                .map_err(st)?;
            print_all(&[i.into_inner()], out);
        }
        ImagesCmd::List => {
            let images = cl
                .list_images(pb::ListImagesRequest {})
                .await
                .map_err(st)?
                .into_inner()
                .images;
            print_all(&images, out);
        }
        ImagesCmd::Delete { id } => {
            cl.delete_image(pb::DeleteImageRequest {
                image_id: id,
                idempotency_key: String::new(),
            })
            .await
            .map_err(st)?;
        }
    }
    Ok(())
}
