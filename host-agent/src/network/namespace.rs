//! Making and removing a VM's network: its namespace, the veth pair to the
//! node, the tap the vmm serves, addresses, routes and the namespace's
//! nftables rules ([`super::rules`]).
//!
//! Done with `ip` and `nft` (iproute2 and nftables), the tools operators
//! read the result with, rather than hand-written netlink: every step is one
//! command whose failure message names what it tried. A namespace is
//! removed with `ip netns del`, which takes the veth pair and the tap with
//! it once nothing holds the namespace any more, so a VM's network is
//! released even after a crash; [`VmNetwork::remove`] deletes the node's
//! veth end first, so that the pair is gone at once.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use super::addressing::{Slot, GATEWAY_IP, GATEWAY_IP6, GUEST_PREFIX, GUEST_PREFIX6, TAP_NAME};
use super::rules::{
    flush_learned_script, forget_script, learned_script, sets_script, vm_ruleset, EgressPolicy,
    Learned, DENIED_COUNTER, TABLE,
};
use crate::error::{Error, Result};

/// Prefix of the namespaces host-agent makes (a node's settings may name
/// another, so that two host-agents, or tests, keep apart).
pub const NETNS_PREFIX: &str = "agentvm-";

/// One VM's network as created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmNetwork {
    /// The namespace's name (`/run/netns/<name>`).
    pub netns: String,
    /// The node's end of the veth pair.
    pub veth_host: String,
    /// The namespace's end.
    pub veth_vm: String,
    /// The VM's /30 of the pool (and /126 of the IPv6 pool, if any).
    pub slot: Slot,
    /// The node namespace the veth's other end lives in (`None`: the one
    /// host-agent runs in; tests name one of their own).
    pub node_netns: Option<String>,
}

/// The sysctls of a VM's namespace set once its rules are loaded: IPv4
/// forwarding (IPv6's is set with its other settings), and conntrack's TCP
/// window tracking liberal, so that only segments of connections it does
/// not know are invalid there.
const NAMESPACE_FORWARDING: &str = "echo 1 > /proc/sys/net/ipv4/ip_forward && echo 1 > /proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal";

/// Who owns the tap (the jailed vmm's uid and gid; `None`: root).
pub type TapOwner = Option<(u32, u32)>;

fn run(what: &str, cmd: &mut Command, stdin: Option<&str>) -> Result<String> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        Error::io(
            format!(
                "{what}: running {:?} (are iproute2 and nftables installed?)",
                cmd.get_program()
            ),
            e,
        )
    })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|e| Error::io(format!("{what}: writing to {:?}", cmd.get_program()), e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io(format!("{what}: waiting for {:?}", cmd.get_program()), e))?;
    if !out.status.success() {
        return Err(Error::Network(format!(
            "{what}: {:?} {:?} failed ({}): {}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip [-n ns] args...`.
fn ip(ns: Option<&str>, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    if let Some(ns) = ns {
        c.args(["-n", ns]);
    }
    c.args(args);
    c
}

/// A command run inside namespace `ns`: the child joins it before it
/// runs `program` (no `ip netns exec`, whose own start and remount of /sys
/// cost more than the program does; nothing run here reads /sys).
fn in_netns(ns: Option<&str>, program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    let Some(ns) = ns else {
        return c;
    };
    match std::fs::File::open(format!("/run/netns/{ns}")) {
        Ok(file) => {
            // SAFETY: runs in the child between fork and exec; it makes one
            // system call (setns, async-signal-safe) on a descriptor the
            // closure owns, and allocates nothing.
            unsafe {
                c.pre_exec(move || {
                    if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            c
        }
        // Let `ip netns exec` say what is wrong with the namespace.
        Err(_) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]).args(args);
            c
        }
    }
}

/// Turns on IPv4 forwarding, and IPv6 forwarding too with `v6`, inside
/// namespace `ns` (`None`: the node's own; an operator's setting, changed
/// only when host-agent is told to manage the node's network). A node that
/// forwards IPv6 ignores router advertisements unless its uplink has
/// `accept_ra=2`: the operator's to set.
pub fn enable_forwarding(ns: Option<&str>, v6: bool) -> Result<()> {
    let script = if v6 {
        "echo 1 > /proc/sys/net/ipv4/ip_forward && echo 1 > /proc/sys/net/ipv6/conf/all/forwarding"
    } else {
        "echo 1 > /proc/sys/net/ipv4/ip_forward"
    };
    run(
        "enabling forwarding",
        &mut in_netns(ns, "sh", &["-c", script]),
        None,
    )
    .map(|_| ())
}

/// Applies an nftables script inside `ns`.
pub fn apply_rules(ns: Option<&str>, script: &str) -> Result<()> {
    run(
        "loading nftables rules",
        &mut in_netns(ns, "nft", &["-f", "-"]),
        Some(script),
    )
    .map(|_| ())
}

/// Adds what the session's DNS resolver learned to the learned sets of
/// namespace `netns`, in one `nft` run (nothing to do: no run).
pub fn add_learned(netns: &str, entries: &[Learned]) -> Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    run(
        "adding resolved addresses to the VM's allowlist",
        &mut in_netns(Some(netns), "nft", &["-f", "-"]),
        Some(&learned_script(entries)),
    )
    .map(|_| ())
}

/// Removes `entries` from the learned sets of namespace `netns` (those
/// already expired are fine).
pub fn forget_learned(netns: &str, entries: &[Learned]) -> Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    run(
        "removing resolved addresses from the VM's allowlist",
        &mut in_netns(Some(netns), "nft", &["-f", "-"]),
        Some(&forget_script(entries)),
    )
    .map(|_| ())
}

/// Empties the learned sets of namespace `netns`.
pub fn flush_learned(netns: &str) -> Result<()> {
    run(
        "emptying the VM's resolved addresses",
        &mut in_netns(Some(netns), "nft", &["-f", "-"]),
        Some(&flush_learned_script()),
    )
    .map(|_| ())
}

impl VmNetwork {
    /// Adds addresses allowed names resolved to, each for its TTL (see
    /// [`add_learned`]). [`VmNetwork::update_policy`] empties these sets:
    /// the resolver's `restore_learned` puts them back.
    pub fn add_learned(&self, entries: &[Learned]) -> Result<()> {
        add_learned(&self.netns, entries)
    }

    /// Names for the VM whose jail id (or session id) is `id` at `slot`,
    /// its namespace named `<prefix><id>`; interface names stay within the
    /// kernel's 15 bytes.
    pub fn plan(prefix: &str, id: &str, slot: Slot, node_netns: Option<String>) -> Self {
        let short: String = id
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(24)
            .collect();
        Self {
            netns: format!("{prefix}{short}"),
            veth_host: format!("avh{}", slot.index),
            veth_vm: format!("avv{}", slot.index),
            slot,
            node_netns,
        }
    }

    /// Creates the namespace, the veth pair, the tap (owned by `tap_owner`)
    /// and the rules of `policy`. On failure, whatever was made is removed.
    pub fn create(&self, policy: &EgressPolicy, tap_owner: TapOwner) -> Result<()> {
        let result = self.create_steps(policy, tap_owner);
        if result.is_err() {
            self.remove();
        }
        result
    }

    fn create_steps(&self, policy: &EgressPolicy, tap_owner: TapOwner) -> Result<()> {
        let node = self.node_netns.as_deref();
        let ns = Some(self.netns.as_str());
        run(
            "creating the VM's network namespace",
            &mut ip(None, &["netns", "add", &self.netns]),
            None,
        )?;
        // Without an IPv6 slot, no IPv6 in the namespace: otherwise the
        // kernel sends router and neighbour solicitations down the tap to the
        // guest as soon as it is up. With one, the namespace is a router
        // that takes no configuration from anyone: no router advertisements,
        // no autoconfiguration, no redirects.
        let sysctls = if self.slot.v6.is_some() {
            "cd /proc/sys/net/ipv6/conf && for c in all default; do echo 0 > $c/accept_ra && echo 0 > $c/autoconf && echo 0 > $c/accept_redirects; done && echo 1 > all/forwarding"
        } else {
            "[ ! -d /proc/sys/net/ipv6 ] || { echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; }"
        };
        run(
            "setting up IPv6 in the VM's namespace",
            &mut in_netns(ns, "sh", &["-c", sysctls]),
            None,
        )?;
        // The node's end, then the namespace's, each in one `ip -batch`
        // run (a process start costs more here than the work it does).
        let mut node_side = vec![
            format!(
                "link add {} type veth peer name {} netns {}",
                self.veth_host, self.veth_vm, self.netns
            ),
            format!("addr add {}/30 dev {}", self.slot.host_ip, self.veth_host),
        ];
        let (uid, gid) = tap_owner.unwrap_or((0, 0));
        let mut vm_side = vec![
            format!("addr add {}/30 dev {}", self.slot.vm_ip, self.veth_vm),
            format!("link set {} up", self.veth_vm),
            "link set lo up".to_string(),
            format!("route add default via {}", self.slot.host_ip),
            format!("tuntap add dev {TAP_NAME} mode tap user {uid} group {gid}"),
            format!("addr add {GATEWAY_IP}/{GUEST_PREFIX} dev {TAP_NAME}"),
        ];
        if let Some(v6) = self.slot.v6 {
            // `nodad`: the addresses are unique by construction, and usable
            // at once instead of after duplicate address detection.
            node_side.push(format!(
                "addr add {}/126 dev {} nodad",
                v6.host_ip, self.veth_host
            ));
            vm_side.push(format!(
                "addr add {}/126 dev {} nodad",
                v6.vm_ip, self.veth_vm
            ));
            vm_side.push(format!(
                "addr add {GATEWAY_IP6}/{GUEST_PREFIX6} dev {TAP_NAME} nodad"
            ));
            vm_side.push(format!("route add ::/0 via {}", v6.host_ip));
        }
        node_side.push(format!("link set {} up", self.veth_host));
        vm_side.push(format!("link set {TAP_NAME} up"));
        let node_script = node_side.join("\n") + "\n";
        let made = run(
            "making the node's end of the VM's veth pair",
            &mut ip(node, &["-batch", "-"]),
            Some(&node_script),
        );
        if let Err(e) = made {
            // The veth of an earlier VM of this slot whose namespace was
            // just removed goes with it, but asynchronously (the kernel
            // tears a namespace down in the background): take it down now
            // and try once more.
            if !e.to_string().contains("File exists") {
                return Err(e);
            }
            let _ = run(
                "removing a stale veth of the slot",
                &mut ip(node, &["link", "del", &self.veth_host]),
                None,
            );
            run(
                "making the node's end of the VM's veth pair",
                &mut ip(node, &["-batch", "-"]),
                Some(&node_script),
            )?;
        }
        run(
            "addressing the VM's veth, tap and routes",
            &mut ip(ns, &["-batch", "-"]),
            Some(&(vm_side.join("\n") + "\n")),
        )?;
        apply_rules(ns, &vm_ruleset(policy, &self.slot, &self.veth_vm))?;
        // After the rules: they load conntrack, whose settings appear in
        // the namespace only then. Forwarding on, and conntrack liberal
        // about TCP windows: the rules reset every guest segment conntrack
        // finds invalid (see `rules::untracked_tcp`), and a segment of a
        // live connection outside conntrack's idea of the window must not
        // be one of them.
        run(
            "turning on forwarding and liberal TCP tracking in the VM's namespace",
            &mut in_netns(ns, "sh", &["-c", NAMESPACE_FORWARDING]),
            None,
        )
        .map(|_| ())
    }

    /// Gives the namespace's rules the sets of `policy` (allowlist, deny
    /// blocks, private ranges allowed) in one transaction; the chains and
    /// what the resolver learned stay. With `reset_denied`, the `denied`
    /// counter starts again from zero.
    pub fn update_policy(&self, policy: &EgressPolicy, reset_denied: bool) -> Result<()> {
        apply_rules(
            Some(&self.netns),
            &sets_script(policy, reset_denied, self.slot.v6.is_some()),
        )
    }

    /// Packets the namespace's rules dropped so far (both families).
    pub fn denied_packets(&self) -> Result<u64> {
        let out = run(
            "reading the denied counters",
            &mut in_netns(Some(&self.netns), "nft", &["list", "counters"]),
            None,
        )?;
        Ok(denied_in_listing(&out))
    }

    /// Removes the namespace (and with it the veth pair and the tap). Never
    /// fails: what is already gone is fine.
    pub fn remove(&self) {
        // The node's veth end first: deleting it takes the pair at once,
        // where the namespace's deletion would take it only when the last
        // holder of the namespace lets go (the kernel's cleanup is
        // asynchronous). So once the namespace is gone from the list, so is
        // the veth. (A veth whose namespace was never made is removed too.)
        let _ = run(
            "removing the node's veth",
            &mut ip(
                self.node_netns.as_deref(),
                &["link", "del", &self.veth_host],
            ),
            None,
        );
        if let Err(e) = run(
            "removing the VM's network namespace",
            &mut ip(None, &["netns", "del", &self.netns]),
            None,
        ) {
            tracing::debug!(netns = %self.netns, error = %e, "network namespace already gone");
        }
    }
}

/// The sum of the `denied` counters of the `agentvm` tables in the output
/// of `nft list counters`.
fn denied_in_listing(listing: &str) -> u64 {
    let mut total = 0u64;
    let mut in_table = false;
    let mut in_counter = false;
    for line in listing.lines().map(str::trim) {
        if line.starts_with("table ") {
            in_table = line.split_whitespace().nth(2) == Some(TABLE);
        } else if line.starts_with("counter ") {
            in_counter = in_table && line.split_whitespace().nth(1) == Some(DENIED_COUNTER);
        } else if in_counter && line.starts_with("packets ") {
            total += line
                .split_whitespace()
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            in_counter = false;
        }
    }
    total
}

/// The namespaces whose names start with `prefix`, for removing the ones no
/// VM owns after a restart.
pub fn list_namespaces(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_denied_counters_of_both_tables_are_summed() {
        let listing = "table ip agentvm {\n\tcounter denied {\n\t\tpackets 7 bytes 420\n\t}\n}\ntable ip6 agentvm {\n\tcounter denied {\n\t\tpackets 5 bytes 300\n\t}\n\tcounter other {\n\t\tpackets 100 bytes 1\n\t}\n}\ntable ip elsewhere {\n\tcounter denied {\n\t\tpackets 1000 bytes 1\n\t}\n}\n";
        assert_eq!(denied_in_listing(listing), 12);
        assert_eq!(denied_in_listing(""), 0);
    }
}
