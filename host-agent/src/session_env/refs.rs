//! Reading a secret named by `secret_refs` from the node's `secrets_dir`
//! (systemd-credentials style: one file per secret, named after it).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::{SessionEnvError, MAX_SECRET_BYTES};

/// The secret in file `name` of `dir`: the file's text, one trailing
/// newline dropped (`echo TOKEN > file` writes one). `name` is a checked
/// identifier, so it is one path component. The file is opened without
/// following a link (`O_NOFOLLOW`) or waiting on a FIFO (`O_NONBLOCK`), and
/// must be a regular file of at most [`MAX_SECRET_BYTES`], UTF-8 without NUL
/// and not empty.
pub(super) fn read(dir: &Path, name: &str) -> Result<String, SessionEnvError> {
    let unusable = |why: String| SessionEnvError::RefUnusable {
        name: name.to_string(),
        why,
    };
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(SessionEnvError::RefMissing {
                name: name.to_string(),
            })
        }
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(unusable(
                "is a symbolic link; secret files are read without following links".into(),
            ))
        }
        Err(source) => {
            return Err(SessionEnvError::RefIo {
                name: name.to_string(),
                source,
            })
        }
    };
    let io = |source| SessionEnvError::RefIo {
        name: name.to_string(),
        source,
    };
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(unusable("is not a regular file".into()));
    }
    // Room for the value, a "\r\n", and one byte more to tell a larger file.
    let most = MAX_SECRET_BYTES + 2;
    let mut data = Vec::new();
    file.take(most as u64 + 1)
        .read_to_end(&mut data)
        .map_err(io)?;
    let too_large = || {
        unusable(format!(
            "is larger than {MAX_SECRET_BYTES} bytes, the most a secret may hold"
        ))
    };
    if data.len() > most {
        return Err(too_large());
    }
    if data.ends_with(b"\n") {
        data.pop();
        if data.ends_with(b"\r") {
            data.pop();
        }
    }
    if data.len() > MAX_SECRET_BYTES {
        return Err(too_large());
    }
    let text = String::from_utf8(data).map_err(|_| unusable("is not UTF-8 text".into()))?;
    if text.contains('\0') {
        return Err(unusable("holds a NUL byte".into()));
    }
    if text.is_empty() {
        return Err(unusable("is empty".into()));
    }
    Ok(text)
}
