//! The session's policy: permission rules from `agents/<agent>.md`, secrets
//! and egress from [`manifest::MANIFEST_PATH`], both read from the repository
//! *at the base commit* (never the working tree, so an agent cannot loosen
//! its own rules by editing them on its branch).

pub mod check;
pub mod command;
pub mod egress;
pub mod git;
pub mod glob;
pub use agent_manifest as manifest;
pub mod risky_env;
pub mod rules;
pub mod secrets;
pub mod shell;

use std::collections::HashSet;

use command::CommandError;
pub use command::ExecContext;
use manifest::{AgentGrant, Manifest, ManifestError};
use rules::{Action, Decision, Rules, RulesError};

/// The tool every Exec is decided as.
pub const EXEC_TOOL: &str = "bash";

/// Why the policy could not be loaded. The session does not start.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// `agents/<agent>.md` is missing at the base commit.
    #[error("policy file {path} does not exist at the base commit {commit}; the session cannot start without rules")]
    Missing {
        /// Path in the repository.
        path: String,
        /// Base commit.
        commit: String,
    },
    /// An agent name that is not a plain file name.
    #[error("agent name {0:?} must be non-empty and use only letters, digits, '-', '_' and '.'")]
    BadAgentName(String),
    /// The rules file does not parse.
    #[error(transparent)]
    Rules(#[from] RulesError),
    /// The manifest does not parse.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// Reading from the repository failed.
    #[error("reading policy from the repository failed: {0}")]
    Read(String),
}

/// Rules plus the agent's grant.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Agent name.
    pub agent: String,
    /// Permission rules.
    pub rules: Rules,
    /// Secrets and egress granted to this agent.
    pub grant: AgentGrant,
}

/// What to do with one Exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecDecision {
    /// Combined action: deny if any command is denied, else ask if any needs
    /// approval, else allow.
    pub action: Action,
    /// The rule that decided.
    pub rule: String,
    /// Where the deciding pattern is written, if a pattern decided.
    pub source: Option<rules::RuleSource>,
    /// The subjects (with the reasons they need approval), joined with ` ; `.
    pub subject: String,
    /// Each subject's key, remembered when the answer is `always`.
    pub keys: Vec<String>,
}

/// The rules file path for `agent`.
pub fn rules_path(agent: &str) -> Result<String, PolicyError> {
    let ok = !agent.is_empty()
        && agent != "."
        && agent != ".."
        && agent
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(PolicyError::BadAgentName(agent.to_string()));
    }
    Ok(format!("agents/{agent}.md"))
}

impl Policy {
    /// Loads the policy. `read(path)` returns the file at the base commit,
    /// `Ok(None)` when it does not exist.
    pub fn load(
        agent: &str,
        commit: &str,
        mut read: impl FnMut(&str) -> Result<Option<String>, String>,
    ) -> Result<Self, PolicyError> {
        let path = rules_path(agent)?;
        let text = read(&path)
            .map_err(PolicyError::Read)?
            .ok_or_else(|| PolicyError::Missing {
                path: path.clone(),
                commit: commit.to_string(),
            })?;
        let rules = Rules::parse(&path, &text)?;
        let manifest = match read(manifest::MANIFEST_PATH).map_err(PolicyError::Read)? {
            Some(text) => Manifest::parse(&text)?,
            None => Manifest::default(),
        };
        Ok(Self {
            agent: agent.to_string(),
            rules,
            grant: manifest.grant(agent),
        })
    }

    /// Decides an Exec run in `ctx`. `always` holds subject keys answered
    /// `always` earlier in the session; they count as allowed.
    ///
    /// A subject that needs approval (see [`command`]) is at least `ask`
    /// where a pattern allowed it; a tool given one value for everything
    /// (`bash: allow`) has no pattern to fool and is not escalated.
    pub fn decide_exec(
        &self,
        argv: &[String],
        ctx: &ExecContext<'_>,
        always: &HashSet<String>,
    ) -> Result<ExecDecision, CommandError> {
        let subjects = command::subjects(argv, ctx)?;
        let mut worst: Option<Decision> = None;
        for s in &subjects {
            let mut d = self.rules.decide(EXEC_TOOL, &s.text);
            if d.action == Action::Allow && d.source.is_some() && !s.escalations.is_empty() {
                d = Decision {
                    action: Action::Ask,
                    rule: format!(
                        "{}; but {}: needs approval",
                        d.rule,
                        s.escalations.join("; ")
                    ),
                    source: d.source,
                };
            }
            if d.action == Action::Ask && always.contains(&s.key()) {
                d = Decision {
                    action: Action::Allow,
                    rule: format!("{EXEC_TOOL}: answered always earlier in this session"),
                    source: None,
                };
            }
            if worst.as_ref().is_none_or(|w| d.action > w.action) {
                worst = Some(d);
            }
        }
        let decision = worst.unwrap_or(Decision {
            action: Action::Deny,
            rule: "empty command".into(),
            source: None,
        });
        let keys: Vec<String> = subjects.iter().map(command::Subject::key).collect();
        Ok(ExecDecision {
            action: decision.action,
            rule: decision.rule,
            source: decision.source,
            subject: keys.join(" ; "),
            keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(rules: &str) -> Policy {
        Policy::load("coder", "abc", |p| {
            Ok(match p {
                "agents/coder.md" => Some(rules.to_string()),
                _ => None,
            })
        })
        .unwrap()
    }

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn decide(p: &Policy, argv: &[String], always: &HashSet<String>) -> ExecDecision {
        let env = std::collections::BTreeMap::new();
        let ctx = ExecContext {
            workspace: std::path::Path::new("/workspace"),
            cwd: std::path::Path::new("/workspace"),
            env: &env,
        };
        p.decide_exec(argv, &ctx, always).unwrap()
    }

    #[test]
    fn combined_decisions() {
        let p = policy("---\npermission:\n  bash:\n    \"*\": ask\n    \"git *\": allow\n    \"git push *\": deny\n    \"ls*\": allow\n---\n");
        let none = HashSet::new();
        assert_eq!(
            decide(&p, &argv(&["git", "status"]), &none).action,
            Action::Allow
        );
        let d = decide(
            &p,
            &argv(&["sh", "-c", "ls && sudo git push origin main"]),
            &none,
        );
        assert_eq!(d.action, Action::Deny);
        assert_eq!(
            d.subject,
            "ls ; git push origin main [sudo runs the command as another user]"
        );
        assert!(d.rule.contains("git push *"));
        assert_eq!(decide(&p, &argv(&["make"]), &none).action, Action::Ask);
        let always: HashSet<String> = ["make".to_string()].into();
        assert_eq!(decide(&p, &argv(&["make"]), &always).action, Action::Allow);
        assert_eq!(
            decide(&p, &argv(&["sh", "-c", "ls $(make)"]), &none).action,
            Action::Ask
        );
    }

    #[test]
    fn load_failures_stop_the_session() {
        let e = Policy::load("coder", "abc", |_| Ok(None)).unwrap_err();
        assert!(
            e.to_string().contains("agents/coder.md does not exist"),
            "{e}"
        );
        assert!(matches!(
            Policy::load("../x", "abc", |_| Ok(None)),
            Err(PolicyError::BadAgentName(_))
        ));
        let e = Policy::load("coder", "abc", |p| {
            Ok(Some(if p.ends_with(".md") {
                "---\npermission: {}\n---\n".into()
            } else {
                "version: 1\nbogus: 1\n".into()
            }))
        })
        .unwrap_err();
        assert!(matches!(e, PolicyError::Manifest(_)), "{e}");
    }
}
