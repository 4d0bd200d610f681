//! The `memory` file: guest memory laid out region after region. A full
//! snapshot writes every non-zero page (zero pages stay holes, so the file is
//! sparse); a diff writes only the dirty pages. Both record the extents they
//! wrote in the manifest.

use std::fs::File;
use std::os::unix::fs::FileExt;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::manifest::{Extent, RegionLayout};
use crate::memory::{GuestMemoryMmap, PAGE_SIZE};

/// Bytes copied out of guest memory per write.
const CHUNK: usize = 2 << 20;

/// The memory layout of `mem` as the manifest records it.
pub fn layout(mem: &GuestMemoryMmap) -> Vec<RegionLayout> {
    let mut offset = 0;
    mem.iter()
        .map(|r| {
            let l = RegionLayout {
                gpa: r.start_addr().0,
                size: r.len(),
                file_offset: offset,
            };
            offset += r.len();
            l
        })
        .collect()
}

/// Appends `[offset, offset + len)` to `extents`, merging with the last one when adjacent.
fn push_extent(extents: &mut Vec<Extent>, offset: u64, len: u64) {
    match extents.last_mut() {
        Some(last) if last.offset + last.len == offset => last.len += len,
        _ => extents.push(Extent { offset, len }),
    }
}

fn write_run(file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    file.write_all_at(buf, offset)
}

/// Writes every non-zero page of `mem` into `file` (sized to the whole layout).
pub fn write_full(mem: &GuestMemoryMmap, file: &File) -> std::io::Result<Vec<Extent>> {
    let regions = layout(mem);
    let total: u64 = regions.iter().map(|r| r.size).sum();
    file.set_len(total)?;
    let mut extents = Vec::new();
    let mut buf = vec![0u8; CHUNK];
    for r in &regions {
        let mut done = 0u64;
        while done < r.size {
            let n = (r.size - done).min(CHUNK as u64) as usize;
            let chunk = &mut buf[..n];
            mem.read_slice(chunk, GuestAddress(r.gpa + done))
                .map_err(|e| std::io::Error::other(format!("reading guest memory: {e}")))?;
            let base = r.file_offset + done;
            let mut run_start: Option<usize> = None;
            for (i, page) in chunk.chunks(PAGE_SIZE as usize).enumerate() {
                let zero = page.iter().all(|b| *b == 0);
                let at = i * PAGE_SIZE as usize;
                match (zero, run_start) {
                    (false, None) => run_start = Some(at),
                    (true, Some(s)) => {
                        write_run(file, &chunk[s..at], base + s as u64)?;
                        push_extent(&mut extents, base + s as u64, (at - s) as u64);
                        run_start = None;
                    }
                    _ => {}
                }
            }
            if let Some(s) = run_start {
                write_run(file, &chunk[s..], base + s as u64)?;
                push_extent(&mut extents, base + s as u64, (n - s) as u64);
            }
            done += n as u64;
        }
    }
    Ok(extents)
}

/// Writes the pages set in `dirty` (one bitmap per region, bit i = page i) into `file`.
pub fn write_diff(
    mem: &GuestMemoryMmap,
    file: &File,
    dirty: &[Vec<u64>],
) -> std::io::Result<Vec<Extent>> {
    let regions = layout(mem);
    let total: u64 = regions.iter().map(|r| r.size).sum();
    file.set_len(total)?;
    let mut extents = Vec::new();
    for (r, bits) in regions.iter().zip(dirty) {
        let pages = r.size / PAGE_SIZE;
        for page in 0..pages {
            let set = bits
                .get((page / 64) as usize)
                .is_some_and(|w| w & (1 << (page % 64)) != 0);
            if set {
                push_extent(&mut extents, r.file_offset + page * PAGE_SIZE, PAGE_SIZE);
            }
        }
    }
    let mut buf = vec![0u8; CHUNK];
    for e in &extents {
        let mut done = 0;
        while done < e.len {
            let n = (e.len - done).min(CHUNK as u64) as usize;
            let gpa = file_offset_to_gpa(&regions, e.offset + done).ok_or_else(|| {
                std::io::Error::other("dirty page outside guest memory (invariant broken)")
            })?;
            mem.read_slice(&mut buf[..n], GuestAddress(gpa))
                .map_err(|e| std::io::Error::other(format!("reading guest memory: {e}")))?;
            file.write_all_at(&buf[..n], e.offset + done)?;
            done += n as u64;
        }
    }
    Ok(extents)
}

/// The guest address of memory-file offset `offset`.
pub fn file_offset_to_gpa(regions: &[RegionLayout], offset: u64) -> Option<u64> {
    regions
        .iter()
        .find(|r| offset >= r.file_offset && offset < r.file_offset + r.size)
        .map(|r| r.gpa + (offset - r.file_offset))
}

/// Splits an extent at region boundaries, so each piece lies in one region.
pub fn split_by_region(regions: &[RegionLayout], e: Extent) -> Vec<Extent> {
    let mut out = Vec::new();
    for r in regions {
        let start = e.offset.max(r.file_offset);
        let end = (e.offset + e.len).min(r.file_offset + r.size);
        if start < end {
            out.push(Extent {
                offset: start,
                len: end - start,
            });
        }
    }
    out
}

/// CRC-64 of all guest memory, region by region.
pub fn checksum(mem: &GuestMemoryMmap) -> Result<u64, vm_memory::GuestMemoryError> {
    let mut digest = super::format::crc64_digest();
    let mut buf = vec![0u8; CHUNK];
    for r in mem.iter() {
        let mut done = 0;
        while done < r.len() {
            let n = (r.len() - done).min(CHUNK as u64) as usize;
            mem.read_slice(&mut buf[..n], GuestAddress(r.start_addr().0 + done))?;
            digest.update(&buf[..n]);
            done += n as u64;
        }
    }
    Ok(digest.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 * PAGE_SIZE as usize)]).unwrap()
    }

    #[test]
    fn full_writes_only_non_zero_pages() {
        let m = mem();
        m.write_obj(0xabu8, GuestAddress(3 * PAGE_SIZE + 5))
            .unwrap();
        m.write_obj(0xcdu8, GuestAddress(4 * PAGE_SIZE)).unwrap();
        m.write_obj(0xefu8, GuestAddress(63 * PAGE_SIZE + 4095))
            .unwrap();
        let f = tempfile::tempfile().unwrap();
        let extents = write_full(&m, &f).unwrap();
        assert_eq!(
            extents,
            vec![
                Extent {
                    offset: 3 * PAGE_SIZE,
                    len: 2 * PAGE_SIZE
                },
                Extent {
                    offset: 63 * PAGE_SIZE,
                    len: PAGE_SIZE
                }
            ]
        );
        let mut content = Vec::new();
        (&f).read_to_end(&mut content).unwrap();
        assert_eq!(content.len(), 64 * PAGE_SIZE as usize);
        assert_eq!(content[3 * 4096 + 5], 0xab);
        assert_eq!(content[63 * 4096 + 4095], 0xef);
    }

    #[test]
    fn diff_writes_exactly_the_dirty_pages() {
        let m = mem();
        m.write_obj(0x11u8, GuestAddress(7 * PAGE_SIZE)).unwrap();
        let f = tempfile::tempfile().unwrap();
        let dirty = vec![vec![(1u64 << 7) | (1 << 8) | (1 << 20)]];
        let extents = write_diff(&m, &f, &dirty).unwrap();
        assert_eq!(
            extents,
            vec![
                Extent {
                    offset: 7 * PAGE_SIZE,
                    len: 2 * PAGE_SIZE
                },
                Extent {
                    offset: 20 * PAGE_SIZE,
                    len: PAGE_SIZE
                }
            ]
        );
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 7 * PAGE_SIZE).unwrap();
        assert_eq!(b[0], 0x11);
    }

    #[test]
    fn extents_split_at_region_boundaries() {
        let regions = vec![
            RegionLayout {
                gpa: 0,
                size: 4 * PAGE_SIZE,
                file_offset: 0,
            },
            RegionLayout {
                gpa: 1 << 32,
                size: 4 * PAGE_SIZE,
                file_offset: 4 * PAGE_SIZE,
            },
        ];
        let parts = split_by_region(
            &regions,
            Extent {
                offset: 3 * PAGE_SIZE,
                len: 2 * PAGE_SIZE,
            },
        );
        assert_eq!(parts.len(), 2);
        assert_eq!(file_offset_to_gpa(&regions, parts[1].offset), Some(1 << 32));
        assert_eq!(file_offset_to_gpa(&regions, 8 * PAGE_SIZE), None);
    }
}
