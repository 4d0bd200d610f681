//! The control socket's protocol: one JSON object per line each way.
//!
//! Requests: `{"op":"status"}`, `{"op":"pause"}`, `{"op":"resume"}`,
//! `{"op":"stop"}`, `{"op":"snapshot","dir":PATH,"kind":"full"|"diff"}`,
//! `{"op":"memory_checksum"}`, and for a vmm started on standby
//! (`vmm restore --standby`) `{"op":"restore","snapshot":PATH,"paused":BOOL}`.
//! Answers: `{"ok":true,...reply fields}` or
//! `{"ok":false,"error":"..."}`. The vmm's server parses requests with
//! [`Request::parse`] and writes replies with [`ok_line`] / [`error_line`];
//! clients write [`Request::to_line`] and read answers with [`decode_answer`].

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Longest request line the vmm accepts, in bytes.
pub const MAX_REQUEST_LEN: usize = 64 * 1024;
/// Longest answer line a client accepts, in bytes (a vmm is not trusted to
/// bound its own answers).
pub const MAX_ANSWER_LEN: usize = 64 * 1024;

/// The operations the socket understands.
pub const OPS: &[&str] = &[
    "status",
    "pause",
    "resume",
    "stop",
    "snapshot",
    "memory_checksum",
    "restore",
];

/// Full or diff snapshot (also the `kind` of a snapshot's manifest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// All of guest memory (zero pages left as holes).
    Full,
    /// Only pages written since the parent snapshot.
    Diff,
}

impl SnapshotKind {
    /// The lowercase name used on the wire and in manifests.
    pub fn as_str(&self) -> &'static str {
        match self {
            SnapshotKind::Full => "full",
            SnapshotKind::Diff => "diff",
        }
    }
}

/// What the VM's vCPUs are doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    /// vCPUs run the guest.
    Running,
    /// Every vCPU is parked outside KVM_RUN.
    Paused,
    /// The VM is ending or has ended.
    Stopping,
    /// A vmm started with `--standby`: its KVM VM exists (with `--mem-mib`
    /// also its memory slots and vCPUs), and it waits for a `restore`
    /// request naming the snapshot to load.
    Standby,
}

impl VmState {
    /// The lowercase name used on the control socket.
    pub fn as_str(&self) -> &'static str {
        match self {
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Stopping => "stopping",
            VmState::Standby => "standby",
        }
    }
}

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Report the state and vCPU count ([`StatusReply`]).
    Status,
    /// Park every vCPU ([`StatusReply`]).
    Pause,
    /// Let parked vCPUs run ([`StatusReply`]).
    Resume,
    /// End the VM with exit code 0 ([`StatusReply`], sent before the exit).
    Stop,
    /// Write a snapshot of the paused VM ([`SnapshotReply`]).
    Snapshot {
        /// Target directory (must not exist).
        dir: PathBuf,
        /// Full or diff.
        kind: SnapshotKind,
    },
    /// A CRC-64 of guest memory, paused VM only ([`ChecksumReply`]).
    MemoryChecksum,
    /// Load a snapshot into a vmm on standby and run it (or leave it paused)
    /// ([`StatusReply`], sent once the VM is restored). A vmm that already
    /// holds a VM refuses it.
    Restore {
        /// The snapshot directory (the top of its chain), as the vmm sees it.
        snapshot: PathBuf,
        /// Leave the vCPUs paused after the restore.
        paused: bool,
    },
}

/// The answer to status, pause, resume and stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    /// The VM's state after the request.
    pub state: VmState,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// The virtio-net device's counters; absent without one (and from a vmm
    /// that predates them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<NetCounters>,
    /// Each virtio-blk disk's counters, in `--disk` order; absent without disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<BlkCounters>,
}

/// What a virtio-net device moved since its vmm process started (a restored
/// VM starts again from zero). Bytes are Ethernet frame bytes, without the
/// virtio-net header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NetCounters {
    /// Bytes of frames delivered to the guest.
    pub rx_bytes: u64,
    /// Frames delivered to the guest.
    pub rx_packets: u64,
    /// Bytes of guest frames written to the tap.
    pub tx_bytes: u64,
    /// Guest frames written to the tap.
    pub tx_packets: u64,
    /// Times the receive rate limiter held a frame back.
    pub rx_throttled: u64,
    /// Times the transmit rate limiter held a guest frame back.
    pub tx_throttled: u64,
}

/// What a virtio-blk disk did since its vmm process started (a restored VM
/// starts again from zero). Only requests that succeeded are counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BlkCounters {
    /// Bytes read from the disk into guest memory.
    pub read_bytes: u64,
    /// Bytes written from guest memory to the disk.
    pub write_bytes: u64,
    /// Read requests.
    pub reads: u64,
    /// Write requests.
    pub writes: u64,
    /// Flush requests.
    pub flushes: u64,
    /// Times the rate limiter held a request back.
    pub throttled: u64,
}

/// The answer to a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReply {
    /// The snapshot directory, canonical.
    pub dir: PathBuf,
    /// Full or diff.
    pub kind: SnapshotKind,
    /// Bytes of guest memory written to the memory file.
    pub memory_bytes_written: u64,
    /// Pages written (`memory_bytes_written` / 4 KiB).
    pub pages_written: u64,
    /// How long the snapshot took in the vmm, milliseconds.
    pub ms: f64,
}

/// The answer to a memory checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChecksumReply {
    /// CRC-64 of all guest memory, 16 hex digits.
    pub crc64: String,
}

impl Request {
    /// The request's `op` name.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Pause => "pause",
            Request::Resume => "resume",
            Request::Stop => "stop",
            Request::Snapshot { .. } => "snapshot",
            Request::MemoryChecksum => "memory_checksum",
            Request::Restore { .. } => "restore",
        }
    }

    /// The request as one line, without the newline.
    pub fn to_line(&self) -> String {
        // Serializing a plain enum of strings and paths cannot fail, except
        // for a path that is not UTF-8, which JSON cannot carry: send it lossily
        // (the vmm then refuses a path that does not exist).
        serde_json::to_string(self).unwrap_or_else(|_| match self {
            Request::Snapshot { dir, kind } => serde_json::json!({
                "op": "snapshot",
                "dir": dir.to_string_lossy(),
                "kind": kind.as_str(),
            })
            .to_string(),
            Request::Restore { snapshot, paused } => serde_json::json!({
                "op": "restore",
                "snapshot": snapshot.to_string_lossy(),
                "paused": paused,
            })
            .to_string(),
            other => serde_json::json!({ "op": other.op() }).to_string(),
        })
    }

    /// Parses one untrusted request line; the error is the message to send back.
    pub fn parse(line: &str) -> Result<Request, String> {
        let value: Value =
            serde_json::from_str(line).map_err(|e| format!("request is not valid JSON: {e}"))?;
        let obj = value.as_object().ok_or_else(|| {
            "request must be a JSON object such as {\"op\":\"status\"}".to_string()
        })?;
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
            "restore" => (parse_restore(obj)?, &["snapshot", "paused"]),
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

fn parse_restore(obj: &Map<String, Value>) -> Result<Request, String> {
    let snapshot = match obj.get("snapshot") {
        Some(Value::String(d)) if !d.is_empty() => PathBuf::from(d),
        Some(_) => return Err("\"snapshot\" must be a non-empty string".into()),
        None => return Err("op \"restore\" needs a \"snapshot\" field".into()),
    };
    let paused = match obj.get("paused") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("\"paused\" must be true or false, not {other}")),
    };
    Ok(Request::Restore { snapshot, paused })
}

/// A successful answer carrying `reply`'s fields, as a JSON value.
pub fn ok_value<T: Serialize>(reply: &T) -> Value {
    let mut obj = Map::new();
    obj.insert("ok".into(), Value::Bool(true));
    match serde_json::to_value(reply) {
        Ok(Value::Object(fields)) => obj.extend(fields),
        // Every reply type is a struct of plain fields: always an object.
        Ok(_) | Err(_) => return error_value("internal: the reply could not be encoded"),
    }
    Value::Object(obj)
}

/// A failed answer with `message`, as a JSON value.
pub fn error_value(message: impl Into<String>) -> Value {
    serde_json::json!({"ok": false, "error": message.into()})
}

/// Why an answer line is not the reply that was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerError {
    /// `{"ok":false,"error":...}`: the vmm refused; its message.
    Refused(String),
    /// Not a well-formed answer of the expected shape; what is wrong.
    Malformed(String),
}

/// Decodes one answer line into the reply type `T`.
pub fn decode_answer<T: DeserializeOwned>(line: &str) -> Result<T, AnswerError> {
    let value: Value = serde_json::from_str(line.trim())
        .map_err(|e| AnswerError::Malformed(format!("not JSON ({e})")))?;
    match value.get("ok") {
        Some(Value::Bool(true)) => serde_json::from_value(value)
            .map_err(|e| AnswerError::Malformed(format!("not the expected reply ({e})"))),
        Some(Value::Bool(false)) => Err(AnswerError::Refused(
            value
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("no message")
                .to_string(),
        )),
        _ => Err(AnswerError::Malformed("no boolean \"ok\" field".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn known_ops_parse() {
        assert_eq!(Request::parse(r#"{"op":"status"}"#), Ok(Request::Status));
        assert_eq!(Request::parse(r#" {"op":"pause"} "#), Ok(Request::Pause));
        assert_eq!(Request::parse(r#"{"op":"resume"}"#), Ok(Request::Resume));
        assert_eq!(Request::parse(r#"{"op":"stop"}"#), Ok(Request::Stop));
        assert_eq!(
            Request::parse(r#"{"op":"memory_checksum"}"#),
            Ok(Request::MemoryChecksum)
        );
    }

    #[test]
    fn every_request_round_trips_through_its_line() {
        let all = [
            Request::Status,
            Request::Pause,
            Request::Resume,
            Request::Stop,
            Request::MemoryChecksum,
            Request::Snapshot {
                dir: "/s/1".into(),
                kind: SnapshotKind::Diff,
            },
            Request::Snapshot {
                dir: "/s/2".into(),
                kind: SnapshotKind::Full,
            },
            Request::Restore {
                snapshot: "/s/golden".into(),
                paused: true,
            },
        ];
        for r in all {
            assert_eq!(Request::parse(&r.to_line()), Ok(r.clone()), "{r:?}");
            assert!(OPS.contains(&r.op()));
        }
        assert_eq!(Request::Pause.to_line(), r#"{"op":"pause"}"#);
    }

    #[test]
    fn bad_requests_get_messages() {
        assert!(Request::parse("status")
            .unwrap_err()
            .starts_with("request is not valid JSON"));
        assert!(Request::parse("[1]").unwrap_err().contains("JSON object"));
        assert_eq!(
            Request::parse("{}").unwrap_err(),
            "request has no \"op\" field"
        );
        assert_eq!(
            Request::parse(r#"{"op":3}"#).unwrap_err(),
            "\"op\" must be a string"
        );
        assert_eq!(
            Request::parse(r#"{"op":"reboot"}"#).unwrap_err(),
            "unknown op \"reboot\"; known ops: status, pause, resume, stop, snapshot, memory_checksum, restore"
        );
        assert!(Request::parse(r#"{"op":"stop","now":true}"#)
            .unwrap_err()
            .contains("\"now\""));
    }

    #[test]
    fn snapshot_requests_parse_with_their_fields() {
        assert_eq!(
            Request::parse(r#"{"op":"snapshot","dir":"/s/1"}"#),
            Ok(Request::Snapshot {
                dir: "/s/1".into(),
                kind: SnapshotKind::Full
            })
        );
        assert_eq!(
            Request::parse(r#"{"op":"snapshot"}"#).unwrap_err(),
            "op \"snapshot\" needs a \"dir\" field"
        );
        assert!(
            Request::parse(r#"{"op":"snapshot","dir":"/s","kind":"half"}"#)
                .unwrap_err()
                .contains("\"full\" or \"diff\"")
        );
        assert!(Request::parse(r#"{"op":"snapshot","dir":7}"#).is_err());
        assert!(Request::parse(r#"{"op":"status","dir":"/s"}"#).is_err());
    }

    #[test]
    fn restore_requests_parse_with_their_fields() {
        assert_eq!(
            Request::parse(r#"{"op":"restore","snapshot":"/s/g"}"#),
            Ok(Request::Restore {
                snapshot: "/s/g".into(),
                paused: false
            })
        );
        assert_eq!(
            Request::parse(r#"{"op":"restore","snapshot":"/s/g","paused":true}"#),
            Ok(Request::Restore {
                snapshot: "/s/g".into(),
                paused: true
            })
        );
        assert_eq!(
            Request::parse(r#"{"op":"restore"}"#).unwrap_err(),
            "op \"restore\" needs a \"snapshot\" field"
        );
        assert!(Request::parse(r#"{"op":"restore","snapshot":""}"#).is_err());
        assert!(
            Request::parse(r#"{"op":"restore","snapshot":"/s","paused":"yes"}"#)
                .unwrap_err()
                .contains("true or false")
        );
        assert!(Request::parse(r#"{"op":"restore","snapshot":"/s","kind":"full"}"#).is_err());
        let standby: StatusReply =
            decode_answer(r#"{"ok":true,"state":"standby","vcpus":2}"#).unwrap();
        assert_eq!(standby.state, VmState::Standby);
    }

    #[test]
    fn replies_encode_and_decode_as_the_server_writes_them() {
        let status = StatusReply {
            state: VmState::Paused,
            vcpus: 2,
            net: None,
            disks: vec![],
        };
        let line = ok_value(&status).to_string();
        assert_eq!(
            serde_json::from_str::<Value>(&line).unwrap(),
            json!({"ok": true, "state": "paused", "vcpus": 2})
        );
        assert_eq!(decode_answer::<StatusReply>(&line), Ok(status));
        let snap = r#"{"ok":true,"dir":"/s","kind":"diff","memory_bytes_written":8192,"pages_written":2,"ms":1.5}"#;
        let reply: SnapshotReply = decode_answer(snap).unwrap();
        assert_eq!(reply.pages_written, 2);
        assert_eq!(reply.kind, SnapshotKind::Diff);
    }

    #[test]
    fn status_counters_travel_and_older_answers_still_decode() {
        let status = StatusReply {
            state: VmState::Running,
            vcpus: 1,
            net: Some(NetCounters {
                rx_bytes: 1,
                rx_packets: 2,
                tx_bytes: 3,
                tx_packets: 4,
                rx_throttled: 5,
                tx_throttled: 6,
            }),
            disks: vec![
                BlkCounters {
                    read_bytes: 512,
                    reads: 1,
                    ..BlkCounters::default()
                },
                BlkCounters {
                    flushes: 1,
                    throttled: 9,
                    ..BlkCounters::default()
                },
            ],
        };
        let line = ok_value(&status).to_string();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["net"]["tx_throttled"], 6);
        assert_eq!(v["disks"][1]["throttled"], 9);
        assert_eq!(decode_answer::<StatusReply>(&line), Ok(status));
        // A vmm without counters (or without these devices) leaves them out.
        let old: StatusReply = decode_answer(r#"{"ok":true,"state":"running","vcpus":1}"#).unwrap();
        assert_eq!((old.net, old.disks.len()), (None, 0));
        // A counter a newer vmm adds, or an older one lacks, does not break decoding.
        let partial: StatusReply = decode_answer(
            r#"{"ok":true,"state":"running","vcpus":1,"net":{"rx_bytes":7,"new_one":1}}"#,
        )
        .unwrap();
        assert_eq!(partial.net.unwrap().rx_bytes, 7);
    }

    #[test]
    fn refusals_and_malformed_answers_are_told_apart() {
        let refused = error_value("the VM is not paused").to_string();
        assert_eq!(
            decode_answer::<StatusReply>(&refused),
            Err(AnswerError::Refused("the VM is not paused".into()))
        );
        for bad in [
            "",
            "nope",
            "[]",
            r#"{"state":"running","vcpus":1}"#,
            r#"{"ok":true,"state":"dancing","vcpus":1}"#,
            r#"{"ok":true,"state":"running","vcpus":-1}"#,
        ] {
            assert!(
                matches!(
                    decode_answer::<StatusReply>(bad),
                    Err(AnswerError::Malformed(_))
                ),
                "{bad:?}"
            );
        }
    }
}
