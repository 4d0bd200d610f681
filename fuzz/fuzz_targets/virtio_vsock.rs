//! A hostile virtio driver and hostile host peers against virtio-vsock: the
//! first 16 KiB of input become guest memory (descriptor tables, rings,
//! packet headers and payloads), the rest a sequence of register accesses,
//! event-loop turns, host connections (`CONNECT <port>` lines and data) and
//! accepted guest connections, as the device meets them in a running vmm.
#![no_main]

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use event_manager::{EventManager, SubscriberOps};
use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::BusDevice;
use vmm::devices::irq::IrqLine;
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::vsock::Vsock;
use vmm::devices::virtio::Interrupt;
use vmm::memory::GuestMemoryMmap;

const MEM_BYTES: usize = 1 << 20;
const SEED_BYTES: usize = 16 << 10;
const GUEST_CID: u32 = 3;
/// The host port guest connections in the seed go to; a listener waits there.
const HOST_PORT: u32 = 1024;
/// At most this many host-side sockets are kept open per run.
const MAX_PEERS: usize = 4;

struct Host {
    uds: PathBuf,
    listener: UnixListener,
}

fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("fuzz-vsock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the fuzz socket directory");
        let uds = dir.join("v.sock");
        let port_path = dir.join(format!("v.sock_{HOST_PORT}"));
        let _ = std::fs::remove_file(&port_path);
        let listener = UnixListener::bind(&port_path).expect("bind the host port listener");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        Host { uds, listener }
    })
}

fn keep(peers: &mut Vec<UnixStream>, s: UnixStream) {
    if s.set_nonblocking(true).is_ok() {
        if peers.len() == MAX_PEERS {
            peers.remove(0);
        }
        peers.push(s);
    }
}

fuzz_target!(|data: &[u8]| {
    let host = host();
    let (seed, ops) = data.split_at(data.len().min(SEED_BYTES));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).expect("memory");
    mem.write_slice(seed, GuestAddress(0)).expect("seed fits");
    let Ok(irq) = IrqLine::new(5) else { return };
    let interrupt = Arc::new(Interrupt::new(irq));
    let Ok(vsock) = Vsock::new(GUEST_CID, &host.uds) else {
        return;
    };
    let vsock = Arc::new(Mutex::new(vsock));
    let Ok(mut em) = EventManager::<Arc<Mutex<Vsock>>>::new() else {
        return;
    };
    em.add_subscriber(vsock.clone());
    let mut transport = MmioTransport::new(vsock.clone(), mem, interrupt);
    let mut peers: Vec<UnixStream> = Vec::new();
    for op in ops.chunks_exact(6) {
        let offset = u64::from(op[1]) * 4;
        let value = [op[2], op[3], op[4], op[5]];
        match op[0] % 7 {
            0 | 1 => transport.write(offset, &value),
            2 => {
                let mut out = [0u8; 4];
                transport.read(offset, &mut out);
            }
            3 => {
                let _ = em.run_with_timeout(0);
            }
            4 => {
                // A host process connects to the device's socket and names a guest port.
                if let Ok(mut s) = UnixStream::connect(&host.uds) {
                    let port = u16::from_le_bytes([op[2], op[3]]);
                    let _ = s.write_all(format!("CONNECT {port}\n").as_bytes());
                    keep(&mut peers, s);
                }
            }
            5 => {
                // The host service takes a guest connection and sends something.
                if let Ok((mut s, _)) = host.listener.accept() {
                    let _ = s.write_all(&value);
                    keep(&mut peers, s);
                }
            }
            _ => {
                // A host peer writes, or hangs up.
                if peers.is_empty() {
                    continue;
                }
                let i = usize::from(op[1]) % peers.len();
                if op[2] & 1 == 0 {
                    let _ = peers[i].write(&op[3..]);
                } else {
                    peers.remove(i);
                }
            }
        }
    }
    // Connections left in the listener's backlog belong to this run only.
    while host.listener.accept().is_ok() {}
});
