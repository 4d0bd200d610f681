//! Coalesced transmit: KVM records the guest's writes to COM1's data
//! register in its coalesced-I/O ring ([`crate::vm::coalesced_ring`])
//! instead of leaving KVM_RUN for each byte. A guest printing polls the line
//! status register before every byte (Linux's 8250 console does), so the
//! exits per byte drop from two to one; each is a KVM_RUN round trip. The
//! hello guest's line took 34 KVM_RUNs instead of 67, and perf cold-boot's
//! step from the first run to that line 0.66 ms instead of 1.0 ms.
//!
//! Order is kept: a vCPU hands every recorded write to the UART before it
//! handles its own next exit ([`CoalescedTx::drain`]), so whatever the guest
//! reads back (line status, interrupt identification, loopback data) sees
//! all its earlier writes. What cannot wait for the next exit is an
//! interrupt: with the THR-empty interrupt enabled, or in loopback (where a
//! written byte is received data), a THR write raises an interrupt the guest
//! may sleep on. So the port is registered only while neither is on, and
//! leaves the ring for good the first time the guest turns one on
//! ([`CoalescedTx::stop`]). Linux clears IER around each console write and
//! enables the THR-empty interrupt only once a tty on the port transmits,
//! so its boot log goes through the ring.
//!
//! A guest may also write its last bytes and then run without exits for a
//! long time (spinning, or halted with KVM's in-kernel timer). The serial
//! writer thread empties the ring then ([`IdleWork`]): every
//! [`FAST_PERIOD`] while the guest has used the UART in the last
//! [`QUIET_POLLS`] periods (and in the VM's first moments), every
//! [`SLOW_PERIOD`] otherwise. So the last bytes of a guest that goes quiet
//! wait 5 ms at most while it prints, and a second at most after a quiet
//! spell. A UART access never wakes the writer itself: measured on restores,
//! waking it at the guest's first access delayed the guest's first output
//! by 1.5-3 ms in half the runs (the woken thread competed for the CPUs the
//! vCPU and the output's reader were about to need).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvm_ioctls::{Cap, IoEventAddress, VcpuFd, VmFd};

use super::output::{IdleWork, WriterHandle};
use super::COM1_PORT_BASE;
use crate::devices::bus::Bus;
use crate::vm::coalesced_ring::CoalescedRing;

/// COM1's data port in the ring, one byte wide.
const DATA_PORT: IoEventAddress = IoEventAddress::Pio(COM1_PORT_BASE);
/// How often the writer thread empties the ring while the guest uses the UART.
pub const FAST_PERIOD: Duration = Duration::from_millis(5);
/// How often it does once the guest has left the UART alone for
/// [`QUIET_POLLS`] fast periods.
pub const SLOW_PERIOD: Duration = Duration::from_secs(1);
/// Fast periods without a UART access before the slow period.
pub const QUIET_POLLS: u32 = 20;

/// COM1's data port routed through KVM's coalesced ring.
pub struct CoalescedTx {
    vm: Arc<VmFd>,
    ring: CoalescedRing,
    /// Held while emptying the ring: one consumer at a time, and a vCPU's
    /// exit is handled only after the writes recorded before it reached
    /// the UART.
    drain: Mutex<()>,
    /// The port is registered (writes go to the ring).
    registered: AtomicBool,
    /// The ring could not be read (an index or entry KVM never writes): it
    /// is left alone from then on.
    unreadable: AtomicBool,
    /// Bytes that reached the UART through the ring.
    bytes: AtomicU64,
    /// The serial writer thread, which polls the ring.
    idle: Option<WriterHandle>,
    /// A UART access since the writer's last poll.
    activity: AtomicBool,
    /// The writer polls at [`FAST_PERIOD`] (else [`SLOW_PERIOD`]).
    fast: AtomicBool,
    /// Polls in a row without a UART access.
    quiet_polls: AtomicU32,
}

impl CoalescedTx {
    /// Maps the ring through `vcpu` and registers COM1's data port, or
    /// `None` (with the reason logged) where KVM lacks coalesced port I/O or
    /// `side_effects` (the UART's THR writes raise interrupts now). `idle`
    /// is the serial writer thread, which empties the ring when no vCPU
    /// exits (see [`CoalescedTx::serve`]); without one (output discarded)
    /// the ring is emptied at exits only.
    pub fn start(
        vm: Arc<VmFd>,
        vcpu: &VcpuFd,
        side_effects: bool,
        idle: Option<WriterHandle>,
    ) -> Option<Arc<Self>> {
        if side_effects {
            tracing::debug!("serial transmit exits for each byte: its interrupt is on");
            return None;
        }
        if !vm.check_extension(Cap::CoalescedPio) {
            tracing::debug!("KVM has no coalesced port I/O: serial transmit exits for each byte");
            return None;
        }
        let ring = match CoalescedRing::map(vcpu) {
            Ok(ring) => ring,
            Err(e) => {
                tracing::warn!(error = %e, "serial transmit exits for each byte");
                return None;
            }
        };
        if let Err(e) = vm.register_coalesced_mmio(DATA_PORT, 1) {
            tracing::warn!(
                error = %e,
                "KVM_REGISTER_COALESCED_MMIO failed: serial transmit exits for each byte"
            );
            return None;
        }
        Some(Arc::new(CoalescedTx {
            vm,
            ring,
            drain: Mutex::new(()),
            registered: AtomicBool::new(true),
            unreadable: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
            idle,
            activity: AtomicBool::new(false),
            // A VM's first output may come at once: start fast.
            fast: AtomicBool::new(true),
            quiet_polls: AtomicU32::new(0),
        }))
    }

    /// Has the serial writer thread empty the ring into `io` when no vCPU
    /// exits (the port bus holds the UART, which holds this: weak links).
    pub fn serve(self: &Arc<Self>, io: &Arc<Bus>) {
        if let Some(idle) = &self.idle {
            idle.set(Arc::new(Poller {
                tx: Arc::downgrade(self),
                io: Arc::downgrade(io),
            }));
        }
    }

    /// The guest accessed the UART (a vCPU exit): noted for the writer's
    /// next poll, which then keeps (or goes back to) the fast period.
    pub fn touch(&self) {
        self.activity.store(true, Ordering::Relaxed);
    }

    /// One poll of the writer thread: empties the ring, then picks the
    /// period: fast after a UART access, slow after [`QUIET_POLLS`] polls
    /// without one.
    fn poll(&self, io: &Bus) {
        self.drain(io);
        if self.activity.swap(false, Ordering::Relaxed) {
            self.quiet_polls.store(0, Ordering::Relaxed);
            self.fast.store(true, Ordering::Relaxed);
        } else if self.quiet_polls.fetch_add(1, Ordering::Relaxed) + 1 >= QUIET_POLLS {
            self.fast.store(false, Ordering::Relaxed);
        }
    }

    /// How long the writer may wait before polling (`None`: no need, the
    /// port left the ring and nothing is left in it).
    fn period(&self) -> Option<Duration> {
        if self.unreadable.load(Ordering::Relaxed) || (!self.registered() && self.ring.is_empty()) {
            return None;
        }
        Some(if self.fast.load(Ordering::Relaxed) {
            FAST_PERIOD
        } else {
            SLOW_PERIOD
        })
    }

    /// Hands the recorded writes to `io`, oldest first. A vCPU thread calls
    /// this after every KVM_RUN, before it handles the exit.
    pub fn drain(&self, io: &Bus) {
        if self.unreadable.load(Ordering::Relaxed)
            || (!self.registered.load(Ordering::Acquire) && self.ring.is_empty())
        {
            return;
        }
        let _consumer = self.drain.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match self.ring.pop() {
                Ok(None) => return,
                Ok(Some(entry)) if entry.pio && entry.addr == COM1_PORT_BASE => {
                    io.write(entry.addr, entry.data());
                    self.bytes
                        .fetch_add(entry.data().len() as u64, Ordering::Relaxed);
                }
                Ok(Some(entry)) => {
                    tracing::warn!(?entry, "coalesced write outside COM1's data port dropped");
                }
                Err(e) => {
                    // Nothing sane can be read from the page any more: stop
                    // routing output there, so the rest exits as usual.
                    self.unreadable.store(true, Ordering::Relaxed);
                    tracing::error!(error = %e, "serial transmit leaves KVM's coalesced ring");
                    self.stop();
                    return;
                }
            }
        }
    }

    /// Unregisters the port: from now on each THR write exits. Writes KVM
    /// recorded before are still drained, in order, by the next exits.
    pub fn stop(&self) {
        if self.registered.swap(false, Ordering::AcqRel) {
            match self.vm.unregister_coalesced_mmio(DATA_PORT, 1) {
                Ok(()) => tracing::debug!(
                    bytes = self.bytes(),
                    "serial transmit leaves KVM's coalesced ring"
                ),
                Err(e) => tracing::error!(
                    error = %e,
                    "KVM_UNREGISTER_COALESCED_MMIO failed: THR writes stay in the ring"
                ),
            }
        }
    }

    /// Whether the port is in the ring now.
    pub fn registered(&self) -> bool {
        self.registered.load(Ordering::Acquire)
    }

    /// Bytes that reached the UART through the ring so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// The serial writer thread's idle work: polling the ring.
struct Poller {
    tx: Weak<CoalescedTx>,
    io: Weak<Bus>,
}

impl IdleWork for Poller {
    fn period(&self) -> Option<Duration> {
        self.tx.upgrade()?.period()
    }

    fn run(&self) {
        if let (Some(tx), Some(io)) = (self.tx.upgrade(), self.io.upgrade()) {
            tx.poll(&io);
        }
    }
}
