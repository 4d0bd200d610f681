//! The sleep control, sleep status and reset registers a hardware-reduced
//! FADT names (ACPI 6.5, sections 4.8.3.7 and 4.8.3.6): one byte each on
//! port I/O. Writing SLP_EN with the S5 sleep type powers the VM off;
//! writing the reset value resets it. The VMM turns both into a clean exit.

use std::sync::Arc;

use crate::devices::bus::BusDevice;

/// Offset of the sleep control register in the device's port range.
pub const SLEEP_CONTROL_OFFSET: u64 = 0;
/// Offset of the sleep status register.
pub const SLEEP_STATUS_OFFSET: u64 = 1;
/// Offset of the reset register.
pub const RESET_OFFSET: u64 = 2;
/// Ports the device claims.
pub const POWER_PORT_LEN: u64 = 3;
/// The value the FADT tells the guest to write to the reset register.
pub const RESET_VALUE: u8 = 1;
/// The S5 (soft off) sleep type, as the DSDT's `\_S5_` package gives it.
pub const S5_SLEEP_TYPE: u8 = 5;
/// SLP_EN: bit 5 of the sleep control register.
const SLEEP_ENABLE: u8 = 1 << 5;
/// SLP_TYPx: bits 2..=4 of the sleep control register.
const SLEEP_TYPE_SHIFT: u8 = 2;
const SLEEP_TYPE_MASK: u8 = 0b111;

/// What the guest asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerRequest {
    /// SLP_EN with the S5 sleep type: power off.
    Poweroff,
    /// The reset value written to the reset register.
    Reset,
}

/// Calls back into the VMM when the guest powers off or resets.
pub type PowerHandler = Arc<dyn Fn(PowerRequest) + Send + Sync>;

/// The sleep control/status and reset registers.
pub struct PowerDevice {
    on_request: PowerHandler,
}

impl PowerDevice {
    /// A device that calls `on_request` when the guest powers off or resets.
    pub fn new(on_request: PowerHandler) -> Self {
        PowerDevice { on_request }
    }

    fn sleep_control(&self, value: u8) {
        if value & SLEEP_ENABLE == 0 {
            return;
        }
        let sleep_type = (value >> SLEEP_TYPE_SHIFT) & SLEEP_TYPE_MASK;
        if sleep_type == S5_SLEEP_TYPE {
            (self.on_request)(PowerRequest::Poweroff);
        } else {
            // Only S5 is offered in the DSDT; any other state is not supported.
            tracing::warn!(
                sleep_type,
                "guest asked for an ACPI sleep state other than S5; ignored"
            );
        }
    }
}

impl BusDevice for PowerDevice {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // The sleep status register never reports a wake (WAK_STS clear); the
        // other registers read as zero.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        // The FADT declares byte registers; a wider access uses its first byte.
        let Some(&value) = data.first() else {
            return;
        };
        match offset {
            SLEEP_CONTROL_OFFSET => self.sleep_control(value),
            RESET_OFFSET if value == RESET_VALUE => (self.on_request)(PowerRequest::Reset),
            // Writes to the sleep status register clear WAK_STS, which is never set.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn recording() -> (PowerDevice, Arc<Mutex<Vec<PowerRequest>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let dev = PowerDevice::new(Arc::new(move |r| s.lock().unwrap().push(r)));
        (dev, seen)
    }

    #[test]
    fn slp_en_with_s5_powers_off_and_the_reset_value_resets() {
        let (mut dev, seen) = recording();
        // What ACPICA writes for S5: (SLP_TYP 5 << 2) | SLP_EN.
        dev.write(SLEEP_CONTROL_OFFSET, &[0x34]);
        dev.write(RESET_OFFSET, &[RESET_VALUE]);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![PowerRequest::Poweroff, PowerRequest::Reset]
        );
    }

    #[test]
    fn other_writes_do_nothing() {
        let (mut dev, seen) = recording();
        dev.write(SLEEP_CONTROL_OFFSET, &[5 << 2]); // S5 without SLP_EN
        dev.write(SLEEP_CONTROL_OFFSET, &[(3 << 2) | SLEEP_ENABLE]); // S3
        dev.write(SLEEP_STATUS_OFFSET, &[0x80]); // clear WAK_STS
        dev.write(RESET_OFFSET, &[0x06]);
        dev.write(RESET_OFFSET, &[]);
        assert!(seen.lock().unwrap().is_empty());
        let mut status = [0xffu8];
        dev.read(SLEEP_STATUS_OFFSET, &mut status);
        assert_eq!(status, [0]);
    }
}
