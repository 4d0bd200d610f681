//! What both ways of restoring guest memory share (`restore_memory` for
//! the file back end, `uffd` for the userfaultfd one): where the newest
//! copy of a page lives in a snapshot chain, and the errors of building
//! restored memory.

use std::path::PathBuf;

use super::manifest::Extent;
use crate::memory::PAGE_SIZE;

/// Errors building restored memory.
#[derive(Debug, thiserror::Error)]
pub enum RestoreMemoryError {
    /// A memory file cannot be opened or read.
    #[error("cannot read snapshot memory {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The mapping failed.
    #[error("cannot map snapshot memory: {0}")]
    Map(String),
    /// userfaultfd is unavailable or failed.
    #[error("userfaultfd backend unavailable: {0} (use --memory-backend file)")]
    Uffd(String),
}

/// Where the newest copy of a memory-file page lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PageSource {
    /// In layer `i`'s memory file, at the same offset.
    Layer(usize),
    /// Nowhere: the page is zero.
    Zero,
}

/// Finds the newest layer holding the page at memory-file offset `offset`.
pub(super) fn page_source(extents: &[Vec<Extent>], offset: u64) -> PageSource {
    for (i, layer) in extents.iter().enumerate().rev() {
        let idx = layer.partition_point(|e| e.offset + e.len <= offset);
        if layer.get(idx).is_some_and(|e| e.offset <= offset) {
            return PageSource::Layer(i);
        }
    }
    PageSource::Zero
}

/// Page size as usize, for buffers.
pub(super) const PAGE: usize = PAGE_SIZE as usize;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_layer_wins_and_gaps_are_zero() {
        let e = |offset: u64, len: u64| Extent { offset, len };
        let layers = vec![
            vec![e(0, 8 * PAGE_SIZE)],
            vec![e(2 * PAGE_SIZE, PAGE_SIZE)],
            vec![e(3 * PAGE_SIZE, 2 * PAGE_SIZE)],
        ];
        assert!(matches!(page_source(&layers, 0), PageSource::Layer(0)));
        assert!(matches!(
            page_source(&layers, 2 * PAGE_SIZE),
            PageSource::Layer(1)
        ));
        assert!(matches!(
            page_source(&layers, 4 * PAGE_SIZE),
            PageSource::Layer(2)
        ));
        assert!(matches!(
            page_source(&layers, 7 * PAGE_SIZE),
            PageSource::Layer(0)
        ));
        assert!(matches!(
            page_source(&layers, 9 * PAGE_SIZE),
            PageSource::Zero
        ));
    }
}
