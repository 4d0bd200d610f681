//! Builds the configured virtio devices, places each at its MMIO window with
//! its GSI, registers the irqfd and queue ioeventfds with KVM, and starts the
//! event thread. Also writes the `virtio_mmio.device=` kernel parameters, and
//! saves and restores the whole set for snapshots.

use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use serde::{Deserialize, Serialize};
use vmm_api::protocol::{BlkCounters, NetCounters};

use super::block::persist::{BlockConstructorArgs, BlockState};
use super::block::{Block, BlockError};
use super::event_loop::{EventGate, EventLoop, EventLoopError, Subscriber};
use super::fs::persist::{FsConstructorArgs, FsState};
use super::fs::{Fs, FsError};
use super::io_counters::{BlkIoCounters, NetIoCounters};
use super::mmio::persist::{MmioConstructorArgs, MmioState};
use super::mmio::{MmioTransport, SharedVirtioDevice, MMIO_WINDOW, QUEUE_NOTIFY_OFFSET};
use super::net::persist::{NetConstructorArgs, NetState};
use super::net::{Net, NetError};
use super::persist::VirtioPersistError;
use super::rng::persist::{RngConstructorArgs, RngState};
use super::rng::{Rng, RngError};
use super::vsock::persist::{VsockConstructorArgs, VsockState};
use super::vsock::{Vsock, VsockError};
use super::Interrupt;
use crate::config::{DeviceConfig, DiskConfig, FsConfig, NetConfig, VsockConfig};
use crate::devices::bus::{Bus, BusError};
use crate::devices::irq::IrqLine;
use crate::memory::{GuestMemoryMmap, MemoryReady};
use crate::persist::Persist;

pub use crate::arch::x86_64::layout::{
    MAX_DEVICES, VIRTIO_FIRST_GSI, VIRTIO_LAST_GSI, VIRTIO_MMIO_BASE,
};

/// The GSI of the `i`-th virtio device: the pins from `VIRTIO_FIRST_GSI`
/// up, skipping the i8042's AUX interrupt (12), which that device raises
/// whenever a guest enables it. `None` past the last pin.
pub fn virtio_gsi(i: usize) -> Option<u32> {
    (VIRTIO_FIRST_GSI..=VIRTIO_LAST_GSI)
        .filter(|g| *g != crate::devices::legacy::i8042::AUX_IRQ)
        .nth(i)
}

/// Errors setting up virtio devices.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A disk could not be opened.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The rng could not be created.
    #[error(transparent)]
    Rng(#[from] RngError),
    /// The tap could not be opened.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The vsock could not be created.
    #[error(transparent)]
    Vsock(#[from] VsockError),
    /// A virtio-fs backend could not be used.
    #[error(transparent)]
    Fs(#[from] FsError),
    /// More devices than interrupt lines.
    #[error("{0} virtio devices configured but at most {MAX_DEVICES} fit (one interrupt each: GSIs {VIRTIO_FIRST_GSI}..={VIRTIO_LAST_GSI} but 12, the keyboard controller's)")]
    TooMany(usize),
    /// An eventfd could not be created.
    #[error("cannot create the interrupt eventfd of {what}: {source}")]
    Eventfd {
        /// Which device.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A queue's notification eventfd could not be duplicated.
    #[error("cannot duplicate the queue eventfds of the virtio device at {addr:#x} (to serve requests queued before the snapshot): {source}")]
    QueueKicker {
        /// The device's MMIO address.
        addr: u64,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// KVM refused an irqfd or ioeventfd.
    #[error("cannot register the {kind} of {what} with KVM: {source}")]
    Kvm {
        /// irqfd or ioeventfd.
        kind: &'static str,
        /// Which device.
        what: String,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The device could not be placed on the bus.
    #[error("cannot place {what} on the MMIO bus: {source}")]
    Bus {
        /// Which device.
        what: String,
        /// Why.
        #[source]
        source: BusError,
    },
    /// The event thread could not start.
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    /// A snapshot's virtio state does not fit the configured devices.
    #[error("cannot restore {what}: {source}")]
    Restore {
        /// Which device.
        what: String,
        /// Why.
        #[source]
        source: VirtioPersistError,
    },
}

/// A typed handle on a device, for saving its state.
#[derive(Clone)]
pub enum DeviceHandle {
    /// virtio-blk.
    Block(Arc<Mutex<Block>>),
    /// virtio-net.
    Net(Arc<Mutex<Net>>),
    /// virtio-vsock.
    Vsock(Arc<Mutex<Vsock>>),
    /// virtio-rng.
    Rng(Arc<Mutex<Rng>>),
    /// virtio-fs.
    Fs(Arc<Mutex<Fs>>),
}

fn locked<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceHandle {
    fn shared(&self) -> SharedVirtioDevice {
        match self {
            DeviceHandle::Block(d) => d.clone(),
            DeviceHandle::Net(d) => d.clone(),
            DeviceHandle::Vsock(d) => d.clone(),
            DeviceHandle::Rng(d) => d.clone(),
            DeviceHandle::Fs(d) => d.clone(),
        }
    }

    fn subscriber(&self) -> Subscriber {
        match self {
            DeviceHandle::Block(d) => d.clone(),
            DeviceHandle::Net(d) => d.clone(),
            DeviceHandle::Vsock(d) => d.clone(),
            DeviceHandle::Rng(d) => d.clone(),
            DeviceHandle::Fs(d) => d.clone(),
        }
    }
}

/// A device built from the config, not yet attached to a VM.
pub struct PlannedDevice {
    /// Name for messages ("virtio-blk 0", ...).
    pub name: String,
    /// The device.
    pub handle: DeviceHandle,
    /// Base of its MMIO window.
    pub addr: u64,
    /// Its GSI.
    pub gsi: u32,
    /// Its interrupt (the device holds it once activated).
    pub interrupt: Arc<Interrupt>,
    /// Transport registers to restore, for a device rebuilt from a snapshot.
    pub transport_state: Option<MmioState>,
}

/// What each configured device is, in device order.
#[derive(Debug, Clone, Copy)]
enum Kind<'a> {
    Block(&'a DiskConfig),
    Net(&'a NetConfig),
    Vsock(&'a VsockConfig),
    Rng,
    Fs(&'a FsConfig),
}

/// The configured devices with their names, in device order: block, net,
/// vsock, rng, fs.
fn kinds(config: &DeviceConfig) -> Vec<(String, Kind<'_>)> {
    let mut kinds: Vec<(String, Kind)> = config
        .disks
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("virtio-blk {i}"), Kind::Block(d)))
        .collect();
    if let Some(net) = &config.net {
        kinds.push(("virtio-net".into(), Kind::Net(net)));
    }
    if let Some(vsock) = &config.vsock {
        kinds.push(("virtio-vsock".into(), Kind::Vsock(vsock)));
    }
    if config.rng {
        kinds.push(("virtio-rng".into(), Kind::Rng));
    }
    for fs in &config.fs {
        kinds.push((format!("virtio-fs {:?}", fs.tag), Kind::Fs(fs)));
    }
    kinds
}

/// The MMIO window and GSI of the `i`-th device (`i < MAX_DEVICES`, which
/// `create_devices` checks first).
fn slot(i: usize) -> (u64, u32) {
    (
        VIRTIO_MMIO_BASE + i as u64 * MMIO_WINDOW,
        virtio_gsi(i).unwrap_or(VIRTIO_LAST_GSI),
    )
}

fn new_interrupt(name: &str, gsi: u32) -> Result<Arc<Interrupt>, SetupError> {
    let irq = IrqLine::new(gsi).map_err(|source| SetupError::Eventfd {
        what: name.into(),
        source,
    })?;
    Ok(Arc::new(Interrupt::new(irq)))
}

fn check_count(n: usize) -> Result<(), SetupError> {
    if n > MAX_DEVICES {
        return Err(SetupError::TooMany(n));
    }
    Ok(())
}

/// Opens every configured backend (disks, tap, vsock socket, rng), in the
/// order block, net, vsock, rng, and assigns addresses and GSIs.
pub fn create_devices(config: &DeviceConfig) -> Result<Vec<PlannedDevice>, SetupError> {
    let kinds = kinds(config);
    check_count(kinds.len())?;
    let mut devices = Vec::with_capacity(kinds.len());
    for (i, (name, kind)) in kinds.into_iter().enumerate() {
        let handle = match kind {
            Kind::Block(disk) => {
                let mut block = Block::new(&disk.path, disk.read_only)?;
                block.set_limits(&disk.limits)?;
                DeviceHandle::Block(Arc::new(Mutex::new(block)))
            }
            Kind::Net(net) => {
                let mut dev = Net::new(&net.tap, net.mac)?;
                dev.set_limits(&net.limits)?;
                DeviceHandle::Net(Arc::new(Mutex::new(dev)))
            }
            Kind::Vsock(v) => {
                DeviceHandle::Vsock(Arc::new(Mutex::new(Vsock::new(v.cid, &v.uds_path)?)))
            }
            Kind::Rng => DeviceHandle::Rng(Arc::new(Mutex::new(Rng::new()?))),
            Kind::Fs(fs) => DeviceHandle::Fs(Arc::new(Mutex::new(Fs::new(
                &fs.tag, &fs.socket, fs.queues,
            )?))),
        };
        let (addr, gsi) = slot(i);
        devices.push(PlannedDevice {
            interrupt: new_interrupt(&name, gsi)?,
            name,
            handle,
            addr,
            gsi,
            transport_state: None,
        });
    }
    Ok(devices)
}

/// The state of one device for a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceState {
    /// virtio-blk.
    Block(BlockState),
    /// virtio-net.
    Net(NetState),
    /// virtio-vsock.
    Vsock(VsockState),
    /// virtio-rng.
    Rng(RngState),
    /// virtio-fs.
    Fs(FsState),
}

/// The state of one virtio-mmio slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotState {
    /// MMIO base.
    pub addr: u64,
    /// GSI.
    pub gsi: u32,
    /// Transport registers.
    pub transport: MmioState,
    /// The device.
    pub device: DeviceState,
}

/// The state of every virtio device, in device order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioState {
    /// One entry per slot.
    pub slots: Vec<SlotState>,
}

/// Rebuilds the configured devices from `state` (the config supplies the
/// backends: disk paths, tap, socket path). The state is untrusted: its slots
/// must match the configuration one for one, and each device checks its own.
pub fn restore_devices(
    config: &DeviceConfig,
    mem: &GuestMemoryMmap,
    memory_ready: &MemoryReady,
    state: &VirtioState,
) -> Result<Vec<PlannedDevice>, SetupError> {
    let kinds = kinds(config);
    check_count(kinds.len())?;
    let mismatch = |what: &str, why: String| SetupError::Restore {
        what: what.into(),
        source: VirtioPersistError::Mismatch(why),
    };
    if state.slots.len() != kinds.len() {
        return Err(mismatch(
            "virtio devices",
            format!(
                "the snapshot has {} virtio devices, the restore was given {}: pass the \
                 same --disk/--net/--vsock/--rng/--fs devices as the snapshotted VM",
                state.slots.len(),
                kinds.len()
            ),
        ));
    }
    let mut devices = Vec::with_capacity(kinds.len());
    for (i, ((name, kind), s)) in kinds.into_iter().zip(&state.slots).enumerate() {
        let (addr, gsi) = slot(i);
        if (s.addr, s.gsi) != (addr, gsi) {
            return Err(mismatch(
                &name,
                format!("snapshot slot at {:#x}:{} differs", s.addr, s.gsi),
            ));
        }
        let interrupt = new_interrupt(&name, gsi)?;
        let err = |source| SetupError::Restore {
            what: name.clone(),
            source,
        };
        let (mem, irq) = (mem.clone(), interrupt.clone());
        let handle = match (kind, &s.device) {
            (Kind::Block(disk), DeviceState::Block(st)) => {
                let args = BlockConstructorArgs {
                    path: disk.path.clone(),
                    read_only: disk.read_only,
                    limits: disk.limits,
                    mem,
                    interrupt: irq,
                };
                DeviceHandle::Block(Arc::new(Mutex::new(Block::restore(args, st).map_err(err)?)))
            }
            (Kind::Net(net), DeviceState::Net(st)) => {
                let args = NetConstructorArgs {
                    tap: net.tap.clone(),
                    limits: net.limits,
                    mem,
                    interrupt: irq,
                };
                DeviceHandle::Net(Arc::new(Mutex::new(Net::restore(args, st).map_err(err)?)))
            }
            (Kind::Vsock(v), DeviceState::Vsock(st)) => {
                let args = VsockConstructorArgs {
                    cid: v.cid,
                    uds_path: v.uds_path.clone(),
                    mem,
                    interrupt: irq,
                };
                DeviceHandle::Vsock(Arc::new(Mutex::new(Vsock::restore(args, st).map_err(err)?)))
            }
            (Kind::Rng, DeviceState::Rng(st)) => {
                let args = RngConstructorArgs {
                    mem,
                    interrupt: irq,
                };
                DeviceHandle::Rng(Arc::new(Mutex::new(Rng::restore(args, st).map_err(err)?)))
            }
            (Kind::Fs(fs), DeviceState::Fs(st)) => {
                let args = FsConstructorArgs {
                    tag: fs.tag.clone(),
                    socket: fs.socket.clone(),
                    request_queues: fs.queues,
                    mem,
                    memory_ready: memory_ready.clone(),
                    interrupt: irq,
                };
                DeviceHandle::Fs(Arc::new(Mutex::new(Fs::restore(args, st).map_err(err)?)))
            }
            _ => {
                return Err(mismatch(
                    &name,
                    "the snapshot has a different device in this slot".into(),
                ))
            }
        };
        devices.push(PlannedDevice {
            name,
            handle,
            addr,
            gsi,
            interrupt,
            transport_state: Some(s.transport.clone()),
        });
    }
    Ok(devices)
}

/// The kernel parameters announcing `devices` (CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES).
pub fn cmdline_params(devices: &[PlannedDevice]) -> String {
    devices
        .iter()
        .map(|d| format!("virtio_mmio.device=4K@{:#x}:{}", d.addr, d.gsi))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One attached device.
struct Attached {
    handle: DeviceHandle,
    addr: u64,
    gsi: u32,
    transport: Arc<Mutex<MmioTransport>>,
}

/// The attached devices and their event thread; keep it alive for the VM's lifetime.
pub struct VirtioRuntime {
    devices: Vec<Attached>,
    /// The virtio-net device's counters, read without locking the device.
    net_counters: Option<Arc<NetIoCounters>>,
    /// Each disk's counters, in device order.
    blk_counters: Vec<Arc<BlkIoCounters>>,
    event_loop: Option<EventLoop>,
}

impl VirtioRuntime {
    /// The virtio-net counters (if there is a net device) and each disk's.
    pub fn io_counters(&self) -> (Option<NetCounters>, Vec<BlkCounters>) {
        (
            self.net_counters.as_ref().map(|c| c.read()),
            self.blk_counters.iter().map(|c| c.read()).collect(),
        )
    }

    /// What a restored VM's devices do when it first runs. Every queue is
    /// kicked once, as if the guest had written QueueNotify: a request the
    /// guest queued and notified just before the snapshot reached the old
    /// process's eventfd, which the new process does not have, so without the
    /// kick a restored Linux waits on it forever (a `sync` hung for good in
    /// the real-guest snapshot scenarios). Devices that owe the guest an event
    /// for having been restored then deliver it (the vsock transport reset),
    /// and an interrupt the driver has not acknowledged is raised again
    /// (`Interrupt::resend_pending`). Before all that, the event thread,
    /// held since the restore, starts serving the devices and their backends
    /// (frames that reached the tap meanwhile; host vsock connections, which
    /// the device holds until the guest has taken its reset). Called when the
    /// VM first runs, not at restore, so that until then its memory is the
    /// snapshot's.
    pub fn first_run_work(&self) -> Result<impl FnOnce() + Send + 'static, SetupError> {
        let gate: Option<EventGate> = self.event_loop.as_ref().map(EventLoop::gate);
        let mut kickers = Vec::new();
        let mut interrupts: Vec<Arc<Interrupt>> = Vec::new();
        let mut vsocks: Vec<Arc<Mutex<Vsock>>> = Vec::new();
        for d in &self.devices {
            let shared = d.handle.shared();
            let dev = locked(&shared);
            let evts = dev
                .common()
                .queue_kickers()
                .map_err(|source| SetupError::QueueKicker {
                    addr: d.addr,
                    source,
                })?;
            kickers.extend(evts.into_iter().map(|e| (d.addr, e)));
            interrupts.extend(dev.common().interrupt.clone());
            drop(dev);
            if let DeviceHandle::Vsock(v) = &d.handle {
                vsocks.push(v.clone());
            }
        }
        Ok(move || {
            if let Some(gate) = gate {
                gate.open();
            }
            for (addr, evt) in kickers {
                if let Err(e) = evt.write(1) {
                    tracing::warn!(device = addr, error = %e, "cannot kick a restored queue");
                }
            }
            for irq in interrupts {
                irq.resend_pending();
            }
            for v in vsocks {
                locked(&v).announce_restore();
            }
        })
    }

    /// The transports, in device order.
    pub fn transports(&self) -> Vec<Arc<Mutex<MmioTransport>>> {
        self.devices.iter().map(|d| d.transport.clone()).collect()
    }

    /// Saves every device and transport. Call while the vCPUs are paused;
    /// for a state consistent with guest memory, save through `quiesce`.
    pub fn save(&self) -> Result<VirtioState, VirtioPersistError> {
        self.quiesce().save()
    }

    /// Stops all device work until the returned guard is dropped: the event
    /// thread blocks on the first device it touches, so nothing writes guest
    /// memory while a snapshot copies it. Hold it from before the memory is
    /// written until after `save`. The vCPUs must be paused first (an MMIO
    /// access would wait for the guard too).
    pub fn quiesce(&self) -> QuiescedDevices<'_> {
        let guards = self
            .devices
            .iter()
            .map(|d| {
                let device = match &d.handle {
                    DeviceHandle::Block(x) => DeviceGuard::Block(locked(x)),
                    DeviceHandle::Net(x) => DeviceGuard::Net(locked(x)),
                    DeviceHandle::Vsock(x) => DeviceGuard::Vsock(locked(x)),
                    DeviceHandle::Rng(x) => DeviceGuard::Rng(locked(x)),
                    DeviceHandle::Fs(x) => {
                        let mut fs = locked(x);
                        // The backend writes guest memory itself: stop it too.
                        fs.stop_for_snapshot();
                        DeviceGuard::Fs(fs)
                    }
                };
                (d, device)
            })
            .collect();
        QuiescedDevices { guards }
    }
}

/// A locked device.
enum DeviceGuard<'a> {
    Block(std::sync::MutexGuard<'a, Block>),
    Net(std::sync::MutexGuard<'a, Net>),
    Vsock(std::sync::MutexGuard<'a, Vsock>),
    Rng(std::sync::MutexGuard<'a, Rng>),
    Fs(std::sync::MutexGuard<'a, Fs>),
}

/// Every virtio device, locked: no device work runs while this lives
/// (vhost-user backends' vrings are stopped until it is dropped).
pub struct QuiescedDevices<'a> {
    guards: Vec<(&'a Attached, DeviceGuard<'a>)>,
}

impl Drop for QuiescedDevices<'_> {
    fn drop(&mut self) {
        for (_, guard) in &mut self.guards {
            if let DeviceGuard::Fs(fs) = guard {
                fs.resume_after_snapshot();
            }
        }
    }
}

impl QuiescedDevices<'_> {
    /// Saves every device and transport.
    pub fn save(&self) -> Result<VirtioState, VirtioPersistError> {
        let mut slots = Vec::with_capacity(self.guards.len());
        for (d, guard) in &self.guards {
            let device = match guard {
                DeviceGuard::Block(g) => DeviceState::Block(g.save()?),
                DeviceGuard::Net(g) => DeviceState::Net(g.save()?),
                DeviceGuard::Vsock(g) => DeviceState::Vsock(g.save()?),
                DeviceGuard::Rng(g) => DeviceState::Rng(g.save()?),
                DeviceGuard::Fs(g) => DeviceState::Fs(g.save()?),
            };
            slots.push(SlotState {
                addr: d.addr,
                gsi: d.gsi,
                // The transport saves its own registers without touching the device.
                transport: locked(&d.transport).save()?,
                device,
            });
        }
        Ok(VirtioState { slots })
    }
}

/// Registers `devices` with KVM, puts them on `mmio` and starts the event thread.
pub fn attach(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    mmio: &mut Bus,
    devices: Vec<PlannedDevice>,
) -> Result<VirtioRuntime, SetupError> {
    let restored = devices.iter().any(|d| d.transport_state.is_some());
    let mut attached = Vec::with_capacity(devices.len());
    let mut subscribers = Vec::with_capacity(devices.len());
    let mut net_counters = None;
    let mut blk_counters = Vec::new();
    for d in devices {
        match &d.handle {
            DeviceHandle::Net(n) => net_counters = Some(locked(n).io_counters()),
            DeviceHandle::Block(b) => blk_counters.push(locked(b).io_counters()),
            DeviceHandle::Vsock(_) | DeviceHandle::Rng(_) | DeviceHandle::Fs(_) => {}
        }
        let what = format!("{} at {:#x}", d.name, d.addr);
        vm.register_irqfd(d.interrupt.irq().eventfd(), d.gsi)
            .map_err(|source| SetupError::Kvm {
                kind: "irqfd",
                what: what.clone(),
                source,
            })?;
        let shared = d.handle.shared();
        {
            let dev = shared.lock().unwrap_or_else(|p| p.into_inner());
            for (i, evt) in dev.common().queue_evts.iter().enumerate() {
                let addr = IoEventAddress::Mmio(d.addr + QUEUE_NOTIFY_OFFSET);
                vm.register_ioevent(evt, &addr, i as u32)
                    .map_err(|source| SetupError::Kvm {
                        kind: "queue ioeventfd",
                        what: what.clone(),
                        source,
                    })?;
            }
        }
        let transport = match &d.transport_state {
            Some(state) => {
                let args = MmioConstructorArgs {
                    device: shared,
                    mem: mem.clone(),
                    interrupt: d.interrupt.clone(),
                };
                MmioTransport::restore(args, state).map_err(|source| SetupError::Restore {
                    what: what.clone(),
                    source,
                })?
            }
            None => MmioTransport::new(shared, mem.clone(), d.interrupt.clone()),
        };
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(transport.clone(), d.addr, MMIO_WINDOW)
            .map_err(|source| SetupError::Bus { what, source })?;
        subscribers.push(d.handle.subscriber());
        attached.push(Attached {
            handle: d.handle,
            addr: d.addr,
            gsi: d.gsi,
            transport,
        });
    }
    // A restored VM's devices serve their backends only once it first runs
    // (`first_run_work`), so that until then its memory is the snapshot's.
    let event_loop = if subscribers.is_empty() {
        None
    } else if restored {
        Some(EventLoop::start_held(subscribers)?)
    } else {
        Some(EventLoop::start(subscribers)?)
    };
    Ok(VirtioRuntime {
        devices: attached,
        net_counters,
        blk_counters,
        event_loop,
    })
}

#[cfg(test)]
mod tests;
