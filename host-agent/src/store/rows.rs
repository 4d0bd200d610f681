//! The rows of the node's database, as the rest of host-agent sees them.

use std::collections::BTreeMap;

/// A registered image.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ImageRow {
    /// Caller-chosen id.
    pub id: String,
    /// Kernel image path.
    pub kernel: String,
    /// Root filesystem path, may be empty.
    pub rootfs: String,
    /// Initial ramdisk path, may be empty.
    pub initrd: String,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory.
    pub mem_mib: u32,
    /// vCPU count.
    pub vcpus: u32,
    /// Whether the image runs guest-init.
    pub guest_init: bool,
    /// Golden snapshot directory, empty until built.
    pub golden_dir: String,
    /// Registration time (Unix ms).
    pub created_at: i64,
    /// Golden snapshot time (Unix ms), 0 until built.
    pub golden_built_at: i64,
    /// Its VMs' device rate limits, encoded by [`crate::io_limits::IoLimits`]
    /// (empty: none).
    pub io_limits: String,
    /// For an image made from a session's snapshot: that session (its
    /// golden snapshot is a layer of that session's chain).
    pub source_session: String,
    /// Host directories shared into its VMs, encoded by
    /// [`crate::shares::encode`] (empty: none); its golden snapshot has a
    /// virtio-fs device per share, in this order.
    pub shares: String,
}

/// A session as persisted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionRow {
    /// Session id (UUID).
    pub id: String,
    /// Image it was created from.
    pub image_id: String,
    /// `SessionState` as i32.
    pub state: i32,
    /// Current execution id.
    pub execution_id: String,
    /// Last stop/pause/failure reason.
    pub reason: String,
    /// Detail for `reason`.
    pub detail: String,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// First READY (Unix ms), 0 before.
    pub ready_at: i64,
    /// STOPPED/FAILED time (Unix ms), 0 before.
    pub ended_at: i64,
    /// The vmm process, 0 when none.
    pub vmm_pid: u32,
    /// The vmm's start time in clock ticks since boot (field 22 of
    /// /proc/PID/stat), to tell a re-used pid apart on re-attach.
    pub vmm_start_ticks: u64,
    /// The session's directory on the node.
    pub dir: String,
    /// TTL in seconds (0 = none).
    pub ttl_s: u64,
    /// Idle timeout in seconds (0 = none).
    pub idle_s: u64,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Session branch after stop.
    pub branch: String,
    /// Head commit of the branch after stop.
    pub head_commit: String,
    /// Last API activity (Unix ms), for the idle timeout.
    pub last_activity: i64,
    /// Host repository served to guest-init.
    pub repository: String,
    /// Agent name for guest-init.
    pub agent: String,
    /// Base ref for guest-init.
    pub base_ref: String,
    /// The client that created the session (`legacy` for sessions from
    /// before owners were recorded).
    pub owner: String,
    /// uid (= gid) of the session's jailed vmm, 0 when not jailed. Kept so a
    /// restarted host-agent never hands a live session's uid to another VM.
    pub jail_uid: u32,
    /// The session's device rate limits in force (the image's with the
    /// session's overrides), encoded by [`crate::io_limits::IoLimits`].
    pub io_limits: String,
    /// The node-side addresses its guest is NATed to (the VM's IPv4 pool
    /// address, then its IPv6 one when it has one), comma-separated; empty
    /// without a network.
    pub vm_addresses: String,
    /// The session's size, encoded by
    /// [`crate::sessions::resources::Resources`] (empty in a row from
    /// before sizes were recorded: the image's).
    pub resources: String,
    /// The snapshot layer its memory descends from (the parent of its next
    /// diff); empty for a session from before layers were recorded.
    pub base_layer: String,
    /// PAUSED to disk: no vmm; `base_layer` holds its memory.
    pub persisted: bool,
    /// Exec, Attach and Files calls resume it from disk.
    pub auto_resume: bool,
    /// The session it was forked from (or whose snapshot its image is).
    pub parent_session: String,
    /// Its shares in force (the image's with its own), encoded by
    /// [`crate::shares::encode`]; every VM of the session gets them.
    pub shares: String,
    /// The virtiofsd processes serving its vmm (`pid:start_ticks`, see
    /// [`crate::shares::Daemons::encode`]), for a restarted host-agent.
    pub fs_daemons: String,
}

/// One event: a session's lifecycle step, or a schedule's fire or run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventRow {
    /// Per-node sequence number.
    pub seq: u64,
    /// Session.
    pub session_id: String,
    /// Execution id at the time.
    pub execution_id: String,
    /// Unix ms.
    pub at: i64,
    /// From state (i32).
    pub from: i32,
    /// To state (i32).
    pub to: i32,
    /// Reason.
    pub reason: String,
    /// Detail.
    pub detail: String,
    /// [`EVENT_SESSION`] or [`EVENT_SCHEDULE`].
    pub kind: String,
    /// A schedule event's schedule (empty for a trigger without one).
    pub schedule_id: String,
    /// A schedule event's run.
    pub run_id: u64,
    /// A schedule event's trigger, when a delivery started the run.
    pub trigger_id: String,
}

/// The kind of a session's lifecycle events.
pub const EVENT_SESSION: &str = "session";
/// The kind of a schedule's (or trigger's) fire and run events.
pub const EVENT_SCHEDULE: &str = "schedule";

/// One usage record.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UsageRow {
    /// Per-node sequence number (0 before insertion).
    pub seq: u64,
    /// Session.
    pub session_id: String,
    /// Execution id.
    pub execution_id: String,
    /// Interval start (Unix ms).
    pub interval_start: i64,
    /// Interval end (Unix ms).
    pub interval_end: i64,
    /// Cumulative billed milliseconds.
    pub billed_ms: i64,
    /// Cumulative vCPU nanoseconds.
    pub vcpu_ns: u64,
    /// Cumulative GiB-milliseconds at allocated size.
    pub mem_alloc_gib_ms: f64,
    /// Cumulative GiB-milliseconds at resident size.
    pub mem_resident_gib_ms: f64,
    /// Snapshot storage held for the session, GiB x ms, cumulative.
    pub snapshot_gib_ms: f64,
    /// Cumulative disk bytes written.
    pub disk_bytes: u64,
    /// Last record of the session.
    pub is_final: bool,
    /// Raw vCPU-thread CPU time of the process at `interval_end` (ns).
    pub raw_cpu_ns: u64,
    /// Raw write_bytes of the process at `interval_end`.
    pub raw_disk: u64,
    /// Cumulative network counters.
    pub net: crate::accounting::NetIo,
}

/// One audit record from a guest, chained on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRow {
    /// Session.
    pub session_id: String,
    /// The guest's seq.
    pub guest_seq: u64,
    /// The JSON line.
    pub json: String,
    /// Host chain hash (hex).
    pub host_hash: String,
    /// Unix ms.
    pub received_at: i64,
}
