//! vCPUs: per-vCPU register setup and the thread that runs KVM_RUN and
//! dispatches its exits to the buses.

pub mod coordinator;
pub mod crash;
pub mod exit_log;
pub mod kick;
pub mod persist;
pub mod threads;

use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    CpuId, KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};

use crate::arch::x86_64::{cpuid, loader::BootEntry, msr, regs};
use crate::devices::bus::Bus;
use crate::devices::legacy::serial::coalesced::CoalescedTx;
use crate::exit::ExitReason;
use crate::memory::GuestMemoryMmap;
use coordinator::{Coordinator, Next};
use exit_log::{Exit, ExitLog};

/// Errors creating or configuring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// A vCPU ioctl failed.
    #[error("vCPU {index}: {what} failed: {source}")]
    Ioctl {
        /// vCPU index.
        index: u8,
        /// Which ioctl.
        what: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM accepted fewer MSRs than given.
    #[error("vCPU {index}: KVM refused boot MSR {msr:#x}")]
    MsrRefused {
        /// vCPU index.
        index: u8,
        /// The first MSR not set.
        msr: u32,
    },
    /// Writing boot structures (GDT, page tables) failed.
    #[error("vCPU {index}: cannot write boot structures: {source}")]
    Memory {
        /// vCPU index.
        index: u8,
        /// The memory error.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The MSR list could not be built.
    #[error("vCPU {index}: cannot build the MSR list: {message}")]
    MsrList {
        /// vCPU index.
        index: u8,
        /// What failed.
        message: String,
    },
    /// A vCPU thread ended before it was handed its vCPU, or the threads
    /// and vCPUs do not pair up.
    #[error("vCPU {index} has no thread waiting for it")]
    Thread {
        /// vCPU index.
        index: u8,
    },
    /// The vCPU thread could not be spawned.
    #[error("cannot spawn the thread for vCPU {index}: {source}")]
    Spawn {
        /// vCPU index.
        index: u8,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The port-I/O and MMIO buses a vCPU dispatches exits to.
#[derive(Clone)]
pub struct Buses {
    /// Port I/O.
    pub io: Arc<Bus>,
    /// MMIO.
    pub mmio: Arc<Bus>,
    /// The serial console's writes KVM recorded instead of exiting, to hand
    /// to the port bus before each exit is handled (`None`: every write exits).
    pub coalesced: Option<Arc<CoalescedTx>>,
}

/// A vCPU fd shared between its thread (which holds the lock only while in
/// KVM_RUN and handling the exit) and the snapshot code (which locks it while
/// the vCPU is parked).
pub type SharedVcpuFd = Arc<Mutex<VcpuFd>>;

/// Locks a vCPU fd, recovering from poisoning.
pub fn lock_fd(fd: &SharedVcpuFd) -> MutexGuard<'_, VcpuFd> {
    fd.lock().unwrap_or_else(|p| p.into_inner())
}

/// One vCPU.
pub struct Vcpu {
    index: u8,
    fd: SharedVcpuFd,
    buses: Buses,
}

impl Vcpu {
    /// Creates vCPU `index` in `vm`.
    pub fn new(vm: &VmFd, index: u8, buses: Buses) -> Result<Self, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Ioctl {
                index,
                what: "KVM_CREATE_VCPU",
                source,
            })?;
        Ok(Self::from_fd(fd, index, buses))
    }

    /// A vCPU from an fd created earlier (KVM_CREATE_VCPU with id `index`),
    /// as a vmm on standby creates them before its devices exist.
    pub fn from_fd(fd: VcpuFd, index: u8, buses: Buses) -> Self {
        Vcpu {
            index,
            fd: Arc::new(Mutex::new(fd)),
            buses,
        }
    }

    /// The shared fd, for saving and restoring state.
    pub fn fd(&self) -> SharedVcpuFd {
        self.fd.clone()
    }

    /// The vCPU's index.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Sets CPUID, MSRs, registers, FPU and LAPIC for the first instruction.
    pub fn configure(
        &self,
        mem: &GuestMemoryMmap,
        supported_cpuid: &CpuId,
        count: u8,
        entry: BootEntry,
    ) -> Result<(), VcpuError> {
        let index = self.index;
        let ioctl = |what: &'static str| {
            move |source| VcpuError::Ioctl {
                index,
                what,
                source,
            }
        };
        let fd = lock_fd(&self.fd);
        let mut cpuid = supported_cpuid.clone();
        cpuid::normalize(&mut cpuid, index, count);
        fd.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))?;

        let entries = msr::boot_msr_entries();
        let msrs = msr::boot_msrs().map_err(|e| VcpuError::MsrList {
            index,
            message: format!("{e:?}"),
        })?;
        let set = fd.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS"))?;
        if set < entries.len() {
            return Err(VcpuError::MsrRefused {
                index,
                msr: entries[set].index,
            });
        }

        fd.set_regs(&regs::boot_regs(entry))
            .map_err(ioctl("KVM_SET_REGS"))?;
        let mut sregs = fd.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?;
        regs::setup_sregs(mem, entry, &mut sregs)
            .map_err(|source| VcpuError::Memory { index, source })?;
        fd.set_sregs(&sregs).map_err(ioctl("KVM_SET_SREGS"))?;
        fd.set_fpu(&regs::boot_fpu())
            .map_err(ioctl("KVM_SET_FPU"))?;
        let mut lapic = fd.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?;
        regs::setup_lint(&mut lapic);
        fd.set_lapic(&lapic).map_err(ioctl("KVM_SET_LAPIC"))?;
        Ok(())
    }

    /// Runs the vCPU until the coordinator says exit (on its thread, which
    /// has installed its seccomp filter: see [`threads`]).
    fn run_loop(self, coordinator: &Coordinator) {
        let target: *mut u8 = &mut lock_fd(&self.fd).get_kvm_run().immediate_exit;
        kick::set_immediate_exit_target(target);
        coordinator.register_current_thread();
        let mut io_pending = false;
        let mut first_run = self.index == 0;
        // The vmm wrote this vCPU's state (`configure`, `persist::restore`)
        // before handing it to this thread, and writes none while it runs:
        // the log starts with the state.
        let mut exits = ExitLog::new();
        loop {
            let ran = match coordinator.next_after(io_pending) {
                Next::Exit => break,
                Next::Run => {
                    if std::mem::take(&mut first_run) {
                        crate::timing::mark("first-run");
                    }
                    let mut fd = lock_fd(&self.fd);
                    run_once(&mut fd, self.index, &self.buses, &mut exits)
                }
                Next::CompleteIo => {
                    let mut fd = lock_fd(&self.fd);
                    // KVM finishes the pending instruction first, then sees
                    // immediate_exit and returns EINTR without running the
                    // guest (or one more I/O exit for a split access).
                    fd.set_kvm_immediate_exit(1);
                    run_once(&mut fd, self.index, &self.buses, &mut exits)
                }
            };
            io_pending = ran.io_pending;
            if let Some(reason) = ran.exit {
                tracing::debug!(vcpu = self.index, %reason, "vCPU ends the VM");
                coordinator.request_exit(reason);
            }
        }
        kick::set_immediate_exit_target(std::ptr::null_mut());
        coordinator.vcpu_exited();
    }
}

/// Logs the vCPU's state and last exits when the guest failed at the CPU
/// level, with `extra` (the internal error's data) after them.
fn log_crash(fd: &VcpuFd, index: usize, exits: &ExitLog, extra: &str) {
    tracing::error!(
        "vCPU {index} at the failure: {}{extra}",
        crash::state(fd, exits)
    );
}

/// What one KVM_RUN led to.
struct Ran {
    /// Why the VM must end, if it must.
    exit: Option<ExitReason>,
    /// The exit was an I/O or MMIO access that KVM completes only on the
    /// next KVM_RUN.
    io_pending: bool,
}

/// Runs the guest until one exit, handles it, and records it in `exits`
/// (after handling: a crash report lists the exits before the failing one).
fn run_once(fd: &mut VcpuFd, index: u8, buses: &Buses, exits: &mut ExitLog) -> Ran {
    let index = usize::from(index);
    let io = Ran {
        exit: None,
        io_pending: true,
    };
    let ends = |exit: ExitReason| Ran {
        exit: Some(exit),
        io_pending: false,
    };
    let nothing = Ran {
        exit: None,
        io_pending: false,
    };
    let ran = fd.run();
    let exit = Exit::of(&ran);
    if let Some(tx) = &buses.coalesced {
        tx.drain(&buses.io);
    }
    let handled = match ran {
        Ok(exit) => match exit {
            VcpuExit::IoIn(port, data) => {
                if !buses.io.read(u64::from(port), data) {
                    data.fill(0xff);
                }
                io
            }
            VcpuExit::IoOut(port, data) => {
                buses.io.write(u64::from(port), data);
                io
            }
            VcpuExit::MmioRead(addr, data) => {
                if !buses.mmio.read(addr, data) {
                    data.fill(0);
                }
                io
            }
            VcpuExit::MmioWrite(addr, data) => {
                buses.mmio.write(addr, data);
                io
            }
            // Only seen without an in-kernel LAPIC: the vCPU stopped for good.
            VcpuExit::Hlt => ends(ExitReason::GuestHalted { vcpu: index }),
            VcpuExit::Shutdown => {
                log_crash(fd, index, exits, "");
                ends(ExitReason::TripleFault { vcpu: index })
            }
            VcpuExit::SystemEvent(kind, _) => ends(match kind {
                KVM_SYSTEM_EVENT_SHUTDOWN => ExitReason::GuestPoweroff,
                KVM_SYSTEM_EVENT_RESET => ExitReason::GuestReset,
                KVM_SYSTEM_EVENT_CRASH => ExitReason::VmmError {
                    vcpu: Some(index),
                    message: "guest reported a crash (KVM_SYSTEM_EVENT_CRASH)".into(),
                },
                other => ExitReason::VmmError {
                    vcpu: Some(index),
                    message: format!("unexpected KVM system event {other}"),
                },
            }),
            VcpuExit::InternalError => {
                // SAFETY: exit_reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the
                // active union member.
                let suberror = unsafe { fd.get_kvm_run().__bindgen_anon_1.internal.suberror };
                let data = crash::internal_error_data(fd);
                log_crash(fd, index, exits, &format!("; data=[{data}]"));
                ends(ExitReason::KvmInternalError {
                    vcpu: index,
                    suberror,
                })
            }
            VcpuExit::FailEntry(reason, _) => {
                log_crash(fd, index, exits, "");
                ends(ExitReason::FailEntry {
                    vcpu: index,
                    reason,
                })
            }
            VcpuExit::Intr => nothing,
            other => ends(ExitReason::VmmError {
                vcpu: Some(index),
                message: format!("unexpected vCPU exit {other:?}"),
            }),
        },
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
            fd.set_kvm_immediate_exit(0);
            nothing
        }
        Err(e) => ends(ExitReason::VmmError {
            vcpu: Some(index),
            message: format!("KVM_RUN failed: {e}"),
        }),
    };
    exits.record(exit);
    handled
}
