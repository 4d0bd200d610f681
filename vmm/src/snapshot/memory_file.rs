//! The `memory` file: guest memory laid out region after region. A full
//! snapshot writes every non-zero page (zero pages stay holes, so the file is
//! sparse); a diff writes only the dirty pages. Both record the extents they
//! wrote in the manifest.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::manifest::{Extent, RegionLayout};
use super::page_sink::PageSink;
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

/// One page bitmap per region of `regions` (bit i of word i / 64 is page i),
/// with the pages of `extents` (memory-file offsets) set; parts of an extent
/// outside every region are ignored.
pub fn bitmaps_of<'a>(
    regions: &[RegionLayout],
    extents: impl IntoIterator<Item = &'a Extent>,
) -> Vec<Vec<u64>> {
    let mut maps: Vec<Vec<u64>> = regions
        .iter()
        .map(|r| vec![0u64; (r.size / PAGE_SIZE).div_ceil(64) as usize])
        .collect();
    for e in extents {
        for (r, map) in regions.iter().zip(maps.iter_mut()) {
            let start = e.offset.max(r.file_offset);
            let end = e.offset.saturating_add(e.len).min(r.file_offset + r.size);
            if start >= end {
                continue;
            }
            let first = (start - r.file_offset) / PAGE_SIZE;
            let last = (end - r.file_offset).div_ceil(PAGE_SIZE);
            for page in first..last {
                if let Some(word) = map.get_mut((page / 64) as usize) {
                    *word |= 1 << (page % 64);
                }
            }
        }
    }
    maps
}

/// Writes the non-zero pages of `[gpa, gpa + len)` (inside one region, at
/// memory-file offset `base`) with one `pwrite` per run of non-zero pages.
fn write_non_zero(
    mem: &GuestMemoryMmap,
    file: &File,
    buf: &mut [u8],
    span: (u64, u64, u64),
    extents: &mut Vec<Extent>,
) -> std::io::Result<()> {
    let (gpa, base, len) = span;
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        let chunk = &mut buf[..n];
        mem.read_slice(chunk, GuestAddress(gpa + done))
            .map_err(|e| std::io::Error::other(format!("reading guest memory: {e}")))?;
        let at_base = base + done;
        let mut run_start: Option<usize> = None;
        for (i, page) in chunk.chunks(PAGE_SIZE as usize).enumerate() {
            let zero = page.iter().all(|b| *b == 0);
            let at = i * PAGE_SIZE as usize;
            match (zero, run_start) {
                (false, None) => run_start = Some(at),
                (true, Some(s)) => {
                    write_run(file, &chunk[s..at], at_base + s as u64)?;
                    push_extent(extents, at_base + s as u64, (at - s) as u64);
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = run_start {
            write_run(file, &chunk[s..], at_base + s as u64)?;
            push_extent(extents, at_base + s as u64, (n - s) as u64);
        }
        done += n as u64;
    }
    Ok(())
}

/// Writes every non-zero page of `mem` into `file` (sized to the whole layout).
///
/// With `candidates` (one bitmap per region, as [`bitmaps_of`] makes), only
/// the pages set there are read: every other page is known to be zero (never
/// written since a fresh boot, or a hole of the restored snapshot and not
/// written since), so an idle 2 GiB guest is not read, and faulted in, page
/// by page. Bitmaps that do not match the layout are ignored (every page is
/// read), never trusted to skip a page.
pub fn write_full(
    mem: &GuestMemoryMmap,
    file: &File,
    candidates: Option<&[Vec<u64>]>,
) -> std::io::Result<Vec<Extent>> {
    let regions = layout(mem);
    let total: u64 = regions.iter().map(|r| r.size).sum();
    file.set_len(total)?;
    let candidates = candidates.filter(|c| {
        c.len() == regions.len()
            && c.iter()
                .zip(&regions)
                .all(|(map, r)| map.len() as u64 >= (r.size / PAGE_SIZE).div_ceil(64))
    });
    let mut extents = Vec::new();
    let mut buf = vec![0u8; CHUNK];
    for (i, r) in regions.iter().enumerate() {
        match candidates.and_then(|c| c.get(i)) {
            None => write_non_zero(
                mem,
                file,
                &mut buf,
                (r.gpa, r.file_offset, r.size),
                &mut extents,
            )?,
            Some(map) => {
                for (first, count) in dirty_runs(map, r.size / PAGE_SIZE) {
                    let at = first * PAGE_SIZE;
                    let span = (r.gpa + at, r.file_offset + at, count * PAGE_SIZE);
                    write_non_zero(mem, file, &mut buf, span, &mut extents)?;
                }
            }
        }
    }
    Ok(extents)
}

/// Runs of set bits in one region's dirty bitmap (bit i of word i / 64 is
/// page i), as `(first page, page count)`, ignoring bits at or past `pages`.
/// Scans a word at a time, so clean stretches cost one compare per 64 pages.
pub fn dirty_runs(bits: &[u64], pages: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut extend = |first: u64, count: u64| match runs.last_mut() {
        Some((f, c)) if *f + *c == first => *c += count,
        _ => runs.push((first, count)),
    };
    for (i, &word) in bits.iter().enumerate() {
        let base = i as u64 * 64;
        if base >= pages {
            break;
        }
        let valid = pages - base;
        let mut w = if valid < 64 {
            word & ((1u64 << valid) - 1)
        } else {
            word
        };
        while w != 0 {
            let start = w.trailing_zeros() as u64;
            let len = (w >> start).trailing_ones() as u64;
            extend(base + start, len);
            // `start + len` is at most 64; a run to the top bit empties the word.
            w = if start + len >= 64 {
                0
            } else {
                w & !(((1u64 << len) - 1) << start)
            };
        }
    }
    runs
}

/// One run of dirty pages: where it lies in guest memory and in the file.
struct DirtyRun {
    /// Index of its region in the memory's region list.
    region: usize,
    /// Byte offset in that region.
    at: u64,
    /// Length in bytes (whole pages).
    len: u64,
    /// Offset in the memory file.
    file_offset: u64,
}

/// The runs of dirty pages a diff writes, found once from its dirty bitmaps:
/// [`write_diff`] writes them, [`DiffRuns::extents`] lists them for the
/// manifest, which can so be written before the pages are.
pub struct DiffRuns(Vec<DirtyRun>);

impl DiffRuns {
    /// The runs of pages set in `dirty` (one bitmap per region of `mem`,
    /// bit i = page i), in file order. Regions past the last bitmap have no
    /// dirty pages; bits past a region's end are ignored.
    pub fn new(mem: &GuestMemoryMmap, dirty: &[Vec<u64>]) -> Self {
        let mut runs = Vec::new();
        for (region, (r, bits)) in layout(mem).iter().zip(dirty).enumerate() {
            for (first, count) in dirty_runs(bits, r.size / PAGE_SIZE) {
                let at = first * PAGE_SIZE;
                runs.push(DirtyRun {
                    region,
                    at,
                    len: count * PAGE_SIZE,
                    file_offset: r.file_offset + at,
                });
            }
        }
        DiffRuns(runs)
    }

    /// The memory-file extents the runs cover (adjacent ones merged).
    pub fn extents(&self) -> Vec<Extent> {
        let mut extents = Vec::new();
        for run in &self.0 {
            push_extent(&mut extents, run.file_offset, run.len);
        }
        extents
    }
}

/// Writes the dirty pages of `runs` (made from `mem`) into `file`, which was
/// opened from `path`.
///
/// Each run of dirty pages is one write straight from guest memory (no
/// bounce buffer); with `path`, long runs go through a second, `O_DIRECT`
/// handle and bypass the page cache (see the `page_sink` module). A run
/// outside `mem` (runs made from other memory) is refused, never read.
pub fn write_diff(
    mem: &GuestMemoryMmap,
    file: &File,
    path: Option<&Path>,
    runs: &DiffRuns,
) -> std::io::Result<()> {
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    file.set_len(total)?;
    let hosts: Vec<(*mut u8, u64)> = mem.iter().map(|r| (r.as_ptr(), r.len())).collect();
    let mut sink = PageSink::open(file, path);
    for run in &runs.0 {
        let host = match hosts.get(run.region) {
            Some(&(host, size)) if run.at.checked_add(run.len).is_some_and(|end| end <= size) => {
                host
            }
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a dirty run lies outside guest memory",
                ))
            }
        };
        // SAFETY: `host` maps region `run.region` of `mem`, which `mem` keeps
        // mapped; the run was checked above to lie inside that region.
        unsafe { sink.write(host.add(run.at as usize), run.len as usize, run.file_offset)? };
    }
    Ok(())
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
        let extents = write_full(&m, &f, None).unwrap();
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
        let runs = DiffRuns::new(&m, &dirty);
        write_diff(&m, &f, None, &runs).unwrap();
        let extents = runs.extents();
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
    fn a_full_with_candidates_reads_only_those_pages() {
        let m = mem();
        for page in [2u64, 5, 40] {
            m.write_obj(0x77u8, GuestAddress(page * PAGE_SIZE + 1))
                .unwrap();
        }
        let regions = layout(&m);
        // Pages 4-6 and 40 may be non-zero; page 2 is (wrongly) claimed zero,
        // which shows that nothing outside the candidates is read.
        let candidates = bitmaps_of(
            &regions,
            &[
                Extent {
                    offset: 4 * PAGE_SIZE,
                    len: 3 * PAGE_SIZE,
                },
                Extent {
                    offset: 40 * PAGE_SIZE,
                    len: PAGE_SIZE,
                },
            ],
        );
        let f = tempfile::tempfile().unwrap();
        let extents = write_full(&m, &f, Some(&candidates)).unwrap();
        assert_eq!(
            extents,
            vec![
                Extent {
                    offset: 5 * PAGE_SIZE,
                    len: PAGE_SIZE
                },
                Extent {
                    offset: 40 * PAGE_SIZE,
                    len: PAGE_SIZE
                }
            ]
        );
        // Bitmaps of the wrong shape are not trusted: every page is read.
        let extents = write_full(&m, &tempfile::tempfile().unwrap(), Some(&[])).unwrap();
        assert_eq!(extents.len(), 3);
        let short: Vec<Vec<u64>> = vec![vec![]];
        let extents = write_full(&m, &tempfile::tempfile().unwrap(), Some(&short)).unwrap();
        assert_eq!(
            extents.len(),
            3,
            "a bitmap shorter than its region is ignored"
        );
    }

    #[test]
    fn bitmaps_of_extents_are_clipped_to_the_regions() {
        let regions = vec![
            RegionLayout {
                gpa: 0,
                size: 70 * PAGE_SIZE,
                file_offset: 0,
            },
            RegionLayout {
                gpa: 1 << 32,
                size: 4 * PAGE_SIZE,
                file_offset: 70 * PAGE_SIZE,
            },
        ];
        let maps = bitmaps_of(
            &regions,
            &[
                Extent {
                    offset: 63 * PAGE_SIZE,
                    len: 9 * PAGE_SIZE,
                },
                Extent {
                    offset: 500 * PAGE_SIZE,
                    len: u64::MAX - 600 * PAGE_SIZE,
                },
            ],
        );
        assert_eq!(maps.len(), 2);
        assert_eq!(maps[0], vec![1 << 63, 0b11_1111]);
        assert_eq!(maps[1], vec![0b11]);
    }

    #[test]
    fn dirty_runs_span_words_and_stop_at_the_region_end() {
        // Pages 0-1, 62-66 (across the word boundary), 127 (top bit of word 1).
        let bits = vec![0b11 | (0b11 << 62), 0b111 | (1 << 63)];
        assert_eq!(dirty_runs(&bits, 128), vec![(0, 2), (62, 5), (127, 1)]);
        // A bitmap whose words are all set is one run, cut at `pages`.
        assert_eq!(dirty_runs(&[u64::MAX, u64::MAX], 100), vec![(0, 100)]);
        assert_eq!(dirty_runs(&[u64::MAX; 3], 128), vec![(0, 128)]);
        // Bits past the region (a hostile or stale bitmap) are ignored.
        assert_eq!(dirty_runs(&[1 << 10, 1], 8), Vec::<(u64, u64)>::new());
        assert_eq!(dirty_runs(&[], 64), Vec::<(u64, u64)>::new());
    }

    #[test]
    fn diff_of_many_runs_matches_a_page_by_page_copy() {
        let m =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 512 * PAGE_SIZE as usize)]).unwrap();
        let mut bits = vec![0u64; 8];
        for page in (0..512u64).filter(|p| p % 3 == 0 || (200..300).contains(p)) {
            bits[(page / 64) as usize] |= 1 << (page % 64);
            m.write_obj(page ^ 0x5a5a, GuestAddress(page * PAGE_SIZE + 8))
                .unwrap();
        }
        let f = tempfile::tempfile().unwrap();
        let runs = DiffRuns::new(&m, &[bits.clone()]);
        write_diff(&m, &f, None, &runs).unwrap();
        let extents = runs.extents();
        let written: u64 = extents.iter().map(|e| e.len).sum();
        let expected = (0..512u64)
            .filter(|p| bits[(p / 64) as usize] & (1 << (p % 64)) != 0)
            .count() as u64;
        assert_eq!(written, expected * PAGE_SIZE);
        for page in 0..512u64 {
            let mut b = [0u8; 8];
            f.read_exact_at(&mut b, page * PAGE_SIZE + 8).unwrap();
            let dirty = bits[(page / 64) as usize] & (1 << (page % 64)) != 0;
            let want = if dirty { page ^ 0x5a5a } else { 0 };
            assert_eq!(u64::from_le_bytes(b), want, "page {page}");
        }
    }

    #[test]
    fn runs_of_other_memory_are_refused_not_read() {
        // Runs found in 512 pages, written against memory of 64: the run
        // past the smaller memory's end must not be read.
        let big =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 512 * PAGE_SIZE as usize)]).unwrap();
        let mut bits = vec![0u64; 8];
        bits[7] = 1 << 3;
        let runs = DiffRuns::new(&big, &[bits]);
        assert_eq!(runs.extents().len(), 1);
        let err = write_diff(&mem(), &tempfile::tempfile().unwrap(), None, &runs).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
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
