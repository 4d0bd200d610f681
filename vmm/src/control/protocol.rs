//! Control-socket requests and responses, and the parser for untrusted request lines.
//!
//! Requests: `{"op":"status"}`, `{"op":"pause"}`, `{"op":"resume"}`,
//! `{"op":"stop"}`. Responses: `{"ok":true,...}` or `{"ok":false,"error":"..."}`.

use serde_json::{json, Map, Value};

use crate::vcpu::coordinator::{Coordinator, VmState};
use crate::exit::ExitReason;

/// Longest request line accepted, in bytes.
pub const MAX_REQUEST_LEN: usize = 64 * 1024;

/// The operations the socket understands.
pub const OPS: &[&str] = &["status", "pause", "resume", "stop"];

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
    let request = match op {
        "status" => Request::Status,
        "pause" => Request::Pause,
        "resume" => Request::Resume,
        "stop" => Request::Stop,
        other => {
            return Err(format!(
                "unknown op {other:?}; known ops: {}",
                OPS.join(", ")
            ))
        }
    };
    if let Some(extra) = obj.keys().find(|k| k.as_str() != "op") {
        return Err(format!("op {op:?} takes no field {extra:?}"));
    }
    Ok(request)
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
pub fn handle(request: &Request, coordinator: &Coordinator) -> Value {
    let vcpus = coordinator.vcpu_count();
    match request {
        Request::Status => ok(state_fields(coordinator.state(), vcpus)),
        Request::Pause => match coordinator.pause() {
            Ok(()) => ok(state_fields(VmState::Paused, vcpus)),
            Err(e) => error(format!("cannot pause: {e}")),
        },
        Request::Resume => match coordinator.resume() {
            Ok(()) => ok(state_fields(VmState::Running, vcpus)),
            Err(e) => error(format!("cannot resume: {e}")),
        },
        Request::Stop => ok(state_fields(VmState::Stopping, vcpus)),
    }
}

/// Follow-up work after the response to `request` has been sent.
pub fn after_response(request: &Request, coordinator: &Coordinator) {
    if *request == Request::Stop {
        coordinator.request_exit(ExitReason::StopRequested);
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
        assert!(parse_request("status").unwrap_err().starts_with("request is not valid JSON"));
        assert!(parse_request("[1]").unwrap_err().contains("JSON object"));
        assert_eq!(parse_request("{}").unwrap_err(), "request has no \"op\" field");
        assert_eq!(parse_request(r#"{"op":3}"#).unwrap_err(), "\"op\" must be a string");
        assert_eq!(
            parse_request(r#"{"op":"reboot"}"#).unwrap_err(),
            "unknown op \"reboot\"; known ops: status, pause, resume, stop"
        );
        assert!(parse_request(r#"{"op":"stop","now":true}"#).unwrap_err().contains("\"now\""));
    }

    #[test]
    fn status_reports_state_and_vcpus() {
        let c = Coordinator::new(3);
        let v = handle(&Request::Status, &c);
        assert_eq!(v, json!({"ok": true, "state": "running", "vcpus": 3}));
        let v = handle(&Request::Resume, &c);
        assert_eq!(v["ok"], false);
        assert_eq!(v["error"], "cannot resume: the VM is not paused");
    }
}
