//! The repository manifest, `agent-manifest.yaml` at the repository root (as
//! of the base ref), granting secrets and egress per agent:
//!
//! ```yaml
//! version: 1
//! agents:
//!   coder:
//!     secrets: [GITHUB_TOKEN, NPM_TOKEN]
//!     egress:
//!       - host: crates.io          # a name, resolved by guest-init
//!         ports: [443]
//!       - cidr: 10.20.0.0/16       # an address block
//!         ports: [5432]
//!       - cidr: 203.0.113.7/32     # ports omitted: every port
//! ```
//!
//! Unknown fields are errors, so a typo never silently drops a restriction.
//! No manifest means no secrets and no egress.
//!
//! [`env`] holds the rules for environment variable names that guest-init
//! and host-agent share (risky variables, the names a session's
//! environment and secrets may use).

pub mod env;

use std::collections::BTreeMap;

use serde::Deserialize;

/// File name of the manifest at the repository root.
pub const MANIFEST_PATH: &str = "agent-manifest.yaml";

/// The parsed manifest.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Format version; only 1 exists.
    pub version: u32,
    /// Grants by agent name.
    #[serde(default)]
    pub agents: BTreeMap<String, AgentGrant>,
}

/// What one agent may receive and reach.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AgentGrant {
    /// Secret names this agent may receive.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Destinations this agent may reach.
    #[serde(default)]
    pub egress: Vec<EgressEntry>,
}

/// One egress allowlist entry: exactly one of `host` or `cidr`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EgressEntry {
    /// A host name, resolved by guest-init at session start.
    pub host: Option<String>,
    /// An address block such as `10.0.0.0/8` or `2001:db8::/32`.
    pub cidr: Option<String>,
    /// TCP/UDP destination ports; empty means every port.
    #[serde(default)]
    pub ports: Vec<u16>,
}

/// What an [`EgressEntry`] names, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressTarget<'a> {
    /// A host name (letters, digits, `-` and `.`, at most 253 characters).
    Host(&'a str),
    /// An address block as written; its syntax is the reader's to check.
    Cidr(&'a str),
}

/// An egress entry that names no target, both, or a host name no resolver,
/// nftables rule or hosts file can take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// Neither or both of `host` and `cidr`.
    #[error("egress: each entry needs exactly one of `host` or `cidr` (entry {0})")]
    BadEntry(usize),
    /// A host name with characters outside `[A-Za-z0-9.-]`, or too long.
    #[error("egress: {0:?} is not a valid host name")]
    BadHost(String),
}

impl EgressEntry {
    /// The entry's target; `index` is its place in the list, for the error.
    pub fn target(&self, index: usize) -> Result<EgressTarget<'_>, EntryError> {
        match (&self.host, &self.cidr) {
            (Some(host), None) if valid_host(host) => Ok(EgressTarget::Host(host)),
            (Some(host), None) => Err(EntryError::BadHost(host.clone())),
            (None, Some(cidr)) => Ok(EgressTarget::Cidr(cidr)),
            _ => Err(EntryError::BadEntry(index)),
        }
    }
}

/// Whether `h` is a host name this project accepts: ASCII letters, digits,
/// `-` and `.` only (nothing a rule, a hosts file or a DNS name could be
/// confused by), 1 to 253 characters.
pub fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

/// Why a manifest was refused. Any of these stops the session.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not valid YAML or not the documented structure.
    #[error("{MANIFEST_PATH}: {0}")]
    Parse(#[from] serde_yaml::Error),
    /// A version this guest does not know.
    #[error("{MANIFEST_PATH}: version {0} is not supported (expected 1)")]
    Version(u32),
}

impl Manifest {
    /// Parses the manifest text.
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        let m: Manifest = serde_yaml::from_str(text)?;
        if m.version != 1 {
            return Err(ManifestError::Version(m.version));
        }
        Ok(m)
    }

    /// The grant for `agent`; an agent not listed gets nothing.
    pub fn grant(&self, agent: &str) -> AgentGrant {
        self.agents.get(agent).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let m = Manifest::parse(
            "version: 1\nagents:\n  coder:\n    secrets: [A]\n    egress:\n      - host: example.com\n        ports: [443]\n",
        )
        .unwrap();
        assert_eq!(m.grant("coder").secrets, ["A"]);
        assert_eq!(
            m.grant("coder").egress[0].host.as_deref(),
            Some("example.com")
        );
        assert_eq!(m.grant("other"), AgentGrant::default());
        assert!(Manifest::parse("version: 1\nagents:\n  coder:\n    secret: [A]\n").is_err());
        assert!(matches!(
            Manifest::parse("version: 2\n"),
            Err(ManifestError::Version(2))
        ));
        assert!(Manifest::parse("version: [\n").is_err());
    }

    #[test]
    fn entry_targets() {
        let e = |host: Option<&str>, cidr: Option<&str>| EgressEntry {
            host: host.map(Into::into),
            cidr: cidr.map(Into::into),
            ports: vec![],
        };
        assert_eq!(
            e(Some("crates.io"), None).target(0),
            Ok(EgressTarget::Host("crates.io"))
        );
        assert_eq!(
            e(None, Some("10.0.0.0/8")).target(0),
            Ok(EgressTarget::Cidr("10.0.0.0/8"))
        );
        assert_eq!(
            e(Some("a\"; flush ruleset"), None).target(0),
            Err(EntryError::BadHost("a\"; flush ruleset".into()))
        );
        assert_eq!(e(None, None).target(3), Err(EntryError::BadEntry(3)));
        assert_eq!(
            e(Some("a.b"), Some("1.2.3.4/32")).target(4),
            Err(EntryError::BadEntry(4))
        );
        assert!(!valid_host(&"a".repeat(254)));
    }
}
