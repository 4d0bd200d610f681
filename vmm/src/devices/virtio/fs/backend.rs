//! The vhost-user connection to a virtio-fs backend (virtiofsd): connecting
//! and negotiating at start, handing it guest memory and the vrings when the
//! driver starts the device, stopping the vrings (`GET_VRING_BASE`) for a
//! snapshot or a reset, and moving the backend's internal state (its inode
//! and handle tables) in and out of snapshots with `SET_DEVICE_STATE_FD`.
//! Every reply is awaited for at most [`REPLY_TIMEOUT`]: a backend that stops
//! answering is an error, never a hung vmm (`watchdog`: the vhost crate
//! retries a receive that times out, so a socket timeout cannot do this).

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

use super::watchdog::Watchdog;
use crate::devices::virtio::{VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use crate::memory::GuestMemoryMmap;

/// Longest wait for one reply of the backend.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest backend state a snapshot keeps (virtiofsd's is its inode paths).
pub const MAX_DEVICE_STATE: usize = 64 << 20;

/// `VIRTIO_RING_F_INDIRECT_DESC`: descriptor tables in guest memory.
const VIRTIO_RING_F_INDIRECT_DESC: u64 =
    1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
/// The virtio features the guest may negotiate, if the backend offers them:
/// the transport-level ones this frontend implements (split rings on
/// virtio-mmio). Device features (virtio-fs notifications need a queue this
/// device does not have) are left out.
const GUEST_FEATURE_MASK: u64 =
    VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_RING_F_INDIRECT_DESC;
/// Protocol features used when offered.
const WANTED_PROTOCOL: VhostUserProtocolFeatures = VhostUserProtocolFeatures::MQ
    .union(VhostUserProtocolFeatures::REPLY_ACK)
    .union(VhostUserProtocolFeatures::DEVICE_STATE);

/// Errors talking to the backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The socket cannot be reached.
    #[error("cannot connect to the vhost-user backend at {path}: {source} (is its virtiofsd running and listening there?)")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A request failed or got a bad (or no) reply.
    #[error("vhost-user backend at {path}: {step} failed: {source}")]
    Protocol {
        /// The socket.
        path: PathBuf,
        /// The request.
        step: &'static str,
        /// vhost's error (a closed socket, garbage, a timeout).
        #[source]
        source: vhost::Error,
    },
    /// The backend did not answer in time.
    #[error("vhost-user backend at {path} did not answer {step} within {} s: the connection is closed", REPLY_TIMEOUT.as_secs())]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The request.
        step: &'static str,
    },
    /// The backend lacks something this device needs.
    #[error("vhost-user backend at {path} cannot serve this device: {why}")]
    Unsuitable {
        /// The socket.
        path: PathBuf,
        /// What is missing.
        why: String,
    },
    /// Moving the backend's state in or out failed.
    #[error("vhost-user backend at {path}: transferring its state failed: {why}")]
    State {
        /// The socket.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

/// One connected, negotiated backend.
pub struct Backend {
    frontend: Frontend,
    watchdog: Watchdog,
    path: PathBuf,
    /// The virtio features the backend offers.
    features: u64,
    protocol: VhostUserProtocolFeatures,
    queues: usize,
}

impl Backend {
    /// Connects to `path`, takes ownership of the backend and negotiates its
    /// protocol features; `queues` is the device's queue count (hiprio and
    /// request queues), which the backend must support.
    pub fn connect(path: &Path, queues: usize) -> Result<Backend, BackendError> {
        let stream = UnixStream::connect(path).map_err(|source| BackendError::Connect {
            path: path.into(),
            source,
        })?;
        let watchdog =
            Watchdog::start(&stream, REPLY_TIMEOUT).map_err(|source| BackendError::Connect {
                path: path.into(),
                source,
            })?;
        let mut frontend = Frontend::from_stream(stream, queues as u64);
        let fail = |step| {
            let path = path.to_path_buf();
            let watchdog = &watchdog;
            move |source| protocol_error(path, step, source, watchdog)
        };
        let _armed = watchdog.arm();
        frontend.set_owner().map_err(fail("SET_OWNER"))?;
        let features = frontend.get_features().map_err(fail("GET_FEATURES"))?;
        let unsuitable = |why: &str| BackendError::Unsuitable {
            path: path.into(),
            why: why.into(),
        };
        if features & VIRTIO_F_VERSION_1 == 0 {
            return Err(unsuitable("it does not offer VIRTIO_F_VERSION_1"));
        }
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            return Err(unsuitable(
                "it does not offer VHOST_USER_F_PROTOCOL_FEATURES",
            ));
        }
        let offered = frontend
            .get_protocol_features()
            .map_err(fail("GET_PROTOCOL_FEATURES"))?;
        let protocol = offered & WANTED_PROTOCOL;
        frontend
            .set_protocol_features(protocol)
            .map_err(fail("SET_PROTOCOL_FEATURES"))?;
        if queues > 1 {
            let max = if protocol.contains(VhostUserProtocolFeatures::MQ) {
                frontend.get_queue_num().map_err(fail("GET_QUEUE_NUM"))?
            } else {
                1
            };
            if (max as usize) < queues {
                return Err(unsuitable(&format!(
                    "it serves {max} queues and this device has {queues} (one high-priority \
                     queue and the request queues)"
                )));
            }
        }
        drop(_armed);
        Ok(Backend {
            frontend,
            watchdog,
            path: path.into(),
            features,
            protocol,
            queues,
        })
    }

    /// The virtio features the guest may negotiate through this backend.
    pub fn guest_features(&self) -> u64 {
        self.features & GUEST_FEATURE_MASK
    }

    /// Whether the backend can hand over its state for snapshots.
    pub fn has_device_state(&self) -> bool {
        self.protocol
            .contains(VhostUserProtocolFeatures::DEVICE_STATE)
    }

    /// The socket path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The socket's descriptor, to watch for the backend hanging up.
    pub fn socket_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.frontend)
    }

    fn fail(&self, step: &'static str) -> impl Fn(vhost::Error) -> BackendError + '_ {
        move |source| protocol_error(self.path.clone(), step, source, &self.watchdog)
    }

    /// Sets the features the driver accepted and hands over guest memory:
    /// every region with its memfd.
    pub fn set_up(&self, acked: u64, mem: &GuestMemoryMmap) -> Result<(), BackendError> {
        let _armed = self.watchdog.arm();
        let acked = (acked & self.features) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        self.frontend
            .set_features(acked)
            .map_err(self.fail("SET_FEATURES"))?;
        let regions = mem
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| BackendError::Unsuitable {
                path: self.path.clone(),
                why: "guest memory is not shared (a memfd): run the VM with --memory shared".into(),
            })?;
        self.frontend
            .set_mem_table(&regions)
            .map_err(self.fail("SET_MEM_TABLE"))?;
        Ok(())
    }

    /// Starts vring `index` at `queue`'s position: its size, addresses (as
    /// host addresses in this process, which the backend translates through
    /// the memory table), the next available index, the call eventfd the
    /// backend signals on completion and the kick eventfd the guest's
    /// QueueNotify signals.
    pub fn start_vring(
        &mut self,
        index: usize,
        queue: &Queue,
        mem: &GuestMemoryMmap,
        call: &EventFd,
        kick: &EventFd,
    ) -> Result<(), BackendError> {
        let _armed = self.watchdog.arm();
        let host = |gpa: u64, what: &str| {
            mem.get_host_address(GuestAddress(gpa))
                .map(|p| p as u64)
                .map_err(|_| BackendError::Unsuitable {
                    path: self.path.clone(),
                    why: format!("queue {index}'s {what} at {gpa:#x} is outside guest memory"),
                })
        };
        let config = VringConfigData {
            queue_max_size: queue.max_size(),
            queue_size: queue.size(),
            flags: 0,
            desc_table_addr: host(queue.desc_table(), "descriptor table")?,
            used_ring_addr: host(queue.used_ring(), "used ring")?,
            avail_ring_addr: host(queue.avail_ring(), "available ring")?,
            log_addr: None,
        };
        self.frontend
            .set_vring_num(index, queue.size())
            .map_err(self.fail("SET_VRING_NUM"))?;
        self.frontend
            .set_vring_addr(index, &config)
            .map_err(self.fail("SET_VRING_ADDR"))?;
        self.frontend
            .set_vring_base(index, queue.next_avail())
            .map_err(self.fail("SET_VRING_BASE"))?;
        self.frontend
            .set_vring_call(index, call)
            .map_err(self.fail("SET_VRING_CALL"))?;
        self.frontend
            .set_vring_kick(index, kick)
            .map_err(self.fail("SET_VRING_KICK"))?;
        let path = self.path.clone();
        self.frontend
            .set_vring_enable(index, true)
            .map_err(|source| protocol_error(path, "SET_VRING_ENABLE", source, &self.watchdog))
    }

    /// Stops vring `index`; returns the next available index the backend
    /// would have read (where a new backend resumes).
    pub fn stop_vring(&mut self, index: usize) -> Result<u16, BackendError> {
        let _armed = self.watchdog.arm();
        let base = self
            .frontend
            .get_vring_base(index)
            .map_err(self.fail("GET_VRING_BASE"))?;
        u16::try_from(base).map_err(|_| BackendError::Unsuitable {
            path: self.path.clone(),
            why: format!("GET_VRING_BASE of queue {index} returned {base}, not a ring index"),
        })
    }

    /// The backend's internal state, read while every vring is stopped.
    pub fn save_state(&self) -> Result<Vec<u8>, BackendError> {
        self.require_device_state()?;
        let _armed = self.watchdog.arm();
        let (mut ours, theirs) = pipe().map_err(|e| self.state_err(e.to_string()))?;
        let reply = self
            .frontend
            .set_device_state_fd(
                VhostTransferStateDirection::SAVE,
                VhostTransferStatePhase::STOPPED,
                theirs.into(),
            )
            .map_err(self.fail("SET_DEVICE_STATE_FD (save)"))?;
        // A backend may hand back its own pipe end to read from instead.
        let mut state = Vec::new();
        let limit = MAX_DEVICE_STATE as u64 + 1;
        let read = match reply {
            Some(file) => file.take(limit).read_to_end(&mut state),
            None => (&mut ours).take(limit).read_to_end(&mut state),
        };
        read.map_err(|e| self.state_err(format!("reading it: {e}")))?;
        if state.len() > MAX_DEVICE_STATE {
            return Err(self.state_err(format!("it is larger than {} MiB", MAX_DEVICE_STATE >> 20)));
        }
        self.frontend
            .check_device_state()
            .map_err(self.fail("CHECK_DEVICE_STATE (save)"))?;
        Ok(state)
    }

    /// Loads `state` (from [`Self::save_state`] of an earlier backend) into
    /// this one, before its vrings start.
    pub fn load_state(&self, state: &[u8]) -> Result<(), BackendError> {
        self.require_device_state()?;
        let _armed = self.watchdog.arm();
        let (theirs, mut ours) = pipe().map_err(|e| self.state_err(e.to_string()))?;
        let reply = self
            .frontend
            .set_device_state_fd(
                VhostTransferStateDirection::LOAD,
                VhostTransferStatePhase::STOPPED,
                theirs.into(),
            )
            .map_err(self.fail("SET_DEVICE_STATE_FD (load)"))?;
        let written = match reply {
            Some(mut file) => file.write_all(state),
            None => ours.write_all(state),
        };
        written.map_err(|e| self.state_err(format!("writing it: {e}")))?;
        drop(ours);
        self.frontend.check_device_state().map_err(|e| match e {
            vhost::Error::VhostUserProtocol(_) if !self.watchdog.fired() => {
                self.state_err(format!(
                    "it could not load the snapshot's state ({e}); its own log says which file \
                 or directory it could not open: a backend serving a directory other than \
                 the snapshotted one needs every path the guest had open, or \
                 `--migration-on-error guest-error`"
                ))
            }
            other => self.fail("CHECK_DEVICE_STATE (load)")(other),
        })
    }

    fn require_device_state(&self) -> Result<(), BackendError> {
        if self.has_device_state() {
            return Ok(());
        }
        Err(self.state_err(
            "the backend does not offer VHOST_USER_PROTOCOL_F_DEVICE_STATE, so a snapshot \
             cannot keep what the guest has open through it"
                .into(),
        ))
    }

    fn state_err(&self, why: String) -> BackendError {
        BackendError::State {
            path: self.path.clone(),
            why,
        }
    }

    /// How many queues the backend serves for this device.
    pub fn queues(&self) -> usize {
        self.queues
    }
}

/// The error of a failed request: a timeout when the watchdog cut it short.
fn protocol_error(
    path: PathBuf,
    step: &'static str,
    source: vhost::Error,
    watchdog: &Watchdog,
) -> BackendError {
    if watchdog.fired() {
        BackendError::Timeout { path, step }
    } else {
        BackendError::Protocol { path, step, source }
    }
}

/// A pipe: (read end, write end), both close-on-exec.
fn pipe() -> std::io::Result<(std::fs::File, std::fs::File)> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    let (r, w) = unsafe {
        use std::os::fd::FromRawFd;
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    Ok((r.into(), w.into()))
}
