//! The i8042 keyboard controller, present so a guest can reset the machine by
//! writing 0xFE to port 0x64; the VMM turns that into a clean VM exit.

use std::sync::Arc;

use vm_superio::{I8042Device, Trigger};

use crate::devices::bus::BusDevice;

/// First I/O port of the controller (data port; 0x64 is the command port).
pub const I8042_PORT_BASE: u64 = 0x60;
/// Ports claimed, 0x60..=0x64.
pub const I8042_PORT_LEN: u64 = 5;

/// Calls back into the VMM when the guest asks for a reset.
#[derive(Clone)]
pub struct ResetTrigger(Arc<dyn Fn() + Send + Sync>);

impl ResetTrigger {
    /// A trigger that runs `on_reset` when the guest resets.
    pub fn new(on_reset: impl Fn() + Send + Sync + 'static) -> Self {
        ResetTrigger(Arc::new(on_reset))
    }
}

impl Trigger for ResetTrigger {
    type E = std::convert::Infallible;

    fn trigger(&self) -> Result<(), Self::E> {
        (self.0)();
        Ok(())
    }
}

/// The i8042 on the port-I/O bus.
pub struct I8042 {
    inner: I8042Device<ResetTrigger>,
}

impl I8042 {
    /// A controller whose reset command runs `reset`.
    pub fn new(reset: ResetTrigger) -> Self {
        I8042 {
            inner: I8042Device::new(reset),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Some(first), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.inner.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(value), Ok(off)) = (data.first(), u8::try_from(offset)) {
            // The trigger is infallible.
            let _ = self.inner.write(off, *value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn reset_command_fires_the_trigger_once() {
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let mut dev = I8042::new(ResetTrigger::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        dev.write(4, &[0x01]);
        dev.write(0, &[0xfe]);
        assert_eq!(count.load(Ordering::SeqCst), 0);
        dev.write(4, &[0xfe]);
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }
}
