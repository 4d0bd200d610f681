//! What makes each restore of a snapshot its own machine: every session
//! starts in a restore of a golden snapshot (or a warm VM restored from it),
//! so every one wakes with the same kernel random state, hostname and
//! machine id. guest-init, as PID 1, gives it its own before Ready:
//!
//! * random state: the host's fresh bytes (StartSession / ResumeSession
//!   `entropy`) are mixed into the kernel's pool and its CRNG reseeded at
//!   once (`RNDADDENTROPY`, then `RNDRESEEDCRNG`), so two clones read
//!   different `/dev/urandom` bytes from their first command on;
//! * identity: the hostname and `/etc/machine-id` derive from the session
//!   id.

use std::os::fd::AsRawFd;
use std::path::Path;

/// Most entropy bytes taken from one message.
pub const MAX_SEED: usize = 512;

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// `struct rand_pool_info` carrying `seed`, all of it credited as entropy
/// (it comes from the host's own CRNG over the session channel).
pub fn rand_pool_info(seed: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(8 + seed.len());
    // Both fit in an i32: `seed` is at most MAX_SEED bytes where used.
    buf.extend_from_slice(&((seed.len() * 8) as i32).to_ne_bytes());
    buf.extend_from_slice(&(seed.len() as i32).to_ne_bytes());
    buf.extend_from_slice(seed);
    buf
}

/// Mixes `seed` into the kernel's random pool through `device` (normally
/// `/dev/random`) and reseeds the CRNG from it. Needs CAP_SYS_ADMIN.
pub fn reseed(device: &Path, seed: &[u8]) -> std::io::Result<()> {
    if seed.is_empty() || seed.len() > MAX_SEED {
        return Err(std::io::Error::other(format!(
            "entropy of {} bytes: 1..={MAX_SEED} expected",
            seed.len()
        )));
    }
    let dev = std::fs::File::open(device)?;
    let info = rand_pool_info(seed);
    // SAFETY: `info` is a rand_pool_info whose buf_size matches the bytes
    // that follow its header; the kernel only reads it during the call.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The hostname of session `id`: the id itself when it is a valid host
/// name label (a UUID is), else `None` (the machine keeps its own).
pub fn hostname_for(id: &str) -> Option<String> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    ok.then(|| id.to_string())
}

/// `/etc/machine-id`'s line for session `id`: its 32 hexadecimal digits
/// when it is a UUID, else `None`.
pub fn machine_id_for(id: &str) -> Option<String> {
    let hex: String = id.chars().filter(|c| *c != '-').collect();
    (hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| format!("{}\n", hex.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_info_credits_every_bit_and_carries_the_bytes() {
        let info = rand_pool_info(&[1, 2, 3, 4]);
        assert_eq!(i32::from_ne_bytes(info[0..4].try_into().unwrap()), 32);
        assert_eq!(i32::from_ne_bytes(info[4..8].try_into().unwrap()), 4);
        assert_eq!(&info[8..], &[1, 2, 3, 4]);
    }

    #[test]
    fn a_seed_out_of_range_or_a_device_that_is_not_one_fails() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("not-a-device");
        std::fs::write(&f, "").unwrap();
        assert!(reseed(&f, &[]).is_err());
        assert!(reseed(&f, &[0; MAX_SEED + 1]).is_err());
        // A plain file has no such ioctl.
        let e = reseed(&f, &[7; 64]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTTY), "{e}");
    }

    #[test]
    fn a_sessions_identity_comes_from_its_id() {
        let id = "3f2b8c1e-9a4d-4e6f-8b7a-0c1d2e3f4a5b";
        assert_eq!(hostname_for(id).as_deref(), Some(id));
        assert_eq!(
            machine_id_for(id).as_deref(),
            Some("3f2b8c1e9a4d4e6f8b7a0c1d2e3f4a5b\n")
        );
        for bad in ["", "Has_Upper", "-lead", "trail-", &"a".repeat(64)] {
            assert_eq!(hostname_for(bad), None, "{bad:?}");
        }
        assert_eq!(machine_id_for("s1"), None);
        assert_eq!(machine_id_for("zzzzzzzz-9a4d-4e6f-8b7a-0c1d2e3f4a5b"), None);
    }
}
