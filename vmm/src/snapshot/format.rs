//! The `state` file: a versioned, checksummed container for the serialised
//! VM state.
//!
//! Layout (little endian):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `AGVMSNAP` |
//! | 8 | 2 | format major version |
//! | 10 | 2 | format minor version |
//! | 12 | 4 | reserved, zero |
//! | 16 | 8 | payload length N (at most `MAX_PAYLOAD_LEN`) |
//! | 24 | N | payload (postcard-encoded `MachineState`) |
//! | 24 + N | 8 | CRC-64/XZ of bytes 0 .. 24 + N |
//!
//! A newer major version is refused; a newer minor version of the same major
//! only appends fields, which older readers ignore and newer readers fill in
//! for older files (see `state`).
//!
//! Minor versions: 1.0 the first; 1.1 appends the i8042's state; 1.2 appends
//! the ACPI devices' state (`None` for a VM without ACPI); 1.3 appends
//! whether the VM has an in-kernel PIT (older VMs all had one).

use crc::{Crc, CRC_64_XZ};

/// File magic.
pub const MAGIC: &[u8; 8] = b"AGVMSNAP";
/// Major version written by this build.
pub const FORMAT_MAJOR: u16 = 1;
/// Minor version written by this build.
pub const FORMAT_MINOR: u16 = 3;
/// Largest payload accepted (the state of 32 vCPUs and all devices is far below this).
pub const MAX_PAYLOAD_LEN: u64 = 16 << 20;
const HEADER_LEN: usize = 24;
const CRC_LEN: usize = 8;
const CRC64: Crc<u64> = Crc::<u64>::new(&CRC_64_XZ);

/// Errors decoding a state file.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// Shorter than a header and checksum.
    #[error("snapshot state is truncated: {len} bytes, at least {min} expected")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes expected at least.
        min: usize,
    },
    /// Not a snapshot state file.
    #[error("not a snapshot state file (bad magic)")]
    BadMagic,
    /// Written by a newer major version.
    #[error("snapshot format version {found_major}.{found_minor} is newer than this vmm supports ({FORMAT_MAJOR}.{FORMAT_MINOR}); restore it with a newer vmm")]
    NewerVersion {
        /// Major version in the file.
        found_major: u16,
        /// Minor version in the file.
        found_minor: u16,
    },
    /// Written by an older, incompatible major version.
    #[error("snapshot format version {found_major}.x is older than this vmm supports ({FORMAT_MAJOR}.{FORMAT_MINOR})")]
    OlderVersion {
        /// Major version in the file.
        found_major: u16,
    },
    /// The payload length field is out of bounds.
    #[error("snapshot state payload length {len} exceeds the limit of {MAX_PAYLOAD_LEN} bytes")]
    TooLarge {
        /// The declared length.
        len: u64,
    },
    /// The declared length does not match the file.
    #[error(
        "snapshot state length mismatch: header says {declared} payload bytes, file holds {actual}"
    )]
    LengthMismatch {
        /// The declared payload length.
        declared: u64,
        /// The payload bytes present.
        actual: usize,
    },
    /// The checksum does not match: the file is corrupt.
    #[error("snapshot state checksum mismatch (stored {stored:#018x}, computed {computed:#018x}): the file is corrupt")]
    Checksum {
        /// CRC in the file.
        stored: u64,
        /// CRC of the bytes.
        computed: u64,
    },
}

/// Wraps `payload` in the state-file container.
pub fn encode(payload: &[u8]) -> Vec<u8> {
    encode_minor(payload, FORMAT_MINOR)
}

/// Wraps `payload` in a container of minor version `minor` (tests write older files).
pub fn encode_minor(payload: &[u8], minor: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + CRC_LEN);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_MAJOR.to_le_bytes());
    out.extend_from_slice(&minor.to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = CRC64.checksum(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Checks the container and returns the payload.
pub fn decode(bytes: &[u8]) -> Result<&[u8], FormatError> {
    decode_versioned(bytes).map(|(_, payload)| payload)
}

/// Checks the container and returns its minor version and the payload.
pub fn decode_versioned(bytes: &[u8]) -> Result<(u16, &[u8]), FormatError> {
    let min = HEADER_LEN + CRC_LEN;
    if bytes.len() < min {
        return Err(FormatError::Truncated {
            len: bytes.len(),
            min,
        });
    }
    if &bytes[..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let (major, minor) = (u16_at(bytes, 8), u16_at(bytes, 10));
    if major > FORMAT_MAJOR {
        return Err(FormatError::NewerVersion {
            found_major: major,
            found_minor: minor,
        });
    }
    if major < FORMAT_MAJOR {
        return Err(FormatError::OlderVersion { found_major: major });
    }
    let declared = u64_at(bytes, 16);
    if declared > MAX_PAYLOAD_LEN {
        return Err(FormatError::TooLarge { len: declared });
    }
    let actual = bytes.len() - min;
    if declared != actual as u64 {
        return Err(FormatError::LengthMismatch { declared, actual });
    }
    let body_end = HEADER_LEN + actual;
    let stored = u64_at(bytes, body_end);
    let computed = CRC64.checksum(&bytes[..body_end]);
    if stored != computed {
        return Err(FormatError::Checksum { stored, computed });
    }
    Ok((minor, &bytes[HEADER_LEN..body_end]))
}

/// CRC-64/XZ of `bytes` (also used for guest-memory checksums).
pub fn crc64(bytes: &[u8]) -> u64 {
    CRC64.checksum(bytes)
}

/// An incremental CRC-64/XZ.
pub fn crc64_digest() -> crc::Digest<'static, u64> {
    CRC64.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let enc = encode(b"hello state");
        assert_eq!(decode(&enc).unwrap(), b"hello state");
        assert_eq!(decode(&encode(b"")).unwrap(), b"");
    }

    #[test]
    fn every_kind_of_damage_is_detected() {
        let enc = encode(b"payload bytes");
        assert!(matches!(
            decode(&enc[..10]),
            Err(FormatError::Truncated { .. })
        ));
        assert!(matches!(
            decode(&enc[..enc.len() - 1]),
            Err(FormatError::LengthMismatch { .. })
        ));
        let mut flipped = enc.clone();
        flipped[30] ^= 0x04;
        assert!(matches!(
            decode(&flipped),
            Err(FormatError::Checksum { .. })
        ));
        let mut magic = enc.clone();
        magic[0] = b'X';
        assert_eq!(decode(&magic), Err(FormatError::BadMagic));
        let mut newer = enc.clone();
        newer[8..10].copy_from_slice(&(FORMAT_MAJOR + 1).to_le_bytes());
        let err = decode(&newer).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "snapshot format version {}.{} is newer than this vmm supports ({}.{}); restore it with a newer vmm",
                FORMAT_MAJOR + 1,
                FORMAT_MINOR,
                FORMAT_MAJOR,
                FORMAT_MINOR
            )
        );
        let mut huge = enc;
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&huge), Err(FormatError::TooLarge { .. })));
    }
}
