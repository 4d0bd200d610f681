//! The control socket of a vmm on standby (`vmm restore --standby`).
//!
//! Such a vmm has done everything a restore can do before it knows its
//! snapshot (process start, seccomp filters compiled, KVM VM; with
//! `--mem-mib` also memory slots over a reservation, irqchip, PIT and vCPUs:
//! a [`PreparedVm`]) and waits here for a request
//! `{"op":"restore","snapshot":DIR,"paused":BOOL}`. Until then it answers
//! `status` (state `standby`) and `stop`, and refuses every other op.
//!
//! A restore request whose snapshot cannot be read, or does not fit the
//! prepared vCPUs, is answered with the error and the vmm stays on standby:
//! nothing has touched the VM yet. Clients are served one at a time, on the
//! calling (main) thread: a standby vmm has one user, the host-agent or
//! harness that started it. That thread has no seccomp filter yet (as in
//! every restore, the main thread installs its filter once the VM runs), so
//! this module only reads bounded lines and parses them with the same
//! parser as the filtered control threads.

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use vmm_api::protocol::{ok_value, StatusReply, VmState};

use super::protocol::{self, Request};
use super::server::{bind, read_line, write_response, ControlError, ControlServer};
use crate::control::protocol::ControlTarget;
use crate::machine::{LoadedSnapshot, PreparedVm};

/// A bound control socket with the prepared VM it will restore into.
pub struct StandbyServer {
    path: PathBuf,
    listener: UnixListener,
    prepared: PreparedVm,
}

/// A restore request whose snapshot was read and fits the prepared VM.
pub struct RestoreRequest {
    /// The snapshot, read and checked.
    pub loaded: LoadedSnapshot,
    /// The snapshot directory as the client named it.
    pub snapshot: PathBuf,
    /// Leave the vCPUs paused after the restore.
    pub paused: bool,
    /// The client that asked, waiting for the answer.
    pub client: PendingAnswer,
}

/// A client waiting for the answer to its restore request.
pub struct PendingAnswer(BufReader<UnixStream>);

/// What a standby vmm was asked to do.
pub enum StandbyRequest {
    /// Restore this snapshot.
    Restore(Box<RestoreRequest>),
    /// End without a VM (a `stop` request, already answered).
    Stop,
}

/// The answer to `status` on standby.
fn standby_status(vcpus: usize) -> serde_json::Value {
    ok_value(&StatusReply {
        state: VmState::Standby,
        vcpus: u32::try_from(vcpus).unwrap_or(u32::MAX),
        net: None,
        disks: Vec::new(),
    })
}

impl StandbyServer {
    /// Binds the control socket at `path` for a vmm holding `prepared`.
    pub fn bind(path: &Path, prepared: PreparedVm) -> Result<Self, ControlError> {
        let listener = bind(path)?;
        Ok(StandbyServer {
            path: path.into(),
            listener,
            prepared,
        })
    }

    /// Serves clients until one asks for a restore of a snapshot that can be
    /// loaded, or for a stop.
    pub fn next_request(&mut self) -> StandbyRequest {
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of fds, or memory: wait a little rather than spin.
                    tracing::warn!(error = %e, "standby: cannot accept a control client");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
            };
            if let Some(request) = self.serve_client(stream) {
                return request;
            }
        }
    }

    /// Serves one client until it leaves (`None`) or makes a request that
    /// ends the standby.
    fn serve_client(&self, stream: UnixStream) -> Option<StandbyRequest> {
        let mut writer = stream.try_clone().ok()?;
        let mut reader = BufReader::new(stream);
        loop {
            let line = match read_line(&mut reader) {
                Ok(Some(Ok(line))) => line,
                Ok(Some(Err(message))) => {
                    let _ = write_response(&mut writer, &protocol::error(message));
                    return None;
                }
                Ok(None) | Err(_) => return None,
            };
            if line.trim().is_empty() {
                continue;
            }
            let answer = match protocol::parse_request(&line) {
                Err(message) => protocol::error(message),
                Ok(Request::Status) => standby_status(self.prepared.vcpu_count()),
                Ok(Request::Stop) => {
                    let _ = write_response(
                        &mut writer,
                        &ok_value(&StatusReply {
                            state: VmState::Stopping,
                            vcpus: u32::try_from(self.prepared.vcpu_count()).unwrap_or(u32::MAX),
                            net: None,
                            disks: Vec::new(),
                        }),
                    );
                    return Some(StandbyRequest::Stop);
                }
                Ok(Request::Restore { snapshot, paused }) => {
                    match LoadedSnapshot::load(&snapshot)
                        .and_then(|loaded| loaded.fits(&self.prepared).map(|()| loaded))
                    {
                        Ok(loaded) => {
                            return Some(StandbyRequest::Restore(Box::new(RestoreRequest {
                                loaded,
                                snapshot,
                                paused,
                                client: PendingAnswer(reader),
                            })))
                        }
                        Err(e) => {
                            tracing::warn!(snapshot = %snapshot.display(), "standby: {e}");
                            protocol::error(format!("cannot restore: {e}"))
                        }
                    }
                }
                Ok(other) => protocol::error(format!(
                    "this vmm is on standby and holds no VM yet: op {:?} needs one; send \
                     {{\"op\":\"restore\",\"snapshot\":DIR}} first",
                    other.op()
                )),
            };
            if write_response(&mut writer, &answer).is_err() {
                return None;
            }
        }
    }

    /// Removes the socket (the vmm ends without a VM).
    pub fn remove(self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The prepared VM, for the restore; the socket stays bound.
    pub fn into_parts(self) -> (PreparedVm, BoundSocket) {
        (
            self.prepared,
            BoundSocket {
                path: self.path,
                listener: self.listener,
            },
        )
    }
}

/// The standby's control socket, kept bound across the restore.
pub struct BoundSocket {
    path: PathBuf,
    listener: UnixListener,
}

impl BoundSocket {
    /// Answers `client` with the restored VM's state and serves the socket
    /// (the requesting client included) for the restored VM from now on.
    pub fn serve_restored(
        self,
        mut client: PendingAnswer,
        target: std::sync::Arc<dyn ControlTarget>,
    ) -> Result<ControlServer, ControlError> {
        let coordinator = target.coordinator();
        let answer = ok_value(&StatusReply {
            state: coordinator.state(),
            vcpus: u32::try_from(coordinator.vcpu_count()).unwrap_or(u32::MAX),
            net: None,
            disks: Vec::new(),
        });
        let client = match write_response(client.0.get_mut(), &answer) {
            Ok(()) => Some(client.0),
            // The client left: the VM runs on all the same, as after a
            // restore from the command line.
            Err(_) => None,
        };
        ControlServer::serve_on(&self.path, self.listener, target, client)
    }

    /// Answers `client` with the error that ended the restore; the caller
    /// then exits (the VM may be half set up). Removes the socket.
    pub fn refuse(self, mut client: PendingAnswer, message: &str) {
        let _ = write_response(
            client.0.get_mut(),
            &protocol::error(format!("cannot restore: {message}")),
        );
        let _ = std::fs::remove_file(&self.path);
    }
}
