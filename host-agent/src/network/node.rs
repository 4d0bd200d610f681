//! The node's side of sessions' networks: its pool of VM addresses, its
//! masquerading and VM-isolation rules, the egress policy every VM starts
//! from, and the removal of VM namespaces nothing owns any more (after a
//! crash or a SIGKILLed host-agent).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

use super::addressing::{AddressPool, Cidr};
use super::namespace::{apply_rules, enable_forwarding, list_namespaces, TapOwner, VmNetwork};
use super::rules::{node_ruleset, Allow, EgressPolicy, Proto};
use crate::error::{Error, Result};

/// How the node's network is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSettings {
    /// The pool VMs' host-side /30s come from, e.g. `10.200.0.0/16`.
    pub pool: String,
    /// The IPv6 pool their /126s come from (e.g. `fd00:200::/112`);
    /// `None`: VMs get no IPv6.
    pub pool6: Option<String>,
    /// The node-wide allowlist: `CIDR`, `CIDR tcp|udp`, or `CIDR tcp|udp PORT`.
    pub allow: Vec<String>,
    /// Private ranges an allowlist may name (otherwise always dropped).
    pub private_allowed: Vec<String>,
    /// The namespace standing for the node (tests); `None`: host-agent's own.
    pub node_netns: Option<String>,
    /// Turn on forwarding and load the node's rules at start (off where
    /// the operator manages the node's firewall).
    pub manage_node: bool,
    /// Prefix of the VM namespaces (`agentvm-` by default): everything under
    /// it not owned by a live VM is removed by [`NodeNetwork::remove_orphans`].
    pub netns_prefix: String,
    /// The address exposed guest ports listen on.
    pub expose_address: String,
    /// Upstream resolvers of the sessions' DNS resolvers, `ADDRESS[:PORT]`;
    /// empty: the `nameserver`s of /etc/resolv.conf.
    pub dns_upstreams: Vec<String>,
}

impl Default for NodeSettings {
    fn default() -> Self {
        Self {
            pool: "10.200.0.0/16".into(),
            pool6: None,
            allow: vec![],
            private_allowed: vec![],
            node_netns: None,
            manage_node: true,
            netns_prefix: super::namespace::NETNS_PREFIX.into(),
            expose_address: "127.0.0.1".into(),
            dns_upstreams: vec![],
        }
    }
}

/// Parses an upstream resolver: `ADDRESS` (port 53) or `ADDRESS:PORT`.
pub fn parse_upstream(text: &str) -> Result<SocketAddr> {
    text.parse::<SocketAddr>()
        .or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
        .map_err(|_| {
            Error::invalid(format!(
                "DNS upstream {text:?} is not an address or address:port"
            ))
        })
}

/// Parses an allowlist entry: `CIDR`, `CIDR tcp|udp`, `CIDR tcp|udp PORT`.
pub fn parse_allow(entry: &str) -> Result<Allow> {
    let words: Vec<&str> = entry.split_whitespace().collect();
    let bad = |why: &str| Error::invalid(format!("allow entry {entry:?}: {why}"));
    let cidr = Cidr::parse(words.first().ok_or_else(|| bad("empty"))?)?;
    let proto = match words.get(1) {
        None => None,
        Some(&"tcp") => Some(Proto::Tcp),
        Some(&"udp") => Some(Proto::Udp),
        Some(other) => return Err(bad(&format!("protocol {other:?} is not tcp or udp"))),
    };
    let port = match words.get(2) {
        None => None,
        Some(p) => Some(
            p.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| bad(&format!("port {p:?} is not 1 to 65535")))?,
        ),
    };
    if words.len() > 3 {
        return Err(bad("expected CIDR [tcp|udp [PORT]]"));
    }
    Ok(Allow { cidr, proto, port })
}

/// The node's addresses, IPv4 and IPv6 (in `ns`, or host-agent's own
/// namespace), each as a /32 or /128: VMs may never reach them.
pub fn node_addresses(ns: Option<&str>) -> Result<Vec<Cidr>> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = ns {
        cmd.args(["-n", ns]);
    }
    let out = cmd
        .args(["-o", "addr", "show"])
        .output()
        .map_err(|e| Error::io("listing the node's addresses with ip", e))?;
    if !out.status.success() {
        return Err(Error::Network(format!(
            "ip -o addr show failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.find(|x| *x == "inet" || *x == "inet6")?;
            let addr: IpAddr = w.next()?.split('/').next()?.parse().ok()?;
            Some(Cidr::host(addr))
        })
        .collect())
}

/// The node's network: the address pool and the policy VMs start from.
#[derive(Debug)]
pub struct NodeNetwork {
    pool: Mutex<AddressPool>,
    policy: EgressPolicy,
    node_netns: Option<String>,
    prefix: String,
    expose_address: IpAddr,
    upstreams: Vec<SocketAddr>,
}

impl NodeNetwork {
    /// Checks `settings`, reads the node's addresses and, when asked to
    /// manage the node, turns on forwarding and loads the node's rules.
    pub fn start(settings: &NodeSettings) -> Result<Self> {
        if settings.netns_prefix.is_empty()
            || settings.netns_prefix.len() > 24
            || !settings
                .netns_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(Error::invalid(format!(
                "network namespace prefix {:?} must be 1 to 24 letters, digits or '-'",
                settings.netns_prefix
            )));
        }
        let block = Cidr::parse(&settings.pool)?;
        let block6 = settings.pool6.as_deref().map(Cidr::parse).transpose()?;
        let pool = AddressPool::new(block, block6)?;
        let allow = settings
            .allow
            .iter()
            .map(|a| parse_allow(a))
            .collect::<Result<Vec<_>>>()?;
        let private_allowed = settings
            .private_allowed
            .iter()
            .map(|c| Cidr::parse(c))
            .collect::<Result<Vec<_>>>()?;
        let expose_address: IpAddr = settings.expose_address.parse().map_err(|_| {
            Error::invalid(format!(
                "expose_address {:?} is not an IP address",
                settings.expose_address
            ))
        })?;
        let upstreams = if settings.dns_upstreams.is_empty() {
            // A node without resolvers still runs sessions: their resolvers
            // answer allowed names with SERVFAIL until it has some.
            super::dns::read_upstreams(Path::new("/etc/resolv.conf")).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "sessions' DNS resolvers have no upstream");
                vec![]
            })
        } else {
            settings
                .dns_upstreams
                .iter()
                .map(|u| parse_upstream(u))
                .collect::<Result<Vec<_>>>()?
        };
        let ns = settings.node_netns.as_deref();
        let addresses = node_addresses(ns)?;
        if settings.manage_node {
            enable_forwarding(ns, block6.is_some())?;
            apply_rules(ns, &node_ruleset(block, block6))?;
        }
        let pools: Vec<Cidr> = std::iter::once(block).chain(block6).collect();
        Ok(Self {
            pool: Mutex::new(pool),
            policy: EgressPolicy::new(allow, &addresses, &pools, private_allowed),
            node_netns: settings.node_netns.clone(),
            prefix: settings.netns_prefix.clone(),
            expose_address,
            upstreams,
        })
    }

    /// The address exposed guest ports listen on.
    pub fn expose_address(&self) -> IpAddr {
        self.expose_address
    }

    /// The resolvers the sessions' DNS resolvers ask.
    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.upstreams
    }

    /// Whether VMs get IPv6 (the node has an IPv6 pool).
    pub fn has_ipv6(&self) -> bool {
        self.pool().block6().is_some()
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, AddressPool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The policy every VM starts from.
    pub fn policy(&self) -> &EgressPolicy {
        &self.policy
    }

    /// Makes the network of the VM named `id`, its tap owned by `tap_owner`,
    /// its guest allowed `allow` (within the node's allowlist: see
    /// [`super::grants`]) on top of the node's fixed denials.
    pub fn make(&self, id: &str, tap_owner: TapOwner, allow: &[Allow]) -> Result<VmNetwork> {
        let slot = self.pool().allocate()?;
        let vm = VmNetwork::plan(&self.prefix, id, slot, self.node_netns.clone());
        let mut policy = self.policy.clone();
        policy.allow = allow.to_vec();
        if let Err(e) = vm.create(&policy, tap_owner) {
            self.pool().release(&slot);
            return Err(e);
        }
        Ok(vm)
    }

    /// Takes back the network of a VM found running after a restart (its
    /// namespace and VM address as recorded).
    pub fn adopt(&self, id: &str, vm_ip: Ipv4Addr) -> Result<VmNetwork> {
        let slot = self.pool().reserve(vm_ip)?;
        Ok(VmNetwork::plan(
            &self.prefix,
            id,
            slot,
            self.node_netns.clone(),
        ))
    }

    /// Takes back the network of the VM named `id` found after a restart,
    /// reading its VM address from its namespace; `None` when the namespace
    /// is gone or holds no address of the pool.
    pub fn adopt_existing(&self, id: &str) -> Option<VmNetwork> {
        let probe = VmNetwork::plan(&self.prefix, id, self.pool().slot(0), None);
        if !std::path::Path::new("/run/netns")
            .join(&probe.netns)
            .exists()
        {
            return None;
        }
        let vm_ip = node_addresses(Some(&probe.netns))
            .ok()?
            .into_iter()
            .find_map(|c| match c.addr {
                IpAddr::V4(a) if self.pool().index_of(a).is_some() => Some(a),
                _ => None,
            })?;
        self.adopt(id, vm_ip).ok()
    }

    /// Takes back, after a restart, the network whose namespace is named
    /// `netns` (as recorded by whoever made it: a session that took a warm
    /// VM keeps the namespace named after the VM's pool directory); `None`
    /// when the name is not one of this node's prefix, the namespace is
    /// gone, or it holds no address of the pool.
    pub fn adopt_named(&self, netns: &str) -> Option<VmNetwork> {
        let id = netns.strip_prefix(self.prefix.as_str())?;
        let vm = self.adopt_existing(id)?;
        if vm.netns == netns {
            Some(vm)
        } else {
            // Not a name `make` gives: the reserved addresses go back.
            self.pool().release(&vm.slot);
            None
        }
    }

    /// Removes a VM's network and gives its addresses back.
    pub fn release(&self, vm: &VmNetwork) {
        vm.remove();
        self.pool().release(&vm.slot);
    }

    /// Removes the VM namespaces not in `live` (by name); returns how many.
    pub fn remove_orphans(&self, live: &HashSet<String>) -> usize {
        let orphans: Vec<String> = list_namespaces(&self.prefix)
            .into_iter()
            .filter(|n| !live.contains(n))
            .collect();
        for ns in &orphans {
            tracing::warn!(netns = %ns, "removing a VM network namespace no VM owns");
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        orphans.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_entries_parse_with_clear_errors() {
        let a = parse_allow("198.51.100.0/24 tcp 443").unwrap();
        assert_eq!((a.proto, a.port), (Some(Proto::Tcp), Some(443)));
        assert_eq!(parse_allow("1.2.3.4 udp").unwrap().port, None);
        assert_eq!(parse_allow("0.0.0.0/0").unwrap().proto, None);
        let v6 = parse_allow("2001:db8::/32 tcp 443").unwrap();
        assert_eq!((v6.cidr.is_v4(), v6.port), (false, Some(443)));
        for (bad, says) in [
            ("", "empty"),
            ("1.2.3.4 icmp", "not tcp or udp"),
            ("1.2.3.4 tcp 0", "1 to 65535"),
            ("1.2.3.4 tcp 70000", "1 to 65535"),
            ("1.2.3.4 tcp 1 2", "expected"),
            ("1.2.3.4/40", "prefix"),
            ("2001:db8::/129", "prefix"),
        ] {
            let e = parse_allow(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
