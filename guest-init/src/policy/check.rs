//! `guest-init policy check`: decides one command line with a rules file
//! (and optionally a manifest) the way a session would, so operators can
//! test their rules before an agent meets them.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use super::manifest::{AgentGrant, Manifest, ManifestError};
use super::rules::{Rules, RulesError};
use super::{ExecContext, ExecDecision, Policy};

/// Why a check could not be made (bad input, never a decision).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A file could not be read.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        /// "rules file" or "manifest".
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The rules file has no usable agent name.
    #[error("rules file {0} must be named AGENT.md (the agent's name is taken from it)")]
    BadName(PathBuf),
    /// The rules do not parse.
    #[error(transparent)]
    Rules(#[from] RulesError),
    /// The manifest does not parse.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// An `--env` value without `=`.
    #[error("--env {0:?} must be NAME=VALUE")]
    BadEnv(String),
    /// The command line cannot be decided (a session answers it with an error).
    #[error("cannot decide this command: {0}")]
    Command(#[from] super::command::CommandError),
}

/// What to check.
#[derive(Debug, Clone)]
pub struct CheckRequest {
    /// `agents/NAME.md`.
    pub rules: PathBuf,
    /// `agent-manifest.yaml`, if the grant should be shown too.
    pub manifest: Option<PathBuf>,
    /// The workspace root the command runs under.
    pub workspace: PathBuf,
    /// The working directory (default: the workspace).
    pub cwd: Option<PathBuf>,
    /// `NAME=VALUE` pairs of the Exec's env.
    pub env: Vec<String>,
    /// The command.
    pub argv: Vec<String>,
}

/// The outcome, printed by the CLI.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The decision.
    pub decision: ExecDecision,
    /// The agent's grant from the manifest, if one was given.
    pub grant: Option<AgentGrant>,
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = &self.decision;
        writeln!(f, "{}", d.action)?;
        match &d.source {
            Some(src) => writeln!(f, "rule: {} ({src})", d.rule)?,
            None => writeln!(f, "rule: {}", d.rule)?,
        }
        for key in &d.keys {
            writeln!(f, "subject: {key}")?;
        }
        if let Some(g) = &self.grant {
            writeln!(f, "secrets granted: {}", list(&g.secrets))?;
            let egress: Vec<String> = g
                .egress
                .iter()
                .map(|e| {
                    let dest = e
                        .host
                        .clone()
                        .or_else(|| e.cidr.clone())
                        .unwrap_or_default();
                    if e.ports.is_empty() {
                        dest
                    } else {
                        let ports: Vec<String> = e.ports.iter().map(u16::to_string).collect();
                        format!("{dest}:{}", ports.join(","))
                    }
                })
                .collect();
            writeln!(f, "egress granted: {}", list(&egress))?;
        }
        Ok(())
    }
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

fn read(what: &'static str, path: &Path) -> Result<String, CheckError> {
    std::fs::read_to_string(path).map_err(|source| CheckError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Loads the rules (and manifest) and decides `req.argv`.
pub fn check(req: &CheckRequest) -> Result<CheckReport, CheckError> {
    let agent = req
        .rules
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".md"))
        .filter(|n| super::rules_path(n).is_ok())
        .ok_or_else(|| CheckError::BadName(req.rules.clone()))?
        .to_string();
    let text = read("rules file", &req.rules)?;
    let rules = Rules::parse(&req.rules.display().to_string(), &text)?;
    let grant = match &req.manifest {
        Some(m) => Some(Manifest::parse(&read("manifest", m)?)?.grant(&agent)),
        None => None,
    };
    let policy = Policy {
        agent,
        rules,
        grant: grant.clone().unwrap_or_default(),
    };
    let mut env = BTreeMap::new();
    for pair in &req.env {
        let (k, v) = pair
            .split_once('=')
            .filter(|(k, _)| !k.is_empty())
            .ok_or_else(|| CheckError::BadEnv(pair.clone()))?;
        env.insert(k.to_string(), v.to_string());
    }
    let cwd = req.cwd.clone().unwrap_or_else(|| req.workspace.clone());
    let cwd = if cwd.is_relative() {
        req.workspace.join(cwd)
    } else {
        cwd
    };
    let ctx = ExecContext {
        workspace: &req.workspace,
        cwd: &cwd,
        env: &env,
    };
    let decision = policy.decide_exec(&req.argv, &ctx, &HashSet::new())?;
    Ok(CheckReport { decision, grant })
}
