//! Just enough ELF64 reading to check built artefacts: is a program static
//! (no `PT_INTERP`), does a kernel carry the PVH entry note.

use std::path::Path;

use crate::error::{Error, IoContext, Result};

const PT_INTERP: u32 = 3;
const PT_NOTE: u32 = 4;
/// `XEN_ELFNOTE_PHYS32_ENTRY`: the PVH entry point.
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// A program header: type, file offset, file size.
struct Phdr {
    kind: u32,
    offset: u64,
    size: u64,
}

fn bad(path: &Path, message: &str) -> Error {
    Error::BadArtifact {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Program headers of a little-endian ELF64 file held in `b`.
fn program_headers(path: &Path, b: &[u8]) -> Result<Vec<Phdr>> {
    if b.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err(bad(path, "not an ELF file"));
    }
    if b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err(bad(path, "not a little-endian 64-bit ELF file"));
    }
    let truncated = || bad(path, "truncated ELF header");
    let phoff = u64_at(b, 0x20).ok_or_else(truncated)?;
    let phentsize = u16_at(b, 0x36).ok_or_else(truncated)? as u64;
    let phnum = u16_at(b, 0x38).ok_or_else(truncated)? as u64;
    let mut out = Vec::new();
    for i in 0..phnum {
        let base = phoff
            .checked_add(i.saturating_mul(phentsize))
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| bad(path, "program header table out of range"))?;
        let ph = (|| {
            Some(Phdr {
                kind: u32_at(b, base)?,
                offset: u64_at(b, base + 8)?,
                size: u64_at(b, base + 32)?,
            })
        })()
        .ok_or_else(|| bad(path, "program header table out of range"))?;
        out.push(ph);
    }
    Ok(out)
}

/// True when the ELF program at `path` has no interpreter (static or
/// static-pie).
pub fn is_static(path: &Path) -> Result<bool> {
    let b = std::fs::read(path).at(path, "inspect a program")?;
    Ok(!program_headers(path, &b)?
        .iter()
        .any(|p| p.kind == PT_INTERP))
}

/// True when the kernel at `path` has the Xen `PHYS32_ENTRY` note (PVH).
pub fn has_pvh_note(path: &Path) -> Result<bool> {
    let b = std::fs::read(path).at(path, "inspect the kernel")?;
    for ph in program_headers(path, &b)?
        .iter()
        .filter(|p| p.kind == PT_NOTE)
    {
        let (Ok(start), Ok(len)) = (usize::try_from(ph.offset), usize::try_from(ph.size)) else {
            continue;
        };
        let Some(notes) = b.get(start..start.saturating_add(len)) else {
            continue;
        };
        let mut off = 0usize;
        while let (Some(namesz), Some(descsz), Some(kind)) = (
            u32_at(notes, off),
            u32_at(notes, off + 4),
            u32_at(notes, off + 8),
        ) {
            let name_start = off + 12;
            let name = notes.get(name_start..name_start + namesz as usize);
            if kind == XEN_ELFNOTE_PHYS32_ENTRY && name == Some(b"Xen\0".as_slice()) {
                return Ok(true);
            }
            let align = |n: u32| (n as usize).div_ceil(4) * 4;
            off = name_start + align(namesz) + align(descsz);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sh_is_dynamic_and_garbage_is_refused() {
        let sh = std::fs::canonicalize("/bin/sh").unwrap();
        assert!(!is_static(&sh).unwrap());
        assert!(!has_pvh_note(&sh).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, b"#!/bin/sh\n").unwrap();
        assert!(is_static(&p)
            .unwrap_err()
            .to_string()
            .contains("not an ELF"));
        std::fs::write(&p, b"\x7fELF\x02\x01").unwrap();
        assert!(is_static(&p).unwrap_err().to_string().contains("truncated"));
    }
}
