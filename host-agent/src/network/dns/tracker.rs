//! What the resolver added to the learned sets and for which names, so
//! that narrowing the names takes back what they opened, and rewriting the
//! namespace's rules (which empties the sets) can put the rest back.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::names::{NamePolicy, Ports};
use crate::network::rules::{Learned, LearnedTarget};

/// Elements tracked at most; past it the tracker gives up (and a narrowing
/// empties the sets whole).
const MAX_TRACKED: usize = 4096;
/// Names tracked per element at most.
const MAX_NAMES: usize = 8;

#[derive(Debug)]
struct Tracked {
    expires: Instant,
    names: BTreeSet<String>,
}

/// The learned elements and the names that opened them.
#[derive(Debug, Default)]
pub struct Tracker {
    entries: HashMap<(IpAddr, LearnedTarget), Tracked>,
    /// Something was not tracked: the tracker no longer knows it all.
    incomplete: bool,
}

/// What a narrowing takes back.
#[derive(Debug, PartialEq, Eq)]
pub enum Revoke {
    /// These elements.
    Entries(Vec<Learned>),
    /// Everything (the tracker lost count).
    All,
}

fn justified(target: LearnedTarget, names: &BTreeSet<String>, policy: &NamePolicy) -> bool {
    names.iter().any(|n| match (policy.ports(n), target) {
        (Some(Ports::Any), _) => true,
        (Some(Ports::Some(set)), LearnedTarget::Port(_, port)) => set.contains(&port),
        _ => false,
    })
}

impl Tracker {
    /// Notes that `name` opened `learned` at `now`.
    pub fn record(&mut self, name: &str, learned: &[Learned], now: Instant) {
        if self.entries.len() + learned.len() > MAX_TRACKED {
            self.entries.retain(|_, t| t.expires > now);
        }
        for l in learned {
            let expires = now + Duration::from_secs(u64::from(l.ttl_secs));
            let full = self.entries.len() >= MAX_TRACKED;
            match self.entries.get_mut(&(l.addr, l.target)) {
                Some(t) => {
                    t.expires = t.expires.max(expires);
                    if t.names.len() < MAX_NAMES {
                        t.names.insert(name.to_string());
                    } else if !t.names.contains(name) {
                        self.incomplete = true;
                    }
                }
                None if full => self.incomplete = true,
                None => {
                    self.entries.insert(
                        (l.addr, l.target),
                        Tracked {
                            expires,
                            names: BTreeSet::from([name.to_string()]),
                        },
                    );
                }
            }
        }
    }

    /// Forgets, and returns, what no name of `policy` opens any more.
    pub fn narrow(&mut self, policy: &NamePolicy, now: Instant) -> Revoke {
        if self.incomplete {
            self.entries.clear();
            self.incomplete = false;
            return Revoke::All;
        }
        let mut out = Vec::new();
        self.entries.retain(|&(addr, target), t| {
            let keep = t.expires > now && justified(target, &t.names, policy);
            if !keep && t.expires > now {
                out.push(Learned {
                    addr,
                    target,
                    ttl_secs: 1,
                });
            }
            keep
        });
        out.sort();
        Revoke::Entries(out)
    }

    /// The elements not expired yet, with the time they have left.
    pub fn live(&self, now: Instant) -> Vec<Learned> {
        let mut out: Vec<Learned> = self
            .entries
            .iter()
            .filter(|(_, t)| t.expires > now)
            .map(|(&(addr, target), t)| Learned {
                addr,
                target,
                ttl_secs: u32::try_from((t.expires - now).as_secs().max(1)).unwrap_or(u32::MAX),
            })
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::dns::names::NameRule;
    use crate::network::rules::Proto;
    use std::net::Ipv4Addr;

    fn policy(rules: &[(&str, &[u16])]) -> NamePolicy {
        let rules: Vec<NameRule> = rules
            .iter()
            .map(|(n, p)| NameRule {
                name: n.to_string(),
                ports: p.to_vec(),
            })
            .collect();
        NamePolicy::new(&rules).unwrap()
    }

    #[test]
    fn narrowing_takes_back_only_what_no_name_opens() {
        let now = Instant::now();
        let mut t = Tracker::default();
        let l = |last: u8, target, ttl_secs| Learned {
            addr: Ipv4Addr::new(203, 0, 113, last).into(),
            target,
            ttl_secs,
        };
        let https = LearnedTarget::Port(Proto::Tcp, 443);
        t.record("a.test", &[l(1, https, 60), l(2, https, 60)], now);
        t.record("b.test", &[l(2, https, 60)], now);
        t.record("c.test", &[l(3, LearnedTarget::Any, 60)], now);
        t.record("d.test", &[l(4, https, 30)], now);
        assert_eq!(t.live(now).len(), 4);
        let later = now + Duration::from_secs(45);
        let narrowed = policy(&[("b.test", &[443]), ("c.test", &[443])]);
        // a.test's 203.0.113.1 goes; .2 stays for b.test; c.test's whole
        // address goes (only 443 now); d.test's element expired already.
        assert_eq!(
            t.narrow(&narrowed, later),
            Revoke::Entries(vec![l(1, https, 1), l(3, LearnedTarget::Any, 1)])
        );
        assert_eq!(t.live(later), [l(2, https, 15)]);
    }

    #[test]
    fn a_tracker_that_lost_count_revokes_everything() {
        let now = Instant::now();
        let mut t = Tracker::default();
        let e = Learned {
            addr: Ipv4Addr::new(203, 0, 113, 1).into(),
            target: LearnedTarget::Any,
            ttl_secs: 60,
        };
        for i in 0..=MAX_NAMES {
            t.record(&format!("n{i}.test"), &[e], now);
        }
        assert_eq!(t.narrow(&policy(&[]), now), Revoke::All);
        assert!(t.live(now).is_empty());
    }
}
