//! virtio-fs as a vhost-user frontend: the device the guest sees (config
//! space with the mount tag, a high-priority queue and request queues) whose
//! queues are served by a separate backend process, virtiofsd, over a
//! vhost-user socket. The vmm hands the backend guest memory (a shared
//! memfd) and the vrings; the guest's QueueNotify ioeventfds go to the
//! backend as its kick eventfds, and the backend's completions come back on
//! call eventfds the vmm watches, so that it can set the virtio-mmio
//! interrupt status (which the backend cannot) and mark the buffers the
//! backend wrote dirty for diff snapshots (`dirty`).
//!
//! For a snapshot the vrings are stopped (`GET_VRING_BASE`) and the backend's
//! own state (virtiofsd's inode and handle tables) is saved with the device;
//! a restore hands it to a new backend process. A backend that dies or stops
//! answering turns the device into one the vmm serves itself with I/O errors
//! (`failed`); the VM keeps running.

pub mod backend;
pub mod dirty;
pub mod failed;
pub mod persist;
pub mod watchdog;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_bindings::virtio_ids::VIRTIO_ID_FS;
use virtio_queue::QueueT;
use vmm_sys_util::eventfd::EventFd;

use self::backend::{Backend, BackendError};
use self::dirty::UsedCursor;
use super::{read_config_bytes, ActivateError, DeviceCommon, Interrupt, VirtioDevice};
use crate::config::FS_TAG_MAX;
use crate::memory::{GuestMemoryMmap, MemoryReady};

/// Queue size offered (what virtiofsd accepts at most).
pub const QUEUE_SIZE: u16 = 1024;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The backend cannot be used.
    #[error("virtio-fs {tag:?}: {source}")]
    Backend {
        /// The device's tag.
        tag: String,
        /// Why.
        #[source]
        source: BackendError,
    },
    /// An eventfd could not be created.
    #[error("cannot create the eventfds of virtio-fs {tag:?}: {source}")]
    Eventfd {
        /// The device's tag.
        tag: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where the device's vrings are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rings {
    /// Not started (the driver has not set DRIVER_OK).
    Idle,
    /// Served by the backend.
    Running,
    /// Stopped for a snapshot; started again when it is taken.
    Stopped,
    /// A restored device waiting for guest memory to be complete before the
    /// backend may map it.
    WaitingForMemory,
    /// The backend is gone: the vmm answers every request with EIO.
    Failed,
}

/// The virtio-fs device.
pub struct Fs {
    common: DeviceCommon,
    tag: String,
    socket: PathBuf,
    request_queues: u16,
    backend: Option<Backend>,
    /// One per queue: the backend signals completions here.
    calls: Vec<EventFd>,
    cursors: Vec<UsedCursor>,
    rings: Rings,
    /// Written when the device fails outside the event thread, so the event
    /// thread starts watching the queues itself.
    failed_evt: EventFd,
    watching_kicks: bool,
    /// Guest memory completeness, for a restored device.
    memory_ready: MemoryReady,
    /// This device's own descriptor of the memory-ready eventfd, which every
    /// fs device of the VM watches (one epoll takes a descriptor only once).
    memory_ready_watch: Option<EventFd>,
    /// The state a restore loaded into the backend, kept for a snapshot
    /// taken before the backend starts (waiting for the memory).
    restored_state: Option<Vec<u8>>,
    /// The backend's state saved by the last `stop_for_snapshot`.
    saved_state: Option<Result<Vec<u8>, String>>,
}

impl Fs {
    /// A device with `tag` whose backend listens on `socket`, with
    /// `request_queues` request queues; connects and negotiates now.
    pub fn new(tag: &str, socket: &Path, request_queues: u16) -> Result<Fs, FsError> {
        let queues = 1 + usize::from(request_queues);
        let backend = Backend::connect(socket, queues).map_err(|source| FsError::Backend {
            tag: tag.into(),
            source,
        })?;
        let eventfd_err = |source| FsError::Eventfd {
            tag: tag.into(),
            source,
        };
        let mut common = DeviceCommon::new(0, &vec![QUEUE_SIZE; queues]).map_err(eventfd_err)?;
        // Only what the backend offers (and this frontend implements).
        common.avail_features = backend.guest_features();
        let calls = (0..queues)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(eventfd_err)?;
        Ok(Fs {
            common,
            tag: tag.into(),
            socket: socket.into(),
            request_queues,
            backend: Some(backend),
            calls,
            cursors: vec![UsedCursor::default(); queues],
            rings: Rings::Idle,
            failed_evt: EventFd::new(libc::EFD_NONBLOCK).map_err(eventfd_err)?,
            watching_kicks: false,
            memory_ready: MemoryReady::now(),
            memory_ready_watch: None,
            restored_state: None,
            saved_state: None,
        })
    }

    /// The mount tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Whether the backend is gone and the vmm answers requests with EIO.
    pub fn has_failed(&self) -> bool {
        self.rings == Rings::Failed
    }

    /// The configuration space: `tag[36]` then `num_request_queues` (le32).
    fn config(&self) -> [u8; FS_TAG_MAX + 4] {
        let mut config = [0u8; FS_TAG_MAX + 4];
        let tag = self.tag.as_bytes();
        let n = tag.len().min(FS_TAG_MAX);
        config[..n].copy_from_slice(&tag[..n]);
        config[FS_TAG_MAX..].copy_from_slice(&u32::from(self.request_queues).to_le_bytes());
        config
    }

    /// Hands memory and every vring to the backend (loading its saved state
    /// first, for a restore).
    fn start_backend(&mut self) -> Result<(), BackendError> {
        let (Some(backend), Some(mem)) = (self.backend.as_mut(), self.common.mem.clone()) else {
            return Ok(());
        };
        backend.set_up(self.common.acked_features, &mem)?;
        self.restored_state = None;
        self.start_vrings()
    }

    fn start_vrings(&mut self) -> Result<(), BackendError> {
        let (Some(backend), Some(mem)) = (self.backend.as_mut(), self.common.mem.clone()) else {
            return Ok(());
        };
        for (i, queue) in self.common.queues.iter().enumerate() {
            backend.start_vring(i, queue, &mem, &self.calls[i], &self.common.queue_evts[i])?;
            self.cursors[i] = UsedCursor(std::num::Wrapping(queue.next_used()));
        }
        self.rings = Rings::Running;
        // A request queued while the rings were stopped is seen now.
        for evt in &self.common.queue_evts {
            let _ = evt.write(1);
        }
        Ok(())
    }

    /// Stops the vrings and saves the backend's state, for a snapshot: from
    /// here until [`Self::resume_after_snapshot`] the backend touches no guest
    /// memory, and the queues' positions are those the backend reached.
    pub fn stop_for_snapshot(&mut self) {
        self.saved_state = None;
        if self.rings != Rings::Running {
            return;
        }
        match self.stop_vrings() {
            Ok(()) => {
                self.rings = Rings::Stopped;
                let state = match &self.backend {
                    Some(b) => b.save_state().map_err(|e| e.to_string()),
                    None => Ok(Vec::new()),
                };
                self.saved_state = Some(state);
            }
            Err(e) => self.fail(&e.to_string()),
        }
    }

    /// Starts the vrings again after a snapshot.
    pub fn resume_after_snapshot(&mut self) {
        if self.rings != Rings::Stopped {
            return;
        }
        if let Err(e) = self.start_vrings() {
            self.fail(&e.to_string());
        }
    }

    fn stop_vrings(&mut self) -> Result<(), BackendError> {
        let (Some(backend), Some(mem)) = (self.backend.as_mut(), self.common.mem.clone()) else {
            return Ok(());
        };
        for i in 0..self.common.queues.len() {
            let base = backend.stop_vring(i)?;
            let queue = &mut self.common.queues[i];
            queue.set_next_avail(base);
            if let Some(used) = dirty::used_idx(&mem, queue) {
                queue.set_next_used(used);
            }
            dirty::mark_completed(&mem, queue, &mut self.cursors[i]);
        }
        Ok(())
    }

    /// The backend is gone: say so, drop it and serve the queues here.
    fn fail(&mut self, why: &str) {
        if self.rings == Rings::Failed {
            return;
        }
        tracing::error!(
            tag = %self.tag,
            socket = %self.socket.display(),
            "virtio-fs backend failed: {why}; the guest's requests get EIO from now on"
        );
        // Requests the backend finished before it went are accounted for.
        if let Some(mem) = self.common.mem.clone() {
            for (q, cursor) in self.common.queues.iter().zip(&mut self.cursors) {
                dirty::mark_completed(&mem, q, cursor);
            }
        }
        self.backend = None;
        self.rings = Rings::Failed;
        failed::take_over(&mut self.common);
        if let Err(e) = self.failed_evt.write(1) {
            tracing::error!(error = %e, "cannot wake the virtio-fs event handler");
        }
    }

    /// Completions from the backend on queue `q`.
    fn backend_completed(&mut self, q: usize) {
        let (Some(mem), Some(queue)) = (self.common.mem.as_ref(), self.common.queues.get(q)) else {
            return;
        };
        dirty::mark_completed(mem, queue, &mut self.cursors[q]);
        // The backend applied EVENT_IDX suppression before signalling.
        self.common.signal_used();
    }

    fn watch_kicks(&mut self, ops: &mut EventOps) {
        if self.watching_kicks {
            return;
        }
        self.watching_kicks = true;
        for (i, evt) in self.common.queue_evts.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(evt, KICK_BASE + i as u32, EventSet::IN)) {
                tracing::error!(error = ?e, "cannot watch a virtio-fs queue");
            }
        }
    }

    fn answer_failed(&mut self) {
        if self.common.mem.is_none() {
            return;
        }
        for q in 0..self.common.queues.len() {
            failed::answer_all(&mut self.common, q);
        }
    }

    /// Whether the backend's socket shows it is gone: hung up, or readable
    /// with nothing to read (replies are only read while the device is
    /// locked, so an event seen here is never one).
    fn socket_says_gone(&self, events: EventSet) -> Option<&'static str> {
        if events.intersects(EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR) {
            return Some("it closed the connection (did virtiofsd exit?)");
        }
        None
    }
}

/// Event data: the socket, the failure eventfd, memory readiness; calls are
/// `CALL_BASE + q`, kicks (failed device only) `KICK_BASE + q`.
const SOCKET: u32 = 1;
const FAILED: u32 = 2;
const MEMORY_READY: u32 = 3;
const CALL_BASE: u32 = 0x100;
const KICK_BASE: u32 = 0x1000;

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }
    fn common(&self) -> &DeviceCommon {
        &self.common
    }
    fn common_mut(&mut self) -> &mut DeviceCommon {
        &mut self.common
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)?;
        if self.rings == Rings::Failed || self.backend.is_none() {
            self.rings = Rings::Failed;
            failed::take_over(&mut self.common);
            let _ = self.failed_evt.write(1);
            return Ok(());
        }
        if !self.memory_ready.is_ready() {
            self.rings = Rings::WaitingForMemory;
            return Ok(());
        }
        // A backend that cannot start is a failed device, not a refused
        // activation: the guest then gets errors rather than a hang.
        if let Err(e) = self.start_backend() {
            self.fail(&e.to_string());
        }
        Ok(())
    }

    fn reset(&mut self) {
        if self.rings == Rings::Running {
            if let Err(e) = self.stop_vrings() {
                self.fail(&e.to_string());
            }
        }
        if self.rings != Rings::Failed {
            self.rings = Rings::Idle;
        }
        self.common.reset();
        self.cursors.fill(UsedCursor::default());
    }
}

impl MutEventSubscriber for Fs {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            SOCKET => {
                if let Some(why) = self.socket_says_gone(events.event_set()) {
                    let _ = ops.remove(events);
                    self.fail(why);
                }
            }
            FAILED => {
                let _ = self.failed_evt.read();
                self.watch_kicks(ops);
                self.answer_failed();
            }
            MEMORY_READY if self.memory_ready.is_ready() => {
                let _ = ops.remove(events);
                self.memory_ready_watch = None;
                if self.rings == Rings::WaitingForMemory {
                    if let Err(e) = self.start_backend() {
                        self.fail(&e.to_string());
                    }
                }
            }
            d if (CALL_BASE..KICK_BASE).contains(&d) => {
                let q = (d - CALL_BASE) as usize;
                if let Some(evt) = self.calls.get(q) {
                    let _ = evt.read();
                }
                self.backend_completed(q);
            }
            d if d >= KICK_BASE => {
                let q = (d - KICK_BASE) as usize;
                if let Some(evt) = self.common.queue_evts.get(q) {
                    let _ = evt.read();
                }
                if self.rings == Rings::Failed {
                    failed::answer_all(&mut self.common, q);
                }
            }
            _ => {}
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        let mut add = |e: Events| {
            if let Err(err) = ops.add(e) {
                tracing::error!(error = ?err, "cannot watch a virtio-fs eventfd");
            }
        };
        if let Some(b) = &self.backend {
            add(Events::with_data_raw(
                b.socket_fd(),
                SOCKET,
                EventSet::READ_HANG_UP,
            ));
        }
        add(Events::with_data(&self.failed_evt, FAILED, EventSet::IN));
        if let Some(evt) = self.memory_ready.eventfd() {
            match evt.try_clone() {
                Ok(own) => {
                    add(Events::with_data(&own, MEMORY_READY, EventSet::IN));
                    self.memory_ready_watch = Some(own);
                }
                Err(e) => self.fail(&format!("cannot watch guest memory readiness: {e}")),
            }
        }
        for (i, call) in self.calls.iter().enumerate() {
            add(Events::with_data(call, CALL_BASE + i as u32, EventSet::IN));
        }
    }
}

#[cfg(test)]
mod tests;
