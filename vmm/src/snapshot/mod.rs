//! Snapshots: a directory holding `state` (versioned, checksummed VM state),
//! `memory` (guest memory, sparse) and `manifest` (layout, parent, extents).
//! Full and diff snapshots, written atomically; restore through a chain of
//! layers with a lazy memory backend.

pub mod format;
pub mod manifest;
pub mod memory_file;
mod page_sink;
mod pages;
pub mod restore_memory;
pub mod state;
mod uffd;
pub mod writer;
