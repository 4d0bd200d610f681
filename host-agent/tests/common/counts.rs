//! What the counting guest printed on its serial console (`count=N`
//! lines), read while the vmm writes it.

use std::path::Path;
use std::time::{Duration, Instant};

/// The counts the counting guest printed to `log` in the lines that start
/// at or after byte `from`. The log is read while the vmm writes it: a line
/// still being written (no newline yet) is not counted, nor is a line that
/// `from` cuts.
pub fn counts(log: &Path, from: usize) -> Vec<u64> {
    let text = std::fs::read(log).unwrap_or_default();
    let from = from.min(text.len());
    let start = if from == 0 || text[from - 1] == b'\n' {
        from
    } else {
        match text[from..].iter().position(|b| *b == b'\n') {
            Some(i) => from + i + 1,
            None => return Vec::new(),
        }
    };
    let end = text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    if end <= start {
        return Vec::new();
    }
    String::from_utf8_lossy(&text[start..end])
        .lines()
        .filter_map(|l| l.strip_prefix("count="))
        .filter_map(|n| n.parse().ok())
        .collect()
}

pub fn wait_for_counts(log: &Path, from: usize, n: usize) -> Vec<u64> {
    let start = Instant::now();
    loop {
        let c = counts(log, from);
        if c.len() >= n {
            return c;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {c:?} in {}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
