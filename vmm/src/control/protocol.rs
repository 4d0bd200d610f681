//! Control-socket requests and their handling. The wire types and the
//! parser for untrusted request lines are `vmm_api::protocol`, shared with
//! every client, so server and clients cannot drift.

use std::path::Path;

use serde_json::Value;
use vmm_api::protocol::{
    error_value, ok_value, BlkCounters, ChecksumReply, NetCounters, SnapshotReply, StatusReply,
};
pub use vmm_api::protocol::{Request, MAX_REQUEST_LEN, OPS};

use crate::exit::ExitReason;
use crate::snapshot::manifest::SnapshotKind;
use crate::vcpu::coordinator::{Coordinator, VmState};

/// What the control socket drives: the VM's coordinator plus the operations
/// that need the whole machine.
pub trait ControlTarget: Send + Sync {
    /// The vCPU coordinator (status, pause, resume, stop).
    fn coordinator(&self) -> &Coordinator;
    /// Writes a snapshot of the paused VM.
    fn snapshot(&self, dir: &Path, kind: SnapshotKind) -> Result<SnapshotReply, String>;
    /// CRC-64 of all guest memory of the paused VM.
    fn memory_checksum(&self) -> Result<u64, String>;
    /// Delivers console output the guest produced so far (after a pause).
    fn flush_console(&self) {}
    /// The virtio-net device's counters (if there is one) and each disk's,
    /// in device order.
    fn io_counters(&self) -> (Option<NetCounters>, Vec<BlkCounters>) {
        (None, Vec::new())
    }
}

/// Parses one request line; the error is the message to send back.
pub fn parse_request(line: &str) -> Result<Request, String> {
    Request::parse(line)
}

/// A failed response with `message`.
pub fn error(message: impl Into<String>) -> Value {
    error_value(message)
}

fn state(target: &dyn ControlTarget, state: VmState, vcpus: usize) -> Value {
    let (net, disks) = target.io_counters();
    ok_value(&StatusReply {
        state,
        vcpus: u32::try_from(vcpus).unwrap_or(u32::MAX),
        net,
        disks,
    })
}

/// Carries out `request` and builds its response. `Stop` only answers here;
/// the caller requests the stop after the response is written, so the client
/// always gets it before the process exits.
pub fn handle(request: &Request, target: &dyn ControlTarget) -> Value {
    let coordinator = target.coordinator();
    let vcpus = coordinator.vcpu_count();
    match request {
        Request::Status => state(target, coordinator.state(), vcpus),
        Request::Pause => match coordinator.pause() {
            Ok(()) => {
                target.flush_console();
                state(target, VmState::Paused, vcpus)
            }
            Err(e) => error(format!("cannot pause: {e}")),
        },
        Request::Resume => match coordinator.resume() {
            Ok(()) => state(target, VmState::Running, vcpus),
            Err(e) => error(format!("cannot resume: {e}")),
        },
        Request::Stop => state(target, VmState::Stopping, vcpus),
        Request::Snapshot { dir, kind } => match target.snapshot(dir, *kind) {
            Ok(reply) => ok_value(&reply),
            Err(e) => error(format!("cannot snapshot: {e}")),
        },
        Request::Restore { .. } => error(
            "this vmm already holds a VM: restore is for a vmm started with \
             `vmm restore --standby`",
        ),
        Request::MemoryChecksum => match target.memory_checksum() {
            Ok(crc) => ok_value(&ChecksumReply {
                crc64: format!("{crc:016x}"),
            }),
            Err(e) => error(format!("cannot checksum memory: {e}")),
        },
    }
}

/// Follow-up work after the response to `request` has been sent.
pub fn after_response(request: &Request, target: &dyn ControlTarget) {
    if *request == Request::Stop {
        target.coordinator().request_exit(ExitReason::StopRequested);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    struct Fake(Coordinator);

    /// A target whose devices moved something.
    struct WithDevices(Coordinator);

    impl ControlTarget for WithDevices {
        fn coordinator(&self) -> &Coordinator {
            &self.0
        }
        fn snapshot(&self, _: &Path, _: SnapshotKind) -> Result<SnapshotReply, String> {
            Err("no".into())
        }
        fn memory_checksum(&self) -> Result<u64, String> {
            Err("no".into())
        }
        fn io_counters(&self) -> (Option<NetCounters>, Vec<BlkCounters>) {
            let net = NetCounters {
                tx_packets: 2,
                tx_bytes: 120,
                ..NetCounters::default()
            };
            let disk = BlkCounters {
                reads: 1,
                read_bytes: 512,
                ..BlkCounters::default()
            };
            (Some(net), vec![disk])
        }
    }

    #[test]
    fn status_carries_the_device_counters() {
        let c = WithDevices(Coordinator::new(1));
        let v = handle(&Request::Status, &c);
        assert_eq!(v["net"]["tx_packets"], 2);
        assert_eq!(v["net"]["tx_bytes"], 120);
        assert_eq!(v["net"]["rx_throttled"], 0);
        assert_eq!(v["disks"][0]["read_bytes"], 512);
        let reply: StatusReply = serde_json::from_value(v).unwrap();
        assert_eq!(reply.disks.len(), 1);
        assert_eq!(handle(&Request::Stop, &c)["net"]["tx_packets"], 2);
    }

    impl ControlTarget for Fake {
        fn coordinator(&self) -> &Coordinator {
            &self.0
        }
        fn snapshot(&self, _: &Path, _: SnapshotKind) -> Result<SnapshotReply, String> {
            Err("the VM is running".into())
        }
        fn memory_checksum(&self) -> Result<u64, String> {
            Ok(0xabc)
        }
    }

    #[test]
    fn status_reports_state_and_vcpus() {
        let c = Fake(Coordinator::new(3));
        let v = handle(&Request::Status, &c);
        assert_eq!(v, json!({"ok": true, "state": "running", "vcpus": 3}));
        let v = handle(&Request::Resume, &c);
        assert_eq!(v["ok"], false);
        assert_eq!(v["error"], "cannot resume: the VM is not paused");
        let v = handle(
            &Request::Snapshot {
                dir: "/x".into(),
                kind: SnapshotKind::Full,
            },
            &c,
        );
        assert_eq!(
            v,
            json!({"ok": false, "error": "cannot snapshot: the VM is running"})
        );
        assert_eq!(
            handle(&Request::MemoryChecksum, &c),
            json!({"ok": true, "crc64": "0000000000000abc"})
        );
    }
}
