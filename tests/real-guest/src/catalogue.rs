//! The scenarios, by group. Each group runs in one fresh outer VM, so an
//! outer-VM failure costs at most the group it happened in; the outer and
//! inner halves of the harness both read this list. Opt-in groups
//! ([`OPT_IN`]) run only when named with `--group` (or one of their
//! scenarios with `--scenario`), never in a plain run.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
    Group {
        name: SOAK,
        about: "2-vCPU guests with block, net and vsock traffic booted and \
                snapshot-restored N times (--soak-n or RG_SOAK_N), crashes counted",
        scenarios: &["soak-smp-boots", "soak-smp-restores"],
        // For the default count; a run scales it to its own (`sized`).
        limit: soak_limit(SOAK_N_DEFAULT),
        node_image: false,
    },
];

/// Groups a plain run leaves out: they run only when asked for by name.
pub const OPT_IN: &[&str] = &[SOAK];

/// The group called `name`.
pub fn group(name: &str) -> Option<&'static Group> {
    GROUPS.iter().find(|g| g.name == name)
}

impl Group {
    /// Whether a plain run leaves the group out ([`OPT_IN`]).
    pub fn opt_in(&self) -> bool {
        OPT_IN.contains(&self.name)
    }
}

/// The groups a run without `--group` and `--scenario` takes, in order:
/// every group but the opt-in ones.
pub fn default_groups() -> Vec<&'static Group> {
    GROUPS.iter().filter(|g| !g.opt_in()).collect()
}

/// The soak group's name.
pub const SOAK: &str = "soak";
/// Iterations of each soak scenario when neither `--soak-n` nor
/// `RG_SOAK_N` says.
pub const SOAK_N_DEFAULT: u32 = 50;
/// The environment variable `real-guest run` reads the soak count from.
pub const SOAK_N_ENV: &str = "RG_SOAK_N";
/// Time budget of one boot of `soak-smp-boots` (a 2-vCPU virtio guest takes
/// 30-60 s under nested emulation; more with `--tcg-thread single`). The
/// scenario starts no boot once N budgets are spent.
pub const SOAK_BOOT_SECS: u64 = 180;
/// Time budget of one cycle of `soak-smp-restores` (pause, snapshot,
/// restore, resume, a few ticks and a vsock echo).
pub const SOAK_CYCLE_SECS: u64 = 150;
/// What the soak group's limit allows besides the budgets: the outer VM's
/// boot, the restore scenario's first boot, an iteration started just
/// before its scenario's budget ran out (each is bounded by its waits'
/// deadlines), and the runner watchdog's margin.
pub const SOAK_OVERHEAD_SECS: u64 = 30 * 60;

/// The soak group's time limit for `n` iterations of each scenario (N=50:
/// 305 min).
pub const fn soak_limit(n: u32) -> Duration {
    Duration::from_secs(SOAK_OVERHEAD_SECS + n as u64 * (SOAK_BOOT_SECS + SOAK_CYCLE_SECS))
}

/// What a run passes to its soak scenarios, written by `real-guest run` as
/// [`SoakSettings::FILE`] beside `env.json` in the work directory (the
/// outer VM passes the runner no environment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SoakSettings {
    /// Iterations of each soak scenario.
    pub n: u32,
}

impl Default for SoakSettings {
    fn default() -> Self {
        SoakSettings { n: SOAK_N_DEFAULT }
    }
}

impl SoakSettings {
    /// The file's name in the work directory.
    pub const FILE: &'static str = "soak.json";

    /// The settings from `--soak-n` (`option`), else from `RG_SOAK_N`'s
    /// value (`env`; empty counts as unset), else the default.
    pub fn from_option_or_env(option: Option<u32>, env: Option<&str>) -> Result<Self, String> {
        let n = match (option, env.map(str::trim).filter(|v| !v.is_empty())) {
            (Some(n), _) => n,
            (None, Some(v)) => v.parse().map_err(|_| {
                format!("{SOAK_N_ENV}={v:?} is not a count of iterations (a whole number)")
            })?,
            (None, None) => SOAK_N_DEFAULT,
        };
        if n == 0 {
            return Err("the soak count (--soak-n or RG_SOAK_N) must be at least 1".into());
        }
        Ok(SoakSettings { n })
    }

    /// Writes the settings into the work directory `work`.
    pub fn save(&self, work: &Path) -> Result<(), String> {
        let path = work.join(Self::FILE);
        let text = serde_json::to_string(self).map_err(|e| e.to_string())?;
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    /// Reads the settings from the work directory `work`; a work directory
    /// without them (an older `run`) gives the default.
    pub fn load(work: &Path) -> Result<Self, String> {
        let path = work.join(Self::FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| format!("{} is not valid: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }
}

/// `group` with its time limit for this run's settings: the soak group's
/// scales with its count (both halves call this, so the outer VM's watch and
/// the runner's watchdog agree); every other group is as it is.
pub fn sized(group: &'static Group, soak: &SoakSettings) -> &'static Group {
    if group.name != SOAK {
        return group;
    }
    let limit = soak_limit(soak.n);
    if limit == group.limit {
        return group;
    }
    // Leaked once per run, like a `--scenario` selection: groups are 'static.
    Box::leak(Box::new(Group { limit, ..*group }))
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

    #[test]
    fn a_plain_run_leaves_the_opt_in_groups_out() {
        let default: Vec<&str> = default_groups().iter().map(|g| g.name).collect();
        assert!(!default.contains(&SOAK), "{default:?}");
        assert_eq!(
            default,
            ["boot", "virtio", "snapshot", "node", "network", "share"]
        );
        for name in OPT_IN {
            let g = group(name).expect("an opt-in group is in the catalogue");
            assert!(g.opt_in());
        }
        assert!(!group("boot").is_some_and(Group::opt_in));
    }

    #[test]
    fn the_soak_count_comes_from_the_option_then_the_environment() {
        let n = |option, env| SoakSettings::from_option_or_env(option, env).map(|s| s.n);
        assert_eq!(n(None, None), Ok(SOAK_N_DEFAULT));
        assert_eq!(n(None, Some("")), Ok(SOAK_N_DEFAULT));
        assert_eq!(n(None, Some(" 7 ")), Ok(7));
        assert_eq!(n(Some(3), Some("7")), Ok(3));
        // The option wins over a bad variable; a bad variable alone fails.
        assert_eq!(n(Some(3), Some("many")), Ok(3));
        let bad = n(None, Some("many")).unwrap_err();
        assert!(bad.contains("RG_SOAK_N=\"many\""), "{bad}");
        assert!(n(None, Some("-1")).is_err());
        assert!(n(Some(0), None).is_err());
        assert!(n(None, Some("0")).is_err());
    }

    #[test]
    fn soak_settings_go_through_the_work_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(SoakSettings::load(dir.path()), Ok(SoakSettings::default()));
        SoakSettings { n: 4 }.save(dir.path()).expect("save");
        assert_eq!(SoakSettings::load(dir.path()), Ok(SoakSettings { n: 4 }));
        std::fs::write(dir.path().join(SoakSettings::FILE), "{").expect("write");
        assert!(SoakSettings::load(dir.path()).is_err());
    }

    #[test]
    fn the_soak_limit_scales_with_the_count_and_nothing_else_changes() {
        let soak = group(SOAK).expect("soak");
        assert_eq!(soak.limit, soak_limit(SOAK_N_DEFAULT));
        assert_eq!(soak_limit(50), Duration::from_secs(305 * 60));
        let small = sized(soak, &SoakSettings { n: 2 });
        assert_eq!(small.limit, Duration::from_secs(30 * 60 + 2 * 330));
        assert_eq!(small.scenarios, soak.scenarios);
        assert!(std::ptr::eq(sized(soak, &SoakSettings::default()), soak));
        let boot = group("boot").expect("boot");
        assert!(std::ptr::eq(sized(boot, &SoakSettings { n: 2 }), boot));
        // Every iteration's budget and the overhead fit in the limit.
        for n in [1, 10, 50, 200] {
            assert!(
                soak_limit(n).as_secs()
                    >= u64::from(n) * (SOAK_BOOT_SECS + SOAK_CYCLE_SECS) + SOAK_OVERHEAD_SECS
            );
        }
    }
}
