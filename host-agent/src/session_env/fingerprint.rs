//! The key of the idempotency fingerprints of CreateSession's environment
//! and secrets: a request's values are kept in the database only as
//! HMAC-SHA256 under a random per-node key, held in its own file
//! (`<state_dir>/fingerprint.key`, mode 0600), so the database alone tells
//! nothing about them, not even by guessing.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The key file in the state directory.
pub const KEY_FILE: &str = "fingerprint.key";
const KEY_BYTES: usize = 32;

/// A per-node fingerprint key. `Debug` does not show it.
#[derive(Clone)]
pub struct Key([u8; KEY_BYTES]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// The key in `<state_dir>/fingerprint.key`, made (from /dev/urandom)
    /// when the file is not there. A key file of another size, or a link,
    /// is an error: replacing the key would make every stored fingerprint
    /// of a request with secrets mismatch its retry.
    pub fn load_or_create(state_dir: &Path) -> Result<Key> {
        let path = state_dir.join(KEY_FILE);
        let what = |verb: &str| format!("{verb} the fingerprint key {}", path.display());
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => {
                let mut data = Vec::new();
                f.take(KEY_BYTES as u64 + 1)
                    .read_to_end(&mut data)
                    .map_err(|e| Error::io(what("reading"), e))?;
                let key: [u8; KEY_BYTES] = data.try_into().map_err(|_| {
                    Error::invalid(format!(
                        "{} is not a {KEY_BYTES}-byte key; move it away to make a new one \
                         (stored idempotency keys of requests with env or secrets then no \
                         longer match their retries)",
                        path.display()
                    ))
                })?;
                Ok(Key(key))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = [0u8; KEY_BYTES];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut r| r.read_exact(&mut key))
                    .map_err(|e| Error::io("reading /dev/urandom", e))?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&path)
                    .map_err(|e| Error::io(what("creating"), e))?;
                f.write_all(&key)
                    .and_then(|()| f.sync_all())
                    .map_err(|e| Error::io(what("writing"), e))?;
                Ok(Key(key))
            }
            Err(e) => Err(Error::io(what("opening"), e)),
        }
    }

    /// HMAC-SHA256 of `msg` under this key, hex.
    pub fn digest(&self, msg: &[u8]) -> String {
        hex::encode(hmac_sha256(&self.0, msg))
    }

    /// A key from fixed bytes (tests).
    #[cfg(test)]
    pub fn fixed(b: u8) -> Key {
        Key([b; KEY_BYTES])
    }
}

/// HMAC-SHA256 (RFC 2104) for a key of at most one block (64 bytes).
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    // Invariant: callers pass at most 64 bytes (a 32-byte key, or the test
    // vectors); a longer key would have to be hashed first.
    block[..key.len()].copy_from_slice(key);
    let inner = Sha256::new()
        .chain_update(block.map(|b| b ^ 0x36))
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(block.map(|b| b ^ 0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test cases 1 and 2.
        assert_eq!(
            hex::encode(hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn the_key_is_made_once_kept_private_and_checked() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let a = Key::load_or_create(t.path()).unwrap();
        let b = Key::load_or_create(t.path()).unwrap();
        assert_eq!(a.digest(b"x"), b.digest(b"x"));
        assert_ne!(a.digest(b"x"), a.digest(b"y"));
        let meta = std::fs::metadata(t.path().join(KEY_FILE)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(!format!("{a:?}").contains(&hex::encode(a.0)));
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            Key::load_or_create(other.path()).unwrap().digest(b"x"),
            a.digest(b"x")
        );
        std::fs::write(t.path().join(KEY_FILE), b"short").unwrap();
        let e = Key::load_or_create(t.path()).unwrap_err().to_string();
        assert!(e.contains("is not a 32-byte key"), "{e}");
    }
}
