//! i8042 state for snapshots: controller RAM (the CTR), the output port,
//! the output buffer, a command waiting for its data byte, and the keyboard.

use serde::{Deserialize, Serialize};

use super::keyboard::Keyboard;
use super::{
    ResetTrigger, Source, CMD_WRITE_AUX, CMD_WRITE_AUX_BUFFER, CMD_WRITE_KBD_BUFFER,
    CMD_WRITE_OUTPUT_PORT, CMD_WRITE_RAM, CMD_WRITE_RAM_LAST, I8042, INITIAL_CTR,
    INITIAL_OUTPUT_PORT, OUTPUT_CAPACITY, RAM_SIZE,
};
use crate::persist::Persist;

/// Where a buffered byte came from, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SourceState {
    /// The controller or the keyboard (IRQ 1).
    Keyboard,
    /// The AUX port (IRQ 12).
    Aux,
    /// An AUX timeout (IRQ 12, timeout bit).
    AuxTimeout,
}

/// The keyboard's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyboardState {
    /// Scanning enabled.
    pub scanning: bool,
    /// Scan-code set, 1 to 3.
    pub scancode_set: u8,
    /// LED bits.
    pub leds: u8,
    /// Typematic rate and delay.
    pub typematic: u8,
    /// A command (0xED, 0xF0, 0xF3) waiting for its parameter.
    pub awaiting: Option<u8>,
    /// The last byte sent, for a resend.
    pub last_sent: u8,
}

/// The controller's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {
    /// Controller RAM, `RAM_SIZE` bytes; byte 0 is the CTR.
    pub ram: Vec<u8>,
    /// The output port.
    pub output_port: u8,
    /// Bytes the guest has not read yet, oldest first (at most `OUTPUT_CAPACITY`).
    pub output: Vec<(u8, SourceState)>,
    /// A command waiting for its data byte.
    pub pending_command: Option<u8>,
    /// Whether the last write went to the command port.
    pub last_was_command: bool,
    /// The keyboard behind port 1.
    pub keyboard: KeyboardState,
}

impl I8042State {
    /// A controller as it powers on: what a snapshot from before the i8042
    /// was saved restores to.
    pub fn power_on() -> Self {
        let mut ram = vec![0u8; RAM_SIZE];
        ram[0] = INITIAL_CTR;
        I8042State {
            ram,
            output_port: INITIAL_OUTPUT_PORT,
            output: Vec::new(),
            pending_command: None,
            last_was_command: false,
            keyboard: keyboard_state(&Keyboard::default()),
        }
    }
}

/// Errors restoring the i8042.
#[derive(Debug, thiserror::Error)]
pub enum I8042PersistError {
    /// The state holds values this controller never has.
    #[error("invalid i8042 state in snapshot: {0}")]
    Invalid(String),
    /// Its interrupt lines could not be created.
    #[error("cannot create the i8042 interrupts: {0}")]
    Irq(#[source] std::io::Error),
}

fn keyboard_state(k: &Keyboard) -> KeyboardState {
    KeyboardState {
        scanning: k.scanning,
        scancode_set: k.scancode_set,
        leds: k.leds,
        typematic: k.typematic,
        awaiting: k.awaiting,
        last_sent: k.last_sent,
    }
}

fn takes_data(cmd: u8) -> bool {
    matches!(
        cmd,
        CMD_WRITE_RAM
            ..=CMD_WRITE_RAM_LAST
                | CMD_WRITE_OUTPUT_PORT
                | CMD_WRITE_KBD_BUFFER
                | CMD_WRITE_AUX_BUFFER
                | CMD_WRITE_AUX
    )
}

/// Checks untrusted state against what the controller can hold.
fn validate(s: &I8042State) -> Result<(), I8042PersistError> {
    let invalid = |what: String| Err(I8042PersistError::Invalid(what));
    if s.ram.len() != RAM_SIZE {
        return invalid(format!("{} RAM bytes ({RAM_SIZE} expected)", s.ram.len()));
    }
    if s.output.len() > OUTPUT_CAPACITY {
        return invalid(format!(
            "{} buffered bytes (at most {OUTPUT_CAPACITY})",
            s.output.len()
        ));
    }
    if let Some(cmd) = s.pending_command.filter(|c| !takes_data(*c)) {
        return invalid(format!("command {cmd:#04x} does not wait for data"));
    }
    let k = &s.keyboard;
    if !(1..=3).contains(&k.scancode_set) {
        return invalid(format!("keyboard scan-code set {}", k.scancode_set));
    }
    if let Some(cmd) = k.awaiting.filter(|c| !Keyboard::takes_parameter(*c)) {
        return invalid(format!("keyboard command {cmd:#04x} takes no parameter"));
    }
    Ok(())
}

impl Persist for I8042 {
    type State = I8042State;
    type ConstructorArgs = ResetTrigger;
    type Error = I8042PersistError;

    fn save(&self) -> Result<I8042State, I8042PersistError> {
        Ok(I8042State {
            ram: self.ram.to_vec(),
            output_port: self.output_port,
            output: self
                .output
                .iter()
                .map(|&(byte, source)| {
                    let source = match source {
                        Source::Keyboard => SourceState::Keyboard,
                        Source::Aux => SourceState::Aux,
                        Source::AuxTimeout => SourceState::AuxTimeout,
                    };
                    (byte, source)
                })
                .collect(),
            pending_command: self.pending,
            last_was_command: self.last_was_command,
            keyboard: keyboard_state(&self.keyboard),
        })
    }

    fn restore(reset: ResetTrigger, s: &I8042State) -> Result<Self, I8042PersistError> {
        validate(s)?;
        let mut dev = I8042::new(reset).map_err(I8042PersistError::Irq)?;
        dev.ram.copy_from_slice(&s.ram);
        dev.output_port = s.output_port;
        dev.output = s
            .output
            .iter()
            .map(|&(byte, source)| {
                let source = match source {
                    SourceState::Keyboard => Source::Keyboard,
                    SourceState::Aux => Source::Aux,
                    SourceState::AuxTimeout => Source::AuxTimeout,
                };
                (byte, source)
            })
            .collect();
        dev.pending = s.pending_command;
        dev.last_was_command = s.last_was_command;
        let k = &s.keyboard;
        dev.keyboard = Keyboard {
            scanning: k.scanning,
            scancode_set: k.scancode_set,
            leds: k.leds,
            typematic: k.typematic,
            awaiting: k.awaiting,
            last_sent: k.last_sent,
        };
        // An interrupt raised just before the snapshot may not have reached the
        // saved irqchip state: raise it again for a byte still waiting.
        dev.signal_head();
        Ok(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;

    fn dev() -> I8042 {
        I8042::new(ResetTrigger::new(|| {})).unwrap()
    }

    fn read(dev: &mut I8042, offset: u64) -> u8 {
        let mut b = [0u8];
        dev.read(offset, &mut b);
        b[0]
    }

    #[test]
    fn ctr_output_buffer_pending_command_and_keyboard_survive() {
        let mut d = dev();
        d.write(4, &[0x60]);
        d.write(0, &[0x47]); // CTR: AUX interrupt on, AUX port on
        d.write(4, &[0xd2]);
        d.write(0, &[0x1c]);
        d.write(4, &[0xd3]);
        d.write(0, &[0x5a]);
        d.write(0, &[0xed]); // keyboard: ACK, then waits for the LED byte
        d.write(4, &[0x60]); // waits for the new CTR
        let state = d.save().unwrap();
        assert_eq!(state.pending_command, Some(0x60));
        assert_eq!(state.keyboard.awaiting, Some(0xed));

        let mut r = I8042::restore(ResetTrigger::new(|| {}), &state).unwrap();
        assert_eq!(r.save().unwrap(), state);
        assert_eq!(r.irq_lines()[0].eventfd().read().unwrap(), 1, "IRQ 1 again");
        assert_ne!(read(&mut r, 4) & 0x08, 0, "last write was a command");
        assert_eq!(read(&mut r, 0), 0x1c);
        assert_eq!(read(&mut r, 4) & 0x21, 0x21, "AUX byte next");
        assert_eq!(read(&mut r, 0), 0x5a);
        assert_eq!(read(&mut r, 0), 0xfa);
        r.write(0, &[0x45]); // completes the pending CTR write
        r.write(4, &[0x20]);
        assert_eq!(read(&mut r, 0), 0x45);
        r.write(0, &[0x07]); // the LED byte
        assert_eq!(read(&mut r, 0), 0xfa);
        assert_eq!(r.save().unwrap().keyboard.leds, 7);
    }

    #[test]
    fn a_fresh_controller_saves_as_power_on() {
        assert_eq!(dev().save().unwrap(), I8042State::power_on());
    }

    #[test]
    fn impossible_states_are_refused() {
        let good = I8042State::power_on();
        let mut bad = Vec::new();
        let mut s = good.clone();
        s.ram.pop();
        bad.push(s);
        let mut s = good.clone();
        s.output = vec![(0, SourceState::Keyboard); OUTPUT_CAPACITY + 1];
        bad.push(s);
        let mut s = good.clone();
        s.pending_command = Some(0x20);
        bad.push(s);
        let mut s = good.clone();
        s.keyboard.scancode_set = 4;
        bad.push(s);
        let mut s = good.clone();
        s.keyboard.awaiting = Some(0xf4);
        bad.push(s);
        for s in &bad {
            let err = I8042::restore(ResetTrigger::new(|| {}), s).err();
            assert!(
                matches!(err, Some(I8042PersistError::Invalid(_))),
                "{s:?}: {err:?}"
            );
        }
        assert!(I8042::restore(ResetTrigger::new(|| {}), &good).is_ok());
    }
}
