//! Serial console state for snapshots: the UART registers and any input the
//! guest has not read yet.

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::Serial;

use super::{SerialDevice, SerialOut};
use crate::devices::irq::IrqLine;
use crate::persist::Persist;

/// The UART's registers and receive FIFO.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    /// Divisor latch low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Bytes received but not read by the guest (at most the 64-byte FIFO).
    pub in_buffer: Vec<u8>,
}

/// Errors restoring the serial device.
#[derive(Debug, thiserror::Error)]
pub enum SerialPersistError {
    /// The saved FIFO is larger than the UART's.
    #[error("invalid serial state in snapshot: {0}")]
    Invalid(String),
}

/// What a restored UART needs besides its state.
pub struct SerialRestoreArgs {
    /// Its interrupt line.
    pub irq: IrqLine,
    /// Where output goes in the new process.
    pub out: SerialOut,
}

impl Persist for SerialDevice {
    type State = SerialSnapshot;
    type ConstructorArgs = SerialRestoreArgs;
    type Error = SerialPersistError;

    fn save(&self) -> Result<SerialSnapshot, SerialPersistError> {
        let s = self.uart.state();
        Ok(SerialSnapshot {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        })
    }

    fn restore(args: SerialRestoreArgs, s: &SerialSnapshot) -> Result<Self, SerialPersistError> {
        let state = SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        };
        let uart = Serial::from_state(&state, args.irq, NoEvents, args.out)
            .map_err(|e| SerialPersistError::Invalid(format!("{e:?}")))?;
        Ok(SerialDevice {
            uart,
            receive_resets: 0,
            coalesced: None,
            writer: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;

    #[test]
    fn registers_and_pending_input_survive() {
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        dev.write(7, &[0x5a]); // scratch register
        dev.enqueue_input(b"abc");
        let state = dev.save().unwrap();
        let args = SerialRestoreArgs {
            irq: IrqLine::new(4).unwrap(),
            out: Box::new(std::io::sink()),
        };
        let mut restored = SerialDevice::restore(args, &state).unwrap();
        let mut b = [0u8];
        restored.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
        restored.read(0, &mut b);
        assert_eq!(b[0], b'a');
    }

    #[test]
    fn an_oversized_fifo_is_refused() {
        let mut dev = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        let mut state = dev.save().unwrap();
        state.in_buffer = vec![0; 4096];
        let args = SerialRestoreArgs {
            irq: IrqLine::new(4).unwrap(),
            out: Box::new(std::io::sink()),
        };
        assert!(SerialDevice::restore(args, &state).is_err());
        dev.flush();
    }
}
