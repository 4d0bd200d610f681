//! Control-socket requests and responses, and the parser for untrusted request lines.
//!
//! Requests: `{"op":"status"}`, `{"op":"pause"}`, `{"op":"resume"}`,
//! `{"op":"stop"}`, `{"op":"snapshot","dir":PATH,"kind":"full"|"diff"}`,
//! `{"op":"memory_checksum"}`. Responses: `{"ok":true,...}` or
//! `{"ok":false,"error":"..."}`.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::exit::ExitReason;
use crate::snapshot::manifest::SnapshotKind;
use crate::vcpu::coordinator::{Coordinator, VmState};

/// What the control socket drives: the VM's coordinator plus the operations
/// that need the whole machine.
pub trait ControlTarget: Send + Sync {
    /// The vCPU coordinator (status, pause, resume, stop).
    fn coordinator(&self) -> &Coordinator;
    /// Writes a snapshot of the paused VM; returns fields for the response.
    fn snapshot(&self, dir: &Path, kind: SnapshotKind) -> Result<Map<String, Value>, String>;
    /// CRC-64 of all guest memory of the paused VM.
    fn memory_checksum(&self) -> Result<u64, String>;
    /// Delivers console output the guest produced so far (after a pause).
    fn flush_console(&self) {}
}

/// Longest request line accepted, in bytes.
pub const MAX_REQUEST_LEN: usize = 64 * 1024;

/// The operations the socket understands.
pub const OPS: &[&str] = &[
    "status",
    "pause",
    "resume",
    "stop",
    "snapshot",
    "memory_checksum",
];

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Report the state and vCPU count.
    Status,
    /// Park every vCPU.
    Pause,
    /// Let parked vCPUs run.
    Resume,
    /// End the VM (exit code 0).
    Stop,
    /// Write a snapshot of the paused VM.
    Snapshot {
        /// Target directory (must not exist).
        dir: PathBuf,
        /// Full or diff.
        kind: SnapshotKind,
    },
    /// Report a CRC-64 of guest memory (paused VM only; for verification).
    MemoryChecksum,
}

/// Parses one request line; the error is the message to send back.
pub fn parse_request(line: &str) -> Result<Request, String> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| format!("request is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or_else(|| "request must be a JSON object such as {\"op\":\"status\"}".to_string())?;
    let op = match obj.get("op") {
        Some(Value::String(op)) => op.as_str(),
        Some(_) => return Err("\"op\" must be a string".into()),
        None => return Err("request has no \"op\" field".into()),
    };
    let (request, fields): (Request, &[&str]) = match op {
        "status" => (Request::Status, &[]),
        "pause" => (Request::Pause, &[]),
        "resume" => (Request::Resume, &[]),
        "stop" => (Request::Stop, &[]),
        "memory_checksum" => (Request::MemoryChecksum, &[]),
        "snapshot" => (parse_snapshot(obj)?, &["dir", "kind"]),
        other => {
            return Err(format!(
                "unknown op {other:?}; known ops: {}",
                OPS.join(", ")
            ))
        }
    };
    if let Some(extra) = obj
        .keys()
        .find(|k| k.as_str() != "op" && !fields.contains(&k.as_str()))
    {
        return Err(format!("op {op:?} takes no field {extra:?}"));
    }
    Ok(request)
}

fn parse_snapshot(obj: &Map<String, Value>) -> Result<Request, String> {
    let dir = match obj.get("dir") {
        Some(Value::String(d)) if !d.is_empty() => PathBuf::from(d),
        Some(_) => return Err("\"dir\" must be a non-empty string".into()),
        None => return Err("op \"snapshot\" needs a \"dir\" field".into()),
    };
    let kind = match obj.get("kind") {
        None => SnapshotKind::Full,
        Some(Value::String(k)) if k == "full" => SnapshotKind::Full,
        Some(Value::String(k)) if k == "diff" => SnapshotKind::Diff,
        Some(other) => {
            return Err(format!(
                "\"kind\" must be \"full\" or \"diff\", not {other}"
            ))
        }
    };
    Ok(Request::Snapshot { dir, kind })
}

/// A successful response carrying `fields`.
pub fn ok(fields: Map<String, Value>) -> Value {
    let mut obj = Map::new();
    obj.insert("ok".into(), Value::Bool(true));
    obj.extend(fields);
    Value::Object(obj)
}

/// A failed response with `message`.
pub fn error(message: impl Into<String>) -> Value {
    json!({"ok": false, "error": message.into()})
}

fn state_fields(state: VmState, vcpus: usize) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("state".into(), Value::String(state.as_str().into()));
    m.insert("vcpus".into(), Value::from(vcpus));
    m
}

/// Carries out `request` and builds its response. `Stop` only answers here;
/// the caller requests the stop after the response is written, so the client
/// always gets it before the process exits.
pub fn handle(request: &Request, target: &dyn ControlTarget) -> Value {
    let coordinator = target.coordinator();
    let vcpus = coordinator.vcpu_count();
    match request {
        Request::Status => ok(state_fields(coordinator.state(), vcpus)),
        Request::Pause => match coordinator.pause() {
            Ok(()) => {
                target.flush_console();
                ok(state_fields(VmState::Paused, vcpus))
            }
            Err(e) => error(format!("cannot pause: {e}")),
        },
        Request::Resume => match coordinator.resume() {
            Ok(()) => ok(state_fields(VmState::Running, vcpus)),
            Err(e) => error(format!("cannot resume: {e}")),
        },
        Request::Stop => ok(state_fields(VmState::Stopping, vcpus)),
        Request::Snapshot { dir, kind } => match target.snapshot(dir, *kind) {
            Ok(fields) => ok(fields),
            Err(e) => error(format!("cannot snapshot: {e}")),
        },
        Request::MemoryChecksum => match target.memory_checksum() {
            Ok(crc) => {
                let mut m = Map::new();
                m.insert("crc64".into(), Value::from(format!("{crc:016x}")));
                ok(m)
            }
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

    #[test]
    fn known_ops_parse() {
        assert_eq!(parse_request(r#"{"op":"status"}"#), Ok(Request::Status));
        assert_eq!(parse_request(r#" {"op":"pause"} "#), Ok(Request::Pause));
        assert_eq!(parse_request(r#"{"op":"resume"}"#), Ok(Request::Resume));
        assert_eq!(parse_request(r#"{"op":"stop"}"#), Ok(Request::Stop));
    }

    #[test]
    fn bad_requests_get_messages() {
        assert!(parse_request("status")
            .unwrap_err()
            .starts_with("request is not valid JSON"));
        assert!(parse_request("[1]").unwrap_err().contains("JSON object"));
        assert_eq!(
            parse_request("{}").unwrap_err(),
            "request has no \"op\" field"
        );
        assert_eq!(
            parse_request(r#"{"op":3}"#).unwrap_err(),
            "\"op\" must be a string"
        );
        assert_eq!(
            parse_request(r#"{"op":"reboot"}"#).unwrap_err(),
            "unknown op \"reboot\"; known ops: status, pause, resume, stop, snapshot, memory_checksum"
        );
        assert!(parse_request(r#"{"op":"stop","now":true}"#)
            .unwrap_err()
            .contains("\"now\""));
    }

    #[test]
    fn snapshot_requests_parse_with_their_fields() {
        assert_eq!(
            parse_request(r#"{"op":"snapshot","dir":"/s/1","kind":"diff"}"#),
            Ok(Request::Snapshot {
                dir: "/s/1".into(),
                kind: SnapshotKind::Diff
            })
        );
        assert_eq!(
            parse_request(r#"{"op":"snapshot","dir":"/s/1"}"#),
            Ok(Request::Snapshot {
                dir: "/s/1".into(),
                kind: SnapshotKind::Full
            })
        );
        assert_eq!(
            parse_request(r#"{"op":"snapshot"}"#).unwrap_err(),
            "op \"snapshot\" needs a \"dir\" field"
        );
        assert!(
            parse_request(r#"{"op":"snapshot","dir":"/s","kind":"half"}"#)
                .unwrap_err()
                .contains("\"full\" or \"diff\"")
        );
        assert!(parse_request(r#"{"op":"snapshot","dir":7}"#).is_err());
        assert!(parse_request(r#"{"op":"status","dir":"/s"}"#).is_err());
    }

    struct Fake(Coordinator);

    impl ControlTarget for Fake {
        fn coordinator(&self) -> &Coordinator {
            &self.0
        }
        fn snapshot(&self, _: &Path, _: SnapshotKind) -> Result<Map<String, Value>, String> {
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
