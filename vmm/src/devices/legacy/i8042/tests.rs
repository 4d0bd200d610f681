//! The controller driven the way Linux's i8042 driver, atkbd and psmouse
//! drive it (drivers/input/serio/i8042.c: i8042_flush, __i8042_command,
//! i8042_controller_selftest/init, i8042_check_aux), plus resets and hostile
//! input.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

const KBD: usize = 0;
const AUX: usize = 1;

struct Harness {
    dev: I8042,
    resets: Arc<AtomicUsize>,
}

impl Harness {
    fn new() -> Self {
        let resets = Arc::new(AtomicUsize::new(0));
        let count = resets.clone();
        let dev = I8042::new(ResetTrigger::new(move || {
            count.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
        Harness { dev, resets }
    }

    fn status(&mut self) -> u8 {
        let mut b = [0u8];
        self.dev.read(4, &mut b);
        b[0]
    }

    fn data(&mut self) -> u8 {
        let mut b = [0u8];
        self.dev.read(0, &mut b);
        b[0]
    }

    /// i8042_wait_read then a data read; Linux gives up after a timeout.
    fn wait_read(&mut self) -> Result<u8, &'static str> {
        for _ in 0..10 {
            if self.status() & STATUS_OBF != 0 {
                return Ok(self.data());
            }
        }
        Err("timeout")
    }

    /// __i8042_command: the command, its parameters, then `replies` bytes.
    fn command(&mut self, cmd: u8, params: &[u8], replies: usize) -> Result<Vec<u8>, &'static str> {
        assert_eq!(self.status() & 0x02, 0, "input buffer never full");
        self.dev.write(4, &[cmd]);
        for p in params {
            assert_eq!(self.status() & 0x02, 0);
            self.dev.write(0, &[*p]);
        }
        (0..replies).map(|_| self.wait_read()).collect()
    }

    /// A byte to the keyboard (i8042_kbd_write) and the replies it expects.
    fn kbd(&mut self, byte: u8, replies: usize) -> Result<Vec<u8>, &'static str> {
        self.dev.write(0, &[byte]);
        (0..replies).map(|_| self.wait_read()).collect()
    }

    /// i8042_flush: bytes read while the output buffer is full, at most 16.
    fn flush(&mut self) -> usize {
        let mut n = 0;
        while self.status() & STATUS_OBF != 0 && n < 16 {
            self.data();
            n += 1;
        }
        n
    }

    /// Interrupts raised on `line` since the last call.
    fn irqs(&self, line: usize) -> u64 {
        self.dev.irq_lines()[line].eventfd().read().unwrap_or(0)
    }

    fn resets(&self) -> usize {
        self.resets.load(Ordering::SeqCst)
    }
}

#[test]
fn linux_probe_reads_a_stable_ctr_writes_it_and_enables_the_keyboard_port() {
    let mut h = Harness::new();
    assert_eq!(h.dev.irq_lines().map(|l| l.gsi()), [1, 12]);
    // i8042_controller_check
    assert_eq!(h.flush(), 0);
    // i8042_controller_init: two reads that agree
    let first = h.command(0x20, &[], 1);
    assert_eq!(first, Ok(vec![INITIAL_CTR]));
    assert_eq!(h.command(0x20, &[], 1), first);
    assert_eq!(INITIAL_CTR, 0x65);
    let status = h.status();
    assert_ne!(
        status & STATUS_NOT_INHIBITED,
        0,
        "no 'Keylock active' warning"
    );
    assert_ne!(status & STATUS_SYSTEM, 0);
    assert_ne!(status & STATUS_LAST_WAS_COMMAND, 0);
    // keyboard port off, its interrupt off, translation kept
    assert_eq!(h.command(0x60, &[0x74], 0), Ok(vec![]));
    assert_eq!(
        h.status() & STATUS_LAST_WAS_COMMAND,
        0,
        "last write was data"
    );
    h.irqs(KBD);
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![0x74]));
    assert_eq!(h.irqs(KBD), 0, "no IRQ 1 with the keyboard interrupt off");
    assert_eq!(h.flush(), 0);
    // i8042_enable_kbd_port
    assert_eq!(h.command(0x60, &[0x65], 0), Ok(vec![]));
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![0x65]));
    assert_eq!(h.irqs(KBD), 1, "replies raise IRQ 1 once it is on");
    assert_eq!(h.resets(), 0);
}

#[test]
fn a_requested_reset_runs_the_self_test_and_the_interface_test() {
    let mut h = Harness::new();
    h.command(0x60, &[0x30], 0).unwrap(); // no system flag, ports off
    assert_eq!(h.status() & STATUS_SYSTEM, 0);
    assert_eq!(h.command(0xaa, &[], 1), Ok(vec![0x55]));
    assert_ne!(
        h.status() & STATUS_SYSTEM,
        0,
        "self-test sets the system flag"
    );
    assert_eq!(h.command(0xab, &[], 1), Ok(vec![0x00]));
    assert_eq!(h.command(0xad, &[], 0), Ok(vec![]));
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![0x34]));
    assert_eq!(h.command(0xae, &[], 0), Ok(vec![]));
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![0x24]));
    assert_eq!(h.flush(), 0);
}

#[test]
fn keyboard_reset_answers_ack_then_self_test_passed_with_an_irq_for_each() {
    let mut h = Harness::new();
    h.irqs(KBD);
    h.dev.write(0, &[0xff]);
    assert_eq!(h.irqs(KBD), 1);
    assert_eq!(h.wait_read(), Ok(0xfa));
    assert_eq!(h.irqs(KBD), 1, "the next byte raises IRQ 1 again");
    assert_eq!(h.wait_read(), Ok(0xaa));
    assert_eq!(h.irqs(KBD), 0);
    assert_eq!(h.status() & STATUS_OBF, 0);
    assert_eq!(h.irqs(AUX), 0);
}

#[test]
fn atkbd_probe_gets_an_mf2_id_and_acks() {
    let mut h = Harness::new();
    assert_eq!(h.kbd(0xf2, 3), Ok(vec![0xfa, 0xab, 0x41]), "translated");
    h.command(0x60, &[0x25], 0).unwrap(); // i8042.direct: translation off
    assert_eq!(h.kbd(0xf2, 3), Ok(vec![0xfa, 0xab, 0x83]));
    assert_eq!(h.kbd(0xf5, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0xed, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0x02, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0xf3, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0x00, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0xf0, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0x00, 2), Ok(vec![0xfa, 0x02]));
    assert_eq!(h.kbd(0xf4, 1), Ok(vec![0xfa]));
    assert_eq!(h.kbd(0xee, 1), Ok(vec![0xee]));
    assert_eq!(h.flush(), 0);
}

#[test]
fn sending_to_a_disabled_keyboard_enables_its_port() {
    let mut h = Harness::new();
    h.command(0xad, &[], 0).unwrap();
    assert_eq!(h.kbd(0xf4, 1), Ok(vec![0xfa]));
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![INITIAL_CTR]));
}

#[test]
fn aux_probe_finds_a_port_with_nothing_attached() {
    let mut h = Harness::new();
    // i8042_check_aux: loopback answers as AUX data
    h.dev.write(4, &[0xd3]);
    h.dev.write(0, &[0x5a]);
    assert_eq!(
        h.status() & (STATUS_OBF | STATUS_AUX_DATA),
        STATUS_OBF | STATUS_AUX_DATA
    );
    assert_eq!(h.data(), 0x5a);
    assert_eq!(h.command(0xa9, &[], 1), Ok(vec![0x00]));
    // i8042_toggle_aux: the CTR's AUX-disabled bit follows 0xA7/0xA8
    h.command(0xa7, &[], 0).unwrap();
    assert_eq!(
        h.command(0x20, &[], 1).unwrap()[0] & CTR_AUX_DISABLED,
        CTR_AUX_DISABLED
    );
    h.command(0xa8, &[], 0).unwrap();
    assert_eq!(h.command(0x20, &[], 1).unwrap()[0] & CTR_AUX_DISABLED, 0);
    // i8042_set_mux_mode: a plain loopback echoes 0xA4, so there is no MUX
    for b in [0xf0, 0x56, 0xa4] {
        assert_eq!(h.command(0xd3, &[b], 1), Ok(vec![b]));
    }
    // AUX IRQ test: with the AUX interrupt on, the loopback raises IRQ 12
    h.command(0x60, &[0x47], 0).unwrap();
    h.irqs(AUX);
    h.irqs(KBD);
    h.command(0xd3, &[0xa5], 0).unwrap();
    assert_eq!(h.irqs(AUX), 1);
    assert_eq!(h.irqs(KBD), 0);
    assert_eq!(h.data(), 0xa5);
    // psmouse: a byte for the mouse times out
    h.command(0xd4, &[0xff], 0).unwrap();
    assert_eq!(h.irqs(AUX), 1);
    let status = h.status();
    assert_eq!(
        status & (STATUS_OBF | STATUS_AUX_DATA | STATUS_TIMEOUT),
        STATUS_OBF | STATUS_AUX_DATA | STATUS_TIMEOUT
    );
    assert_eq!(h.data(), 0xfe);
    assert_eq!(h.status() & (STATUS_AUX_DATA | STATUS_TIMEOUT), 0);
    assert_eq!(h.flush(), 0);
}

#[test]
fn the_reset_line_resets_through_pulse_commands_and_the_output_port() {
    let mut h = Harness::new();
    assert_eq!(h.command(0xd0, &[], 1), Ok(vec![INITIAL_OUTPUT_PORT]));
    h.dev.write(4, &[0xfe]);
    assert_eq!(h.resets(), 1);
    h.dev.write(4, &[0xf1]); // pulses lines 1-3, not reset
    h.dev.write(4, &[0xff]);
    assert_eq!(h.resets(), 1);
    h.dev.write(4, &[0xf0]);
    assert_eq!(h.resets(), 2);
    h.command(0xd1, &[0x03], 0).unwrap();
    assert_eq!(h.resets(), 2);
    assert_eq!(h.command(0xd0, &[], 1), Ok(vec![0x03]));
    h.command(0xd1, &[0x02], 0).unwrap();
    assert_eq!(h.resets(), 3);
    // 0xFE on the data port is a keyboard command (resend), not a reset.
    h.dev.write(0, &[0xfe]);
    assert_eq!(h.resets(), 3);
}

#[test]
fn ram_and_the_keyboard_output_buffer_round_trip() {
    let mut h = Harness::new();
    h.command(0x65, &[0x42], 0).unwrap();
    assert_eq!(h.command(0x25, &[], 1), Ok(vec![0x42]));
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![INITIAL_CTR]));
    h.irqs(KBD);
    h.command(0xd2, &[0x1c], 0).unwrap();
    assert_eq!(h.irqs(KBD), 1);
    assert_eq!(h.status() & STATUS_AUX_DATA, 0);
    assert_eq!(h.data(), 0x1c);
}

#[test]
fn enabling_an_interrupt_with_data_waiting_raises_it() {
    let mut h = Harness::new();
    h.command(0x60, &[0x74], 0).unwrap();
    h.command(0xd2, &[0x1c], 0).unwrap();
    assert_eq!(h.irqs(KBD), 0);
    h.command(0x60, &[0x65], 0).unwrap();
    assert_eq!(h.irqs(KBD), 1);
    assert_eq!(h.data(), 0x1c);
}

#[test]
fn a_new_command_abandons_one_waiting_for_its_data() {
    let mut h = Harness::new();
    h.dev.write(4, &[0x60]);
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![INITIAL_CTR]));
    // The next data byte goes to the keyboard, not into the CTR.
    assert_eq!(h.kbd(0xf4, 1), Ok(vec![0xfa]));
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![INITIAL_CTR]));
}

#[test]
fn hostile_input_never_panics_wedges_or_grows_the_buffer() {
    let mut h = Harness::new();
    let mut x: u32 = 0x1234_5678;
    for cmd in 0..=u8::MAX {
        h.dev.write(4, &[cmd]);
        for _ in 0..40 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            h.dev.write(0, &[x as u8]);
            assert!(h.dev.output.len() <= OUTPUT_CAPACITY);
        }
    }
    // Wide and stray accesses are refused without effect.
    h.dev.write(0, &[0xff, 0xff]);
    h.dev.write(1, &[0xfe]);
    let mut wide = [0u8; 2];
    h.dev.read(0, &mut wide);
    assert_eq!(wide, [0xff, 0xff]);
    let mut stray = [0u8];
    h.dev.read(2, &mut stray);
    assert_eq!(stray, [0xff]);
    // Still a working controller.
    assert!(h.flush() <= OUTPUT_CAPACITY);
    assert_eq!(h.flush(), 0);
    h.command(0x60, &[INITIAL_CTR], 0).unwrap();
    assert_eq!(h.command(0x20, &[], 1), Ok(vec![INITIAL_CTR]));
    assert_eq!(h.command(0xaa, &[], 1), Ok(vec![0x55]));
    assert_eq!(h.kbd(0xff, 2), Ok(vec![0xfa, 0xaa]));
    // Every even pulse command (and D1 with bit 0 clear) reset on the way.
    assert!(h.resets() >= 8);
}
