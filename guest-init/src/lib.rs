//! guest-init: PID 1 of every guest and the session agent.
//!
//! * [`pid1`]: mounts, hostname, network, orphan reaping, shutdown.
//! * [`channel`]: the transport to host-agent (vsock or Unix socket) and framing.
//! * [`agent`]: the session agent serving one connection at a time (a newer one
//!   from the host supersedes it).
//! * [`session`]: cloning the repository from a bundle and cutting the branch.
//! * [`exec`]: running commands with streamed output.
//! * [`files`]: file operations in the workspace for the Files API.
//! * [`pty`]: pseudo-terminals for commands that ask for one.
//! * [`policy`]: rules, wrappers, manifest, egress and secrets.
//! * [`clone_safety`]: each restore's own random state, hostname and machine id.
//! * [`sizing`]: a session's vCPUs and root disk within the VM.
//! * [`shares`]: mounting the session's virtio-fs shares (PID 1 only).
//! * [`turn`]: grouping a turn's processes and killing them.
//! * [`audit`]: the hash-chained audit log and its verifier.
//! * [`privilege`]: the unprivileged user agent commands run as.
//! * [`reaper`]: orphan reaping that never steals a managed child's status.
//! * [`workspace`]: checks on paths sent by the host.
//!
//! See README.md for the protocol, repository mechanism, policy files and
//! audit format.

pub mod agent;
pub mod audit;
pub mod channel;
pub mod clock;
pub mod clone_safety;
pub mod exec;
pub mod files;
pub mod pid1;
pub mod policy;
pub mod privilege;
pub mod pty;
pub mod reaper;
pub mod session;
pub mod shares;
pub mod sizing;
pub mod turn;
pub mod workspace;
