//! The 8250 serial console (vm-superio) at COM1: guest output to stdout, a
//! file or nowhere; host stdin to guest input. vm-superio ignores the FIFO
//! control register; this wrapper honours its receive-FIFO reset.

pub mod coalesced;
pub mod output;
pub mod persist;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vm_superio::serial::NoEvents;
use vm_superio::Serial;

use crate::devices::bus::BusDevice;
use crate::devices::irq::IrqLine;
use coalesced::CoalescedTx;
use output::WriterHandle;

/// COM1's first I/O port.
pub const COM1_PORT_BASE: u64 = 0x3f8;
/// Ports claimed by the UART.
pub const COM1_PORT_LEN: u64 = 8;
/// COM1's interrupt line.
pub const COM1_IRQ: u32 = 4;

/// The UART's receive FIFO holds this many bytes (vm-superio's 16550A).
pub const RX_FIFO_SIZE: usize = 64;
/// Register offsets and bits this wrapper handles itself.
const DATA_OFFSET: u8 = 0;
const IER_OFFSET: u8 = 1;
const FCR_OFFSET: u8 = 2;
const LCR_OFFSET: u8 = 3;
const MCR_OFFSET: u8 = 4;
/// IER bit 1: interrupt when the transmit holding register empties.
const IER_THR_EMPTY: u8 = 0x02;
/// MCR bit 4: loopback (transmitted bytes become received data).
const MCR_LOOP: u8 = 0x10;
/// FCR bit 1: clear the receive FIFO.
const FCR_CLEAR_RECEIVE: u8 = 0x02;
/// LCR bit 7: offsets 0 and 1 reach the divisor latch instead of the FIFO.
const LCR_DLAB: u8 = 0x80;

/// Where guest output goes.
pub type SerialOut = Box<dyn Write + Send>;

/// The UART on the port-I/O bus.
pub struct SerialDevice {
    uart: Serial<IrqLine, NoEvents, SerialOut>,
    /// Receive-FIFO resets so far: host input held back across one is dropped.
    receive_resets: u64,
    /// The data port's writes through KVM's coalesced ring, while that is on.
    coalesced: Option<Arc<CoalescedTx>>,
    /// The thread writing the output, where it has one (to wait for it).
    writer: Option<WriterHandle>,
}

fn log_write_error<E: std::fmt::Debug>(result: Result<(), E>) {
    if let Err(e) = result {
        // A closed stdout or a full disk must not stop the guest.
        tracing::debug!(error = ?e, "serial output dropped");
    }
}

impl SerialDevice {
    /// A UART that raises `irq` and writes guest output to `out`.
    pub fn new(irq: IrqLine, out: SerialOut) -> Self {
        SerialDevice {
            uart: Serial::new(irq, out),
            receive_resets: 0,
            coalesced: None,
            writer: None,
        }
    }

    /// Names the thread writing the output, so that [`SerialDevice::flush`]
    /// waits for it.
    pub fn set_writer(&mut self, writer: WriterHandle) {
        self.writer = Some(writer);
    }

    /// Whether a THR write does more than output a byte now: raise the
    /// THR-empty interrupt, or (loopback) become received data. Such writes
    /// must exit at once, so they cannot go through KVM's coalesced ring.
    pub fn transmit_has_side_effects(&self) -> bool {
        let state = self.uart.state();
        state.interrupt_enable & IER_THR_EMPTY != 0 || state.modem_control & MCR_LOOP != 0
    }

    /// Hands the UART the coalesced transmit routing its data port, to stop
    /// it when the guest turns on a THR side effect.
    pub fn attach_coalesced(&mut self, tx: Arc<CoalescedTx>) {
        self.coalesced = Some(tx);
    }

    /// The interrupt line, to register with KVM.
    pub fn irq(&self) -> &IrqLine {
        self.uart.interrupt_evt()
    }

    /// Queues host input for the guest; returns how many bytes fit in the FIFO.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        let room = self.uart.fifo_capacity();
        let n = bytes.len().min(room);
        if n == 0 {
            return 0;
        }
        match self.uart.enqueue_raw_bytes(&bytes[..n]) {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::debug!(error = ?e, "serial input dropped");
                0
            }
        }
    }

    /// Room left in the guest's receive FIFO.
    pub fn input_room(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// How many times the guest has reset its receive FIFO.
    pub fn receive_resets(&self) -> u64 {
        self.receive_resets
    }

    /// Empties the receive FIFO, as a UART does when the guest writes FCR with
    /// the receive-reset bit (Linux does whenever it sets the port up).
    fn reset_receive_fifo(&mut self) {
        self.receive_resets = self.receive_resets.wrapping_add(1);
        // vm-superio has no way to clear its FIFO but reading it, and reads at
        // offset 0 reach the divisor latch while DLAB is set: clear DLAB for
        // the reads and put LCR back afterwards (an LCR write has no side effect).
        let lcr = self.uart.read(LCR_OFFSET);
        if lcr & LCR_DLAB != 0 {
            log_write_error(self.uart.write(LCR_OFFSET, lcr & !LCR_DLAB));
        }
        for _ in 0..RX_FIFO_SIZE {
            if self.uart.fifo_capacity() >= RX_FIFO_SIZE {
                break;
            }
            self.uart.read(DATA_OFFSET);
        }
        if lcr & LCR_DLAB != 0 {
            log_write_error(self.uart.write(LCR_OFFSET, lcr));
        }
    }

    /// Flushes buffered guest output: waits (bounded) until the writer
    /// thread, if any, has written what is queued.
    pub fn flush(&mut self) {
        match &self.writer {
            Some(writer) => writer.wait_written(),
            None => {
                let _ = self.uart.writer_mut().flush();
            }
        }
    }

    /// Logs (info) how the guest's output left: the bytes that went through
    /// KVM's coalesced ring, and whether the data port is still in it.
    pub fn log_transmit_summary(&self) {
        let (bytes, on) = self
            .coalesced
            .as_ref()
            .map_or((0, false), |tx| (tx.bytes(), tx.registered()));
        tracing::info!(
            coalesced_bytes = bytes,
            coalescing = on,
            "serial transmit summary"
        );
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let Some(tx) = &self.coalesced {
            tx.touch();
        }
        if let (Some(first), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.uart.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(tx) = &self.coalesced {
            tx.touch();
        }
        if let (Some(value), Ok(off)) = (data.first(), u8::try_from(offset)) {
            if off == FCR_OFFSET && value & FCR_CLEAR_RECEIVE != 0 {
                self.reset_receive_fifo();
            }
            log_write_error(self.uart.write(off, *value));
            if matches!(off, IER_OFFSET | MCR_OFFSET) {
                if let Some(tx) = &self.coalesced {
                    if tx.registered() && self.transmit_has_side_effects() {
                        tx.stop();
                    }
                }
            }
        }
    }
}

/// What became of a chunk of host input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Every byte reached the guest's FIFO.
    Delivered,
    /// The guest reset its receive FIFO while part of the chunk was held back:
    /// those bytes were sent before the reset and went with it.
    DroppedAtReset {
        /// Bytes dropped.
        dropped: usize,
    },
}

/// Hands `bytes` to the guest's FIFO, waiting `retry` between attempts while
/// it is full. If the guest resets its receive FIFO meanwhile, the bytes
/// still held are dropped, as the reset dropped those already in the FIFO,
/// so what the guest reads next starts with input sent after its reset.
pub fn deliver(serial: &Mutex<SerialDevice>, bytes: &[u8], retry: Duration) -> Delivery {
    let mut pending = bytes;
    let mut since: Option<u64> = None;
    while !pending.is_empty() {
        let accepted = {
            let mut dev = serial.lock().unwrap_or_else(|p| p.into_inner());
            let resets = dev.receive_resets();
            if *since.get_or_insert(resets) != resets {
                tracing::debug!(
                    dropped = pending.len(),
                    "serial input sent before the guest reset its FIFO dropped"
                );
                return Delivery::DroppedAtReset {
                    dropped: pending.len(),
                };
            }
            dev.enqueue_input(pending)
        };
        pending = &pending[accepted..];
        if accepted == 0 {
            std::thread::sleep(retry);
        }
    }
    Delivery::Delivered
}

/// Whether `file` is /dev/null (character device 1:3), whose reads end at once.
fn is_dev_null(file: &File) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    file.metadata()
        .is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == libc::makedev(1, 3))
}

/// Forwards host stdin to the guest's serial input until stdin closes.
///
/// Input is held back, not dropped, while the guest's 64-byte FIFO is full,
/// so at most one read buffer (256 bytes) is ever pending on the host side
/// (stdin is read unbuffered, through its own descriptor). Held-back input
/// is dropped when the guest resets its receive FIFO (see [`deliver`]).
pub fn spawn_stdin_forwarder(serial: Arc<Mutex<SerialDevice>>) -> std::io::Result<()> {
    // std's Stdin buffers up to 8 KiB beyond what it hands out: read a duplicate
    // descriptor instead, so nothing is pending on the host side but `buf`.
    let mut stdin = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => File::from(fd),
        Err(e) => {
            tracing::warn!(error = %e, "stdin cannot be read: the guest gets no serial input");
            return Ok(());
        }
    };
    if is_dev_null(&stdin) {
        // Reading it ends at once: no thread (and no seccomp filter) for that.
        tracing::debug!("stdin is /dev/null: no serial input");
        return Ok(());
    }
    std::thread::Builder::new()
        .name("serial-stdin".into())
        .spawn(move || {
            crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
            let mut buf = [0u8; 256];
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                deliver(&serial, &buf[..n], Duration::from_millis(5));
            }
        })
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_dev_null_counts_as_dev_null() {
        assert!(is_dev_null(&File::open("/dev/null").unwrap()));
        assert!(!is_dev_null(&File::open("/dev/zero").unwrap()));
        assert!(!is_dev_null(&tempfile::tempfile().unwrap()));
    }

    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn guest_bytes_reach_the_output_and_input_reaches_the_guest() {
        let out = SharedBuf::default();
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(out.clone()));
        for b in b"hi\n" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*out.0.lock().unwrap(), b"hi\n");

        assert_eq!(dev.enqueue_input(b"ok"), 2);
        let mut lsr = [0u8];
        dev.read(5, &mut lsr);
        assert_eq!(lsr[0] & 1, 1, "data-ready bit set");
        let mut byte = [0u8];
        dev.read(0, &mut byte);
        assert_eq!(byte[0], b'o');
    }

    fn read_byte(dev: &mut SerialDevice, offset: u64) -> u8 {
        let mut b = [0u8];
        dev.read(offset, &mut b);
        b[0]
    }

    #[test]
    fn a_receive_fifo_reset_empties_the_fifo() {
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        assert_eq!(dev.input_room(), RX_FIFO_SIZE);
        assert_eq!(dev.enqueue_input(b"ping-from-host-0\n"), 17);
        // FCR without the receive-reset bit (enable FIFOs, clear transmit) keeps input.
        dev.write(2, &[0x05]);
        assert_eq!(read_byte(&mut dev, 5) & 1, 1, "data still ready");
        assert_eq!(read_byte(&mut dev, 0), b'p');
        // Linux's serial8250_clear_fifos: enable, clear receive and transmit.
        dev.write(2, &[0x07]);
        assert_eq!(
            read_byte(&mut dev, 5) & 1,
            0,
            "no data ready after the reset"
        );
        assert_eq!(dev.input_room(), RX_FIFO_SIZE);
        assert_eq!(dev.enqueue_input(b"next"), 4);
        assert_eq!(read_byte(&mut dev, 0), b'n');
    }

    #[test]
    fn a_receive_fifo_reset_with_the_divisor_latch_open_keeps_the_divisor() {
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        dev.enqueue_input(b"stale");
        dev.write(3, &[0x83]); // DLAB on, 8 bits
        dev.write(0, &[0x01]); // divisor 1: 115200 baud
        dev.write(2, &[0x02]); // receive FIFO reset only
        assert_eq!(read_byte(&mut dev, 3), 0x83);
        assert_eq!(read_byte(&mut dev, 0), 0x01, "divisor latch untouched");
        dev.write(3, &[0x03]);
        assert_eq!(read_byte(&mut dev, 5) & 1, 0);
        assert_eq!(dev.input_room(), RX_FIFO_SIZE);
    }

    #[test]
    fn held_back_input_is_dropped_when_the_guest_resets_its_fifo() {
        let serial = Arc::new(Mutex::new(SerialDevice::new(
            IrqLine::new(4).unwrap(),
            Box::new(std::io::sink()),
        )));
        assert_eq!(serial.lock().unwrap().enqueue_input(&[b'a'; 60]), 60);
        let (done_tx, done) = std::sync::mpsc::channel();
        let feeder = serial.clone();
        std::thread::spawn(move || {
            let _ = done_tx.send(deliver(&feeder, &[b'b'; 200], Duration::from_millis(1)));
        });
        // The first attempt fills the FIFO; the other 196 bytes are held back.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while serial.lock().unwrap().input_room() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the feeder never started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        serial.lock().unwrap().write(2, &[0x07]);
        let outcome = done.recv_timeout(Duration::from_secs(10));
        assert_eq!(outcome, Ok(Delivery::DroppedAtReset { dropped: 196 }));
        let mut dev = serial.lock().unwrap();
        assert_eq!(
            dev.input_room(),
            RX_FIFO_SIZE,
            "nothing from before the reset"
        );
        assert_eq!(dev.enqueue_input(b"next"), 4);
        assert_eq!(read_byte(&mut dev, 0), b'n');
    }

    #[test]
    fn input_sent_after_a_reset_is_delivered_whole() {
        let serial = Mutex::new(SerialDevice::new(
            IrqLine::new(4).unwrap(),
            Box::new(std::io::sink()),
        ));
        serial.lock().unwrap().write(2, &[0x07]);
        let line = b"ping-from-host-0\n";
        assert_eq!(
            deliver(&serial, line, Duration::from_millis(1)),
            Delivery::Delivered
        );
        let mut dev = serial.lock().unwrap();
        let read: Vec<u8> = (0..line.len()).map(|_| read_byte(&mut dev, 0)).collect();
        assert_eq!(read, line);
    }

    #[test]
    fn transmit_side_effects_are_the_thr_empty_interrupt_and_loopback() {
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        assert!(!dev.transmit_has_side_effects());
        // Received-data and line-status interrupts leave THR writes alone.
        dev.write(1, &[0x05]);
        assert!(!dev.transmit_has_side_effects());
        // Offset 1 with the divisor latch open is the divisor, not IER.
        dev.write(3, &[0x80]);
        dev.write(1, &[0x02]);
        assert!(!dev.transmit_has_side_effects());
        dev.write(3, &[0x03]);
        dev.write(1, &[0x02]);
        assert!(dev.transmit_has_side_effects());
        dev.write(1, &[0x00]);
        assert!(!dev.transmit_has_side_effects());
        dev.write(4, &[0x10]);
        assert!(dev.transmit_has_side_effects(), "loopback");
        dev.write(4, &[0x03]);
        assert!(!dev.transmit_has_side_effects());
    }

    #[test]
    fn input_beyond_the_fifo_is_held_back() {
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        let big = [b'x'; 200];
        let accepted = dev.enqueue_input(&big);
        assert!(accepted > 0 && accepted < 200);
        assert_eq!(dev.enqueue_input(&big), 0);
    }
}
