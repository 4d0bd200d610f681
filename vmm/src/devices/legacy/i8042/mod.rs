//! The i8042 PS/2 controller at ports 0x60 (data) and 0x64 (status and
//! command): the controller command byte (CTR) and the rest of its RAM,
//! self and interface tests, port enable and disable, the output port, a
//! small output buffer that raises IRQ 1 (keyboard) or IRQ 12 (AUX), a PS/2
//! keyboard behind the first port ([`keyboard`]) and an AUX port with no
//! device attached. Enough for Linux's i8042 probe and atkbd to bind without
//! timeouts, and for a guest to reset the machine (0xFE to port 0x64, or an
//! output-port write that pulls the reset line low), which the VMM turns
//! into a clean VM exit. Guest writes are untrusted: every byte is handled,
//! none panics, and the output buffer is bounded.

pub mod keyboard;
pub mod persist;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;

use vm_superio::Trigger;

use crate::devices::bus::BusDevice;
use crate::devices::irq::IrqLine;
use keyboard::Keyboard;

/// First I/O port of the controller (data port; 0x64 is the command port).
pub const I8042_PORT_BASE: u64 = 0x60;
/// Ports claimed, 0x60..=0x64.
pub const I8042_PORT_LEN: u64 = 5;
/// The keyboard port's interrupt line.
pub const KBD_IRQ: u32 = 1;
/// The AUX (mouse) port's interrupt line.
pub const AUX_IRQ: u32 = 12;
/// Bytes the output buffer holds; more are dropped until the guest reads.
pub const OUTPUT_CAPACITY: usize = 16;
/// Bytes of controller RAM (command 0x20 + n reads byte n, 0x60 + n writes it).
pub const RAM_SIZE: usize = 32;

const DATA_OFFSET: u64 = 0;
const COMMAND_OFFSET: u64 = 4;

/// Status register bits. IBF (0x02) is never set: a write is handled before
/// the vCPU resumes.
const STATUS_OBF: u8 = 0x01;
const STATUS_SYSTEM: u8 = 0x04;
const STATUS_LAST_WAS_COMMAND: u8 = 0x08;
const STATUS_NOT_INHIBITED: u8 = 0x10;
const STATUS_AUX_DATA: u8 = 0x20;
const STATUS_TIMEOUT: u8 = 0x40;

/// Controller command byte (RAM byte 0) bits.
const CTR_KBD_INT: u8 = 0x01;
const CTR_AUX_INT: u8 = 0x02;
const CTR_SYSTEM: u8 = 0x04;
const CTR_KBD_DISABLED: u8 = 0x10;
const CTR_AUX_DISABLED: u8 = 0x20;
const CTR_TRANSLATE: u8 = 0x40;
/// As firmware leaves it: translation on, AUX port off, POST passed,
/// keyboard interrupt on.
pub const INITIAL_CTR: u8 = CTR_TRANSLATE | CTR_AUX_DISABLED | CTR_SYSTEM | CTR_KBD_INT;

/// Output port bit 0: the CPU reset line (low resets).
const OUTPUT_PORT_RESET: u8 = 0x01;
/// Reset line high, A20 on, unused lines high, both buffer-full lines low.
pub const INITIAL_OUTPUT_PORT: u8 = 0xcf;

const CMD_READ_RAM: u8 = 0x20;
const CMD_READ_RAM_LAST: u8 = 0x3f;
const CMD_WRITE_RAM: u8 = 0x60;
const CMD_WRITE_RAM_LAST: u8 = 0x7f;
const CMD_AUX_DISABLE: u8 = 0xa7;
const CMD_AUX_ENABLE: u8 = 0xa8;
const CMD_AUX_TEST: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_KBD_TEST: u8 = 0xab;
const CMD_KBD_DISABLE: u8 = 0xad;
const CMD_KBD_ENABLE: u8 = 0xae;
const CMD_READ_OUTPUT_PORT: u8 = 0xd0;
const CMD_WRITE_OUTPUT_PORT: u8 = 0xd1;
const CMD_WRITE_KBD_BUFFER: u8 = 0xd2;
const CMD_WRITE_AUX_BUFFER: u8 = 0xd3;
const CMD_WRITE_AUX: u8 = 0xd4;
/// 0xF0..=0xFF pulse output-port lines low for each clear bit 0-3; bit 0 is reset.
const CMD_PULSE_FIRST: u8 = 0xf0;

const SELF_TEST_PASSED: u8 = 0x55;
const INTERFACE_OK: u8 = 0x00;
/// What an AUX write gets back with no device on the port (with TIMEOUT set).
const AUX_NO_DEVICE: u8 = 0xfe;

/// Calls back into the VMM when the guest asks for a reset.
#[derive(Clone)]
pub struct ResetTrigger(Arc<dyn Fn() + Send + Sync>);

impl ResetTrigger {
    /// A trigger that runs `on_reset` when the guest resets.
    pub fn new(on_reset: impl Fn() + Send + Sync + 'static) -> Self {
        ResetTrigger(Arc::new(on_reset))
    }

    fn fire(&self) {
        (self.0)()
    }
}

/// Where a byte in the output buffer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The controller or the keyboard: IRQ 1.
    Keyboard,
    /// The AUX port: IRQ 12, status AUX-data bit.
    Aux,
    /// The AUX port timed out (no device): IRQ 12, AUX-data and timeout bits.
    AuxTimeout,
}

/// The i8042 on the port-I/O bus.
pub struct I8042 {
    reset: ResetTrigger,
    kbd_irq: IrqLine,
    aux_irq: IrqLine,
    /// Controller RAM; byte 0 is the CTR.
    ram: [u8; RAM_SIZE],
    output_port: u8,
    output: VecDeque<(u8, Source)>,
    /// A command written to 0x64 that waits for its data byte at 0x60.
    pending: Option<u8>,
    /// Whether the last write went to the command port (status bit 3).
    last_was_command: bool,
    keyboard: Keyboard,
}

impl I8042 {
    /// A controller in its power-on state whose reset command runs `reset`;
    /// it creates its IRQ 1 and IRQ 12 lines (register both with KVM).
    pub fn new(reset: ResetTrigger) -> std::io::Result<Self> {
        let mut ram = [0u8; RAM_SIZE];
        ram[0] = INITIAL_CTR;
        Ok(I8042 {
            reset,
            kbd_irq: IrqLine::new(KBD_IRQ)?,
            aux_irq: IrqLine::new(AUX_IRQ)?,
            ram,
            output_port: INITIAL_OUTPUT_PORT,
            output: VecDeque::with_capacity(OUTPUT_CAPACITY),
            pending: None,
            last_was_command: false,
            keyboard: Keyboard::default(),
        })
    }

    /// The keyboard and AUX interrupt lines, to register as irqfds.
    pub fn irq_lines(&self) -> [&IrqLine; 2] {
        [&self.kbd_irq, &self.aux_irq]
    }

    fn ctr(&self) -> u8 {
        self.ram[0]
    }

    fn status(&self) -> u8 {
        let mut status = STATUS_NOT_INHIBITED;
        if self.ctr() & CTR_SYSTEM != 0 {
            status |= STATUS_SYSTEM;
        }
        if self.last_was_command {
            status |= STATUS_LAST_WAS_COMMAND;
        }
        match self.output.front() {
            None => {}
            Some((_, Source::Keyboard)) => status |= STATUS_OBF,
            Some((_, Source::Aux)) => status |= STATUS_OBF | STATUS_AUX_DATA,
            Some((_, Source::AuxTimeout)) => {
                status |= STATUS_OBF | STATUS_AUX_DATA | STATUS_TIMEOUT
            }
        }
        status
    }

    /// Raises the interrupt for the byte now at the head of the output buffer,
    /// if its port's interrupt is enabled in the CTR.
    fn signal_head(&self) {
        let (line, enabled) = match self.output.front() {
            None => return,
            Some((_, Source::Keyboard)) => (&self.kbd_irq, CTR_KBD_INT),
            Some((_, Source::Aux | Source::AuxTimeout)) => (&self.aux_irq, CTR_AUX_INT),
        };
        if self.ctr() & enabled != 0 {
            if let Err(e) = line.trigger() {
                tracing::debug!(gsi = line.gsi(), error = %e, "i8042 interrupt lost");
            }
        }
    }

    fn push(&mut self, byte: u8, source: Source) {
        if self.output.len() >= OUTPUT_CAPACITY {
            tracing::debug!(byte, "i8042 output buffer full: byte dropped");
            return;
        }
        self.output.push_back((byte, source));
        if self.output.len() == 1 {
            self.signal_head();
        }
    }

    fn read_data(&mut self) -> u8 {
        let byte = self.output.pop_front().map_or(0, |(b, _)| b);
        self.signal_head();
        byte
    }

    fn set_ctr(&mut self, value: u8) {
        let newly_enabled = value & !self.ctr() & (CTR_KBD_INT | CTR_AUX_INT);
        self.ram[0] = value;
        if newly_enabled != 0 {
            self.signal_head();
        }
    }

    fn write_command(&mut self, cmd: u8) {
        self.last_was_command = true;
        // A new command abandons one still waiting for its data byte.
        self.pending = None;
        match cmd {
            CMD_READ_RAM..=CMD_READ_RAM_LAST => {
                self.push(self.ram[usize::from(cmd - CMD_READ_RAM)], Source::Keyboard)
            }
            CMD_WRITE_RAM..=CMD_WRITE_RAM_LAST
            | CMD_WRITE_OUTPUT_PORT
            | CMD_WRITE_KBD_BUFFER
            | CMD_WRITE_AUX_BUFFER
            | CMD_WRITE_AUX => self.pending = Some(cmd),
            CMD_AUX_DISABLE => self.ram[0] |= CTR_AUX_DISABLED,
            CMD_AUX_ENABLE => self.ram[0] &= !CTR_AUX_DISABLED,
            CMD_AUX_TEST | CMD_KBD_TEST => self.push(INTERFACE_OK, Source::Keyboard),
            CMD_SELF_TEST => {
                self.ram[0] |= CTR_SYSTEM;
                self.push(SELF_TEST_PASSED, Source::Keyboard);
            }
            CMD_KBD_DISABLE => self.ram[0] |= CTR_KBD_DISABLED,
            CMD_KBD_ENABLE => self.ram[0] &= !CTR_KBD_DISABLED,
            CMD_READ_OUTPUT_PORT => self.push(self.output_port, Source::Keyboard),
            CMD_PULSE_FIRST..=u8::MAX => {
                if cmd & OUTPUT_PORT_RESET == 0 {
                    self.reset.fire();
                }
            }
            _ => tracing::debug!(cmd, "i8042 command not emulated: ignored"),
        }
    }

    fn write_data(&mut self, byte: u8) {
        self.last_was_command = false;
        match self.pending.take() {
            Some(cmd @ CMD_WRITE_RAM..=CMD_WRITE_RAM_LAST) => {
                let index = usize::from(cmd - CMD_WRITE_RAM);
                if index == 0 {
                    self.set_ctr(byte);
                } else {
                    self.ram[index] = byte;
                }
            }
            Some(CMD_WRITE_OUTPUT_PORT) => {
                self.output_port = byte;
                if byte & OUTPUT_PORT_RESET == 0 {
                    self.reset.fire();
                }
            }
            Some(CMD_WRITE_KBD_BUFFER) => self.push(byte, Source::Keyboard),
            Some(CMD_WRITE_AUX_BUFFER) => self.push(byte, Source::Aux),
            Some(CMD_WRITE_AUX) => {
                // Nothing is attached, so the controller times out. Writing to
                // the port enables it, as on hardware.
                self.ram[0] &= !CTR_AUX_DISABLED;
                self.push(AUX_NO_DEVICE, Source::AuxTimeout);
            }
            Some(other) => tracing::debug!(cmd = other, "i8042 data for a command without one"),
            None => {
                // A byte for the keyboard; sending it enables the keyboard port.
                self.ram[0] &= !CTR_KBD_DISABLED;
                let translated = self.ctr() & CTR_TRANSLATE != 0;
                for reply in self.keyboard.receive(byte, translated) {
                    self.push(reply, Source::Keyboard);
                }
            }
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (offset, &mut *data) {
            (DATA_OFFSET, [byte]) => *byte = self.read_data(),
            (COMMAND_OFFSET, [byte]) => *byte = self.status(),
            // Ports 0x61-0x63 and wide accesses: nothing decodes them here.
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data) {
            (DATA_OFFSET, [byte]) => self.write_data(*byte),
            (COMMAND_OFFSET, [byte]) => self.write_command(*byte),
            _ => tracing::debug!(offset, len = data.len(), "i8042 write ignored"),
        }
    }
}
