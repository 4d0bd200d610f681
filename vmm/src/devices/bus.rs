//! The port-I/O and MMIO buses: address ranges mapped to devices, so a vCPU
//! exit for an address reaches the device that owns it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device that answers reads and writes inside its range.
pub trait BusDevice: Send {
    /// Handles a read of `data.len()` bytes at `offset` from the device's base.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Handles a write of `data` at `offset` from the device's base.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors building a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// Two devices claim overlapping ranges.
    #[error("bus range {base:#x}+{len:#x} overlaps a device already on the bus")]
    Overlap {
        /// Base of the refused range.
        base: u64,
        /// Its length.
        len: u64,
    },
    /// A zero-length or wrapping range.
    #[error("bus range {base:#x}+{len:#x} is empty or wraps around")]
    BadRange {
        /// Base of the refused range.
        base: u64,
        /// Its length.
        len: u64,
    },
}

/// A shared, lockable bus device.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// A bus: non-overlapping ranges, each owned by one device.
#[derive(Default)]
pub struct Bus {
    /// base -> (length, device)
    ranges: BTreeMap<u64, (u64, SharedDevice)>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `device` at `[base, base + len)`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0);
        let Some(end) = end else {
            return Err(BusError::BadRange { base, len });
        };
        if let Some((prev_base, (prev_len, _))) = self.ranges.range(..end).next_back() {
            if prev_base + prev_len > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        self.ranges.insert(base, (len, device));
        Ok(())
    }

    /// The device owning `addr` and the offset of `addr` inside its range.
    fn find(&self, addr: u64) -> Option<(&SharedDevice, u64)> {
        let (base, (len, dev)) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < *len).then_some((dev, offset))
    }

    /// Routes a read; returns false when no device owns `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((dev, offset)) => {
                lock(dev).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Routes a write; returns false when no device owns `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((dev, offset)) => {
                lock(dev).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering from a poisoned lock: a panic in one vCPU's
/// device call must not wedge the others (the panic itself ends the process
/// under `panic = "abort"`; this matters for tests).
fn lock(dev: &SharedDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    dev.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        last_write: Option<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last_write = Some((offset, data.to_vec()));
        }
    }

    #[test]
    fn routes_by_range_and_offset() {
        let dev = Arc::new(Mutex::new(Recorder::default()));
        let mut bus = Bus::new();
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        let mut buf = [0u8; 1];
        assert!(bus.read(0x3fa, &mut buf));
        assert_eq!(buf, [2]);
        assert!(bus.write(0x3ff, &[7]));
        assert_eq!(dev.lock().unwrap().last_write, Some((7, vec![7])));
        assert!(!bus.read(0x400, &mut buf));
        assert!(!bus.write(0x3f7, &[1]));
    }

    #[test]
    fn overlaps_and_empty_ranges_are_refused() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Recorder::default())), 0x60, 5)
            .unwrap();
        let other = Arc::new(Mutex::new(Recorder::default()));
        assert_eq!(
            bus.insert(other.clone(), 0x64, 2),
            Err(BusError::Overlap { base: 0x64, len: 2 })
        );
        assert_eq!(
            bus.insert(other.clone(), 0x5f, 2),
            Err(BusError::Overlap { base: 0x5f, len: 2 })
        );
        assert!(bus.insert(other.clone(), 0x65, 1).is_ok());
        assert!(matches!(
            bus.insert(other, 0x70, 0),
            Err(BusError::BadRange { .. })
        ));
    }
}
