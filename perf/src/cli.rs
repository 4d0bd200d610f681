//! The command line.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// Benchmark the vmm: cold boot, restore latency, creation rate, memory
/// overhead and snapshot write; optionally side by side with Firecracker.
#[derive(Debug, Parser)]
#[command(name = "perf", version, about, long_about = None)]
pub struct Cli {
    /// Scenario to run.
    #[arg(value_enum)]
    pub scenario: ScenarioArg,
    /// vmm binary to measure [default: `vmm` next to this perf binary,
    /// i.e. the workspace's target/<profile>/vmm].
    #[arg(long, value_name = "PATH")]
    pub vmm: Option<PathBuf>,
    /// Also run every scenario against this Firecracker binary, with the
    /// same guests, and report vmm/Firecracker ratios.
    #[arg(long, value_name = "PATH")]
    pub vs_firecracker: Option<PathBuf>,
    /// Measured runs per metric (after warm-up) [default: per scenario:
    /// cold-boot 20, restore 30, creation-rate 5 rounds, memory-overhead 5,
    /// snapshot-write 10, net-throughput 10, net-latency 10 rounds,
    /// network-setup 20, files-throughput 3, session-persist 5,
    /// session-fork 5, session-create 200 per path, density 3 rounds per
    /// count, fleet 10].
    #[arg(long, value_name = "N")]
    pub runs: Option<u32>,
    /// Warm-up runs discarded before measuring [default: 2, 1 with --quick].
    #[arg(long, value_name = "N")]
    pub warmup: Option<u32>,
    /// A short run: few runs, one warm-up, 128 MiB only (unless overridden).
    #[arg(long)]
    pub quick: bool,
    /// Folder for results.json, results.md and latency.svg.
    #[arg(long, value_name = "DIR", default_value = "perf-results")]
    pub out: PathBuf,
    /// Guest memory sizes in MiB for restore, memory-overhead and
    /// snapshot-write [default: 128,1024,4096; 128 with --quick].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub mem_sizes: Option<Vec<u64>>,
    /// Restores in flight at once in creation-rate [default: number of cores].
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// Cold-boot this kernel image instead of the hello test guest (needs
    /// hardware KVM; skipped otherwise).
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Kernel command line for --kernel [default: console=ttyS0 reboot=k panic=-1 pci=off].
    #[arg(long, value_name = "STR")]
    pub cmdline: Option<String>,
    /// Passed to `vmm restore --memory-backend`.
    #[arg(long, value_name = "BACKEND", value_parser = ["file", "uffd"])]
    pub memory_backend: Option<String>,
    /// Passed to `vmm run` and `vmm restore` as `--memory`: private (the
    /// default), shared (a memfd, as vhost-user backends need) or shared-hugepages.
    #[arg(long, value_name = "MODE", value_parser = ["private", "shared", "shared-hugepages"])]
    pub memory: Option<String>,
    /// Frames per net-throughput run [default: 20000; 2000 with --quick].
    #[arg(long, value_name = "N")]
    pub net_frames: Option<u64>,
    /// Round trips per frame size per net-latency round [default: 200; 50
    /// with --quick].
    #[arg(long, value_name = "N")]
    pub net_pings: Option<u64>,
    /// Seconds one step (a boot, a restore, a snapshot) may take before the run fails.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub timeout_secs: u64,
    /// Guest memory of session-persist's dirtier sessions, MiB [default:
    /// 2048; 256 with --quick].
    #[arg(long, value_name = "MIB")]
    pub session_mem_mib: Option<u64>,
    /// Dirty fractions of session-persist in thousandths of the guest's
    /// pages [default: 5,25,100, i.e. 0.5 %, 2.5 %, 10 %].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub dirty_permille: Option<Vec<u64>>,
    /// How many idle sessions density restores at once from one snapshot,
    /// a round per count [default: 10,50,100; 10 with --quick].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub density_counts: Option<Vec<u64>>,
    /// Scratch folder for sockets and snapshots [default: a new folder in
    /// $TMPDIR]; removed at the end. Put it on the disk you want snapshots
    /// written to.
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
}

/// The scenarios, by command-line name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScenarioArg {
    /// Spawn -> guest output -> clean exit.
    ColdBoot,
    /// Spawn restoring a snapshot -> first guest output (p50/p90/p99 per memory size).
    Restore,
    /// Restore of a snapshot holding memory, per memory backing (private or
    /// shared memfd) and fill (file or uffd): ready to run, working set touched again.
    RestoreMemory,
    /// Sustained restores per second with N in flight.
    CreationRate,
    /// VMM resident memory minus guest memory touched.
    MemoryOverhead,
    /// Rss and Pss of N idle VMs restored at once from one 512 MiB
    /// snapshot, and how many fit in this host's memory.
    Density,
    /// Full and diff (1 %, 10 % dirty) snapshot write time.
    SnapshotWrite,
    /// Frames/s and MiB/s through virtio-net, each way, 1514- and 64-byte frames.
    NetThroughput,
    /// Round trip of a frame host -> guest -> host through virtio-net.
    NetLatency,
    /// One VM's network made cold, handed over warm, removed (host-agent).
    NetworkSetup,
    /// MB/s of the Files service's upload and download (stand-in guest).
    FilesThroughput,
    /// PauseSession persist time and snapshot size, ResumeSession time, per dirty fraction (host-agent).
    SessionPersist,
    /// ForkSession of 1 and of 10 sessions until all are RUNNING (host-agent).
    SessionFork,
    /// CreateSession until READY, 4 in flight, from the warm pool and from
    /// the golden snapshot (host-agent).
    SessionCreate,
    /// Two nodes over NATS JetStream: event export latency, image pull
    /// throughput, time to a first session on a node without the image (host-agent).
    Fleet,
    /// Every scenario, in the order above.
    All,
}

impl ScenarioArg {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            ScenarioArg::ColdBoot => "cold-boot",
            ScenarioArg::Restore => "restore",
            ScenarioArg::RestoreMemory => "restore-memory",
            ScenarioArg::CreationRate => "creation-rate",
            ScenarioArg::MemoryOverhead => "memory-overhead",
            ScenarioArg::Density => "density",
            ScenarioArg::SnapshotWrite => "snapshot-write",
            ScenarioArg::NetThroughput => "net-throughput",
            ScenarioArg::NetLatency => "net-latency",
            ScenarioArg::NetworkSetup => "network-setup",
            ScenarioArg::FilesThroughput => "files-throughput",
            ScenarioArg::SessionPersist => "session-persist",
            ScenarioArg::SessionFork => "session-fork",
            ScenarioArg::SessionCreate => "session-create",
            ScenarioArg::Fleet => "fleet",
            ScenarioArg::All => "all",
        }
    }
}
