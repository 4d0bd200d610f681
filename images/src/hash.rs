//! SHA-256 of files and of recipe inputs.

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{IoContext, Result};

/// Hex SHA-256 of a file's content, read in 1 MiB pieces.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).at(path, "hash an input")?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).at(path, "hash an input")?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Hex SHA-256 of bytes.
pub fn bytes_sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_bytes_hashes_agree() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"abc").unwrap();
        let want = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(file_sha256(&p).unwrap(), want);
        assert_eq!(bytes_sha256(b"abc"), want);
    }
}
