//! Taking snapshots of a paused VM, and the control-socket operations that
//! need the whole machine.

use std::path::Path;
use std::time::Instant;

use vmm_api::protocol::{BlkCounters, NetCounters, SnapshotReply};

use super::MachineShared;
use crate::control::protocol::ControlTarget;
use crate::devices::virtio::setup::VirtioState;
use crate::persist::Persist;
use crate::snapshot::manifest::SnapshotKind;
use crate::snapshot::memory_file;
use crate::snapshot::state::MachineState;
use crate::snapshot::writer::{write_snapshot, MemoryContent, WriteError};
use crate::vcpu::coordinator::Coordinator;
use crate::vcpu::{lock_fd, persist as vcpu_persist};
use crate::vm::persist as vm_persist;

/// Why a snapshot request failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotRequestError {
    /// The VM is running.
    #[error("a snapshot needs a paused VM: send {{\"op\":\"pause\"}} first")]
    NotPaused,
    /// A diff was asked for with nothing to diff against.
    #[error("no earlier snapshot of this VM to diff against: take a full snapshot first")]
    NoParent,
    /// Saving KVM or device state failed.
    #[error("cannot save VM state: {0}")]
    State(String),
    /// Writing the files failed.
    #[error(transparent)]
    Write(#[from] WriteError),
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn or_into(acc: &mut Vec<Vec<u64>>, new: &[Vec<u64>]) {
    if acc.is_empty() {
        *acc = new.to_vec();
        return;
    }
    for (a, n) in acc.iter_mut().zip(new) {
        for (x, y) in a.iter_mut().zip(n) {
            *x |= y;
        }
    }
}

impl MachineShared {
    /// The machine's state for a snapshot; errors are what the snapshot's
    /// "cannot save VM state" reports.
    fn save_state(&self, virtio: VirtioState) -> Result<MachineState, String> {
        let state_err = |e: &dyn std::fmt::Display| e.to_string();
        let msr_indices = vcpu_persist::msrs_to_save(self.kvm.kvm()).map_err(|e| state_err(&e))?;
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for (i, fd) in self.vcpus.iter().enumerate() {
            let fd = lock_fd(fd);
            vcpus.push(vcpu_persist::save(&fd, i as u8, &msr_indices).map_err(|e| state_err(&e))?);
        }
        Ok(MachineState {
            mem_mib: self.mem_mib,
            vm: vm_persist::save(self.vm.fd(), self.pit).map_err(|e| state_err(&e))?,
            vcpus,
            serial: lock(&self.serial).save().map_err(|e| state_err(&e))?,
            virtio,
            i8042: lock(&self.i8042).save().map_err(|e| state_err(&e))?,
            acpi: self
                .acpi
                .as_ref()
                .map(Persist::save)
                .transpose()
                .map_err(|e| state_err(&e))?,
            pit: self.pit,
        })
    }

    /// Writes a snapshot of the paused VM into `dir`.
    pub fn snapshot(
        &self,
        dir: &Path,
        kind: SnapshotKind,
    ) -> Result<SnapshotReply, SnapshotRequestError> {
        self.coordinator
            .wait_until_parked()
            .map_err(|_| SnapshotRequestError::NotPaused)?;
        let started = Instant::now();
        let parent = lock(&self.last_snapshot).clone();
        if kind == SnapshotKind::Diff && parent.is_none() {
            return Err(SnapshotRequestError::NoParent);
        }
        // Stop device work (DMA into guest memory) until the snapshot is written.
        let devices = self.virtio.quiesce();
        // Collect dirty pages first, so nothing written from here on is missed; keep them
        // pending until a snapshot that includes them is safely on disk.
        let newly_dirty = self
            .vm
            .take_dirty_pages()
            .map_err(|e| SnapshotRequestError::State(e.to_string()))?;
        let mut pending = lock(&self.pending_dirty);
        or_into(&mut pending, &newly_dirty);
        let mut maybe_nonzero = lock(&self.maybe_nonzero);
        or_into(&mut maybe_nonzero, &newly_dirty);

        // Runs while guest memory is being written; it only reads guest
        // memory (the vCPUs are parked, the devices quiesced).
        let state_bytes = || -> Result<Vec<u8>, String> {
            let virtio = devices.save().map_err(|e| e.to_string())?;
            let state = self.save_state(virtio)?;
            state.encode().map_err(|e| e.to_string())
        };
        let content = match (kind, parent) {
            (SnapshotKind::Full, _) => MemoryContent::Full {
                candidates: Some(&maybe_nonzero),
            },
            (SnapshotKind::Diff, Some(parent)) => MemoryContent::Diff {
                dirty: &pending,
                parent,
            },
            (SnapshotKind::Diff, None) => return Err(SnapshotRequestError::NoParent),
        };
        let manifest = write_snapshot(dir, state_bytes, self.vm.memory(), content)?;
        drop(devices);
        pending.clear();
        if kind == SnapshotKind::Full {
            // What this snapshot found zero is zero until written again.
            *maybe_nonzero = memory_file::bitmaps_of(&manifest.regions, &manifest.extents);
        }
        let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        *lock(&self.last_snapshot) = Some(canonical.clone());

        let bytes: u64 = manifest.extents.iter().map(|e| e.len).sum();
        tracing::info!(dir = %canonical.display(), ?kind, bytes, "snapshot written");
        Ok(SnapshotReply {
            dir: canonical,
            kind,
            memory_bytes_written: bytes,
            pages_written: bytes / crate::memory::PAGE_SIZE,
            ms: started.elapsed().as_secs_f64() * 1000.0,
        })
    }
}

impl ControlTarget for MachineShared {
    fn coordinator(&self) -> &Coordinator {
        &self.coordinator
    }

    fn snapshot(&self, dir: &Path, kind: SnapshotKind) -> Result<SnapshotReply, String> {
        MachineShared::snapshot(self, dir, kind).map_err(|e| e.to_string())
    }

    fn flush_console(&self) {
        lock(&self.serial).flush();
    }

    fn io_counters(&self) -> (Option<NetCounters>, Vec<BlkCounters>) {
        self.virtio.io_counters()
    }

    fn memory_checksum(&self) -> Result<u64, String> {
        if self.coordinator.wait_until_parked().is_err() {
            return Err(
                "a memory checksum needs a paused VM: send {\"op\":\"pause\"} first".into(),
            );
        }
        memory_file::checksum(self.vm.memory()).map_err(|e| e.to_string())
    }
}
