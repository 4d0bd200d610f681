//! Builds the configured virtio devices, places each at its MMIO window with
//! its GSI, registers the irqfd and queue ioeventfds with KVM, and starts the
//! event thread. Also writes the `virtio_mmio.device=` kernel parameters.

use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};

use super::block::{Block, BlockError};
use super::event_loop::{EventLoop, EventLoopError, Subscriber};
use super::mmio::{MmioTransport, SharedVirtioDevice, MMIO_WINDOW, QUEUE_NOTIFY_OFFSET};
use super::net::{Net, NetError};
use super::rng::{Rng, RngError};
use super::vsock::{Vsock, VsockError};
use super::Interrupt;
use crate::config::VmConfig;
use crate::devices::bus::{Bus, BusError};
use crate::devices::irq::IrqLine;
use crate::memory::GuestMemoryMmap;

/// MMIO address of the first virtio device; each next one is `MMIO_WINDOW` higher.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// GSI of the first virtio device; each next one uses the next GSI.
pub const VIRTIO_FIRST_GSI: u32 = 5;
/// Highest GSI the IOAPIC has (24 pins).
pub const VIRTIO_LAST_GSI: u32 = 23;

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
    /// More devices than interrupt lines.
    #[error("{0} virtio devices configured but at most {max} fit (GSIs {VIRTIO_FIRST_GSI}..={VIRTIO_LAST_GSI})", max = VIRTIO_LAST_GSI - VIRTIO_FIRST_GSI + 1)]
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
}

/// A device built from the config, not yet attached to a VM.
pub struct PlannedDevice {
    /// Name for messages ("virtio-blk 0", ...).
    pub name: String,
    /// The device, as the transport sees it.
    pub device: SharedVirtioDevice,
    /// The device, as the event thread sees it.
    pub subscriber: Subscriber,
    /// Base of its MMIO window.
    pub addr: u64,
    /// Its GSI.
    pub gsi: u32,
}

fn plan<T>(devices: &mut Vec<PlannedDevice>, name: String, dev: T)
where
    T: super::VirtioDevice + event_manager::MutEventSubscriber + 'static,
{
    let i = devices.len() as u64;
    let shared = Arc::new(Mutex::new(dev));
    devices.push(PlannedDevice {
        name,
        device: shared.clone(),
        subscriber: shared,
        addr: VIRTIO_MMIO_BASE + i * MMIO_WINDOW,
        gsi: VIRTIO_FIRST_GSI + i as u32,
    });
}

/// Opens every configured backend (disks, tap, vsock socket, rng), in the
/// order block, net, vsock, rng, and assigns addresses and GSIs.
pub fn create_devices(config: &VmConfig) -> Result<Vec<PlannedDevice>, SetupError> {
    let mut devices = Vec::new();
    for (i, disk) in config.disks.iter().enumerate() {
        plan(
            &mut devices,
            format!("virtio-blk {i}"),
            Block::new(&disk.path, disk.read_only)?,
        );
    }
    if let Some(net) = &config.net {
        plan(
            &mut devices,
            "virtio-net".into(),
            Net::new(&net.tap, net.mac)?,
        );
    }
    if let Some(vsock) = &config.vsock {
        plan(
            &mut devices,
            "virtio-vsock".into(),
            Vsock::new(vsock.cid, &vsock.uds_path)?,
        );
    }
    if config.rng {
        plan(&mut devices, "virtio-rng".into(), Rng::new()?);
    }
    let max = (VIRTIO_LAST_GSI - VIRTIO_FIRST_GSI + 1) as usize;
    if devices.len() > max {
        return Err(SetupError::TooMany(devices.len()));
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

/// The attached devices and their event thread; keep it alive for the VM's lifetime.
pub struct VirtioRuntime {
    /// The transports, in device order.
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
    _event_loop: Option<EventLoop>,
}

/// Registers `devices` with KVM, puts them on `mmio` and starts the event thread.
pub fn attach(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    mmio: &mut Bus,
    devices: Vec<PlannedDevice>,
) -> Result<VirtioRuntime, SetupError> {
    let mut transports = Vec::with_capacity(devices.len());
    let mut subscribers = Vec::with_capacity(devices.len());
    for d in devices {
        let what = format!("{} at {:#x}", d.name, d.addr);
        let irq = IrqLine::new(d.gsi).map_err(|source| SetupError::Eventfd {
            what: what.clone(),
            source,
        })?;
        vm.register_irqfd(irq.eventfd(), irq.gsi())
            .map_err(|source| SetupError::Kvm {
                kind: "irqfd",
                what: what.clone(),
                source,
            })?;
        {
            let dev = d.device.lock().unwrap_or_else(|p| p.into_inner());
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
        let transport = Arc::new(Mutex::new(MmioTransport::new(
            d.device,
            mem.clone(),
            Arc::new(Interrupt::new(irq)),
        )));
        mmio.insert(transport.clone(), d.addr, MMIO_WINDOW)
            .map_err(|source| SetupError::Bus { what, source })?;
        transports.push(transport);
        subscribers.push(d.subscriber);
    }
    let event_loop = if subscribers.is_empty() {
        None
    } else {
        Some(EventLoop::start(subscribers)?)
    };
    Ok(VirtioRuntime {
        transports,
        _event_loop: event_loop,
    })
}
