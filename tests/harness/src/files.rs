//! Looking through a test's files: which of them hold a byte string (a
//! secret value that must be nowhere on disk).

use std::path::Path;

/// Every file under `dir` (links not followed) that holds `needle`, added
/// to `found`; unreadable entries are skipped.
pub fn files_holding(dir: &Path, needle: &[u8], found: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() {
            files_holding(&path, needle, found);
        } else if kind.is_file() {
            let data = std::fs::read(&path).unwrap_or_default();
            if !needle.is_empty() && data.windows(needle.len()).any(|w| w == needle) {
                found.push(path.display().to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_files_that_hold_the_bytes() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/a"), b"xx-secret-yy").unwrap();
        std::fs::write(d.path().join("b"), b"nothing").unwrap();
        let mut found = Vec::new();
        files_holding(d.path(), b"secret", &mut found);
        assert_eq!(found, [d.path().join("sub/a").display().to_string()]);
    }
}
