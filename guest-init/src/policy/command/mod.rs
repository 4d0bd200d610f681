//! Turns an Exec into the *subjects* that permission rules match: one per
//! command that will run, with the reasons (if any) why a rule that allows
//! it is not enough and a person must approve it.
//!
//! * `sh -c SCRIPT` (any shell, any flags) is read by [`super::shell`]: the
//!   script is split at `;`, `&`, `|`, `&&`, `||`, newlines and subshells,
//!   and the scripts of `$(...)`, backticks and `<(...)` are decided too.
//! * Redirections are taken out of the matched text; one writing outside the
//!   workspace (or into its `.git`) needs approval.
//! * Commands that run other commands (`env`, `timeout`, `nice`, `nohup`,
//!   `setsid`, `stdbuf`, `xargs`, `find -exec`, `watch`, `flock`, `sudo`,
//!   `eval`, shells with `-c`, ... see [`WRAPPERS`]) are unwrapped and the
//!   inner command is decided; some need approval on their own (`sudo`,
//!   `chroot`, `xargs`, ...).
//! * Variables that change what runs ([`super::risky_env`]) need approval,
//!   whether set as `VAR=x cmd`, through `env`, `export`, or the Exec's env.
//! * A program named by a path is decided as that path, normalised; only a
//!   program in one of [`SYSTEM_BIN_DIRS`] is decided by its bare name. A
//!   `..` after a directory name (which a symbolic link can redirect) that
//!   leads out of the workspace needs approval.
//! * Shells that read start-up files (`-i`, `-l`, `--rcfile`, zsh, fish,
//!   csh) and programs whose options name a program to run (`tar
//!   --to-command`, `rsync -e`, `ssh -o ProxyCommand=`, see `programs`)
//!   need approval; the program they name is decided too.
//! * `git`'s global options are taken out ([`super::git`]).
//! * A word whose value only the shell knows (a variable, a substitution, a
//!   file name pattern, brace expansion) needs approval.
//!
//! The subject's text is the command's words joined by single spaces.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use super::git;
use super::risky_env::{is_identifier, is_risky};
use super::shell::{self, Redirect, Word};

mod programs;
mod wrappers;

/// Directories whose programs are decided by their bare name. They are the
/// commands' PATH ([`crate::exec::BASE_PATH`]) and belong to root in the
/// image, so the agent cannot put a program there.
pub const SYSTEM_BIN_DIRS: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// Files outside the workspace that output may always go to.
pub const ALLOWED_OUTPUT_FILES: &[&str] = &["/dev/null", "/dev/stdout", "/dev/stderr"];

/// Programs that run another command, unwrapped before matching.
pub const WRAPPERS: &[&str] = &[
    "env",
    "nice",
    "ionice",
    "timeout",
    "nohup",
    "setsid",
    "stdbuf",
    "chrt",
    "taskset",
    "command",
    "builtin",
    "exec",
    "time",
    "doas",
    "sudo",
    "su",
    "runuser",
    "sg",
    "chroot",
    "unshare",
    "nsenter",
    "setpriv",
    "prlimit",
    "cgexec",
    "fakeroot",
    "valgrind",
    "catchsegv",
    "strace",
    "ltrace",
    "xargs",
    "parallel",
    "watch",
    "flock",
    "busybox",
    "find",
    "eval",
    "coproc",
    "git",
    "sh",
    "bash",
    "dash",
    "zsh",
    "ksh",
    "mksh",
    "ash",
    "yash",
    "posh",
    "rbash",
    "lksh",
    "fish",
    "csh",
    "tcsh",
];

const SHELLS: &[&str] = &[
    "sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "yash", "posh", "rbash", "lksh", "fish",
    "csh", "tcsh",
];

/// Where an Exec runs: what the policy needs beyond its argv.
#[derive(Debug, Clone, Copy)]
pub struct ExecContext<'a> {
    /// The workspace root; output outside it needs approval.
    pub workspace: &'a Path,
    /// The Exec's working directory (inside the workspace).
    pub cwd: &'a Path,
    /// The Exec's own environment additions.
    pub env: &'a BTreeMap<String, String>,
}

/// One command found in an Exec, as rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    /// Words joined by single spaces: wrappers, assignments and
    /// redirections removed, the program as it resolves.
    pub text: String,
    /// Why this command needs approval even where a rule allows it.
    pub escalations: Vec<String>,
}

impl Subject {
    /// The text shown to the approver and remembered after `always`: the
    /// matched text plus the reasons it needs approval.
    pub fn key(&self) -> String {
        if self.escalations.is_empty() {
            self.text.clone()
        } else {
            format!("{} [{}]", self.text, self.escalations.join("; "))
        }
    }
}

/// Problems with a command line that make it impossible to decide.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CommandError {
    /// The argv is empty.
    #[error("empty command: argv needs at least one element")]
    Empty,
    /// A shell script with an unterminated quote or substitution.
    #[error("unterminated quote or substitution in shell script")]
    UnterminatedQuote,
    /// Shells nested deeper than the limit.
    #[error("shell scripts nested more than {0} levels deep")]
    TooDeep(usize),
    /// More commands or wrappers than the policy reads in one Exec.
    #[error("more than {0} commands and wrappers in one command line")]
    TooLong(usize),
}

const MAX_DEPTH: usize = 8;
const MAX_STEPS: usize = 512;
/// Reasons listed per subject; more are counted.
const MAX_REASONS: usize = 8;

/// The subjects of `argv` run in `ctx`, in order.
pub fn subjects(argv: &[String], ctx: &ExecContext<'_>) -> Result<Vec<Subject>, CommandError> {
    if argv.is_empty() {
        return Err(CommandError::Empty);
    }
    let mut w = Walker {
        ctx,
        out: Vec::new(),
        dir_changed: false,
        steps: 0,
    };
    w.command(
        argv.iter().map(|a| Word::literal(a)).collect(),
        Vec::new(),
        0,
    )?;
    let risky: Vec<&str> = ctx
        .env
        .keys()
        .map(String::as_str)
        .filter(|k| is_risky(k))
        .collect();
    if !risky.is_empty() {
        let mut named = risky[..risky.len().min(3)].join(", ");
        if risky.len() > 3 {
            named.push_str(&format!(" and {} more", risky.len() - 3));
        }
        let reason = format!("the Exec's environment sets {named}");
        for s in &mut w.out {
            s.escalations.push(reason.clone());
        }
    }
    Ok(w.out)
}

struct Walker<'a> {
    ctx: &'a ExecContext<'a>,
    out: Vec<Subject>,
    /// A `cd` (or `env -C`) ran earlier: relative paths are no longer known.
    dir_changed: bool,
    steps: usize,
}

/// What a wrapper leaves to decide.
enum Next {
    /// Go on with the wrapper's arguments after the first `n` (the inner
    /// command is the rest).
    Skip(usize),
    /// Go on with these words (an inner command the wrapper builds).
    Inner(Vec<Word>),
    /// Decide this shell script instead.
    Script(String),
    /// The wrapper runs nothing else: decide it as it is.
    Itself,
    /// Already decided (the subject is out).
    Done,
}

/// `NAME=value` with a plain name.
fn assignment_name(word: &Word) -> Option<&str> {
    let (name, _) = word.text.split_once('=')?;
    is_identifier(name).then_some(name)
}

fn texts(words: &[Word]) -> Vec<String> {
    words.iter().map(|w| w.text.clone()).collect()
}

/// Lexically normalised absolute path (`.` and `..` resolved).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// True when `path` has a `..` after a directory name. The kernel resolves
/// `dir/..` from wherever `dir` leads, so when `dir` is a symbolic link (the
/// agent can make one in the workspace) the path is not what
/// [`normalize`] makes of it: `a/../../usr/bin/git` with `a -> /tmp/x/y` is
/// `/tmp/usr/bin/git`. A leading `..` climbs from the working directory,
/// which is resolved already.
fn climbs_out_of_a_directory(path: &str) -> bool {
    let mut named = false;
    for c in Path::new(path).components() {
        match c {
            Component::Normal(_) => named = true,
            Component::ParentDir if named => return true,
            _ => {}
        }
    }
    false
}

/// Options of a wrapper: the index of its first operand and the options seen
/// with their values. `short` lists the one-letter options taking a value,
/// `long` the long ones taking a separate value.
fn options(args: &[Word], short: &str, long: &[&str]) -> (usize, Vec<(String, String)>) {
    let mut seen = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].text.as_str();
        if a == "--" {
            return (i + 1, seen);
        }
        if !a.starts_with('-') || a == "-" {
            return (i, seen);
        }
        if a.starts_with("--") {
            if let Some((name, value)) = a.split_once('=') {
                seen.push((name.to_string(), value.to_string()));
                i += 1;
            } else if long.contains(&a) {
                let value = args.get(i + 1).map(|w| w.text.clone()).unwrap_or_default();
                seen.push((a.to_string(), value));
                i += 2;
            } else {
                seen.push((a.to_string(), String::new()));
                i += 1;
            }
            continue;
        }
        let cluster: Vec<char> = a[1..].chars().collect();
        i += 1;
        for (j, ch) in cluster.iter().enumerate() {
            if short.contains(*ch) {
                let attached: String = cluster[j + 1..].iter().collect();
                let value = if attached.is_empty() {
                    i += 1;
                    args.get(i - 1).map(|w| w.text.clone()).unwrap_or_default()
                } else {
                    attached
                };
                seen.push((format!("-{ch}"), value));
                break;
            }
            seen.push((format!("-{ch}"), String::new()));
        }
    }
    (args.len(), seen)
}

fn has(opts: &[(String, String)], names: &[&str]) -> Option<String> {
    opts.iter()
        .find(|(n, _)| names.contains(&n.as_str()))
        .map(|(_, v)| v.clone())
}

impl Walker<'_> {
    fn step(&mut self) -> Result<(), CommandError> {
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err(CommandError::TooLong(MAX_STEPS));
        }
        Ok(())
    }

    fn script(&mut self, text: &str, esc: &[String], depth: usize) -> Result<(), CommandError> {
        if depth > MAX_DEPTH {
            return Err(CommandError::TooDeep(MAX_DEPTH));
        }
        for cmd in shell::parse(text)? {
            self.step()?;
            for sub in &cmd.substitutions {
                self.script(sub, esc, depth + 1)?;
            }
            let mut e = esc.to_vec();
            e.extend(cmd.notes.iter().map(|n| n.to_string()));
            for r in &cmd.redirects {
                if let Some(why) = self.redirect_reason(r) {
                    e.push(why);
                }
            }
            self.command(cmd.words, e, depth)?;
        }
        Ok(())
    }

    fn redirect_reason(&self, r: &Redirect) -> Option<String> {
        if !r.writes_file() {
            return None;
        }
        if let Some(why) = r.target.dynamic {
            return Some(format!(
                "it writes to a file named by {why} ({} {})",
                r.op, r.target.text
            ));
        }
        self.output_reason(&r.target.text, &r.op)
    }

    /// Why writing to `path` needs approval, if it does.
    fn output_reason(&self, path: &str, how: &str) -> Option<String> {
        if ALLOWED_OUTPUT_FILES.contains(&path) {
            return None;
        }
        let p = Path::new(path);
        if p.is_relative() && self.dir_changed {
            return Some(format!(
                "it writes to {path} after changing directory ({how} {path})"
            ));
        }
        let full = normalize(&self.ctx.cwd.join(p));
        if ALLOWED_OUTPUT_FILES.iter().any(|a| Path::new(a) == full) {
            return None;
        }
        let ws = normalize(self.ctx.workspace);
        match full.strip_prefix(&ws) {
            Err(_) => Some(format!("it writes outside the workspace ({how} {path})")),
            Ok(inside) if inside.components().any(|c| c.as_os_str() == ".git") => Some(format!(
                "it writes into the repository's .git directory ({how} {path})"
            )),
            Ok(_) => None,
        }
    }

    fn emit(&mut self, words: &[Word], mut esc: Vec<String>) {
        // One reason per kind of dynamic word, naming the first few words.
        let mut dynamic: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for w in words {
            if let Some(why) = w.dynamic {
                dynamic.entry(why).or_default().push(&w.text);
            }
        }
        for (why, ws) in dynamic {
            let mut named: Vec<String> = ws.iter().take(3).map(|t| format!("{t:?}")).collect();
            if ws.len() > 3 {
                named.push(format!("{} more", ws.len() - 3));
            }
            esc.push(format!("{} comes from {why}", named.join(", ")));
        }
        let mut seen = std::collections::HashSet::new();
        let mut unique: Vec<String> = esc.into_iter().filter(|r| seen.insert(r.clone())).collect();
        if unique.len() > MAX_REASONS {
            let more = unique.len() - MAX_REASONS;
            unique.truncate(MAX_REASONS);
            unique.push(format!("and {more} more reasons"));
        }
        self.out.push(Subject {
            text: texts(words).join(" "),
            escalations: unique,
        });
    }

    /// Decides one simple command (and whatever it runs).
    fn command(
        &mut self,
        mut words: Vec<Word>,
        mut esc: Vec<String>,
        depth: usize,
    ) -> Result<(), CommandError> {
        if depth > MAX_DEPTH {
            return Err(CommandError::TooDeep(MAX_DEPTH));
        }
        // The command is `words[start..]`; unwrapping moves `start`.
        let mut start = 0;
        loop {
            self.step()?;
            // Reserved words of compound commands.
            start += words[start..]
                .iter()
                .take_while(|w| {
                    w.dynamic.is_none()
                        && matches!(
                            w.text.as_str(),
                            "!" | "{" | "if" | "then" | "else" | "elif" | "while" | "until" | "do"
                        )
                })
                .count();
            if words.len() == start + 1
                && matches!(words[start].text.as_str(), "fi" | "done" | "}" | "esac")
            {
                start += 1;
            }
            let assigned_from = start;
            start += words[start..]
                .iter()
                .take_while(|w| assignment_name(w).is_some())
                .count();
            for name in words[assigned_from..start]
                .iter()
                .filter_map(assignment_name)
            {
                if is_risky(name) {
                    esc.push(format!("it sets {name}"));
                }
            }
            if start == words.len() {
                // Assignments or redirections alone still take effect.
                if !esc.is_empty() {
                    self.emit(&words[assigned_from..], esc);
                }
                return Ok(());
            }
            if let Some(why) = words[start].dynamic {
                esc.push(format!("the program name comes from {why}"));
                self.emit(&words[start..], esc);
                return Ok(());
            }
            let Some(name) = self.resolve(&words[start].text, &mut esc) else {
                // A program outside the system directories: its full path.
                let full = normalize(&self.ctx.cwd.join(&words[start].text));
                words[start].text = full.to_string_lossy().into_owned();
                self.emit(&words[start..], esc);
                return Ok(());
            };
            words[start].text = name.clone();
            match self.unwrap(&name, &words[start + 1..], &mut esc, depth)? {
                Next::Skip(n) if start + 1 + n < words.len() => start += 1 + n,
                Next::Inner(inner) if !inner.is_empty() => {
                    words = inner;
                    start = 0;
                }
                Next::Skip(_) | Next::Inner(_) | Next::Itself => {
                    self.emit(&words[start..], esc);
                    return Ok(());
                }
                Next::Script(s) => return self.script(&s, &esc, depth + 1),
                Next::Done => return Ok(()),
            }
        }
    }

    /// The name a program is decided by: its bare name when it is one or
    /// lives in a system directory; `None` for any other path.
    fn resolve(&self, prog: &str, esc: &mut Vec<String>) -> Option<String> {
        if !prog.contains('/') {
            return Some(prog.to_string());
        }
        if Path::new(prog).is_relative() && self.dir_changed {
            esc.push(format!(
                "{prog} is a relative path after a change of directory"
            ));
        }
        let full = normalize(&self.ctx.cwd.join(prog));
        if climbs_out_of_a_directory(prog) && !full.starts_with(normalize(self.ctx.workspace)) {
            esc.push(format!(
                "{prog} goes up ('..') out of a directory that a symbolic link can put elsewhere"
            ));
        }
        let parent = full.parent()?.to_str()?;
        if SYSTEM_BIN_DIRS.contains(&parent) {
            full.file_name().map(|n| n.to_string_lossy().into_owned())
        } else {
            None
        }
    }

    /// A dynamic word among a wrapper's options changes what it runs.
    fn check_skipped(skipped: &[Word], name: &str, esc: &mut Vec<String>) {
        for w in skipped {
            if let Some(why) = w.dynamic {
                esc.push(format!("{name} option {:?} comes from {why}", w.text));
            }
        }
    }

    /// Generic wrapper: options, then `operands` fixed operands, then the command.
    fn simple(
        name: &str,
        rest: &[Word],
        short: &str,
        long: &[&str],
        operands: usize,
        esc: &mut Vec<String>,
    ) -> (Vec<(String, String)>, Next) {
        let (i, opts) = options(rest, short, long);
        let start = (i + operands).min(rest.len());
        Self::check_skipped(&rest[..start], name, esc);
        (opts, Next::Skip(start))
    }
}

#[cfg(test)]
mod tests;
