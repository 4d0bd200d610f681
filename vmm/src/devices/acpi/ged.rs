//! The Generic Event Device's event register (ACPI 6.5, section 5.6.9): the
//! VMM sets an event bit and raises the GED's interrupt; the guest's
//! `_EVT` method reads this one-byte port to learn which events fired (the
//! read clears them) and sends the matching `Notify`.

use vm_superio::Trigger;

use crate::devices::bus::BusDevice;
use crate::devices::irq::IrqLine;

/// Ports the register claims.
pub const GED_PORT_LEN: u64 = 1;
/// Event bit: the VM generation ID changed (`_EVT` notifies `\_SB.VGEN`).
pub const EVENT_VMGENID_CHANGED: u8 = 1 << 0;
/// Every event bit this VMM defines; a saved register holding others is refused.
pub const KNOWN_EVENTS: u8 = EVENT_VMGENID_CHANGED;

/// The event register and the interrupt that announces it.
pub struct Ged {
    irq: IrqLine,
    pending: u8,
}

impl Ged {
    /// A GED raising `irq`, with `pending` events not yet read by the guest.
    pub fn new(irq: IrqLine, pending: u8) -> Self {
        Ged { irq, pending }
    }

    /// Records `events` and raises the interrupt.
    pub fn notify(&mut self, events: u8) -> std::io::Result<()> {
        self.pending |= events;
        self.irq.trigger()
    }

    /// Events raised and not yet read by the guest.
    pub fn pending(&self) -> u8 {
        self.pending
    }

    /// The interrupt line (its eventfd is registered as an irqfd).
    pub fn irq(&self) -> &IrqLine {
        &self.irq
    }
}

impl BusDevice for Ged {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = std::mem::take(&mut self.pending);
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {
        // Read-only: the AML field is declared WriteAsZeros and never written.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_sets_the_bit_raises_the_interrupt_and_a_read_clears_it() {
        let mut ged = Ged::new(IrqLine::new(3).unwrap(), 0);
        ged.notify(EVENT_VMGENID_CHANGED).unwrap();
        // The irqfd's eventfd counts one edge.
        assert_eq!(ged.irq().eventfd().read().unwrap(), 1);
        assert_eq!(ged.pending(), EVENT_VMGENID_CHANGED);
        let mut reg = [0xffu8; 1];
        ged.read(0, &mut reg);
        assert_eq!(reg, [EVENT_VMGENID_CHANGED]);
        ged.read(0, &mut reg);
        assert_eq!(reg, [0], "a read clears the events");
        // Nothing more was raised, so the non-blocking eventfd is empty.
        assert!(ged.irq().eventfd().read().is_err());
    }

    #[test]
    fn writes_are_ignored_and_wide_reads_zero_the_rest() {
        let mut ged = Ged::new(IrqLine::new(3).unwrap(), EVENT_VMGENID_CHANGED);
        ged.write(0, &[0xff]);
        let mut reg = [0xffu8; 4];
        ged.read(0, &mut reg);
        assert_eq!(reg, [EVENT_VMGENID_CHANGED, 0, 0, 0]);
    }
}
