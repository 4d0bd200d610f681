//! The scenarios, by group (see `catalogue`), and what they share.

mod boot;
mod checks;
mod network;
mod node;
mod pause_io;
mod share;
mod snapshot;
mod soak;
mod virtio;

use std::path::Path;

use vmm_api::RunSpec;

use super::net::{AckServer, Tap};
use super::{Check, Ctx};

/// Fixtures shared by the scenarios of a group, built on first use, so a
/// retried group that skips finished scenarios still gets what it needs.
#[derive(Default)]
pub struct Fixtures {
    /// The tap and TCP server guests reach.
    network: Option<(Tap, AckServer)>,
    /// The one run of the virtio guest.
    virtio: Option<virtio::VirtioRun>,
    /// The ticking guest's snapshot.
    tick: Option<snapshot::TickSnapshot>,
    /// host-agent with the real image registered and its golden snapshot.
    agent: Option<node::HostAgent>,
    /// How long the golden snapshot took.
    golden_secs: f64,
    /// The `network` group's internet, repository and first session
    /// (after `agent`, so host-agent stops its sessions before the
    /// internet goes).
    net: Option<network::Net>,
    /// The `share` group's directories and its snapshotted guest.
    share: share::Fixtures,
}

/// `vmm run` of a probe guest (devices may be added).
pub fn probe_args(kernel: &Path, initrd: &Path, vcpus: u8, cmdline: &str) -> RunSpec {
    let mut run = RunSpec::new(kernel);
    run.initrd = Some(initrd.to_path_buf());
    run.mem_mib = PROBE_MEM_MIB;
    run.vcpus = u64::from(vcpus);
    run.cmdline = Some(cmdline.into());
    run
}

/// Memory of a probe guest.
pub const PROBE_MEM_MIB: u64 = 256;

/// Runs scenario `name`.
pub fn run(ctx: &mut Ctx, name: &str) -> Check {
    match name {
        "boot-1-vcpu" => boot::boot_vcpus(ctx, name, 1),
        "boot-2-vcpus" => boot::boot_vcpus(ctx, name, 2),
        "boot-bzimage" => boot::bzimage(ctx, name),
        "poweroff" => boot::poweroff(ctx, name),
        "boot-mp-table" => boot::mptable(ctx, name),
        "serial-input" => boot::serial_input(ctx, name),
        "virtio-blk" => virtio::blk(ctx, name),
        "virtio-blk-read-only" => virtio::blk_read_only(ctx, name),
        "virtio-rng" => virtio::rng(ctx, name),
        "virtio-net" => virtio::net(ctx, name),
        "virtio-vsock" => virtio::vsock(ctx, name),
        "pause-after-io" => pause_io::pause_after_io(ctx, name),
        "restore-file" => snapshot::restore(ctx, name, "file"),
        "restore-uffd" => snapshot::restore(ctx, name, "uffd"),
        "diff-chain-checksums" => snapshot::diff_chain(ctx, name),
        "clones-randomness" => snapshot::clones_randomness(ctx, name),
        "guest-init-direct" => node::guest_init_direct(ctx, name),
        "node-golden" => node::golden(ctx, name),
        "node-session" => node::session(ctx, name),
        "node-secrets" => node::secrets(ctx, name),
        "node-clones" => node::clones(ctx, name),
        "node-agent-api" => node::agent_api(ctx, name),
        "node-persist" => node::persist(ctx, name),
        "node-fork" => node::fork(ctx, name),
        "node-move" => node::moves(ctx, name),
        "node-sizing" => node::sizing(ctx, name),
        "pool-timing" => node::pool_timing(ctx, name),
        "net-resolve" => network::resolve(ctx, name),
        "net-dns-denied" => network::dns_denied(ctx, name),
        "net-ip-denied" => network::ip_denied(ctx, name),
        "net-expose" => network::expose(ctx, name),
        "net-clones" => network::clones(ctx, name),
        "net-throughput" => network::throughput(ctx, name),
        "net-ipv6" => network::ipv6(ctx, name),
        "share-read" => share::read(ctx, name),
        "share-read-only" => share::read_only(ctx, name),
        "share-restore-file" => share::restore(ctx, name, "file"),
        "share-restore-uffd" => share::restore(ctx, name, "uffd"),
        "share-perf" => share::perf(ctx, name),
        "soak-smp-boots" => soak::smp_boots(ctx, name),
        "soak-smp-restores" => soak::smp_restores(ctx, name),
        other => Err(format!("the runner has no scenario {other}")),
    }
}

/// The command line every probe guest gets, before its `rg.*` options: the
/// vmm's default (console on the 8250, reboot through the keyboard
/// controller, no PCI) and `quiet`, since every console byte is an exit
/// that the emulated outer CPU handles slowly.
pub const BASE_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux i8042.nomux i8042.dumbkbd quiet";
