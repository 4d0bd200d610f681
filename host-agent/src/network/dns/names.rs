//! The name policy: which names a session's guest may resolve, and for
//! which ports the addresses they resolve to are opened.
//!
//! Rules come from the repository manifest's `host:` entries: an exact name
//! (case-insensitive, a trailing dot ignored), or `*.suffix` for every name
//! below `suffix` (not `suffix` itself). Names are compared label by label
//! on letters, digits, `-` and `_` only: a query whose labels carry anything
//! else (a dot inside a label, a NUL) matches no rule.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};

use crate::error::{Error, Result};

/// One name the session may resolve, with the ports its addresses open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameRule {
    /// `host.example`, or `*.example` for any name below `example`.
    pub name: String,
    /// TCP and UDP ports opened to the addresses it resolves to; empty:
    /// every port.
    pub ports: Vec<u16>,
}

/// The ports of a matching name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ports {
    /// Every protocol and port.
    Any,
    /// These TCP and UDP ports.
    Some(BTreeSet<u16>),
}

impl Ports {
    fn merge(&mut self, ports: &[u16]) {
        match self {
            Ports::Any => {}
            Ports::Some(set) if !ports.is_empty() => set.extend(ports.iter().copied()),
            Ports::Some(_) => *self = Ports::Any,
        }
    }
}

/// A label of a name this policy can match: letters, digits, `-`, `_`.
fn valid_label(label: &[u8]) -> bool {
    !label.is_empty()
        && label.len() <= 63
        && label
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
}

/// The lowercase dotted form of `labels`, when every label is one this
/// policy can match and the name is at most 253 characters.
pub fn normalize_labels<'a>(labels: impl Iterator<Item = &'a [u8]>) -> Option<String> {
    let mut out = String::new();
    for label in labels {
        if !valid_label(label) {
            return None;
        }
        if !out.is_empty() {
            out.push('.');
        }
        out.extend(label.iter().map(|b| char::from(b.to_ascii_lowercase())));
        if out.len() > 253 {
            return None;
        }
    }
    (!out.is_empty()).then_some(out)
}

/// A text name in the policy's form (lowercase, no trailing dot), if valid.
pub fn normalize(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    normalize_labels(name.split('.').map(str::as_bytes))
}

/// The compiled rules.
#[derive(Debug, Clone, Default)]
pub struct NamePolicy {
    exact: HashMap<String, Vec<u16>>,
    below: HashMap<String, Vec<u16>>,
}

impl NamePolicy {
    /// Compiles `rules`; a name that is not a host name (or `*.` one) is an
    /// error naming it.
    pub fn new(rules: &[NameRule]) -> Result<Self> {
        let mut policy = NamePolicy::default();
        for rule in rules {
            let (map, text) = match rule.name.strip_prefix("*.") {
                Some(rest) => (&mut policy.below, rest),
                None => (&mut policy.exact, rule.name.as_str()),
            };
            let name = normalize(text).ok_or_else(|| {
                Error::invalid(format!(
                    "DNS name rule {:?} is not a host name (letters, digits, '-', '_' and dots, or '*.' and one)",
                    rule.name
                ))
            })?;
            match map.entry(name) {
                Entry::Vacant(v) => {
                    v.insert(rule.ports.clone());
                }
                // Merging with an earlier rule of the same name: every port
                // of either, and an empty list (every port) wins.
                Entry::Occupied(mut o) => {
                    let ports = o.get_mut();
                    if ports.is_empty() || rule.ports.is_empty() {
                        ports.clear();
                    } else {
                        ports.extend(rule.ports.iter().copied());
                    }
                }
            }
        }
        Ok(policy)
    }

    /// The ports of the rules that `name` (normalized) matches; `None` when
    /// none does.
    pub fn ports(&self, name: &str) -> Option<Ports> {
        let mut found: Option<Ports> = None;
        let mut add = |ports: &Vec<u16>| {
            found
                .get_or_insert_with(|| Ports::Some(BTreeSet::new()))
                .merge(ports)
        };
        if let Some(p) = self.exact.get(name) {
            add(p);
        }
        let mut rest = name;
        while let Some((_, parent)) = rest.split_once('.') {
            if let Some(p) = self.below.get(parent) {
                add(p);
            }
            rest = parent;
        }
        found
    }

    /// Whether `name` (normalized) may be resolved.
    pub fn allows(&self, name: &str) -> bool {
        self.ports(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, ports: &[u16]) -> NameRule {
        NameRule {
            name: name.into(),
            ports: ports.to_vec(),
        }
    }

    fn lookup(p: &NamePolicy, name: &str) -> Option<Ports> {
        p.ports(&normalize(name)?)
    }

    fn some(ports: &[u16]) -> Option<Ports> {
        Some(Ports::Some(ports.iter().copied().collect()))
    }

    #[test]
    fn exact_names_match_whatever_the_case_and_trailing_dot() {
        let p = NamePolicy::new(&[rule("Crates.io", &[443])]).unwrap();
        assert_eq!(lookup(&p, "crates.io"), some(&[443]));
        assert_eq!(lookup(&p, "CRATES.IO."), some(&[443]));
        assert_eq!(lookup(&p, "static.crates.io"), None, "no subdomain");
        assert_eq!(lookup(&p, "crates.io.evil"), None);
        assert_eq!(lookup(&p, "xcrates.io"), None);
        assert_eq!(lookup(&p, "io"), None);
    }

    #[test]
    fn wildcards_match_subdomains_but_not_the_apex() {
        let p = NamePolicy::new(&[rule("*.example.com", &[])]).unwrap();
        assert_eq!(lookup(&p, "a.example.com"), Some(Ports::Any));
        assert_eq!(lookup(&p, "b.a.Example.COM."), Some(Ports::Any));
        assert_eq!(lookup(&p, "example.com"), None, "not the apex");
        assert_eq!(lookup(&p, "aexample.com"), None);
        assert_eq!(lookup(&p, "a.example.com.evil"), None);
    }

    #[test]
    fn rules_of_one_name_merge_and_every_port_wins() {
        let p = NamePolicy::new(&[
            rule("a.test", &[443]),
            rule("a.test", &[80]),
            rule("*.test", &[22]),
            rule("b.test", &[1]),
            rule("b.test", &[]),
        ])
        .unwrap();
        assert_eq!(lookup(&p, "a.test"), some(&[22, 80, 443]));
        assert_eq!(lookup(&p, "b.test"), Some(Ports::Any));
        assert_eq!(lookup(&p, "c.test"), some(&[22]));
    }

    #[test]
    fn odd_labels_match_nothing_and_bad_rules_are_refused() {
        let p = NamePolicy::new(&[rule("*.allowed.test", &[443])]).unwrap();
        // A label with a dot inside, as a hostile guest may send on the wire.
        let labels: [&[u8]; 3] = [b"x", b"evil.allowed", b"test"];
        assert_eq!(normalize_labels(labels.into_iter()), None);
        let labels: [&[u8]; 3] = [b"x\0", b"allowed", b"test"];
        assert_eq!(normalize_labels(labels.into_iter()), None);
        assert!(p.allows("x.allowed.test"));
        assert_eq!(normalize(""), None);
        assert_eq!(normalize("a..b"), None);
        assert_eq!(normalize(&"a.".repeat(130)), None, "longer than 253");
        let e = NamePolicy::new(&[rule("bad name", &[])]).unwrap_err();
        assert!(e.to_string().contains("bad name"), "{e}");
        assert!(NamePolicy::new(&[rule("*.", &[])]).is_err());
        assert!(NamePolicy::new(&[rule("a.*.b", &[])]).is_err());
    }
}
