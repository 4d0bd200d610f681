//! Resident memory of a VMM process from /proc/PID/smaps, split into guest
//! memory and the VMM's own.
//!
//! Guest memory is recognised by shape: a readable and writable mapping of at
//! least [`MIN_GUEST_MAPPING`] that is anonymous, a memfd, or a file under
//! the snapshot folder being restored (the MAP_PRIVATE memory file); shared
//! anonymous memory shows as `/dev/zero (deleted)` and counts too. Nothing
//! else in a VMM is that large and writable: thread stacks are a few MiB and
//! malloc arenas reserve 64 MiB but map it PROT_NONE until used.

use std::path::Path;

use crate::error::{PerfError, Result};

/// Smallest mapping counted as guest memory.
pub const MIN_GUEST_MAPPING: u64 = 16 << 20;

/// Resident memory of one process, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Residency {
    /// Resident set of the whole process (sum of every mapping's Rss).
    pub total_kib: u64,
    /// Resident part of the guest memory mappings: guest memory touched.
    pub guest_kib: u64,
    /// Size of the guest memory mappings found.
    pub guest_mapped_kib: u64,
}

impl Residency {
    /// Resident memory that is not guest memory: the VMM's overhead.
    pub fn overhead_kib(&self) -> u64 {
        self.total_kib.saturating_sub(self.guest_kib)
    }
}

/// Reads /proc/`pid`/smaps; `snapshot` is the folder a restored VM maps its
/// memory from, if any.
pub fn read(pid: u32, snapshot: Option<&Path>) -> Result<Residency> {
    let path = format!("/proc/{pid}/smaps");
    let text = std::fs::read_to_string(&path).map_err(PerfError::io("cannot read", &path))?;
    Ok(parse(&text, snapshot))
}

/// Parses the text of an smaps file.
pub fn parse(text: &str, snapshot: Option<&Path>) -> Residency {
    let mut r = Residency::default();
    let mut current_is_guest = false;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((start, end)) = first.split_once('-').and_then(|(a, b)| {
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        }) {
            // Mapping header: range perms offset dev inode [path]
            let perms = fields.next().unwrap_or("");
            let path: Vec<&str> = fields.skip(3).collect();
            let path = path.join(" ");
            let size = end.saturating_sub(start);
            let rw = perms.starts_with("rw");
            let backing_ok = path.is_empty()
                || path.starts_with("/memfd:")
                || path.starts_with("/dev/zero")
                || path.starts_with("[anon")
                || snapshot.is_some_and(|s| Path::new(&path).starts_with(s));
            current_is_guest = rw && backing_ok && size >= MIN_GUEST_MAPPING;
            if current_is_guest {
                r.guest_mapped_kib += size / 1024;
            }
        } else if first == "Rss:" {
            let kib: u64 = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            r.total_kib += kib;
            if current_is_guest {
                r.guest_kib += kib;
            }
        }
    }
    r
}

/// Resident memory of one process from /proc/PID/smaps_rollup, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rollup {
    /// Resident set: every page the process maps that is in memory, shared
    /// ones counted in full.
    pub rss_kib: u64,
    /// Proportional set: each page divided by the number of processes
    /// mapping it, so pages shared by N processes count 1/N in each.
    pub pss_kib: u64,
}

/// Reads /proc/`pid`/smaps_rollup.
pub fn rollup(pid: u32) -> Result<Rollup> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = std::fs::read_to_string(&path).map_err(PerfError::io("cannot read", &path))?;
    parse_rollup(&text)
        .ok_or_else(|| PerfError::Guest(format!("{path} has no Rss: and Pss: lines: {text:?}")))
}

/// Parses the text of an smaps_rollup file; `None` without both lines.
pub fn parse_rollup(text: &str) -> Option<Rollup> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(name))
                .then(|| words.next()?.parse::<u64>().ok())
                .flatten()
        })
    };
    Some(Rollup {
        rss_kib: field("Rss:")?,
        pss_kib: field("Pss:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rollup_gives_rss_and_pss() {
        let text = "\
55d0c0000000-7ffd5a5fe000 ---p 00000000 00:00 0                          [rollup]
Rss:                5120 kB
Pss:                2048 kB
Pss_Dirty:          1024 kB
Pss_Anon:           1000 kB
Shared_Clean:       3072 kB
";
        assert_eq!(
            parse_rollup(text),
            Some(Rollup {
                rss_kib: 5120,
                pss_kib: 2048
            })
        );
        assert_eq!(parse_rollup("Rss: 1 kB\n"), None);
    }

    const SAMPLE: &str = "\
55d0c0000000-55d0c0100000 r-xp 00000000 fd:01 123 /usr/bin/vmm
Size:               1024 kB
Rss:                 800 kB
7f0000000000-7f0008000000 rw-p 00000000 00:00 0 
Size:             131072 kB
Rss:                 300 kB
7f1000000000-7f1004000000 ---p 00000000 00:00 0 
Size:              65536 kB
Rss:                   0 kB
7f2000000000-7f2000800000 rw-p 00000000 00:00 0 
Size:               8192 kB
Rss:                  40 kB
7f3000000000-7f3008000000 rw-p 00000000 fd:01 77 /tmp/snap/memory
Size:             131072 kB
Rss:                 100 kB
7f4000000000-7f4004000000 rw-s 00000000 00:01 1062 /dev/zero (deleted)
Size:              65536 kB
Rss:                  64 kB
";

    #[test]
    fn guest_mappings_are_told_apart() {
        let r = parse(SAMPLE, None);
        assert_eq!(r.total_kib, 1304);
        assert_eq!(r.guest_kib, 364);
        assert_eq!(r.guest_mapped_kib, 131072 + 65536);
        assert_eq!(r.overhead_kib(), 940);
        let r = parse(SAMPLE, Some(Path::new("/tmp/snap")));
        assert_eq!(r.guest_kib, 464);
        assert_eq!(r.overhead_kib(), 840);
    }
}
