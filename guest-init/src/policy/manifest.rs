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
}
