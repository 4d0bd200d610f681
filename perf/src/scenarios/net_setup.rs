//! network-setup: what one VM's network costs host-agent (its
//! `host_agent::network` library, as the session code calls it): making it
//! cold, handing a made one over to a session (the warm path), removing it.
//!
//! The host is not touched: a scratch namespace stands for the node (as in
//! host-agent's own network tests), `NodeNetwork::start` loads the node's
//! rules there, and the VMs' namespaces get names of this run's own prefix;
//! all of them are removed at the end, also after a failure.
//!
//! Clocks, per run, each around one library call:
//! * cold: `NodeNetwork::make(id, None, &allow)` (an address pair from the
//!   pool, the namespace, veth pair, tap, addresses, routes, forwarding and
//!   the nftables rules with the session's allowlist), as a session without
//!   a warm VM does;
//! * teardown: `NodeNetwork::release` of that network (`ip netns del`, the
//!   node's veth, the addresses back to the pool);
//! * warm-handover: on a network made ahead with no allowlist (as the warm
//!   pool does, outside the clock), the session's policy built from the
//!   node's and loaded with `VmNetwork::update_policy(policy, true)`, as
//!   CreateSession does when it takes a warm VM; that network is then
//!   released outside the clock.
//!
//! The target is under 5 ms added to CreateSession on the warm path.

use std::process::{Command, Stdio};
use std::time::Instant;

use host_agent::network::node::{parse_allow, NodeNetwork, NodeSettings};

use crate::backend::Subject;
use crate::error::{PerfError, Result};
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "network-setup";
/// The address pool of the scratch node (its namespace is private, so any
/// block does).
const POOL: &str = "10.251.0.0/16";
/// A session's allowlist: a few entries of each shape.
const SESSION_ALLOW: &[&str] = &[
    "203.0.113.0/24 tcp 443",
    "198.51.100.7 udp 53",
    "192.0.2.0/25",
    "198.51.100.64/26 tcp 8080",
];

fn runs(ctx: &Context) -> u32 {
    ctx.runs(20, 5)
}

/// Progress steps: one per run.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(ctx.warmup() + runs(ctx))
}

/// Why host-agent's network code cannot run here, if it cannot.
fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("skipped: needs root (it makes network namespaces)".into());
    }
    for (tool, package) in [("ip", "iproute2"), ("nft", "nftables")] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("skipped: {tool} is not installed ({package})"));
        }
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("skipped: /dev/net/tun is missing (load the tun module)".into());
    }
    None
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = unavailable() {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

/// `ip args...`, failing with its message.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| PerfError::Network {
            action: format!("running ip {}", args.join(" ")),
            source,
        })?;
    if !out.status.success() {
        return Err(PerfError::Net(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// The scratch node namespace and every VM namespace of the run's prefix,
/// removed when dropped.
struct Namespaces {
    node: String,
    prefix: String,
}

impl Namespaces {
    fn new() -> Result<Self> {
        let pid = std::process::id();
        let ns = Namespaces {
            node: format!("perfnode{pid}"),
            prefix: format!("perf{pid}-"),
        };
        ns.remove_all();
        ip(&["netns", "add", &ns.node])?;
        ip(&["-n", &ns.node, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    fn remove_all(&self) {
        let mut names = vec![self.node.clone()];
        if let Ok(dir) = std::fs::read_dir("/run/netns") {
            names.extend(
                dir.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .filter(|n| n.starts_with(&self.prefix)),
            );
        }
        for name in names {
            let _ = Command::new("ip")
                .args(["netns", "del", &name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        self.remove_all();
    }
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    let spaces = Namespaces::new()?;
    let settings = NodeSettings {
        pool: POOL.into(),
        node_netns: Some(spaces.node.clone()),
        netns_prefix: spaces.prefix.clone(),
        // The sessions' resolvers are not started here; naming one keeps
        // /etc/resolv.conf out of it.
        dns_upstreams: vec!["127.0.0.1".into()],
        ..NodeSettings::default()
    };
    let node = NodeNetwork::start(&settings).map_err(PerfError::HostNetwork)?;
    let allow = SESSION_ALLOW
        .iter()
        .map(|a| parse_allow(a))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(PerfError::HostNetwork)?;
    result.notes.push(format!(
        "host-agent's network library in a scratch node namespace; session allowlist of {} \
         entries; vmm only (Firecracker has no network of its own to compare)",
        allow.len()
    ));
    let metric = |id: &str, label: &str| {
        Metric::new(format!("{NAME}.{id}"), label, "ms", Subject::Vmm)
            .param("allow_entries", allow.len() as u64)
    };
    let mut cold = metric("cold", "network setup: one VM's network made cold");
    let mut warm = metric(
        "warm-handover",
        "network setup: a session's policy loaded into a made network (warm path)",
    );
    let mut teardown = metric("teardown", "network setup: one VM's network removed");
    let mut n = 0u32;
    ctx.repeat(runs(ctx), |warmup| {
        n += 1;
        let start = Instant::now();
        let vm = node
            .make(&format!("c{n}"), None, &allow)
            .map_err(PerfError::HostNetwork)?;
        cold.push(ms(start.elapsed()), warmup);
        let start = Instant::now();
        node.release(&vm);
        teardown.push(ms(start.elapsed()), warmup);

        let vm = node
            .make(&format!("w{n}"), None, &[])
            .map_err(PerfError::HostNetwork)?;
        let start = Instant::now();
        let mut policy = node.policy().clone();
        policy.allow = allow.clone();
        let loaded = vm.update_policy(&policy, true);
        let took = start.elapsed();
        node.release(&vm);
        loaded.map_err(PerfError::HostNetwork)?;
        warm.push(ms(took), warmup);
        Ok(())
    })?;
    result
        .metrics
        .extend([cold.finish(), warm.finish(), teardown.finish()]);
    Ok(())
}
