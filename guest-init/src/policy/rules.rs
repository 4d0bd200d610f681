//! Permission rules from `agents/<agent>.md`: YAML frontmatter whose
//! `permission:` maps tools to `allow | ask | deny`, either one value or a map
//! of glob patterns to values where the last matching pattern wins.
//!
//! ```yaml
//! ---
//! permission:
//!   edit: allow
//!   webfetch: deny
//!   bash:
//!     "*": ask
//!     "git status*": allow
//!     "git push *": deny
//! ---
//! ```
//!
//! A tool that is not listed, or a subject no pattern matches, is `ask`.
//! A pattern ending in ` *` also matches the text without that last space:
//! `"git push *"` matches `git push` as well as `git push origin main`.

use std::collections::BTreeMap;
use std::fmt;

use super::glob::glob_match;

/// What a rule says to do with a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Run it.
    Allow,
    /// Hold it until the control plane answers.
    Ask,
    /// Refuse it.
    Deny,
}

impl Action {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "allow" => Some(Self::Allow),
            "ask" => Some(Self::Ask),
            "deny" => Some(Self::Deny),
            _ => None,
        }
    }

    /// The lowercase name used in policy files and audit events.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "allow",
            Self::Ask => "ask",
            Self::Deny => "deny",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The rule for one tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolRule {
    /// One action for every use of the tool.
    Single(Action),
    /// Patterns in file order; the last one matching wins.
    Patterns(Vec<Pattern>),
}

/// One pattern of a tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// The glob.
    pub glob: String,
    /// What it decides.
    pub action: Action,
    /// Where it is written.
    pub source: RuleSource,
}

/// Where a rule is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSource {
    /// The rules file.
    pub path: String,
    /// Position among the tool's patterns, from 1.
    pub index: usize,
    /// Line in the file, from 1, where it could be found.
    pub line: Option<usize>,
}

impl fmt::Display for RuleSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{l}, pattern {}", self.path, self.index),
            None => write!(f, "{}, pattern {}", self.path, self.index),
        }
    }
}

/// A decision and the rule that made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Human-readable rule, e.g. `bash: "git push *" = deny`.
    pub rule: String,
    /// The pattern that decided, if one did (not a tool's single value or
    /// the default).
    pub source: Option<RuleSource>,
}

/// Why a policy file was refused. Any of these stops the session.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The file does not start with a `---` frontmatter block.
    #[error("{path}: no YAML frontmatter (the file must start with a line `---` and the block end with `---`)")]
    NoFrontmatter {
        /// Path of the file in the repository.
        path: String,
    },
    /// The frontmatter is not valid YAML.
    #[error("{path}: frontmatter is not valid YAML: {source}")]
    Yaml {
        /// Path of the file in the repository.
        path: String,
        /// Parser error.
        source: serde_yaml::Error,
    },
    /// The structure or a value is not what `permission:` allows.
    #[error("{path}: {detail}")]
    Invalid {
        /// Path of the file in the repository.
        path: String,
        /// What is wrong and where.
        detail: String,
    },
}

/// The permission rules of one agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    tools: BTreeMap<String, ToolRule>,
}

/// Extracts the YAML frontmatter between the opening and closing `---`.
pub fn frontmatter(text: &str) -> Option<&str> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let rest = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))?;
    let mut offset = 0;
    for line in rest.split_inclusive('\n') {
        if line.trim_end() == "---" {
            return Some(&rest[..offset]);
        }
        offset += line.len();
    }
    None
}

impl Rules {
    /// Parses the rules from the text of `path` (used in error messages).
    pub fn parse(path: &str, text: &str) -> Result<Self, RulesError> {
        let invalid = |detail: String| RulesError::Invalid {
            path: path.to_string(),
            detail,
        };
        let fm = frontmatter(text).ok_or_else(|| RulesError::NoFrontmatter {
            path: path.to_string(),
        })?;
        let doc: serde_yaml::Value =
            serde_yaml::from_str(fm).map_err(|source| RulesError::Yaml {
                path: path.to_string(),
                source,
            })?;
        let mut tools = BTreeMap::new();
        let perm = match &doc {
            serde_yaml::Value::Mapping(m) => m.get("permission"),
            serde_yaml::Value::Null => None,
            _ => return Err(invalid("frontmatter must be a mapping".into())),
        };
        let Some(perm) = perm else {
            return Ok(Self { tools });
        };
        let serde_yaml::Value::Mapping(perm) = perm else {
            return Err(invalid("`permission` must map tool names to rules".into()));
        };
        for (tool, rule) in perm {
            let tool = tool
                .as_str()
                .ok_or_else(|| invalid(format!("permission key {tool:?} is not a tool name")))?;
            let rule = match rule {
                serde_yaml::Value::String(s) => ToolRule::Single(Action::parse(s).ok_or_else(|| {
                    invalid(format!("permission.{tool}: {s:?} is not one of allow, ask, deny"))
                })?),
                serde_yaml::Value::Mapping(patterns) => {
                    let mut list = Vec::new();
                    let mut search_from = tool_line(fm, tool);
                    for (pat, act) in patterns {
                        let pat = pat.as_str().ok_or_else(|| {
                            invalid(format!("permission.{tool}: pattern {pat:?} is not a string"))
                        })?;
                        let act = act.as_str().and_then(Action::parse).ok_or_else(|| {
                            invalid(format!(
                                "permission.{tool}.{pat:?}: {act:?} is not one of allow, ask, deny"
                            ))
                        })?;
                        let line = pattern_line(fm, pat, search_from);
                        if let Some(l) = line {
                            search_from = l;
                        }
                        list.push(Pattern {
                            glob: pat.to_string(),
                            action: act,
                            source: RuleSource {
                                path: path.to_string(),
                                index: list.len() + 1,
                                // The frontmatter starts on line 2.
                                line: line.map(|l| l + 2),
                            },
                        });
                    }
                    ToolRule::Patterns(list)
                }
                other => {
                    return Err(invalid(format!(
                        "permission.{tool}: expected allow|ask|deny or a map of patterns, found {other:?}"
                    )))
                }
            };
            tools.insert(tool.to_string(), rule);
        }
        Ok(Self { tools })
    }

    /// Decides one use of `tool` on `subject` (a command line for `bash`, a
    /// path for `edit`, a URL for `webfetch`).
    pub fn decide(&self, tool: &str, subject: &str) -> Decision {
        match self.tools.get(tool) {
            None => Decision {
                action: Action::Ask,
                rule: format!("{tool}: not listed (default ask)"),
                source: None,
            },
            Some(ToolRule::Single(a)) => Decision {
                action: *a,
                rule: format!("{tool}: {a}"),
                source: None,
            },
            Some(ToolRule::Patterns(list)) => list
                .iter()
                .rev()
                .find(|p| pattern_matches(&p.glob, subject))
                .map(|p| Decision {
                    action: p.action,
                    rule: format!("{tool}: {:?} = {}", p.glob, p.action),
                    source: Some(p.source.clone()),
                })
                .unwrap_or_else(|| Decision {
                    action: Action::Ask,
                    rule: format!("{tool}: no pattern matched (default ask)"),
                    source: None,
                }),
        }
    }
}

/// `glob_match`, plus: a pattern ending in ` *` matches zero arguments too.
pub fn pattern_matches(pattern: &str, subject: &str) -> bool {
    glob_match(pattern, subject)
        || pattern
            .strip_suffix(" *")
            .is_some_and(|head| !head.ends_with('\\') && glob_match(head, subject))
}

/// 0-based line of the frontmatter where `tool:` is a key.
fn tool_line(fm: &str, tool: &str) -> usize {
    fm.lines()
        .position(|l| key_of(l).as_deref() == Some(tool))
        .unwrap_or(0)
}

/// 0-based line, at or after `from`, where `pattern` is a key.
fn pattern_line(fm: &str, pattern: &str, from: usize) -> Option<usize> {
    fm.lines()
        .enumerate()
        .skip(from)
        .find(|(_, l)| key_of(l).as_deref() == Some(pattern))
        .map(|(i, _)| i)
}

/// The key of a `key: value` YAML line, quotes removed (simple cases only;
/// used to point at a line, never to decide).
fn key_of(line: &str) -> Option<String> {
    let t = line.trim_start();
    for q in ['"', '\''] {
        if let Some(rest) = t.strip_prefix(q) {
            let end = rest.find(q)?;
            return rest[end + 1..]
                .trim_start()
                .starts_with(':')
                .then(|| rest[..end].to_string());
        }
    }
    let (k, _) = t.split_once(':')?;
    Some(k.trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "---\ndescription: coder\npermission:\n  edit: allow\n  webfetch: deny\n  bash:\n    \"*\": ask\n    \"git *\": allow\n    \"git push *\": deny\n---\n# Coder\nbody\n";

    #[test]
    fn last_match_wins() {
        let r = Rules::parse("agents/coder.md", FILE).unwrap();
        assert_eq!(r.decide("bash", "git status").action, Action::Allow);
        let d = r.decide("bash", "git push origin main");
        assert_eq!(d.action, Action::Deny);
        assert_eq!(d.rule, "bash: \"git push *\" = deny");
        assert_eq!(r.decide("bash", "rm -rf /").action, Action::Ask);
        assert_eq!(r.decide("edit", "src/x").action, Action::Allow);
        assert_eq!(r.decide("webfetch", "https://x").action, Action::Deny);
        assert_eq!(r.decide("other", "x").action, Action::Ask);
    }

    #[test]
    fn order_matters() {
        let f = "---\npermission:\n  bash:\n    \"git push *\": deny\n    \"*\": allow\n---\n";
        let r = Rules::parse("a.md", f).unwrap();
        assert_eq!(r.decide("bash", "git push x").action, Action::Allow);
    }

    #[test]
    fn errors_are_reported() {
        assert!(matches!(
            Rules::parse("a.md", "no frontmatter"),
            Err(RulesError::NoFrontmatter { .. })
        ));
        assert!(matches!(
            Rules::parse("a.md", "---\npermission: [\n---\n"),
            Err(RulesError::Yaml { .. })
        ));
        let e = Rules::parse("a.md", "---\npermission:\n  bash: maybe\n---\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("\"maybe\" is not one of allow, ask, deny"),
            "{e}"
        );
        assert!(Rules::parse("a.md", "---\npermission: allow\n---\n").is_err());
        assert!(Rules::parse("a.md", "---\npermission:\n  bash:\n    \"*\": 1\n---\n").is_err());
    }
}
