//! Random bytes from the host kernel, through glibc's `getrandom(3)`.
//!
//! Not the `getrandom` crate: it finds glibc's function with `dlsym`, which
//! a statically linked vmm (scripts/build-release) cannot do, and then falls
//! back to opening /dev/urandom, which a jailed vmm's root does not have.
//! The direct call works linked either way and in the jail (the seccomp
//! lists allow `getrandom`).

use std::io;

/// Fills `buf` from the kernel's random pool (blocking only before the pool
/// is first initialised, as getrandom(2) with no flags does).
pub fn fill(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length describe `rest`, which is valid for
        // writes of that many bytes; the kernel writes at most that many.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match usize::try_from(n) {
            Ok(0) => return Err(io::Error::other("getrandom returned no bytes")),
            Ok(n) => done += n.min(rest.len()),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_every_byte_of_large_and_empty_buffers() {
        fill(&mut []).unwrap();
        // Larger than one getrandom(2) call returns for the urandom pool
        // (32 MiB - 1 at most): several calls must be stitched together.
        let mut big = vec![0u8; 33 << 20];
        fill(&mut big).unwrap();
        // A 64 KiB window of zeros in random data would be a bug, not luck.
        for (i, chunk) in big.chunks(64 << 10).enumerate() {
            assert!(chunk.iter().any(|&b| b != 0), "chunk {i} stayed zero");
        }
        let (mut a, mut b) = ([0u8; 16], [0u8; 16]);
        fill(&mut a).unwrap();
        fill(&mut b).unwrap();
        assert_ne!(a, b);
    }
}
