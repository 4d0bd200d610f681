//! Restoring a VM from a snapshot chain into this fresh process.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{
    acpi, build_devices, reset_trigger, serial_irq, serial_output, Machine, MachineShared,
    StartError,
};
use crate::config::{DeviceConfig, MemoryMode, SerialConfig};
use crate::devices::acpi::persist::AcpiRestoreArgs;
use crate::devices::acpi::AcpiDevices;
use crate::devices::legacy::i8042::{AUX_IRQ, I8042, KBD_IRQ};
use crate::devices::legacy::serial::persist::SerialRestoreArgs;
use crate::devices::legacy::serial::SerialDevice;
use crate::devices::legacy::serial::COM1_IRQ;
use crate::devices::virtio::setup as virtio_setup;
use crate::kvm::KvmHandle;
use crate::memory::{create_guest_memory, MemoryReady};
use crate::persist::Persist;
use crate::snapshot::manifest::{resolve_chain, Layer};
use crate::snapshot::memory_file;
use crate::snapshot::restore_memory::{self, MemoryBackend};
use crate::snapshot::state::MachineState;
use crate::timing;
use crate::vcpu::coordinator::Coordinator;
use crate::vcpu::threads::VcpuThreads;
use crate::vcpu::{lock_fd, persist as vcpu_persist, Vcpu, VcpuError};
use crate::vm::{persist as vm_persist, EmptyVm};
use kvm_ioctls::{VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

/// What `vmm restore` needs.
#[derive(Debug, Clone)]
pub struct RestoreConfig {
    /// The snapshot directory (the top of its chain).
    pub snapshot: PathBuf,
    /// How guest memory is populated.
    pub backend: MemoryBackend,
    /// How guest memory is backed (shared for vhost-user devices).
    pub memory: MemoryMode,
    /// Serial output for the restored guest.
    pub serial: SerialConfig,
    /// Control socket path.
    pub control_socket: Option<PathBuf>,
    /// Leave the vCPUs paused after restore.
    pub paused: bool,
    /// The virtio devices' back ends: the same device set as the snapshotted VM.
    pub devices: DeviceConfig,
}

/// What a restore can do before it knows its snapshot. Always: KVM opened
/// and KVM_CREATE_VM. With a memory reservation (a vmm on standby given
/// `--mem-mib`, for the `file` backend and private memory): the memory slots
/// registered over the reservation, the irqchip, the PIT and the vCPUs too;
/// the snapshot's memory file is then mapped over the reservation. Without
/// one, those wait for the restored memory (slots must come before the
/// irqchip: see [`EmptyVm`]).
pub struct PreparedVm {
    kvm: KvmHandle,
    vm: EmptyVm,
    vcpu_count: usize,
    /// The vCPUs, created once the irqchip exists (with a reservation).
    vcpus: Vec<VcpuFd>,
    /// Their threads, filtered and waiting.
    threads: VcpuThreads,
}

/// Creates vCPUs `0..count` of `vm`.
pub(super) fn create_vcpu_fds(vm: &VmFd, count: usize) -> Result<Vec<VcpuFd>, VcpuError> {
    (0..count)
        .map(|index| {
            // `count` is at most KVM's max_vcpus, checked below 256 by the caller.
            let index = index as u8;
            vm.create_vcpu(u64::from(index))
                .map_err(|source| VcpuError::Ioctl {
                    index,
                    what: "KVM_CREATE_VCPU",
                    source,
                })
        })
        .collect()
}

impl PreparedVm {
    /// Opens KVM and creates the VM for `vcpus` vCPUs; with `reserve_mib`,
    /// also reserves that much guest memory (anonymous, not touched),
    /// registers it, and creates the irqchip, PIT and vCPUs.
    pub fn new(vcpus: usize, reserve_mib: Option<u64>) -> Result<Self, StartError> {
        let kvm = KvmHandle::open()?;
        if vcpus == 0 || vcpus > kvm.max_vcpus().min(usize::from(u8::MAX)) {
            return Err(StartError::TooManyVcpus {
                requested: u8::try_from(vcpus).unwrap_or(u8::MAX),
                max: kvm.max_vcpus(),
            });
        }
        // Their seccomp filters go in while the VM is prepared and restored.
        let threads = VcpuThreads::spawn(vcpus)?;
        let reserved = reserve_mib
            .map(|mib| create_guest_memory(mib, MemoryMode::Private))
            .transpose()?;
        let vm = EmptyVm::create(&kvm, reserved)?;
        let fds = if vm.has_irqchip() {
            create_vcpu_fds(vm.fd(), vcpus)?
        } else {
            Vec::new()
        };
        Ok(PreparedVm {
            kvm,
            vm,
            vcpu_count: vcpus,
            vcpus: fds,
            threads,
        })
    }

    /// How many vCPUs the VM is prepared for.
    pub fn vcpu_count(&self) -> usize {
        self.vcpu_count
    }

    /// The guest memory reserved ahead, in MiB (`None`: none was).
    pub fn reserved_mib(&self) -> Option<u64> {
        self.vm
            .reservation()
            .map(|m| m.iter().map(|r| r.len()).sum::<u64>() >> 20)
    }
}

/// A snapshot chain read from disk and checked, before any of it touches a VM.
pub struct LoadedSnapshot {
    layers: Vec<Layer>,
    top: PathBuf,
    state: MachineState,
}

impl LoadedSnapshot {
    /// Resolves the chain whose top is `snapshot` and reads its state file.
    pub fn load(snapshot: &Path) -> Result<Self, StartError> {
        let layers = resolve_chain(snapshot)?;
        let top = layers
            .last()
            .map(|l| l.dir.clone())
            .unwrap_or_else(|| snapshot.to_path_buf());
        let state = MachineState::load(&top)?;
        for (i, vstate) in state.vcpus.iter().enumerate() {
            if usize::from(vstate.index) != i {
                return Err(StartError::VcpuOrder {
                    position: i,
                    index: vstate.index,
                });
            }
        }
        Ok(LoadedSnapshot { layers, top, state })
    }

    /// How many vCPUs the snapshot holds.
    pub fn vcpu_count(&self) -> usize {
        self.state.vcpus.len()
    }

    /// Checks that `prepared` has the vCPUs this snapshot needs and, if it
    /// reserved memory, the same memory layout.
    pub fn fits(&self, prepared: &PreparedVm) -> Result<(), StartError> {
        if prepared.vcpu_count() != self.vcpu_count() {
            return Err(StartError::StandbyVcpus {
                prepared: prepared.vcpu_count(),
                snapshot: self.vcpu_count(),
            });
        }
        if let Some(reserved) = prepared.vm.reservation() {
            let regions = self.layers.first().map(|l| &l.manifest.regions[..]);
            let same = regions.is_some_and(|regions| {
                regions.len() == reserved.num_regions()
                    && regions
                        .iter()
                        .zip(reserved.iter())
                        .all(|(r, m)| r.gpa == m.start_addr().0 && r.size == m.len())
            });
            if !same {
                return Err(StartError::StandbyMemory {
                    prepared_mib: prepared.reserved_mib().unwrap_or(0),
                    snapshot_mib: self.state.mem_mib,
                });
            }
        }
        Ok(())
    }
}

impl Machine {
    /// Restores the VM saved in `config.snapshot` and starts it (or leaves it paused).
    pub fn restore(config: &RestoreConfig) -> Result<Machine, StartError> {
        let loaded = LoadedSnapshot::load(&config.snapshot)?;
        timing::mark("snapshot-read");
        let prepared = PreparedVm::new(loaded.vcpu_count(), None)?;
        timing::mark("vm-prepared");
        Self::restore_prepared(prepared, loaded, config)
    }

    /// Restores `loaded` into the VM and vCPUs of `prepared` (see
    /// [`LoadedSnapshot::fits`]) and starts it (or leaves it paused).
    pub fn restore_prepared(
        prepared: PreparedVm,
        loaded: LoadedSnapshot,
        config: &RestoreConfig,
    ) -> Result<Machine, StartError> {
        loaded.fits(&prepared)?;
        let LoadedSnapshot { layers, top, state } = loaded;
        let PreparedVm {
            kvm,
            vm,
            vcpu_count: count,
            vcpus: vcpu_fds,
            threads,
        } = prepared;
        let (vm, vcpu_fds, memory_ready) = match vm.reservation() {
            Some(reserved) => {
                let memory =
                    restore_memory::build_over(&layers, reserved, config.backend, config.memory)?;
                timing::mark("memory-mapped");
                (
                    vm.with_memory_over_reservation(memory)?,
                    vcpu_fds,
                    MemoryReady::now(),
                )
            }
            None => {
                let restore_memory::RestoredMemory { mem, ready } =
                    restore_memory::build(&layers, config.backend, config.memory)?;
                timing::mark("memory-mapped");
                let vm = vm.with_memory(mem)?;
                let fds = create_vcpu_fds(vm.fd(), count)?;
                (vm, fds, ready)
            }
        };
        if state.pit {
            vm.create_pit()?;
        }
        vm_persist::restore(vm.fd(), &state.vm, state.pit)?;
        timing::mark("vm-restored");

        let coordinator = Arc::new(if config.paused {
            Coordinator::new_paused(count)
        } else {
            Coordinator::new(count)
        });
        let (out, writer) = serial_output(&config.serial)?;
        let serial = SerialDevice::restore(
            SerialRestoreArgs {
                irq: serial_irq()?,
                out,
            },
            &state.serial,
        )?;
        // Virtio device state is not in the snapshot format yet (see
        // devices/virtio/setup.rs: VirtioRuntime::save, restore_devices).
        let virtio_devices = virtio_setup::restore_devices(
            &config.devices,
            vm.memory(),
            &memory_ready,
            &state.virtio,
        )?;
        let i8042 = I8042::restore(reset_trigger(&coordinator), &state.i8042)?;
        // A snapshot without ACPI state (ACPI off, or format 1.0 or 1.1)
        // restores without ACPI devices, exactly as before they existed.
        let acpi = match &state.acpi {
            Some(acpi_state) => {
                // The PIT, the i8042, COM1 and the virtio devices.
                let taken_gsis = [0, KBD_IRQ, AUX_IRQ, COM1_IRQ]
                    .into_iter()
                    .chain(state.virtio.slots.iter().map(|s| s.gsi))
                    .collect();
                let args = AcpiRestoreArgs {
                    mem: vm.memory().clone(),
                    on_request: acpi::power_handler(&coordinator),
                    taken_gsis,
                };
                Some(AcpiDevices::restore(args, acpi_state)?)
            }
            None => None,
        };
        let devices = build_devices(
            &vm,
            vcpu_fds.first(),
            (serial, writer),
            i8042,
            virtio_devices,
            acpi,
        )?;
        timing::mark("devices-restored");
        let mut vcpus = Vec::with_capacity(count);
        // `fits` checked one fd per saved vCPU, and `load` that the saved
        // vCPUs are in id order, so each fd is the vCPU its state belongs to.
        for (vstate, fd) in state.vcpus.iter().zip(vcpu_fds) {
            let vcpu = Vcpu::from_fd(fd, vstate.index, devices.buses.clone());
            vcpu_persist::restore(&lock_fd(&vcpu.fd()), vstate)?;
            vcpus.push(vcpu);
        }
        timing::mark("vcpus-restored");
        // This VM is a new instance of the snapshotted one: a fresh generation
        // ID, announced when it first runs (now, or at the first resume of a
        // paused restore; until then its memory is the snapshot's), after the
        // LAPICs are restored (the interrupt must land in a restored LAPIC)
        // and before any vCPU runs guest code.
        let announce = devices.virtio.first_run_work()?;
        coordinator.add_first_run(Box::new(move || {
            announce();
            Ok(())
        }));
        if let Some(acpi) = &devices.acpi {
            let (acpi, mem) = (acpi.clone(), vm.memory().clone());
            coordinator.add_first_run(Box::new(move || {
                acpi.announce_new_generation(&mem)
                    .map_err(|e| format!("cannot announce the new VM generation: {e}"))?;
                tracing::info!(
                    vmgenid_addr = acpi.vmgenid().addr(),
                    "new VM generation ID written and announced"
                );
                Ok(())
            }));
        }
        tracing::info!(
            snapshot = %top.display(),
            layers = layers.len(),
            backend = ?config.backend,
            vcpus = count,
            "snapshot restored"
        );
        // Holes in every layer read as zero; only the layers' pages may not.
        let maybe_nonzero = memory_file::bitmaps_of(
            &memory_file::layout(vm.memory()),
            layers.iter().flat_map(|l| &l.manifest.extents),
        );
        let shared = MachineShared {
            kvm,
            vm,
            coordinator,
            vcpus: vcpus.iter().map(Vcpu::fd).collect(),
            serial: devices.serial,
            i8042: devices.i8042,
            mem_mib: state.mem_mib,
            pit: state.pit,
            last_snapshot: Mutex::new(Some(top)),
            pending_dirty: Mutex::new(Vec::new()),
            maybe_nonzero: Mutex::new(maybe_nonzero),
            virtio: devices.virtio,
            acpi: devices.acpi,
        };
        Self::launch(shared, vcpus, threads, &config.serial)
    }
}
