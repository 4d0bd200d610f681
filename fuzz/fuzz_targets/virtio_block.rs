//! A hostile virtio driver against the virtio-mmio transport and the block
//! device: the first 16 KiB of input become guest memory (descriptor tables,
//! rings, buffers), the rest a sequence of register reads/writes and queue
//! processing steps.
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::BusDevice;
use vmm::devices::irq::IrqLine;
use vmm::devices::virtio::block::Block;
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::Interrupt;
use vmm::memory::GuestMemoryMmap;

const MEM_BYTES: usize = 1 << 20;
const SEED_BYTES: usize = 16 << 10;

fn disk_path() -> &'static std::path::Path {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("fuzz-virtio-block-{}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 64 * 512]).expect("create the fuzz disk");
        path
    })
}

fuzz_target!(|data: &[u8]| {
    let (seed, ops) = data.split_at(data.len().min(SEED_BYTES));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).expect("memory");
    mem.write_slice(seed, GuestAddress(0)).expect("seed fits");
    let Ok(irq) = IrqLine::new(5) else { return };
    let interrupt = Arc::new(Interrupt::new(irq));
    let Ok(block) = Block::new(disk_path(), false) else {
        return;
    };
    let block = Arc::new(Mutex::new(block));
    let mut transport = MmioTransport::new(block.clone(), mem, interrupt);
    for op in ops.chunks_exact(6) {
        let offset = u64::from(op[1]) * 4;
        let value = [op[2], op[3], op[4], op[5]];
        match op[0] % 4 {
            0 | 1 => transport.write(offset, &value),
            2 => {
                let mut out = [0u8; 4];
                transport.read(offset, &mut out);
            }
            _ => {
                let _ = block.lock().map(|mut b| b.process_queue());
            }
        }
    }
});
