//! The scenarios, by group. Each group runs in one fresh outer VM, so an
//! outer-VM failure costs at most the group it happened in; the outer and
//! inner halves of the harness both read this list.

use std::time::Duration;

/// A set of scenarios run in one outer VM.
#[derive(Debug, Clone, Copy)]
pub struct Group {
    /// Name, as given to `--group`.
    pub name: &'static str,
    /// What the group shows.
    pub about: &'static str,
    /// Its scenarios, in the order they run.
    pub scenarios: &'static [&'static str],
    /// Longest the whole group may take in one outer VM (boot included).
    pub limit: Duration,
    /// Whether its scenarios serve the project's image (its root
    /// filesystem, built with debootstrap on first use): prepared only for
    /// a run that has such a group.
    pub node_image: bool,
}

/// Every group, in the order `run` takes them.
pub const GROUPS: &[Group] = &[
    Group {
        name: "boot",
        about: "Debian's cloud kernel boots to user space; the kernel's own view of the machine",
        scenarios: &[
            "boot-1-vcpu",
            "boot-2-vcpus",
            "boot-bzimage",
            "boot-mp-table",
            "poweroff",
            "serial-input",
        ],
        limit: Duration::from_secs(25 * 60),
        node_image: false,
    },
    Group {
        name: "virtio",
        about: "the guest's own virtio drivers against the vmm's devices",
        scenarios: &[
            "virtio-blk",
            "virtio-blk-read-only",
            "virtio-rng",
            "virtio-net",
            "virtio-vsock",
        ],
        limit: Duration::from_secs(20 * 60),
        node_image: false,
    },
    Group {
        name: "snapshot",
        about: "a running guest snapshotted and restored in new vmm processes",
        scenarios: &[
            "pause-after-io",
            "restore-file",
            "restore-uffd",
            "diff-chain-checksums",
            "clones-randomness",
        ],
        limit: Duration::from_secs(35 * 60),
        node_image: false,
    },
    Group {
        name: "node",
        about: "host-agent serving a session on the real image (golden snapshot, guest-init)",
        scenarios: &[
            "guest-init-direct",
            "node-golden",
            "node-session",
            "node-secrets",
            "node-clones",
            "node-agent-api",
            "node-persist",
            "node-fork",
            "node-move",
            "node-sizing",
            "pool-timing",
        ],
        limit: Duration::from_secs(40 * 60),
        node_image: true,
    },
    Group {
        name: "network",
        about: "sessions' networks in the real guest: the per-session resolver, egress, clones, exposed ports",
        scenarios: &[
            "net-resolve",
            "net-dns-denied",
            "net-ip-denied",
            "net-expose",
            "net-clones",
            "net-ipv6",
            "net-throughput",
        ],
        limit: Duration::from_secs(40 * 60),
        node_image: true,
    },
    Group {
        name: "share",
        about: "virtio-fs shares served by virtiofsd: read, read-only, across a snapshot; fs/blk ratios",
        scenarios: &[
            "share-read",
            "share-read-only",
            "share-restore-file",
            "share-restore-uffd",
            "share-perf",
        ],
        limit: Duration::from_secs(40 * 60),
        node_image: false,
    },
];

/// The group called `name`.
pub fn group(name: &str) -> Option<&'static Group> {
    GROUPS.iter().find(|g| g.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenario_names_are_unique_and_plain() {
        let mut seen = std::collections::HashSet::new();
        for g in GROUPS {
            assert!(group(g.name).is_some());
            for s in g.scenarios {
                assert!(seen.insert(*s), "{s} appears twice");
                assert!(
                    s.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                    "{s}: scenario names are parsed from console lines"
                );
            }
        }
    }
}
