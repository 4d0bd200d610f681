//! The ACPI devices' state in a snapshot: where the generation ID lives, the
//! GED's interrupt and its unread events. The tables themselves are in guest
//! memory and need no state; the register ports are fixed.

use serde::{Deserialize, Serialize};

use super::ged::KNOWN_EVENTS;
use super::power::PowerHandler;
use super::{locked, AcpiDeviceError, AcpiDevices};
use crate::memory::GuestMemoryMmap;
use crate::persist::Persist;

/// Highest GSI the IOAPIC has (24 pins).
const LAST_GSI: u32 = 23;

/// The ACPI devices of a snapshotted VM (snapshot format 1.1 and later).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcpiState {
    /// Guest-physical address of the 16-byte VM generation ID.
    pub vmgenid_addr: u64,
    /// The GED's interrupt.
    pub ged_gsi: u32,
    /// GED events raised and not yet read by the guest.
    pub ged_pending: u8,
}

/// What restoring the ACPI devices needs besides their state.
pub struct AcpiRestoreArgs {
    /// Guest memory (the generation ID's address is checked against it).
    pub mem: GuestMemoryMmap,
    /// Where power-off and reset requests go.
    pub on_request: PowerHandler,
    /// GSIs other devices of the VM use (the GED's must differ).
    pub taken_gsis: Vec<u32>,
}

impl Persist for AcpiDevices {
    type State = AcpiState;
    type ConstructorArgs = AcpiRestoreArgs;
    type Error = AcpiDeviceError;

    fn save(&self) -> Result<AcpiState, AcpiDeviceError> {
        Ok(AcpiState {
            vmgenid_addr: self.vmgenid.addr(),
            ged_gsi: self.ged_gsi,
            ged_pending: locked(&self.ged).pending(),
        })
    }

    fn restore(args: AcpiRestoreArgs, state: &AcpiState) -> Result<Self, AcpiDeviceError> {
        let invalid = |why: String| Err(AcpiDeviceError::InvalidState(why));
        if state.ged_gsi > LAST_GSI {
            return invalid(format!(
                "GED interrupt GSI {} is past the IOAPIC's last pin ({LAST_GSI})",
                state.ged_gsi
            ));
        }
        if args.taken_gsis.contains(&state.ged_gsi) {
            return invalid(format!(
                "GED interrupt GSI {} is also used by another device",
                state.ged_gsi
            ));
        }
        if state.ged_pending & !KNOWN_EVENTS != 0 {
            return invalid(format!(
                "GED events {:#04x} include bits this vmm does not define",
                state.ged_pending
            ));
        }
        Self::build(
            state.vmgenid_addr,
            state.ged_gsi,
            state.ged_pending,
            &args.mem,
            args.on_request,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::devices::acpi::ged::EVENT_VMGENID_CHANGED;
    use crate::devices::acpi::GED_GSI;
    use crate::memory::ram_ranges;

    fn args(taken: Vec<u32>) -> AcpiRestoreArgs {
        AcpiRestoreArgs {
            mem: GuestMemoryMmap::from_ranges(&ram_ranges(2 << 20)).unwrap(),
            on_request: Arc::new(|_| {}),
            taken_gsis: taken,
        }
    }

    #[test]
    fn state_round_trips_with_the_pending_events() {
        let a = args(vec![4, 5]);
        let devices = AcpiDevices::new(0xe0040, &a.mem, a.on_request.clone()).unwrap();
        devices.announce_new_generation(&a.mem).unwrap();
        let state = devices.save().unwrap();
        assert_eq!(
            state,
            AcpiState {
                vmgenid_addr: 0xe0040,
                ged_gsi: GED_GSI,
                ged_pending: EVENT_VMGENID_CHANGED
            }
        );
        let restored = AcpiDevices::restore(a, &state).unwrap();
        assert_eq!(restored.save().unwrap(), state);
        assert_eq!(restored.vmgenid().addr(), 0xe0040);
    }

    #[test]
    fn impossible_states_are_refused() {
        let good = AcpiState {
            vmgenid_addr: 0xe0040,
            ged_gsi: GED_GSI,
            ged_pending: 0,
        };
        let bad = [
            AcpiState {
                ged_gsi: 24,
                ..good.clone()
            },
            AcpiState {
                ged_pending: 0x80,
                ..good.clone()
            },
            AcpiState {
                vmgenid_addr: 0xe0041,
                ..good.clone()
            },
            AcpiState {
                vmgenid_addr: 4 << 20,
                ..good.clone()
            },
        ];
        for state in &bad {
            assert!(
                AcpiDevices::restore(args(vec![4]), state).is_err(),
                "{state:?}"
            );
        }
        let clash = AcpiDevices::restore(args(vec![4, GED_GSI]), &good);
        assert!(matches!(clash, Err(AcpiDeviceError::InvalidState(_))));
        assert!(AcpiDevices::restore(args(vec![4]), &good).is_ok());
    }
}
