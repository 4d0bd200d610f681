//! The machine state stored in a snapshot's `state` file, and its encoding
//! (postcard inside the checksummed container of `format`).

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::format::{self, FormatError, MAX_PAYLOAD_LEN};
use super::manifest::STATE_FILE;
use crate::arch::x86_64::mptable::MAX_CPUS;
use crate::devices::acpi::persist::AcpiState;
use crate::devices::legacy::i8042::persist::I8042State;
use crate::devices::legacy::serial::persist::SerialSnapshot;
use crate::devices::virtio::setup::VirtioState;
use crate::vcpu::persist::VcpuState;
use crate::vm::persist::VmState;

/// Everything but guest memory.
#[derive(Debug, Serialize, Deserialize)]
pub struct MachineState {
    /// Guest memory size in MiB when the snapshot was taken.
    pub mem_mib: u64,
    /// VM-wide KVM state.
    pub vm: VmState,
    /// One entry per vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// The serial console.
    pub serial: SerialSnapshot,
    /// Every virtio device and its transport, in slot order.
    pub virtio: VirtioState,
    /// The i8042 (format 1.1; a 1.0 file restores a power-on controller).
    pub i8042: I8042State,
    /// The ACPI devices (format 1.2); `None` for a VM booted with ACPI off
    /// and for 1.0 and 1.1 files.
    pub acpi: Option<AcpiState>,
    /// Whether the VM has an in-kernel i8254 PIT, whose state is `vm.pit`
    /// (format 1.3; older files always had one).
    pub pit: bool,
}

/// A format 1.0 payload: `MachineState` without the fields 1.1 appended.
#[derive(Deserialize)]
struct MachineStateV1_0 {
    mem_mib: u64,
    vm: VmState,
    vcpus: Vec<VcpuState>,
    serial: SerialSnapshot,
    virtio: VirtioState,
}

impl From<MachineStateV1_0> for MachineState {
    fn from(old: MachineStateV1_0) -> Self {
        MachineState {
            mem_mib: old.mem_mib,
            vm: old.vm,
            vcpus: old.vcpus,
            serial: old.serial,
            virtio: old.virtio,
            i8042: I8042State::power_on(),
            acpi: None,
            pit: true,
        }
    }
}

/// A format 1.1 payload: `MachineState` without the fields 1.2 appended.
#[derive(Deserialize)]
struct MachineStateV1_1 {
    mem_mib: u64,
    vm: VmState,
    vcpus: Vec<VcpuState>,
    serial: SerialSnapshot,
    virtio: VirtioState,
    i8042: I8042State,
}

impl From<MachineStateV1_1> for MachineState {
    fn from(old: MachineStateV1_1) -> Self {
        MachineState {
            mem_mib: old.mem_mib,
            vm: old.vm,
            vcpus: old.vcpus,
            serial: old.serial,
            virtio: old.virtio,
            i8042: old.i8042,
            acpi: None,
            pit: true,
        }
    }
}

/// A format 1.2 payload: `MachineState` without the fields 1.3 appended.
#[derive(Deserialize)]
struct MachineStateV1_2 {
    mem_mib: u64,
    vm: VmState,
    vcpus: Vec<VcpuState>,
    serial: SerialSnapshot,
    virtio: VirtioState,
    i8042: I8042State,
    acpi: Option<AcpiState>,
}

impl From<MachineStateV1_2> for MachineState {
    fn from(old: MachineStateV1_2) -> Self {
        MachineState {
            mem_mib: old.mem_mib,
            vm: old.vm,
            vcpus: old.vcpus,
            serial: old.serial,
            virtio: old.virtio,
            i8042: old.i8042,
            acpi: old.acpi,
            pit: true,
        }
    }
}

/// Errors reading or decoding the state file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file cannot be read.
    #[error("cannot read snapshot state {path}: {source}")]
    Unreadable {
        /// The state file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The container is damaged or from an unsupported version.
    #[error("snapshot state {path}: {source}")]
    Format {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
    /// The payload does not decode or holds impossible values.
    #[error("snapshot state {path} is invalid: {reason}")]
    Invalid {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Why state-file bytes were refused.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The container is damaged or from an unsupported version.
    #[error(transparent)]
    Format(FormatError),
    /// The payload does not decode or holds impossible values.
    #[error("invalid payload: {0}")]
    Invalid(String),
}

impl MachineState {
    /// Serialises the state into a complete state file.
    pub fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        Ok(format::encode(&postcard::to_stdvec(self)?))
    }

    /// Checks counts and indices that come from disk.
    pub fn validate(&self) -> Result<(), String> {
        let n = self.vcpus.len();
        if n == 0 || n > usize::from(MAX_CPUS) {
            return Err(format!("{n} vCPUs (1 to {MAX_CPUS} expected)"));
        }
        for (i, v) in self.vcpus.iter().enumerate() {
            if usize::from(v.index) != i {
                return Err(format!("vCPU {i} is stored with index {}", v.index));
            }
        }
        Ok(())
    }

    /// Checks and decodes the bytes of a state file (untrusted input).
    pub fn decode(bytes: &[u8]) -> Result<MachineState, DecodeError> {
        let (minor, payload) = format::decode_versioned(bytes).map_err(DecodeError::Format)?;
        let invalid = |e: postcard::Error| DecodeError::Invalid(e.to_string());
        let state: MachineState = match minor {
            0 => postcard::from_bytes::<MachineStateV1_0>(payload)
                .map_err(invalid)?
                .into(),
            1 => postcard::from_bytes::<MachineStateV1_1>(payload)
                .map_err(invalid)?
                .into(),
            2 => postcard::from_bytes::<MachineStateV1_2>(payload)
                .map_err(invalid)?
                .into(),
            // 1.3, or a newer minor whose appended fields are ignored.
            _ => postcard::from_bytes(payload).map_err(invalid)?,
        };
        state.validate().map_err(DecodeError::Invalid)?;
        Ok(state)
    }

    /// Reads, checks and decodes `dir/state`.
    pub fn load(dir: &Path) -> Result<MachineState, StateError> {
        let path = dir.join(STATE_FILE);
        let unreadable = |source| StateError::Unreadable {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(unreadable)?;
        // Never read more than a valid file can hold.
        let mut bytes = Vec::new();
        file.take(MAX_PAYLOAD_LEN + 64)
            .read_to_end(&mut bytes)
            .map_err(unreadable)?;
        MachineState::decode(&bytes).map_err(|e| match e {
            DecodeError::Format(source) => StateError::Format { path, source },
            DecodeError::Invalid(reason) => StateError::Invalid { path, reason },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::irq::IrqLine;
    use crate::devices::legacy::i8042::persist::{KeyboardState, SourceState};
    use crate::devices::legacy::serial::SerialDevice;
    use crate::persist::Persist;

    fn sample() -> MachineState {
        let serial = SerialDevice::new(IrqLine::new(4).unwrap(), Box::new(std::io::sink()));
        let mut i8042 = I8042State::power_on();
        i8042.ram[0] = 0x47;
        i8042.output = vec![(0xfa, SourceState::Keyboard), (0x5a, SourceState::Aux)];
        i8042.pending_command = Some(0xd1);
        i8042.keyboard = KeyboardState {
            awaiting: Some(0xed),
            ..i8042.keyboard
        };
        MachineState {
            mem_mib: 128,
            vm: VmState {
                pit: Default::default(),
                clock: Default::default(),
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
            },
            vcpus: vec![VcpuState {
                index: 0,
                cpuid: Vec::new(),
                mp_state: Default::default(),
                regs: Default::default(),
                sregs: Default::default(),
                xsave: Default::default(),
                xcrs: Default::default(),
                debugregs: Default::default(),
                lapic: Default::default(),
                msrs: Vec::new(),
                vcpu_events: Default::default(),
                tsc_khz: None,
            }],
            serial: serial.save().unwrap(),
            virtio: VirtioState { slots: Vec::new() },
            i8042,
            acpi: Some(AcpiState {
                vmgenid_addr: 0xe0040,
                ged_gsi: 3,
                ged_pending: 1,
            }),
            pit: false,
        }
    }

    /// `state`'s payload as format 1.`minor` (0 to 2) wrote it: the fields
    /// that version had, in order (postcard puts tuples' fields one after
    /// another, so nesting them changes nothing).
    fn payload_as_minor(state: &MachineState, minor: u16) -> Vec<u8> {
        let v1_0 = (
            state.mem_mib,
            &state.vm,
            &state.vcpus,
            &state.serial,
            &state.virtio,
        );
        match minor {
            0 => postcard::to_stdvec(&v1_0),
            1 => postcard::to_stdvec(&(v1_0, &state.i8042)),
            _ => postcard::to_stdvec(&(v1_0, &state.i8042, &state.acpi)),
        }
        .unwrap()
    }

    #[test]
    fn the_i8042_round_trips() {
        let state = sample();
        let decoded = MachineState::decode(&state.encode().unwrap()).unwrap();
        assert_eq!(decoded.i8042, state.i8042);
        assert_eq!(decoded.mem_mib, 128);
    }

    #[test]
    fn the_acpi_state_round_trips_and_older_readers_ignore_it() {
        let state = sample();
        let bytes = state.encode().unwrap();
        let decoded = MachineState::decode(&bytes).unwrap();
        assert_eq!(decoded.acpi, state.acpi);
        // A 1.1 reader decodes the same payload and ignores the appended field.
        let as_1_1: MachineStateV1_1 =
            postcard::from_bytes(format::decode(&bytes).unwrap()).unwrap();
        assert_eq!(as_1_1.i8042, state.i8042);
        let without = MachineState {
            acpi: None,
            ..sample()
        };
        let decoded = MachineState::decode(&without.encode().unwrap()).unwrap();
        assert_eq!(decoded.acpi, None);
    }

    #[test]
    fn a_format_1_1_file_restores_without_acpi() {
        let state = sample();
        let legacy = payload_as_minor(&state, 1);
        let bytes = format::encode_minor(&legacy, 1);
        let decoded = MachineState::decode(&bytes).unwrap();
        assert_eq!(decoded.acpi, None);
        assert_eq!(decoded.i8042, state.i8042);
        assert_eq!(decoded.serial, state.serial);
        // The same 1.1 payload labelled as this version lacks the ACPI field.
        let mislabelled = format::encode(&legacy);
        assert!(matches!(
            MachineState::decode(&mislabelled),
            Err(DecodeError::Invalid(_))
        ));
    }

    #[test]
    fn a_format_1_2_file_restores_with_a_pit() {
        let state = sample();
        assert!(!state.pit);
        let decoded = MachineState::decode(&state.encode().unwrap()).unwrap();
        assert!(!decoded.pit, "a VM without a PIT is stored so");
        // Every VM had a PIT before 1.3.
        let bytes = format::encode_minor(&payload_as_minor(&state, 2), 2);
        let decoded = MachineState::decode(&bytes).unwrap();
        assert!(decoded.pit);
        assert_eq!(decoded.acpi, state.acpi);
        // A 1.2 reader decodes a 1.3 payload and ignores the appended field.
        let as_1_2: MachineStateV1_2 =
            postcard::from_bytes(format::decode(&state.encode().unwrap()).unwrap()).unwrap();
        assert_eq!(as_1_2.acpi, state.acpi);
    }

    #[test]
    fn a_format_1_0_file_restores_a_power_on_i8042() {
        let state = sample();
        let legacy = payload_as_minor(&state, 0);
        let bytes = format::encode_minor(&legacy, 0);
        let decoded = MachineState::decode(&bytes).unwrap();
        assert_eq!(decoded.i8042, I8042State::power_on());
        assert_eq!(decoded.acpi, None);
        assert_eq!(decoded.mem_mib, 128);
        assert_eq!(decoded.serial, state.serial);
        // The same 1.0 payload labelled as this version lacks the i8042 and is refused.
        let mislabelled = format::encode(&legacy);
        assert!(matches!(
            MachineState::decode(&mislabelled),
            Err(DecodeError::Invalid(_))
        ));
    }
}
