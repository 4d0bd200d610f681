//! The `vmm` command line. Everything but argument handling lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use vmm::config::{
    parse_acpi, parse_pit, ConfigFile, DeviceConfig, MemoryMode, SerialConfig, VmConfig,
};
use vmm::control::server::{ControlError, ControlServer};
use vmm::control::standby::{RestoreRequest, StandbyRequest, StandbyServer};
use vmm::exit::{EXIT_BAD_INPUT, EXIT_VM_FAILURE};
use vmm::jail::cgroup::{parse_cpu_max, parse_size, CgroupLimits};
use vmm::jail::{BindMount, JailConfig, JailError};
use vmm::machine::{Machine, PreparedVm, RestoreConfig};
use vmm::seccomp::{self, ThreadKind};
use vmm::signals;
use vmm::snapshot::restore_memory::MemoryBackend;

#[derive(Parser)]
#[command(
    name = "vmm",
    version,
    about = "A KVM microVM monitor: one process per VM"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// Log filter: `LEVEL` and `TARGET=LEVEL` directives, comma-separated (e.g. `warn,vmm::acpi=info`); RUST_LOG wins when set.
    #[arg(long, default_value = "warn", global = true)]
    log_level: String,
    /// Run without seccomp filters (debugging only: a compromised device model is then
    /// free to make any system call).
    #[arg(long, global = true)]
    no_seccomp: bool,
    /// Test hook: `KIND[:CALL]`: make a thread of this kind (main, vcpu, control,
    /// device) make a forbidden call right after its filter is installed: getppid
    /// (default), socket-inet, clone-process, prctl, ioctl or mprotect-exec.
    #[arg(long, global = true, hide = true)]
    seccomp_selftest: Option<String>,
    /// Bound of the serial file (`--serial file:PATH`, rotated to PATH.1 when
    /// full) and of this process's log where stderr is a file (capped): bytes, or
    /// K/M/G; at least 4K.
    #[arg(long, global = true, default_value = "16M")]
    log_max_bytes: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// Each subcommand's arguments are built only when it is the one given:
// building all of them was most of the 160-290 us clap took per start.
#[derive(Subcommand)]
#[command(defer = true)]
enum Command {
    /// Boot a kernel and run the VM until it ends.
    Run(RunArgs),
    /// Restore a VM from a snapshot in this new process and run it until it ends.
    Restore(RestoreArgs),
    /// Run `vmm ARGS...` confined: new namespaces, a per-VM root directory, cgroup
    /// limits, resource limits and an unprivileged uid/gid (must start as root).
    Jail(JailArgs),
}

#[derive(clap::Args)]
struct JailArgs {
    /// VM name: the cgroup `agentvm/<id>` and the jail's hostname.
    #[arg(long)]
    id: String,
    /// The jail's root directory (created if missing); paths given to the jailed vmm
    /// are relative to it.
    #[arg(long)]
    root: PathBuf,
    /// uid the vmm runs as (not 0).
    #[arg(long)]
    uid: u32,
    /// gid the vmm runs as (not 0).
    #[arg(long)]
    gid: u32,
    /// Accepted for compatibility and ignored: a jailed vmm always has its own
    /// network namespace (only loopback and the --tap interfaces in it).
    #[arg(long, hide = true)]
    netns: bool,
    /// Join this network namespace (e.g. `/run/netns/NAME`, made by the
    /// caller with the VM's tap in it) instead of making a new, empty one.
    #[arg(long, value_name = "PATH")]
    netns_path: Option<PathBuf>,
    /// A tap for the VM (repeatable): a host tap of that name is moved
    /// into the jail's namespace and back when the VM ends; any other is created
    /// there. Either way it is persistent, owned by --uid and up.
    #[arg(long = "tap", value_name = "NAME")]
    taps: Vec<String>,
    /// Bring a host file or directory in: `HOST_PATH:/JAIL_PATH[:ro]` (repeatable).
    #[arg(long = "bind")]
    binds: Vec<String>,
    /// Device nodes to create: kvm, tun, urandom, userfaultfd (repeatable).
    #[arg(long = "device", default_values_t = ["kvm".to_string(), "urandom".to_string()])]
    devices: Vec<String>,
    /// CPU bandwidth `QUOTA_US/PERIOD_US`, e.g. 100000/100000 for one CPU.
    #[arg(long)]
    cpu_max: Option<String>,
    /// Memory limit of the cgroup (bytes, or K/M/G).
    #[arg(long)]
    memory_max: Option<String>,
    /// Where cgroups are mounted.
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_root: PathBuf,
    /// RLIMIT_NOFILE for the vmm.
    #[arg(long, default_value_t = 1024)]
    nofile: u64,
    /// RLIMIT_FSIZE for the vmm: the largest file it may write (bytes, or K/M/G).
    #[arg(long)]
    max_file_size: Option<String>,
    /// The vmm command to run inside, after `--`: e.g. `-- run --kernel /kernel`.
    #[arg(last = true, required = true)]
    vmm_args: Vec<String>,
}

#[derive(clap::Args)]
struct RestoreArgs {
    /// Snapshot directory (for a diff, its parents are found through the manifests).
    #[arg(long, required_unless_present = "standby", conflicts_with = "standby")]
    snapshot: Option<PathBuf>,
    /// Start ahead of the session: create the KVM VM (with --mem-mib also its memory
    /// slots, irqchip, PIT and vCPUs), then wait on the control socket (required) for `{"op":"restore","snapshot":DIR,"paused":BOOL}`;
    /// the other options (devices, serial, memory) apply to that restore.
    #[arg(long, requires = "control_socket", conflicts_with = "paused")]
    standby: bool,
    /// vCPUs to create on standby: the snapshot restored must have as many [default: 1].
    #[arg(long, requires = "standby", value_parser = clap::value_parser!(u8).range(1..))]
    vcpus: Option<u8>,
    /// Guest memory to reserve on standby, in MiB: its memory slots, the irqchip, the PIT
    /// and the vCPUs are then set up ahead too, and the snapshot (which must have this
    /// size) is mapped over the reservation. Only with --memory-backend file and private
    /// memory; without it those steps wait for the restore request.
    #[arg(long, requires = "standby", value_parser = clap::value_parser!(u64).range(1..))]
    mem_mib: Option<u64>,
    /// How guest memory is populated: file (MAP_PRIVATE of the memory file) or uffd
    /// (userfaultfd, pages served by the vmm on first touch).
    #[arg(long, default_value = "file")]
    memory_backend: String,
    /// Serial output: stdout, none or file:PATH.
    #[arg(long, default_value = "stdout")]
    serial: String,
    /// Unix socket for JSON-lines control requests.
    #[arg(long)]
    control_socket: Option<PathBuf>,
    /// Leave the vCPUs paused after the restore (resume through the control socket).
    #[arg(long)]
    paused: bool,
    /// virtio-blk back end for the snapshot's next disk, `PATH[,ro][,bw=RATE][,iops=RATE]`;
    /// give the same devices as the snapshotted VM, in the same order. Limits are not
    /// part of the snapshot: these apply (RATE is `SIZE[/MS][+BURST]`).
    #[arg(long = "disk", value_name = "PATH[,ro][,bw=RATE][,iops=RATE]")]
    disk: Vec<String>,
    /// virtio-vsock back end, `CID:UDS_PATH` (the CID must match the snapshot's).
    #[arg(long, value_name = "CID:UDS_PATH")]
    vsock: Option<String>,
    /// virtio-net back end, `TAP[,mac=..][,rx_bw=RATE][,tx_bw=RATE][,rx_ops=RATE][,tx_ops=RATE]`;
    /// the limits given here apply (they are not part of the snapshot).
    #[arg(long, value_name = "TAP[,mac=MAC][,rx_bw=RATE]...")]
    net: Option<String>,
    /// The snapshot has a virtio-rng device.
    #[arg(long)]
    rng: bool,
    /// virtio-fs device served by a vhost-user backend (virtiofsd) listening on SOCKET:
    /// `TAG:SOCKET[,queues=N]`; the guest mounts TAG (`mount -t virtiofs TAG DIR`).
    /// Give the snapshot's tags in its order; each restore needs a fresh backend. Makes guest memory shared (a memfd the backend maps).
    #[arg(long = "fs", value_name = "TAG:SOCKET[,queues=N]")]
    fs: Vec<String>,
    /// Guest memory backing: private, shared or shared-hugepages [default: shared with
    /// --fs, else private]. Shared memory is filled by copying the snapshot into a new
    /// memfd (--memory-backend file) or lazily through userfaultfd (uffd).
    #[arg(long, value_name = "private|shared|shared-hugepages")]
    memory: Option<String>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// JSON file with the same fields as the flags (kernel, initrd, cmdline, mem_mib,
    /// vcpus, serial, control_socket, disk (a list), vsock, net, rng, acpi (true or
    /// false)); flags given on the command line win.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Kernel: ELF vmlinux (PVH entry used when present) or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long)]
    cmdline: Option<String>,
    /// Guest memory in MiB [default: 128].
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Number of vCPUs [default: 1].
    #[arg(long)]
    vcpus: Option<u64>,
    /// Serial output: stdout, none or file:PATH [default: stdout].
    #[arg(long)]
    serial: Option<String>,
    /// Unix socket for JSON-lines control requests.
    #[arg(long)]
    control_socket: Option<PathBuf>,
    /// virtio-blk disk: a raw image, `PATH[,ro][,bw=RATE][,iops=RATE]`; repeat for more
    /// disks. `bw` limits data bytes, `iops` requests; RATE is `SIZE[/MS][+BURST]`: SIZE
    /// tokens per MS milliseconds (default 1000) plus a one-time BURST, bytes with
    /// K/M/G suffixes for `bw`.
    #[arg(long = "disk", value_name = "PATH[,ro][,bw=RATE][,iops=RATE]")]
    disk: Vec<String>,
    /// virtio-vsock: guest CID and the host Unix socket (Firecracker's convention).
    #[arg(long, value_name = "CID:UDS_PATH")]
    vsock: Option<String>,
    /// virtio-net on a tap interface (created if absent), with an optional MAC and
    /// rate limits per direction: `TAP[,mac=..][,rx_bw=RATE][,tx_bw=RATE][,rx_ops=RATE]
    /// [,tx_ops=RATE]` (bytes and frames; RATE as for --disk).
    #[arg(long, value_name = "TAP[,mac=..][,rx_bw=RATE]...")]
    net: Option<String>,
    /// virtio-rng fed by the host's getrandom.
    #[arg(long)]
    rng: bool,
    /// virtio-fs device served by a vhost-user backend (virtiofsd) listening on SOCKET:
    /// `TAG:SOCKET[,queues=N]`; the guest mounts TAG (`mount -t virtiofs TAG DIR`).
    /// Repeat for more shares. Makes guest memory shared (a memfd the backend maps).
    #[arg(long = "fs", value_name = "TAG:SOCKET[,queues=N]")]
    fs: Vec<String>,
    /// Guest memory backing: private (anonymous), shared (a memfd, as vhost-user
    /// backends need) or shared-hugepages (a 2 MiB hugetlbfs memfd) [default: shared
    /// with --fs, else private].
    #[arg(long, value_name = "private|shared|shared-hugepages")]
    memory: Option<String>,
    /// ACPI tables (RSDP, XSDT, FADT, MADT, DSDT), the VM generation ID and ACPI
    /// power-off/reset [default: on]. `off` is for kernels built without ACPI: the
    /// virtio devices are then announced as `virtio_mmio.device=` on the kernel
    /// command line, and the MP table alone describes the CPUs.
    #[arg(long, value_name = "on|off")]
    acpi: Option<String>,
    /// An in-kernel i8254 PIT [default: on]. Off, the ACPI machine (hardware-reduced)
    /// boots Linux, which times with kvmclock and the LAPIC; `--acpi off`'s legacy PC
    /// needs one. Restores follow the snapshot (a VM that had a PIT gets one back).
    #[arg(long, value_name = "on|off")]
    pit: Option<String>,
    /// File that keeps the host's supported CPUID (KVM_GET_SUPPORTED_CPUID, the
    /// costliest step of a boot on a nested host) between vmm processes, reused while
    /// the boot, the KVM modules and the host CPU's feature flags are unchanged; `none`
    /// asks KVM every time [default: /run/agentvm/kvm-supported-cpuid].
    #[arg(long, value_name = "PATH|none")]
    cpuid_cache: Option<String>,
}

/// Installs the stderr logger. The filter is `target=level` directives
/// (tracing-subscriber's `Targets`: `warn,vmm::acpi=info`), from `RUST_LOG`
/// when set and valid, else from `level`, else `warn`. `Targets` rather than
/// `EnvFilter`: the vmm needs no span or field filters, and leaving out
/// EnvFilter's regex engine keeps about a third of the binary's code out of
/// every vmm process (measured with `size` and perf's memory-overhead).
fn init_logging(format: LogFormat, level: &str) {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.parse::<Targets>().ok())
        .or_else(|| level.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(tracing::Level::WARN));
    // Colour only on a terminal: a log file (host-agent's vmm.log, whose
    // last lines go into error messages) gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(|| vmm::logfile::CappedStderr);
    match format {
        LogFormat::Text => tracing_subscriber::registry()
            .with(layer)
            .with(filter)
            .init(),
        LogFormat::Json => tracing_subscriber::registry()
            .with(layer.json())
            .with(filter)
            .init(),
    }
}

fn run(args: RunArgs) -> Result<i32, (i32, String)> {
    let bad = |e: &dyn std::fmt::Display| (EXIT_BAD_INPUT, e.to_string());
    let file = match &args.config {
        Some(path) => ConfigFile::load(path).map_err(|e| bad(&e))?,
        None => ConfigFile::default(),
    };
    let flags = ConfigFile {
        kernel: args.kernel,
        initrd: args.initrd,
        cmdline: args.cmdline,
        mem_mib: args.mem_mib,
        vcpus: args.vcpus,
        serial: args.serial,
        control_socket: args.control_socket,
        disk: (!args.disk.is_empty()).then_some(args.disk),
        vsock: args.vsock,
        net: args.net,
        rng: args.rng.then_some(true),
        fs: (!args.fs.is_empty()).then_some(args.fs),
        memory: args.memory,
        acpi: args
            .acpi
            .as_deref()
            .map(parse_acpi)
            .transpose()
            .map_err(|e| bad(&e))?,
        pit: args
            .pit
            .as_deref()
            .map(parse_pit)
            .transpose()
            .map_err(|e| bad(&e))?,
        cpuid_cache: args.cpuid_cache,
    };
    let config = VmConfig::try_from(file.overridden_by(flags)).map_err(|e| bad(&e))?;
    let blocked = block_signals()?;
    let machine = Machine::start(&config).map_err(|e| (e.exit_code(), e.to_string()))?;
    serve_on_socket(machine, blocked, config.control_socket.as_deref())
}

fn restore(args: RestoreArgs) -> Result<i32, (i32, String)> {
    let bad = |e: &dyn std::fmt::Display| (EXIT_BAD_INPUT, e.to_string());
    let devices = DeviceConfig::parse(
        &args.disk,
        args.vsock.as_deref(),
        args.net.as_deref(),
        args.rng,
        &args.fs,
    )
    .map_err(|e| bad(&e))?;
    let requested = args
        .memory
        .as_deref()
        .map(str::parse::<MemoryMode>)
        .transpose()
        .map_err(|e| bad(&e))?;
    let config = RestoreConfig {
        memory: devices.memory_mode(requested).map_err(|e| bad(&e))?,
        // On standby the restore request names it.
        snapshot: args.snapshot.unwrap_or_default(),
        backend: args
            .memory_backend
            .parse::<MemoryBackend>()
            .map_err(|e| bad(&e))?,
        serial: args.serial.parse::<SerialConfig>().map_err(|e| bad(&e))?,
        control_socket: args.control_socket,
        paused: args.paused,
        devices,
    };
    if args.standby {
        return standby(args.vcpus.unwrap_or(1), args.mem_mib, config);
    }
    let blocked = block_signals()?;
    let machine = Machine::restore(&config).map_err(|e| (e.exit_code(), e.to_string()))?;
    serve_on_socket(machine, blocked, config.control_socket.as_deref())
}

/// Serves `machine` as [`serve`] does, with a control socket bound at `path` if given.
fn serve_on_socket(
    machine: Machine,
    blocked: signals::BlockedSignals,
    path: Option<&std::path::Path>,
) -> Result<i32, (i32, String)> {
    let control = path.map(|path| ControlServer::start(path, machine.shared()));
    serve(machine, blocked, control)
}

fn block_signals() -> Result<signals::BlockedSignals, (i32, String)> {
    signals::block_termination_signals().map_err(|e| {
        (
            EXIT_VM_FAILURE,
            format!("cannot block termination signals: {e}"),
        )
    })
}

/// `vmm restore --standby`: prepares the VM and its vCPUs, waits on the
/// control socket for the snapshot to restore, then runs it as `vmm restore`
/// would. Until the request comes, termination signals end the process at
/// once (there is nothing to save).
fn standby(
    vcpus: u8,
    mem_mib: Option<u64>,
    mut config: RestoreConfig,
) -> Result<i32, (i32, String)> {
    let Some(path) = config.control_socket.clone() else {
        return Err((EXIT_BAD_INPUT, "--standby needs --control-socket".into()));
    };
    if mem_mib.is_some() && (config.backend != MemoryBackend::File || config.memory.is_shared()) {
        return Err((
            EXIT_BAD_INPUT,
            "--mem-mib on standby reserves private memory for --memory-backend file; \
             uffd and shared memory are set up when the restore request comes: leave --mem-mib out"
                .into(),
        ));
    }
    let prepared =
        PreparedVm::new(usize::from(vcpus), mem_mib).map_err(|e| (e.exit_code(), e.to_string()))?;
    vmm::timing::mark("vm-prepared");
    let mut server =
        StandbyServer::bind(&path, prepared).map_err(|e| (EXIT_BAD_INPUT, e.to_string()))?;
    tracing::info!(socket = %path.display(), vcpus, "on standby: waiting for a restore request");
    let request = match server.next_request() {
        StandbyRequest::Stop => {
            server.remove();
            tracing::info!("stopped on standby, without a VM");
            return Ok(0);
        }
        StandbyRequest::Restore(request) => request,
    };
    vmm::timing::mark("restore-requested");
    let RestoreRequest {
        loaded,
        snapshot,
        paused,
        client,
    } = *request;
    config.snapshot = snapshot;
    config.paused = paused;
    let (prepared, socket) = server.into_parts();
    let blocked = match block_signals() {
        Ok(blocked) => blocked,
        Err((code, message)) => {
            socket.refuse(client, &message);
            return Err((code, message));
        }
    };
    match Machine::restore_prepared(prepared, loaded, &config) {
        Ok(machine) => {
            let control = socket.serve_restored(client, machine.shared());
            serve(machine, blocked, Some(control))
        }
        Err(e) => {
            socket.refuse(client, &e.to_string());
            Err((e.exit_code(), e.to_string()))
        }
    }
}

fn jail(args: JailArgs) -> Result<i32, (i32, String)> {
    // --netns is what every jail gets now; the flag stays accepted for old scripts.
    let _always_on = args.netns;
    let bad = |e: String| (EXIT_BAD_INPUT, e);
    let limits = CgroupLimits {
        cpu_max: args
            .cpu_max
            .as_deref()
            .map(parse_cpu_max)
            .transpose()
            .map_err(bad)?,
        memory_max: args
            .memory_max
            .as_deref()
            .map(parse_size)
            .transpose()
            .map_err(bad)?,
    };
    let config = JailConfig {
        id: args.id,
        root: args.root,
        uid: args.uid,
        gid: args.gid,
        taps: args.taps,
        netns: args.netns_path,
        binds: args
            .binds
            .iter()
            .map(|b| b.parse::<BindMount>())
            .collect::<Result<_, _>>()
            .map_err(bad)?,
        devices: args.devices,
        limits,
        cgroup_root: args.cgroup_root,
        nofile: args.nofile,
        fsize: args
            .max_file_size
            .as_deref()
            .map(parse_size)
            .transpose()
            .map_err(bad)?,
        vmm_args: args.vmm_args,
    };
    vmm::jail::run(&config).map_err(|e| match e {
        JailError::Invalid(_) | JailError::NotRoot => (EXIT_BAD_INPUT, e.to_string()),
        _ => (EXIT_VM_FAILURE, e.to_string()),
    })
}

/// Serves the control socket and signals until the VM ends; returns the exit code.
fn serve(
    mut machine: Machine,
    blocked: signals::BlockedSignals,
    control: Option<Result<ControlServer, ControlError>>,
) -> Result<i32, (i32, String)> {
    let _control = match control {
        Some(started) => match started {
            Ok(server) => Some(server),
            Err(e) => {
                machine
                    .coordinator()
                    .request_exit(vmm::exit::ExitReason::VmmError {
                        vcpu: None,
                        message: e.to_string(),
                    });
                machine.wait();
                return Err((EXIT_BAD_INPUT, e.to_string()));
            }
        },
        None => None,
    };
    // Filtered before the guest runs: the main thread is then asleep in
    // `watch_until_ended` by the guest's first output (see `Machine::run`).
    seccomp::apply_or_die(ThreadKind::Main);
    vmm::timing::mark("main-filtered");
    machine.run().map_err(|e| (e.exit_code(), e.to_string()))?;
    signals::watch_until_ended(&blocked, &machine.coordinator());
    let reason = machine.wait();
    // What remains is the process's exit: dropping the VM and, in the
    // kernel, tearing down its memory and KVM state before the parent sees it.
    vmm::timing::mark("vm-ended");
    let code = reason.exit_code();
    if code == 0 {
        tracing::info!(kind = reason.name(), %reason, code, "VM exited");
    } else {
        tracing::error!(kind = reason.name(), %reason, code, "VM failed");
        eprintln!("vmm: VM failed: {reason}");
    }
    Ok(code)
}

/// Parses `--seccomp-selftest KIND[:CALL]`.
fn parse_selftest(s: &str) -> Option<(ThreadKind, seccomp::SelftestCall)> {
    let (kind, call) = s.split_once(':').unwrap_or((s, "getppid"));
    Some((
        ThreadKind::from_name(kind)?,
        seccomp::SelftestCall::from_name(call)?,
    ))
}

/// musl's allocator (the node's static vmm) is slow at the many small
/// allocations of start-up (the command line's parser, the snapshot's
/// state): parsing the command line took 288 µs with it, 162 with dlmalloc.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

fn main() -> ExitCode {
    let entered = vmm::timing::now_ns();
    // The VM's keeper, forked first: the fewer pages this process has
    // written by then, the fewer the keeper ends up holding copies of.
    if std::env::args_os()
        .skip(1)
        .find(|a| ["run", "restore", "jail"].iter().any(|c| a == c))
        .is_some_and(|c| c != "jail")
    {
        vmm::keeper::start();
    }
    let kept = vmm::timing::now_ns();
    // One malloc arena for the whole process instead of one per thread: the
    // vmm's threads allocate little and rarely, and each arena costs a 128 MiB
    // reservation, page faults and about 132 KiB of memory once touched.
    // (musl's allocator has no arenas to limit.)
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a glibc tuning value; no other thread exists yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1)
    };
    let cli = Cli::parse();
    let parsed = vmm::timing::now_ns();
    match parse_size(&cli.log_max_bytes) {
        Ok(n) if n >= vmm::logfile::MIN_MAX_BYTES => vmm::logfile::set_max_bytes(n),
        _ => {
            eprintln!(
                "vmm: invalid --log-max-bytes {:?}: bytes, or K/M/G, at least 4K",
                cli.log_max_bytes
            );
            return ExitCode::from(EXIT_BAD_INPUT as u8);
        }
    }
    vmm::logfile::init_stderr();
    init_logging(cli.log_format, &cli.log_level);
    vmm::timing::mark_at("main", entered);
    vmm::timing::mark_at("keeper-forked", kept);
    vmm::timing::mark_at("cli-parsed", parsed);
    vmm::timing::mark("logging");
    let selftest = match cli.seccomp_selftest.as_deref().map(parse_selftest) {
        Some(None) => {
            eprintln!(
                "vmm: --seccomp-selftest takes KIND[:CALL]: main, vcpu, control or device, \
                 and getppid, socket-inet, clone-process, prctl, ioctl or mprotect-exec"
            );
            return ExitCode::from(EXIT_BAD_INPUT as u8);
        }
        Some(Some(test)) => Some(test),
        None => None,
    };
    if let Err(e) = seccomp::init(!cli.no_seccomp, selftest) {
        eprintln!("vmm: {e}");
        return ExitCode::from(EXIT_VM_FAILURE as u8);
    }
    vmm::timing::mark("seccomp-installed");
    let code = match cli.command {
        Command::Run(args) => run(args),
        Command::Restore(args) => restore(args),
        Command::Jail(args) => jail(args),
    };
    let code = match code {
        Ok(code) => code,
        Err((code, message)) => {
            tracing::error!(code, "{message}");
            eprintln!("vmm: {message}");
            code
        }
    };
    ExitCode::from(code as u8)
}

#[cfg(test)]
#[path = "main_tests.rs"]
mod tests;
