//! How the client prints what the API returns: aligned tables for people
//! (the default), or one JSON object per line for scripts (`--output json`).

use proto::hostagent as pb;
use serde_json::{json, Value};

use host_agent::sessions::state_name;

/// The client's output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns with a header line.
    Table,
    /// One JSON object per line.
    Json,
}

/// Something the client prints: one table row, or one JSON object.
pub trait Record {
    /// The column headers.
    fn headers() -> &'static [&'static str];
    /// This record's cells, in header order.
    fn cells(&self) -> Vec<String>;
    /// This record as JSON (every field, not only the table's).
    fn json(&self) -> Value;
}

/// Lays out `rows` under `headers`, each column as wide as its widest cell.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let parts: Vec<String> = cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(&mut headers.iter().copied());
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

/// Prints `items` in format `out`.
pub fn print_all<T: Record>(items: &[T], out: Output) {
    match out {
        Output::Table => {
            let rows: Vec<Vec<String>> = items.iter().map(Record::cells).collect();
            print!("{}", table(T::headers(), &rows));
        }
        Output::Json => {
            for i in items {
                println!("{}", i.json());
            }
        }
    }
}

/// Prints one record of a stream as it arrives (the table's header before
/// the first; cells separated by two spaces, since widths are not known
/// ahead).
pub fn print_streamed<T: Record>(item: &T, first: bool, out: Output) {
    match out {
        Output::Table => {
            if first {
                println!("{}", T::headers().join("  "));
            }
            println!("{}", item.cells().join("  "));
        }
        Output::Json => println!("{}", item.json()),
    }
}

/// `s`, or "-" when empty (a table's empty cell).
pub(crate) fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

impl Record for pb::Image {
    fn headers() -> &'static [&'static str] {
        &["IMAGE", "MEM_MIB", "VCPUS", "GUEST_INIT", "GOLDEN_SNAPSHOT"]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.image_id.clone(),
            self.mem_mib.to_string(),
            self.vcpus.to_string(),
            if self.guest_init { "yes" } else { "no" }.into(),
            or_dash(&self.golden_snapshot_dir),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "image_id": self.image_id,
            "kernel_path": self.kernel_path,
            "initrd_path": self.initrd_path,
            "rootfs_path": self.rootfs_path,
            "cmdline": self.cmdline,
            "mem_mib": self.mem_mib,
            "vcpus": self.vcpus,
            "guest_init": self.guest_init,
            "golden_snapshot_dir": self.golden_snapshot_dir,
            "created_at": self.created_at,
            "golden_built_at": self.golden_built_at,
            "io_limits": self.io_limits.as_ref().map(limits_json),
            "shares": shares_json(&self.shares),
        })
    }
}

impl Record for pb::Session {
    fn headers() -> &'static [&'static str] {
        &[
            "SESSION", "IMAGE", "STATE", "REASON", "PID", "BRANCH", "DETAIL",
        ]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.session_id.clone(),
            self.image_id.clone(),
            state_name(self.state).into(),
            or_dash(&self.reason),
            if self.vmm_pid == 0 {
                "-".into()
            } else {
                self.vmm_pid.to_string()
            },
            or_dash(&self.branch),
            or_dash(&self.detail),
        ]
    }
    fn json(&self) -> Value {
        let limits = self.limits.as_ref().map(|l| {
            json!({"ttl_seconds": l.ttl_seconds, "idle_timeout_seconds": l.idle_timeout_seconds})
        });
        json!({
            "session_id": self.session_id,
            "image_id": self.image_id,
            "state": state_name(self.state),
            "execution_id": self.execution_id,
            "reason": self.reason,
            "detail": self.detail,
            "created_at": self.created_at,
            "ready_at": self.ready_at,
            "ended_at": self.ended_at,
            "vmm_pid": self.vmm_pid,
            "limits": limits,
            "branch": self.branch,
            "head_commit": self.head_commit,
            "labels": self.labels,
            "network": self.network.as_ref().map(Record::json),
            "io_limits": self.io_limits.as_ref().map(limits_json),
            "resources": self.resources.as_ref().map(|r| json!({
                "vcpus": r.vcpus,
                "mem_mib": r.mem_mib,
                "cpu_millis": r.cpu_millis,
                "disk_mib": r.disk_mib,
            })),
            "shares": shares_json(&self.shares),
        })
    }
}

/// Shares as JSON, in device order.
fn shares_json(shares: &[pb::Share]) -> Value {
    shares
        .iter()
        .map(|s| {
            json!({
                "tag": s.tag,
                "host_path": s.host_path,
                "read_only": s.read_only,
                "mount_path": s.mount_path,
            })
        })
        .collect()
}

/// Rate limits as JSON: the fields that are set.
fn limits_json(l: &pb::IoLimits) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in [
        ("net_rx_bandwidth", &l.net_rx_bandwidth),
        ("net_tx_bandwidth", &l.net_tx_bandwidth),
        ("net_rx_packets", &l.net_rx_packets),
        ("net_tx_packets", &l.net_tx_packets),
        ("disk_bandwidth", &l.disk_bandwidth),
        ("disk_iops", &l.disk_iops),
    ] {
        if !v.is_empty() {
            m.insert(k.into(), Value::String(v.clone()));
        }
    }
    Value::Object(m)
}

impl Record for pb::Event {
    fn headers() -> &'static [&'static str] {
        &["SEQ", "SESSION", "FROM", "TO", "REASON", "DETAIL"]
    }
    fn cells(&self) -> Vec<String> {
        // A schedule's event has no states: its FROM/TO say whose it is.
        let (from, to) = if self.kind == "schedule" {
            (
                format!("schedule:{}", or_dash(&self.schedule_id)),
                format!("run:{}", self.run_id),
            )
        } else {
            (state_name(self.from).into(), state_name(self.to).into())
        };
        vec![
            self.seq.to_string(),
            or_dash(&self.session_id),
            from,
            to,
            or_dash(&self.reason),
            or_dash(&self.detail),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "seq": self.seq,
            "session_id": self.session_id,
            "execution_id": self.execution_id,
            "at": self.at,
            "from": state_name(self.from),
            "to": state_name(self.to),
            "reason": self.reason,
            "detail": self.detail,
            "kind": self.kind,
            "schedule_id": self.schedule_id,
            "run_id": self.run_id,
            "trigger_id": self.trigger_id,
            "node": self.node,
        })
    }
}

impl Record for pb::SessionNetwork {
    fn headers() -> &'static [&'static str] {
        &["SESSION", "VM ADDRESS", "ALLOW", "DENY", "HOSTS", "EXPOSED"]
    }
    fn cells(&self) -> Vec<String> {
        let exposed: Vec<String> = self.exposed_ports.iter().map(exposed_cell).collect();
        vec![
            self.session_id.clone(),
            or_dash(
                &[self.vm_address.as_str(), self.vm_address6.as_str()]
                    .iter()
                    .filter(|a| !a.is_empty())
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            or_dash(&self.allow.join(", ")),
            or_dash(&self.deny.join(", ")),
            or_dash(&self.hosts.join(", ")),
            or_dash(&exposed.join(", ")),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "session_id": self.session_id,
            "vm_address": self.vm_address,
            "vm_address6": self.vm_address6,
            "allow": self.allow,
            "deny": self.deny,
            "hosts": self.hosts,
            "exposed_ports": self.exposed_ports.iter().map(Record::json).collect::<Vec<_>>(),
        })
    }
}

/// `tcp 8080 -> 127.0.0.1:41234`.
fn exposed_cell(e: &pb::ExposedPort) -> String {
    format!("{} {} -> {}", e.protocol, e.guest_port, e.host_address)
}

impl Record for pb::ExposedPort {
    fn headers() -> &'static [&'static str] {
        &["GUEST PORT", "PROTOCOL", "HOST ADDRESS"]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.guest_port.to_string(),
            self.protocol.clone(),
            self.host_address.clone(),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "guest_port": self.guest_port,
            "protocol": self.protocol,
            "host_address": self.host_address,
        })
    }
}

impl Record for pb::UsageRecord {
    fn headers() -> &'static [&'static str] {
        &[
            "SEQ",
            "SESSION",
            "BILLED_S",
            "VCPU_S",
            "MEM_ALLOC_GIB_S",
            "MEM_RSS_GIB_S",
            "DISK_WRITTEN_B",
            "FINAL",
        ]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.seq.to_string(),
            self.session_id.clone(),
            format!("{:.3}", self.billed_seconds),
            format!("{:.3}", self.vcpu_seconds),
            format!("{:.4}", self.memory_allocated_gib_seconds),
            format!("{:.5}", self.memory_resident_gib_seconds),
            self.disk_bytes_written.to_string(),
            if self.r#final { "yes" } else { "no" }.into(),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "seq": self.seq,
            "session_id": self.session_id,
            "execution_id": self.execution_id,
            "interval_start": self.interval_start,
            "interval_end": self.interval_end,
            "billed_seconds": self.billed_seconds,
            "vcpu_seconds": self.vcpu_seconds,
            "memory_allocated_gib_seconds": self.memory_allocated_gib_seconds,
            "memory_resident_gib_seconds": self.memory_resident_gib_seconds,
            "disk_bytes_written": self.disk_bytes_written,
            "final": self.r#final,
            "net_rx_bytes": self.net_rx_bytes,
            "net_rx_packets": self.net_rx_packets,
            "net_tx_bytes": self.net_tx_bytes,
            "net_tx_packets": self.net_tx_packets,
            "egress_denied_packets": self.egress_denied_packets,
            "dns_denied_queries": self.dns_denied_queries,
        })
    }
}

/// The node: its version and capacity, as one record.
pub struct NodeInfo {
    /// GetVersion's answer.
    pub version: pb::Version,
    /// GetCapacity's answer.
    pub capacity: pb::Capacity,
}

impl Record for NodeInfo {
    fn headers() -> &'static [&'static str] {
        &[
            "VERSION",
            "VCPUS_USED",
            "MEMORY_MIB_USED",
            "SESSIONS_LIVE",
            "WARM_READY",
            "VMM",
        ]
    }
    fn cells(&self) -> Vec<String> {
        let c = &self.capacity;
        vec![
            self.version.version.clone(),
            format!("{}/{}", c.vcpus_used, c.vcpus_total),
            format!("{}/{}", c.memory_mib_used, c.memory_mib_total),
            format!("{}/{}", c.sessions_live, c.sessions_max),
            c.warm_pool_ready.to_string(),
            self.version.vmm_path.clone(),
        ]
    }
    fn json(&self) -> Value {
        let c = &self.capacity;
        json!({
            "version": self.version.version,
            "vmm_path": self.version.vmm_path,
            "vcpus_total": c.vcpus_total,
            "vcpus_used": c.vcpus_used,
            "memory_mib_total": c.memory_mib_total,
            "memory_mib_used": c.memory_mib_used,
            "memory_mib_limit": c.memory_mib_limit,
            "memory_overcommit_ratio": c.memory_overcommit_ratio,
            "sessions_max": c.sessions_max,
            "sessions_live": c.sessions_live,
            "warm_pool_ready": c.warm_pool_ready,
        })
    }
}

impl Record for pb::KilledProcess {
    fn headers() -> &'static [&'static str] {
        &["PID", "COMMAND"]
    }
    fn cells(&self) -> Vec<String> {
        vec![self.pid.to_string(), self.command.clone()]
    }
    fn json(&self) -> Value {
        json!({ "pid": self.pid, "command": self.command })
    }
}

impl Record for pb::Ask {
    fn headers() -> &'static [&'static str] {
        &["ASK", "EXEC", "TURN", "TOOL", "COMMAND", "RULE"]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.ask_id.clone(),
            self.exec_id.clone(),
            self.turn_id.clone(),
            self.tool.clone(),
            self.subject.clone(),
            self.rule.clone(),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "ask_id": self.ask_id,
            "session_id": self.session_id,
            "exec_id": self.exec_id,
            "turn_id": self.turn_id,
            "tool": self.tool,
            "subject": self.subject,
            "rule": self.rule,
            "asked_at": self.asked_at,
        })
    }
}

impl Record for pb::AuditRecord {
    fn headers() -> &'static [&'static str] {
        &["SEQ", "RECEIVED", "RECORD"]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.guest_seq.to_string(),
            self.received_at.to_string(),
            self.json.clone(),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "session_id": self.session_id,
            "guest_seq": self.guest_seq,
            "json": self.json,
            "host_hash": self.host_hash,
            "received_at": self.received_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_network_prints_its_lists() {
        let n = pb::SessionNetwork {
            session_id: "s1".into(),
            allow: vec!["203.0.113.0/24 tcp 443".into(), "198.51.100.0/24".into()],
            deny: vec![],
            vm_address: "10.200.0.2".into(),
            hosts: vec!["crates.io".into()],
            exposed_ports: vec![pb::ExposedPort {
                guest_port: 8080,
                protocol: "tcp".into(),
                host_address: "127.0.0.1:41234".into(),
            }],
            vm_address6: "fd00:200::2".into(),
        };
        assert_eq!(
            n.cells(),
            [
                "s1",
                "10.200.0.2, fd00:200::2",
                "203.0.113.0/24 tcp 443, 198.51.100.0/24",
                "-",
                "crates.io",
                "tcp 8080 -> 127.0.0.1:41234"
            ]
        );
        assert_eq!(n.json()["allow"][1], "198.51.100.0/24");
        assert_eq!(
            n.json()["exposed_ports"][0]["host_address"],
            "127.0.0.1:41234"
        );
    }

    #[test]
    fn columns_line_up_under_their_headers() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["wide-cell".into(), "x".into()],
                vec!["b".into(), "y".into()],
            ],
        );
        assert_eq!(t, "A          LONGER\nwide-cell  x\nb          y\n");
    }

    #[test]
    fn a_session_prints_as_a_row_and_as_json_with_every_field() {
        let s = pb::Session {
            session_id: "s1".into(),
            image_id: "img".into(),
            state: pb::SessionState::Running as i32,
            vmm_pid: 42,
            shares: vec![pb::Share {
                tag: "cargo".into(),
                host_path: "/srv/cargo".into(),
                read_only: true,
                mount_path: "/mnt/cargo".into(),
            }],
            ..Default::default()
        };
        assert_eq!(
            s.cells(),
            ["s1", "img", "RUNNING", "-", "42", "-", "-"].map(String::from)
        );
        let j = s.json();
        assert_eq!(j["state"], "RUNNING");
        assert_eq!(j["vmm_pid"], 42);
        assert_eq!(j["limits"], Value::Null);
        assert_eq!(j["shares"][0]["mount_path"], "/mnt/cargo");
        assert_eq!(j["shares"][0]["read_only"], true);
    }
}
