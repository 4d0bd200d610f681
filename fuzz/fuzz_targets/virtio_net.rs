//! A hostile virtio driver and a hostile network against virtio-net: the
//! first 16 KiB of input become guest memory (descriptor tables, rings,
//! frames), the rest a sequence of register accesses, event-loop turns, and
//! frames the "tap" side sends (or reads back). The tap is a socket-pair
//! stand-in (`Tap::pair`), so no privilege is needed.
#![no_main]

use std::sync::{Arc, Mutex};

use event_manager::{EventManager, SubscriberOps};
use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::BusDevice;
use vmm::devices::irq::IrqLine;
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::net::tap::Tap;
use vmm::devices::virtio::net::Net;
use vmm::devices::virtio::Interrupt;
use vmm::memory::GuestMemoryMmap;

const MEM_BYTES: usize = 1 << 20;
const SEED_BYTES: usize = 16 << 10;

fuzz_target!(|data: &[u8]| {
    let (seed, ops) = data.split_at(data.len().min(SEED_BYTES));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).expect("memory");
    mem.write_slice(seed, GuestAddress(0)).expect("seed fits");
    let Ok(irq) = IrqLine::new(5) else { return };
    let interrupt = Arc::new(Interrupt::new(irq));
    let Ok((tap, network)) = Tap::pair("fuzz") else {
        return;
    };
    let Ok(net) = Net::with_tap(tap, Some([2, 0, 0, 0, 0, 1])) else {
        return;
    };
    let net = Arc::new(Mutex::new(net));
    let Ok(mut em) = EventManager::<Arc<Mutex<Net>>>::new() else {
        return;
    };
    em.add_subscriber(net.clone());
    let mut transport = MmioTransport::new(net.clone(), mem, interrupt);
    let mut scratch = vec![0u8; 70_000];
    let mut rest = ops;
    while let Some((&kind, tail)) = rest.split_first() {
        match kind % 5 {
            0 | 1 => {
                let Some(op) = tail.get(..5) else { break };
                transport.write(u64::from(op[0]) * 4, &op[1..5]);
                rest = &tail[5..];
            }
            2 => {
                let Some(op) = tail.get(..1) else { break };
                let mut out = [0u8; 4];
                transport.read(u64::from(op[0]) * 4, &mut out);
                rest = &tail[1..];
            }
            3 => {
                let _ = em.run_with_timeout(0);
                // The network reads whatever the guest sent.
                while network.recv(&mut scratch).is_ok() {}
                rest = tail;
            }
            _ => {
                // The network sends one frame: a length byte pair, then that many bytes.
                let Some(len) = tail.get(..2) else { break };
                let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
                let body = &tail[2..];
                let frame = &body[..len.min(body.len())];
                let _ = network.send(frame);
                rest = &body[frame.len()..];
            }
        }
    }
});
