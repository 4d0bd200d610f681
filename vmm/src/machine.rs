//! Builds a whole microVM from a validated config: KVM, memory, kernel and
//! boot structures, devices on the buses, vCPUs; starts it and waits for it
//! to end.

use std::fs::OpenOptions;
use std::io::LineWriter;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;

use crate::arch::x86_64::{loader, mptable};
use crate::config::{SerialConfig, VmConfig};
use crate::devices::bus::{Bus, BusError};
use crate::devices::irq::IrqLine;
use crate::devices::legacy::i8042::{ResetTrigger, I8042, I8042_PORT_BASE, I8042_PORT_LEN};
use crate::devices::legacy::serial::{
    spawn_stdin_forwarder, SerialDevice, SerialOut, COM1_IRQ, COM1_PORT_BASE, COM1_PORT_LEN,
};
use crate::devices::virtio::setup::{self as virtio_setup, SetupError, VirtioRuntime};
use crate::exit::{ExitReason, EXIT_BAD_INPUT, EXIT_VM_FAILURE};
use crate::kvm::{KvmError, KvmHandle};
use crate::memory::{create_guest_memory, MemoryError};
use crate::vcpu::coordinator::Coordinator;
use crate::vcpu::{kick, Buses, Vcpu, VcpuError};
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
}

impl StartError {
    /// The process exit code: 2 for bad input, 1 for host or VMM failures.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::Memory(MemoryError::Allocate { .. }) => EXIT_VM_FAILURE,
            StartError::Memory(_)
            | StartError::Loader(_)
            | StartError::TooManyVcpus { .. }
            | StartError::MpTable(mptable::MpTableError::TooManyCpus(_)) => EXIT_BAD_INPUT,
            StartError::Device { what, .. } if what.starts_with("serial output file") => {
                EXIT_BAD_INPUT
            }
            StartError::Virtio(
                SetupError::Block(_)
                | SetupError::Net(_)
                | SetupError::Vsock(_)
                | SetupError::TooMany(_),
            ) => EXIT_BAD_INPUT,
            _ => EXIT_VM_FAILURE,
        }
    }
}

/// A running microVM.
pub struct Machine {
    coordinator: Arc<Coordinator>,
    threads: Vec<JoinHandle<()>>,
    serial: Arc<Mutex<SerialDevice>>,
    /// The virtio devices and their event thread.
    virtio: VirtioRuntime,
    // Kept alive for the VM's lifetime: the fds and guest memory.
    _vm: Vm,
}

fn serial_output(cfg: &SerialConfig) -> Result<SerialOut, StartError> {
    Ok(match cfg {
        SerialConfig::Stdout => Box::new(std::io::stdout()),
        SerialConfig::None => Box::new(std::io::sink()),
        SerialConfig::File(path) => {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| StartError::Device {
                    what: format!("serial output file {}", path.display()),
                    source,
                })?;
            Box::new(LineWriter::new(file))
        }
    })
}

impl Machine {
    /// Builds the VM described by `config` and starts its vCPUs.
    pub fn start(config: &VmConfig) -> Result<Machine, StartError> {
        let kvm = KvmHandle::open()?;
        let max = kvm.max_vcpus();
        if usize::from(config.vcpus) > max {
            return Err(StartError::TooManyVcpus {
                requested: config.vcpus,
                max,
            });
        }
        let memory = create_guest_memory(config.mem_mib)?;

        let kernel = loader::load_kernel(&memory, &config.kernel)?;
        let virtio_devices = virtio_setup::create_devices(config)?;
        let mut cmdline_text = config.cmdline.clone();
        if !virtio_devices.is_empty() {
            cmdline_text.push(' ');
            cmdline_text.push_str(&virtio_setup::cmdline_params(&virtio_devices));
        }
        let cmdline = loader::build_cmdline(&cmdline_text, loader::cmdline_limit(&kernel))?;
        let initrd = match &config.initrd {
            Some(path) => Some(loader::load_initrd(&memory, path, &kernel)?),
            None => None,
        };
        loader::write_boot_params(&memory, &kernel, &cmdline, initrd)?;
        mptable::write(&memory, config.vcpus)?;
        tracing::info!(
            kernel = %config.kernel.display(),
            format = ?kernel.format,
            entry = ?kernel.entry,
            mem_mib = config.mem_mib,
            vcpus = config.vcpus,
            "kernel loaded"
        );

        let vm = Vm::new(&kvm, memory)?;
        let coordinator = Arc::new(Coordinator::new(usize::from(config.vcpus)));

        let irq = IrqLine::new(COM1_IRQ).map_err(|source| StartError::Device {
            what: "the serial interrupt".into(),
            source,
        })?;
        vm.fd()
            .register_irqfd(irq.eventfd(), irq.gsi())
            .map_err(|e| StartError::Device {
                what: "the serial irqfd".into(),
                source: std::io::Error::from_raw_os_error(e.errno()),
            })?;
        let serial = Arc::new(Mutex::new(SerialDevice::new(
            irq,
            serial_output(&config.serial)?,
        )));
        let reset_coordinator = coordinator.clone();
        let i8042 = Arc::new(Mutex::new(I8042::new(ResetTrigger::new(move || {
            reset_coordinator.request_exit(ExitReason::GuestReset)
        }))));
        let mut io = Bus::new();
        io.insert(serial.clone(), COM1_PORT_BASE, COM1_PORT_LEN)?;
        io.insert(i8042, I8042_PORT_BASE, I8042_PORT_LEN)?;
        let mut mmio = Bus::new();
        let virtio = virtio_setup::attach(vm.fd(), vm.memory(), &mut mmio, virtio_devices)?;
        let buses = Buses {
            io: Arc::new(io),
            mmio: Arc::new(mmio),
        };

        let supported = kvm
            .kvm()
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(StartError::Cpuid)?;
        let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
        for index in 0..config.vcpus {
            let mut vcpu = Vcpu::new(vm.fd(), index, buses.clone())?;
            vcpu.configure(vm.memory(), &supported, config.vcpus, kernel.entry)?;
            vcpus.push(vcpu);
        }

        if config.serial == SerialConfig::Stdout {
            spawn_stdin_forwarder(serial.clone()).map_err(|source| StartError::Device {
                what: "the serial input thread".into(),
                source,
            })?;
        }

        kick::install_handler().map_err(|source| StartError::Device {
            what: "the vCPU kick signal handler".into(),
            source,
        })?;
        let mut threads = Vec::with_capacity(vcpus.len());
        for vcpu in vcpus {
            match vcpu.start(coordinator.clone()) {
                Ok(handle) => threads.push(handle),
                Err(e) => {
                    coordinator.request_exit(ExitReason::VmmError {
                        vcpu: None,
                        message: e.to_string(),
                    });
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(Machine {
            coordinator,
            threads,
            serial,
            virtio,
            _vm: vm,
        })
    }

    /// The coordinator, for the control socket.
    pub fn coordinator(&self) -> Arc<Coordinator> {
        self.coordinator.clone()
    }

    /// The virtio devices (transports, and `save` for snapshots).
    pub fn virtio(&self) -> &VirtioRuntime {
        &self.virtio
    }

    /// Waits until the VM ends and returns why.
    pub fn wait(self) -> ExitReason {
        let reason = self.coordinator.wait_for_exit();
        for t in self.threads {
            let _ = t.join();
        }
        self.serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush();
        reason
    }
}
