//! Builds a whole microVM, from a kernel (boot) or from a snapshot
//! (restore): KVM, memory, devices on the buses, vCPUs; starts it, serves
//! snapshot requests, and waits for it to end.

mod acpi;
mod restore;
mod snapshot;

pub use restore::{LoadedSnapshot, PreparedVm, RestoreConfig};
pub use snapshot::SnapshotRequestError;

use std::io::LineWriter;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::acpi::AcpiError;
use crate::arch::x86_64::layout::ACPI_VMGENID_START;
use crate::arch::x86_64::{cpuid_cache, loader, mptable};
use crate::config::{SerialConfig, VmConfig};
use crate::devices::acpi::vmgenid::VmGenIdError;
use crate::devices::acpi::{AcpiDeviceError, AcpiDevices};
use crate::devices::bus::{Bus, BusError};
use crate::devices::irq::IrqLine;
use crate::devices::legacy::i8042::persist::I8042PersistError;
use crate::devices::legacy::i8042::{ResetTrigger, I8042, I8042_PORT_BASE, I8042_PORT_LEN};
use crate::devices::legacy::serial::coalesced::CoalescedTx;
use crate::devices::legacy::serial::output::{BufferedOutput, WriterHandle};
use crate::devices::legacy::serial::{
    spawn_stdin_forwarder, SerialDevice, SerialOut, COM1_IRQ, COM1_PORT_BASE, COM1_PORT_LEN,
};
use crate::devices::virtio::setup::{
    self as virtio_setup, PlannedDevice, SetupError, VirtioRuntime,
};
use crate::exit::{ExitReason, EXIT_BAD_INPUT, EXIT_VM_FAILURE};
use crate::kvm::{KvmError, KvmHandle};
use crate::memory::{create_guest_memory, MemoryError};
use crate::snapshot::memory_file;
use crate::timing;
use crate::vcpu::coordinator::Coordinator;
use crate::vcpu::threads::VcpuThreads;
use crate::vcpu::{kick, Buses, SharedVcpuFd, Vcpu, VcpuError};
use crate::vm::{Vm, VmError};

/// Errors building or starting a VM.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// KVM is missing something.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// Guest memory could not be set up.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The kernel, initrd or command line was refused.
    #[error(transparent)]
    Loader(#[from] loader::LoaderError),
    /// A snapshot's saved vCPUs are not in id order (a damaged or forged state file).
    #[error("the snapshot's vCPU state {position} is for vCPU {index}: the state file is damaged")]
    VcpuOrder {
        /// Position in the state file.
        position: usize,
        /// The vCPU id saved there.
        index: u8,
    },
    /// A vmm on standby was started for another vCPU count than the snapshot has.
    #[error("this vmm was started on standby with {prepared} vCPUs but the snapshot has {snapshot}: start the standby vmm with --vcpus {snapshot}")]
    StandbyVcpus {
        /// vCPUs created on standby.
        prepared: usize,
        /// vCPUs in the snapshot.
        snapshot: usize,
    },
    /// A vmm on standby reserved another memory size than the snapshot has.
    #[error("this vmm was started on standby with {prepared_mib} MiB of guest memory reserved but the snapshot has {snapshot_mib} MiB: start the standby vmm with --mem-mib {snapshot_mib}")]
    StandbyMemory {
        /// MiB reserved on standby.
        prepared_mib: u64,
        /// MiB in the snapshot.
        snapshot_mib: u64,
    },
    /// More vCPUs than KVM allows.
    #[error("{requested} vCPUs requested but this host's KVM allows at most {max}")]
    TooManyVcpus {
        /// Requested.
        requested: u8,
        /// KVM's limit.
        max: usize,
    },
    /// VM setup failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// vCPU setup failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// The MP table could not be written.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// Devices could not be placed on the bus.
    #[error("device setup failed: {0}")]
    Bus(#[from] BusError),
    /// The serial output file cannot be opened.
    #[error("cannot set up serial output file {path}: {source}")]
    SerialFile {
        /// The file.
        path: std::path::PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A device could not be created.
    #[error("cannot set up {what}: {source}")]
    Device {
        /// Which device.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A virtio device could not be set up.
    #[error(transparent)]
    Virtio(#[from] SetupError),
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("cannot read the CPUID KVM supports: {0}")]
    Cpuid(#[source] kvm_ioctls::Error),
    /// The snapshot's manifests or chain are invalid.
    #[error(transparent)]
    Manifest(#[from] crate::snapshot::manifest::ManifestError),
    /// The snapshot's state file is invalid.
    #[error(transparent)]
    State(#[from] crate::snapshot::state::StateError),
    /// Restored memory could not be built.
    #[error(transparent)]
    RestoreMemory(#[from] crate::snapshot::restore_memory::RestoreMemoryError),
    /// VM-wide state could not be restored.
    #[error("cannot restore VM state: {0}")]
    VmState(#[from] crate::vm::persist::VmStateError),
    /// A vCPU's state could not be restored.
    #[error("cannot restore vCPU state: {0}")]
    VcpuState(#[from] crate::vcpu::persist::VcpuStateError),
    /// The serial device's state could not be restored.
    #[error("cannot restore the serial console: {0}")]
    SerialState(#[from] crate::devices::legacy::serial::persist::SerialPersistError),
    /// The i8042's state could not be restored.
    #[error("cannot restore the i8042: {0}")]
    I8042State(#[from] I8042PersistError),
    /// The work due right before the vCPUs first run failed.
    #[error("cannot start the vCPUs: {0}")]
    FirstRun(#[source] crate::vcpu::coordinator::CoordinatorError),
    /// The ACPI tables cannot describe the VM or be written.
    #[error(transparent)]
    Acpi(#[from] AcpiError),
    /// The ACPI devices could not be set up or restored.
    #[error(transparent)]
    AcpiDevices(#[from] AcpiDeviceError),
}

impl StartError {
    /// The process exit code: 2 for bad input, 1 for host or VMM failures.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::Memory(MemoryError::Allocate { .. }) => EXIT_VM_FAILURE,
            StartError::Memory(_)
            | StartError::Loader(_)
            | StartError::Manifest(_)
            | StartError::State(_)
            | StartError::SerialState(_)
            | StartError::I8042State(I8042PersistError::Invalid(_))
            | StartError::TooManyVcpus { .. }
            | StartError::VcpuOrder { .. }
            | StartError::StandbyVcpus { .. }
            | StartError::StandbyMemory { .. }
            | StartError::SerialFile { .. }
            | StartError::MpTable(mptable::MpTableError::TooManyCpus(_))
            | StartError::Acpi(
                AcpiError::TooManyVcpus { .. }
                | AcpiError::TooManyDevices { .. }
                | AcpiError::Device { .. }
                | AcpiError::TooLarge { .. },
            )
            | StartError::AcpiDevices(
                AcpiDeviceError::InvalidState(_)
                | AcpiDeviceError::VmGenId(VmGenIdError::Misplaced { .. }),
            ) => EXIT_BAD_INPUT,
            StartError::Virtio(
                SetupError::Block(_)
                | SetupError::Net(_)
                | SetupError::Vsock(_)
                | SetupError::Fs(_)
                | SetupError::TooMany(_)
                | SetupError::Restore { .. },
            ) => EXIT_BAD_INPUT,
            _ => EXIT_VM_FAILURE,
        }
    }
}

/// A built microVM: its vCPUs run once [`Machine::run`] is called.
pub struct Machine {
    shared: Arc<MachineShared>,
    /// The vCPUs and the threads waiting for them, until `run`.
    waiting: Option<(Vec<Vcpu>, VcpuThreads)>,
    threads: Vec<JoinHandle<()>>,
}

/// The parts of a running VM that the control socket reaches.
pub struct MachineShared {
    kvm: KvmHandle,
    vm: Vm,
    coordinator: Arc<Coordinator>,
    vcpus: Vec<SharedVcpuFd>,
    serial: Arc<Mutex<SerialDevice>>,
    /// The i8042, for snapshots (held here also so that it and its irqfds
    /// are dropped on this thread, not on a vCPU thread under its seccomp filter).
    i8042: Arc<Mutex<I8042>>,
    mem_mib: u64,
    /// Whether the VM has an in-kernel PIT (its state is then saved).
    pit: bool,
    /// The snapshot the current memory descends from (the parent of the next diff).
    last_snapshot: Mutex<Option<PathBuf>>,
    /// Dirty pages taken from KVM but not yet written to a snapshot (kept if a write fails).
    pending_dirty: Mutex<Vec<Vec<u64>>>,
    /// Per region, the pages that may hold non-zero bytes: every other page is
    /// known to be zero, so a full snapshot reads only these. Grows with every
    /// dirty log taken; shrinks to what a full snapshot found non-zero.
    maybe_nonzero: Mutex<Vec<Vec<u64>>>,
    /// The virtio devices and their event thread.
    virtio: VirtioRuntime,
    /// The ACPI devices, when the VM has ACPI tables.
    acpi: Option<AcpiDevices>,
}

/// The devices and buses of a VM, before its vCPUs exist.
struct Devices {
    buses: Buses,
    serial: Arc<Mutex<SerialDevice>>,
    i8042: Arc<Mutex<I8042>>,
    virtio: VirtioRuntime,
    acpi: Option<AcpiDevices>,
}

/// Puts the serial console, the i8042 (its IRQ 1 and 12 registered as
/// irqfds) and the ACPI registers (if any) on the port-I/O bus and the virtio
/// devices on the MMIO bus.
///
/// The serial console's data port goes through KVM's coalesced ring where
/// KVM has one (mapped through `first_vcpu`, none for a VM without vCPUs; see
/// [`crate::devices::legacy::serial::coalesced`]).
fn build_devices(
    vm: &Vm,
    first_vcpu: Option<&kvm_ioctls::VcpuFd>,
    (mut serial, writer): (SerialDevice, Option<WriterHandle>),
    i8042: I8042,
    virtio_devices: Vec<PlannedDevice>,
    acpi: Option<AcpiDevices>,
) -> Result<Devices, StartError> {
    vm.fd()
        .register_irqfd(serial.irq().eventfd(), serial.irq().gsi())
        .map_err(|e| StartError::Device {
            what: "the serial irqfd".into(),
            source: std::io::Error::from_raw_os_error(e.errno()),
        })?;
    if let Some(writer) = &writer {
        serial.set_writer(writer.clone());
    }
    let coalesced = first_vcpu.and_then(|vcpu| {
        CoalescedTx::start(
            vm.shared_fd(),
            vcpu,
            serial.transmit_has_side_effects(),
            writer,
        )
    });
    if let Some(tx) = &coalesced {
        serial.attach_coalesced(tx.clone());
    }
    let serial = Arc::new(Mutex::new(serial));
    for line in i8042.irq_lines() {
        vm.fd()
            .register_irqfd(line.eventfd(), line.gsi())
            .map_err(|e| StartError::Device {
                what: format!("the i8042 irqfd for IRQ {}", line.gsi()),
                source: std::io::Error::from_raw_os_error(e.errno()),
            })?;
    }
    let i8042 = Arc::new(Mutex::new(i8042));
    let mut io = Bus::new();
    io.insert(serial.clone(), COM1_PORT_BASE, COM1_PORT_LEN)?;
    io.insert(i8042.clone(), I8042_PORT_BASE, I8042_PORT_LEN)?;
    if let Some(acpi) = &acpi {
        acpi.attach(vm.fd(), &mut io)?;
    }
    let mut mmio = Bus::new();
    let virtio = virtio_setup::attach(vm.fd(), vm.memory(), &mut mmio, virtio_devices)?;
    let io = Arc::new(io);
    if let Some(tx) = &coalesced {
        tx.serve(&io);
    }
    Ok(Devices {
        buses: Buses {
            io,
            mmio: Arc::new(mmio),
            coalesced,
        },
        serial,
        i8042,
        virtio,
        acpi,
    })
}

/// What the i8042 runs when the guest resets: the VM ends with a guest reset.
fn reset_trigger(coordinator: &Arc<Coordinator>) -> ResetTrigger {
    let coordinator = coordinator.clone();
    ResetTrigger::new(move || coordinator.request_exit(ExitReason::GuestReset))
}

fn serial_irq() -> Result<IrqLine, StartError> {
    IrqLine::new(COM1_IRQ).map_err(|source| StartError::Device {
        what: "the serial interrupt".into(),
        source,
    })
}

/// Where guest output goes, and a handle to the thread writing it there
/// (none for discarded output).
fn serial_output(cfg: &SerialConfig) -> Result<(SerialOut, Option<WriterHandle>), StartError> {
    let buffered = |sink: SerialOut,
                    direct: Option<RawFd>|
     -> Result<(SerialOut, Option<WriterHandle>), StartError> {
        let out = BufferedOutput::new(sink, direct).map_err(|source| StartError::Device {
            what: "the serial output thread".into(),
            source,
        })?;
        let writer = out.handle();
        Ok((Box::new(out), Some(writer)))
    };
    Ok(match cfg {
        // Stdout stays open for the process's life; the writer thread
        // flushes std's line buffer after every batch.
        SerialConfig::Stdout => buffered(Box::new(std::io::stdout()), Some(libc::STDOUT_FILENO))?,
        SerialConfig::None => (Box::new(std::io::sink()), None),
        SerialConfig::File(path) => {
            // Rotated at the log bound: a guest cannot fill the disk through it.
            let file = crate::logfile::RotatingFile::open(path, crate::logfile::max_bytes())
                .map_err(|source| StartError::SerialFile {
                    path: path.clone(),
                    source,
                })?;
            buffered(Box::new(LineWriter::new(file)), None)?
        }
    })
}

impl Machine {
    /// Builds the VM described by `config`; [`Machine::run`] starts its vCPUs.
    pub fn start(config: &VmConfig) -> Result<Machine, StartError> {
        let kvm = KvmHandle::open()?;
        let max = kvm.max_vcpus();
        if usize::from(config.vcpus) > max {
            return Err(StartError::TooManyVcpus {
                requested: config.vcpus,
                max,
            });
        }
        // Their seccomp filters go in while the VM is built.
        let threads = VcpuThreads::spawn(usize::from(config.vcpus))?;
        let memory = create_guest_memory(config.mem_mib, config.memory)?;
        timing::mark("memory-mapped");

        let kernel = loader::load_kernel(&memory, &config.kernel)?;
        let virtio_devices = virtio_setup::create_devices(&config.devices)?;
        let mut cmdline_text = config.cmdline.clone();
        // With ACPI the DSDT describes the devices; a kernel that also had
        // them on the command line would probe each one twice.
        if !config.acpi && !virtio_devices.is_empty() {
            cmdline_text.push(' ');
            cmdline_text.push_str(&virtio_setup::cmdline_params(&virtio_devices));
        }
        let cmdline = loader::build_cmdline(&cmdline_text, loader::cmdline_limit(&kernel))?;
        let initrd = match &config.initrd {
            Some(path) => Some(loader::load_initrd(&memory, path, &kernel)?),
            None => None,
        };
        let rsdp = if config.acpi {
            Some(acpi::write_tables(&memory, config.vcpus, &virtio_devices)?)
        } else {
            None
        };
        loader::write_boot_params(&memory, &kernel, &cmdline, initrd, rsdp)?;
        // The MP table stays with ACPI on: Linux ignores it once the MADT has
        // given the local APICs and the IOAPIC (mpparse.c), it costs a few
        // microseconds and 1 KiB of the EBDA (see the README), and it keeps
        // SMP for a kernel booted with `acpi=off`.
        let mptable_started = std::time::Instant::now();
        mptable::write(&memory, config.vcpus)?;
        tracing::info!(
            target: "vmm::mptable",
            build_us = (mptable_started.elapsed().as_nanos() / 100) as f64 / 10.0,
            "MP table written"
        );
        tracing::info!(
            kernel = %config.kernel.display(),
            format = ?kernel.format,
            entry = ?kernel.entry,
            mem_mib = config.mem_mib,
            vcpus = config.vcpus,
            acpi = config.acpi,
            "kernel loaded"
        );

        timing::mark("kernel-loaded");
        let vm = Vm::new(&kvm, memory, config.pit)?;
        timing::mark("vm-created");
        let coordinator = Arc::new(Coordinator::new(usize::from(config.vcpus)));
        let (out, writer) = serial_output(&config.serial)?;
        let serial = SerialDevice::new(serial_irq()?, out);
        let i8042 =
            I8042::new(reset_trigger(&coordinator)).map_err(|source| StartError::Device {
                what: "the i8042 interrupts".into(),
                source,
            })?;
        let acpi = if config.acpi {
            let devices = AcpiDevices::new(
                ACPI_VMGENID_START,
                vm.memory(),
                acpi::power_handler(&coordinator),
            )?;
            devices.write_first_generation(vm.memory())?;
            Some(devices)
        } else {
            None
        };
        let vcpu_fds = restore::create_vcpu_fds(vm.fd(), usize::from(config.vcpus))?;
        let devices = build_devices(
            &vm,
            vcpu_fds.first(),
            (serial, writer),
            i8042,
            virtio_devices,
            acpi,
        )?;
        timing::mark("devices-created");

        let (supported, source) =
            cpuid_cache::supported_cpuid(kvm.kvm(), config.cpuid_cache.as_deref())
                .map_err(StartError::Cpuid)?;
        tracing::info!(target: "vmm::cpuid", source = ?source, "host CPUID");
        let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
        for (index, fd) in (0..config.vcpus).zip(vcpu_fds) {
            let vcpu = Vcpu::from_fd(fd, index, devices.buses.clone());
            vcpu.configure(vm.memory(), &supported, config.vcpus, kernel.entry)?;
            vcpus.push(vcpu);
        }
        timing::mark("vcpus-created");
        // Fresh memory is all zeros; what the vmm writes while loading the
        // kernel is in its own dirty bitmap and joins at the first snapshot.
        let maybe_nonzero = memory_file::bitmaps_of(&memory_file::layout(vm.memory()), &[]);
        let shared = MachineShared {
            kvm,
            vm,
            coordinator,
            vcpus: vcpus.iter().map(Vcpu::fd).collect(),
            serial: devices.serial,
            i8042: devices.i8042,
            mem_mib: config.mem_mib,
            pit: config.pit,
            last_snapshot: Mutex::new(None),
            pending_dirty: Mutex::new(Vec::new()),
            maybe_nonzero: Mutex::new(maybe_nonzero),
            virtio: devices.virtio,
            acpi: devices.acpi,
        };
        Self::launch(shared, vcpus, threads, &config.serial)
    }

    /// Readies a built VM: the serial input forwarder, the kick handler and
    /// the first-run work; the vCPUs wait for [`Machine::run`].
    fn launch(
        shared: MachineShared,
        vcpus: Vec<Vcpu>,
        threads: VcpuThreads,
        serial: &SerialConfig,
    ) -> Result<Machine, StartError> {
        if *serial == SerialConfig::Stdout {
            spawn_stdin_forwarder(shared.serial.clone()).map_err(|source| StartError::Device {
                what: "the serial input thread".into(),
                source,
            })?;
        }
        kick::install_handler().map_err(|source| StartError::Device {
            what: "the vCPU kick signal handler".into(),
            source,
        })?;
        shared
            .coordinator
            .before_start()
            .map_err(StartError::FirstRun)?;
        Ok(Machine {
            shared: Arc::new(shared),
            waiting: Some((vcpus, threads)),
            threads: Vec::new(),
        })
    }

    /// Hands the vCPU threads their vCPUs: the guest runs (or waits paused,
    /// as the coordinator says). The caller does its own last set-up steps
    /// (control socket, its seccomp filter) first, so that it is asleep
    /// when the guest starts: on a busy host the guest's first output then
    /// finds a free CPU for whoever reads it, instead of a reader queued
    /// behind the vCPU thread that woke it. Calling it again does nothing.
    pub fn run(&mut self) -> Result<(), StartError> {
        let Some((vcpus, threads)) = self.waiting.take() else {
            return Ok(());
        };
        match threads.start(vcpus, &self.shared.coordinator) {
            Ok(threads) => {
                self.threads = threads;
                Ok(())
            }
            Err((e, started)) => {
                self.shared.coordinator.request_exit(ExitReason::VmmError {
                    vcpu: None,
                    message: e.to_string(),
                });
                for t in started {
                    let _ = t.join();
                }
                Err(e.into())
            }
        }
    }

    /// The coordinator, for the control socket and signal handling.
    pub fn coordinator(&self) -> Arc<Coordinator> {
        self.shared.coordinator.clone()
    }

    /// The shared machine, for the control socket.
    pub fn shared(&self) -> Arc<MachineShared> {
        self.shared.clone()
    }

    /// The virtio devices (transports, and `save` for snapshots).
    pub fn virtio(&self) -> &VirtioRuntime {
        &self.shared.virtio
    }

    /// Waits until the VM ends and returns why.
    pub fn wait(mut self) -> ExitReason {
        // vCPUs not yet handed out (the caller gave up before `run`) are
        // handed out now: they see the exit request and leave at once.
        if let Err(e) = self.run() {
            return ExitReason::VmmError {
                vcpu: None,
                message: e.to_string(),
            };
        }
        let reason = self.shared.coordinator.wait_for_exit();
        for t in self.threads {
            let _ = t.join();
        }
        let mut serial = self.shared.serial.lock().unwrap_or_else(|p| p.into_inner());
        serial.flush();
        serial.log_transmit_summary();
        drop(serial);
        reason
    }
}
