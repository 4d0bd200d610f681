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
//!   program in one of [`SYSTEM_BIN_DIRS`] is decided by its bare name.
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

    fn unwrap(
        &mut self,
        name: &str,
        rest: &[Word],
        esc: &mut Vec<String>,
        depth: usize,
    ) -> Result<Next, CommandError> {
        let r = |s: &str| s.to_string();
        Ok(match name {
            "env" => {
                let (mut i, opts) = options(rest, "uCS", &["--unset", "--chdir", "--split-string"]);
                Self::check_skipped(&rest[..i], name, esc);
                if has(&opts, &["-C", "--chdir"]).is_some() {
                    self.dir_changed = true;
                }
                while rest.get(i).is_some_and(|w| w.text == "-") {
                    i += 1;
                }
                let split = has(&opts, &["-S", "--split-string"]);
                let mut inner = Vec::new();
                if let Some(split) = &split {
                    for cmd in shell::parse(split)? {
                        inner.extend(cmd.words);
                    }
                }
                let no_command = inner
                    .iter()
                    .chain(&rest[i..])
                    .all(|w| assignment_name(w).is_some());
                if no_command {
                    // env prints the environment.
                    for w in inner.iter().chain(&rest[i..]) {
                        if let Some(n) = assignment_name(w).filter(|n| is_risky(n)) {
                            esc.push(format!("it sets {n}"));
                        }
                    }
                    Next::Itself
                } else if split.is_some() {
                    inner.extend(rest[i..].iter().cloned());
                    Next::Inner(inner)
                } else {
                    Next::Skip(i)
                }
            }
            "nice" => Self::simple(name, rest, "n", &["--adjustment"], 0, esc).1,
            "ionice" => {
                let (opts, next) = Self::simple(
                    name,
                    rest,
                    "cnpPu",
                    &["--class", "--classdata", "--pid", "--pgid", "--uid"],
                    0,
                    esc,
                );
                if has(&opts, &["-p", "-P", "-u", "--pid", "--pgid", "--uid"]).is_some() {
                    Next::Itself
                } else {
                    next
                }
            }
            "timeout" => Self::simple(name, rest, "sk", &["--signal", "--kill-after"], 1, esc).1,
            "nohup" | "setsid" | "builtin" | "catchsegv" | "valgrind" | "setpriv" => {
                if name == "setpriv" {
                    esc.push(r("setpriv changes the command's privileges"));
                }
                Self::simple(name, rest, "", &[], 0, esc).1
            }
            "command" => {
                let (_, opts) = options(rest, "", &[]);
                if has(&opts, &["-v", "-V"]).is_some() {
                    // `command -v x` only looks x up.
                    Next::Itself
                } else {
                    Self::simple(name, rest, "", &[], 0, esc).1
                }
            }
            "exec" => Self::simple(name, rest, "a", &[], 0, esc).1,
            "stdbuf" => {
                Self::simple(
                    name,
                    rest,
                    "ioe",
                    &["--input", "--output", "--error"],
                    0,
                    esc,
                )
                .1
            }
            "chrt" | "taskset" => {
                let short = if name == "chrt" { "TPD" } else { "" };
                let (opts, next) = Self::simple(name, rest, short, &[], 1, esc);
                if has(&opts, &["-p", "--pid", "-m", "--max", "-a", "--all-tasks"]).is_some() {
                    Next::Itself
                } else {
                    next
                }
            }
            "prlimit" => {
                let (opts, next) = Self::simple(name, rest, "p", &["--pid"], 0, esc);
                if has(&opts, &["-p", "--pid"]).is_some() {
                    Next::Itself
                } else {
                    next
                }
            }
            "cgexec" => Self::simple(name, rest, "g", &[], 0, esc).1,
            "fakeroot" => Self::simple(name, rest, "ls", &["--lib", "--faked"], 0, esc).1,
            "time" => {
                let (opts, next) =
                    Self::simple(name, rest, "fo", &["--format", "--output"], 0, esc);
                if let Some(file) = has(&opts, &["-o", "--output"]) {
                    esc.extend(self.output_reason(&file, "time -o"));
                }
                next
            }
            "strace" | "ltrace" => {
                let (opts, next) = Self::simple(
                    name,
                    rest,
                    if name == "strace" {
                        "abeEIoOpPsSuUX"
                    } else {
                        "aAeoOpsnuwxF"
                    },
                    &[
                        "--output", "--env", "--user", "--attach", "--expr", "--signal",
                    ],
                    0,
                    esc,
                );
                for (o, v) in &opts {
                    if (o == "-E" || o == "--env") && is_risky(v.split('=').next().unwrap_or(v)) {
                        esc.push(format!("{name} {o} sets {v}"));
                    }
                    if o == "-o" || o == "--output" {
                        esc.extend(self.output_reason(v, &format!("{name} -o")));
                    }
                    if o == "-u" || o == "--user" {
                        esc.push(format!("{name} -u runs the command as another user"));
                    }
                }
                if has(&opts, &["-p", "--attach"]).is_some() {
                    Next::Itself
                } else {
                    next
                }
            }
            "sudo" | "doas" => {
                esc.push(format!("{name} runs the command as another user"));
                let (i, _) = if name == "sudo" {
                    options(
                        rest,
                        "ughpCDrtUTR",
                        &[
                            "--user",
                            "--group",
                            "--host",
                            "--prompt",
                            "--chdir",
                            "--close-from",
                            "--role",
                            "--type",
                            "--other-user",
                            "--command-timeout",
                            "--chroot",
                        ],
                    )
                } else {
                    options(rest, "uC", &[])
                };
                Self::check_skipped(&rest[..i], name, esc);
                Next::Skip(i)
            }
            "su" | "runuser" => {
                esc.push(format!("{name} runs the command as another user"));
                let (i, opts) = options(
                    rest,
                    "cgGsw",
                    &[
                        "--command",
                        "--session-command",
                        "--shell",
                        "--group",
                        "--supp-group",
                        "--whitelist-environment",
                    ],
                );
                if let Some(script) = has(&opts, &["-c", "--command", "--session-command"]) {
                    Next::Script(script)
                } else if name == "runuser" && has(&opts, &["-u"]).is_some() {
                    Next::Skip(i)
                } else {
                    Next::Itself
                }
            }
            "sg" => {
                esc.push(r("sg runs the command with another group"));
                let args = rest.get(1..).unwrap_or_default();
                let args = match args.first() {
                    Some(w) if w.text == "-c" => &args[1..],
                    _ => args,
                };
                if args.is_empty() {
                    Next::Itself
                } else {
                    Next::Script(texts(args).join(" "))
                }
            }
            "chroot" => {
                esc.push(r("chroot changes the root directory"));
                Self::simple(name, rest, "", &["--userspec", "--groups"], 1, esc).1
            }
            "unshare" => {
                esc.push(r("unshare runs the command in new namespaces"));
                Self::simple(
                    name,
                    rest,
                    "SGRw",
                    &["--setuid", "--setgid", "--root", "--wd"],
                    0,
                    esc,
                )
                .1
            }
            "nsenter" => {
                esc.push(r("nsenter runs the command in other namespaces"));
                Self::simple(
                    name,
                    rest,
                    "tSG",
                    &["--target", "--setuid", "--setgid"],
                    0,
                    esc,
                )
                .1
            }
            "xargs" => {
                esc.push(r("xargs adds arguments read from its input"));
                let (_, next) = Self::simple(
                    name,
                    rest,
                    "adEILnPs",
                    &[
                        "--arg-file",
                        "--delimiter",
                        "--eof",
                        "--replace",
                        "--max-lines",
                        "--max-args",
                        "--max-procs",
                        "--max-chars",
                        "--process-slot-var",
                    ],
                    0,
                    esc,
                );
                match next {
                    // No command: xargs runs echo.
                    Next::Skip(n) if n >= rest.len() => Next::Inner(vec![Word::literal("echo")]),
                    other => other,
                }
            }
            "parallel" => {
                esc.push(r("parallel runs commands built from its input"));
                let (i, _) = options(
                    rest,
                    "jaSdIEnN",
                    &[
                        "--jobs",
                        "--arg-file",
                        "--sshlogin",
                        "--delimiter",
                        "--replace",
                        "--eof",
                        "--max-args",
                        "--joblog",
                        "--results",
                        "--tmpdir",
                        "--timeout",
                        "--delay",
                    ],
                );
                Self::check_skipped(&rest[..i], name, esc);
                let cmd: Vec<Word> = rest[i..]
                    .iter()
                    .take_while(|w| !w.text.starts_with(":::"))
                    .cloned()
                    .collect();
                if cmd.is_empty() {
                    Next::Itself
                } else {
                    self.check_dynamic(&cmd, name, esc);
                    Next::Script(texts(&cmd).join(" "))
                }
            }
            "watch" => {
                let (opts, next) =
                    Self::simple(name, rest, "nq", &["--interval", "--equexit"], 0, esc);
                match next {
                    Next::Skip(n) if has(&opts, &["-x", "--exec"]).is_none() => {
                        // watch runs its arguments through `sh -c`.
                        let inner = &rest[n.min(rest.len())..];
                        self.check_dynamic(inner, name, esc);
                        Next::Script(texts(inner).join(" "))
                    }
                    other => other,
                }
            }
            "flock" => {
                let c = rest.iter().position(|w| {
                    w.text == "-c" || w.text == "--command" || w.text.starts_with("--command=")
                });
                match c {
                    Some(p) => {
                        let w = &rest[p];
                        let script = match w.text.strip_prefix("--command=") {
                            Some(s) => s.to_string(),
                            None => rest.get(p + 1).map(|w| w.text.clone()).unwrap_or_default(),
                        };
                        self.check_dynamic(&rest[p..(p + 2).min(rest.len())], name, esc);
                        Next::Script(script)
                    }
                    None => {
                        Self::simple(
                            name,
                            rest,
                            "wE",
                            &["--wait", "--timeout", "--conflict-exit-code"],
                            1,
                            esc,
                        )
                        .1
                    }
                }
            }
            "busybox" => match rest.first() {
                Some(w) if !w.text.starts_with('-') => Next::Skip(0),
                _ => Next::Itself,
            },
            "coproc" => {
                esc.push(r(
                    "coproc runs the command in the background with open pipes",
                ));
                Next::Skip(0)
            }
            "eval" => {
                self.check_dynamic(rest, name, esc);
                Next::Script(texts(rest).join(" "))
            }
            "source" | "." => {
                esc.push(format!("{name} runs the commands in a file"));
                Next::Itself
            }
            "trap" => {
                esc.push(r("trap sets a command to run later"));
                Next::Itself
            }
            "alias" | "enable" | "function" | "for" | "select" | "case" => {
                esc.push(format!(
                    "{name} is a shell construct whose effect the policy does not read"
                ));
                Next::Itself
            }
            "hash" if rest.iter().any(|w| w.text.starts_with("-p")) => {
                esc.push(r("hash -p sets the file a command name runs"));
                Next::Itself
            }
            "export" | "declare" | "typeset" | "local" | "readonly" | "read" | "printf"
            | "getopts" | "mapfile" | "readarray" => {
                for w in rest {
                    let n = w.text.split('=').next().unwrap_or_default();
                    if !w.text.starts_with('-') && is_risky(n) && is_identifier(n) {
                        esc.push(format!("{name} sets {n} for the commands after it"));
                    }
                }
                Next::Itself
            }
            "cd" | "pushd" | "popd" => {
                self.dir_changed = true;
                Next::Itself
            }
            "find" => {
                self.find(rest, esc, depth)?;
                Next::Itself
            }
            "git" => return self.git(rest, esc, depth),
            s if SHELLS.contains(&s) => self.shell(name, rest, esc),
            _ => Next::Itself,
        })
    }

    fn check_dynamic(&self, words: &[Word], name: &str, esc: &mut Vec<String>) {
        for w in words {
            if let Some(why) = w.dynamic {
                esc.push(format!("the command {name} runs comes from {why}"));
            }
        }
    }

    fn shell(&mut self, name: &str, rest: &[Word], esc: &mut Vec<String>) -> Next {
        let mut i = 0;
        let mut has_c = false;
        let mut stdin = false;
        while i < rest.len() {
            let a = rest[i].text.as_str();
            if a == "--" || a == "-" {
                i += 1;
                break;
            }
            if a.starts_with("--") {
                if a == "--command" {
                    has_c = true;
                    i += 1;
                    continue;
                }
                if let Some(s) = a.strip_prefix("--command=") {
                    return Next::Script(s.to_string());
                }
                i += if matches!(a, "--rcfile" | "--init-file") {
                    2
                } else {
                    1
                };
                continue;
            }
            if (a.starts_with('-') || a.starts_with('+')) && a.len() > 1 {
                let letters = &a[1..];
                has_c |= a.starts_with('-') && letters.contains('c');
                stdin |= letters.contains('s');
                i += if letters.contains(['o', 'O']) { 2 } else { 1 };
                continue;
            }
            break;
        }
        Self::check_skipped(&rest[..i.min(rest.len())], name, esc);
        if has_c {
            match rest.get(i) {
                Some(script) => {
                    if let Some(why) = script.dynamic {
                        esc.push(format!("the script {name} -c runs comes from {why}"));
                    }
                    Next::Script(script.text.clone())
                }
                None => Next::Itself,
            }
        } else if i < rest.len() && !stdin {
            // A script file: decided as `bash FILE`.
            Next::Itself
        } else {
            esc.push(format!("{name} reads commands from its input"));
            Next::Itself
        }
    }

    fn find(
        &mut self,
        rest: &[Word],
        esc: &mut Vec<String>,
        depth: usize,
    ) -> Result<(), CommandError> {
        let mut i = 0;
        while i < rest.len() {
            let a = rest[i].text.as_str();
            if matches!(a, "-exec" | "-execdir" | "-ok" | "-okdir") {
                let inner: Vec<Word> = rest[i + 1..]
                    .iter()
                    .take_while(|w| w.text != ";" && w.text != "+")
                    .cloned()
                    .collect();
                i += inner.len() + 2;
                if inner.is_empty() {
                    continue;
                }
                let mut e = esc.clone();
                if inner.iter().any(|w| w.text.contains("{}")) {
                    e.push(format!(
                        "find {a} puts the names of found files into the command ({{}})"
                    ));
                }
                self.command(inner, e, depth + 1)?;
                continue;
            }
            if matches!(a, "-fprint" | "-fprint0" | "-fprintf" | "-fls") {
                if let Some(file) = rest.get(i + 1) {
                    esc.extend(self.output_reason(&file.text, a));
                }
            }
            i += 1;
        }
        Ok(())
    }

    fn git(
        &mut self,
        rest: &[Word],
        esc: &mut Vec<String>,
        depth: usize,
    ) -> Result<Next, CommandError> {
        let g = git::parse(&texts(rest));
        let cut = rest.len() - g.args.len().min(rest.len());
        Self::check_skipped(&rest[..cut], "git", esc);
        esc.extend(g.escalations);
        for s in &g.scripts {
            self.script(s, esc, depth + 1)?;
        }
        for c in &g.commands {
            let words = c.iter().map(|a| Word::literal(a)).collect();
            self.command(words, esc.clone(), depth + 1)?;
        }
        let mut words = vec![Word::literal("git")];
        words.extend(rest[cut..].iter().cloned());
        self.emit(&words, std::mem::take(esc));
        Ok(Next::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(argv: &[&str], env: &[(&str, &str)]) -> Vec<Subject> {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let ctx = ExecContext {
            workspace: Path::new("/workspace"),
            cwd: Path::new("/workspace/src"),
            env: &env,
        };
        subjects(&argv, &ctx).unwrap()
    }

    fn texts_of(argv: &[&str]) -> Vec<String> {
        run(argv, &[]).into_iter().map(|s| s.text).collect()
    }

    fn plain(argv: &[&str]) -> bool {
        run(argv, &[]).iter().all(|s| s.escalations.is_empty())
    }

    #[test]
    fn programs_resolve_to_their_path() {
        assert_eq!(texts_of(&["/usr/bin/git", "push"]), ["git push"]);
        assert_eq!(
            texts_of(&["./git", "status"]),
            ["/workspace/src/git status"]
        );
        assert_eq!(texts_of(&["../bin/../x", "a"]), ["/workspace/x a"]);
        assert_eq!(texts_of(&["/usr/bin/sub/git"]), ["/usr/bin/sub/git"]);
        assert_eq!(texts_of(&["/usr/local/bin/../../../tmp/git"]), ["/tmp/git"]);
    }

    #[test]
    fn wrappers_are_unwrapped() {
        assert_eq!(texts_of(&["env", "-i", "A=1", "git", "push"]), ["git push"]);
        assert_eq!(
            texts_of(&["timeout", "-s", "KILL", "10s", "git", "push"]),
            ["git push"]
        );
        assert_eq!(texts_of(&["nice", "-5", "git", "push"]), ["git push"]);
        assert_eq!(texts_of(&["stdbuf", "-oL", "-e", "0", "make"]), ["make"]);
        assert_eq!(texts_of(&["env"]), ["env"]);
        assert_eq!(texts_of(&["/usr/bin/env", "-i"]), ["env -i"]);
        assert_eq!(
            texts_of(&[
                "sudo",
                "env",
                "X=1",
                "timeout",
                "5",
                "nice",
                "/usr/bin/git",
                "push"
            ]),
            ["git push"]
        );
        assert_eq!(
            texts_of(&["find", ".", "-name", "x", "-exec", "rm", "{}", ";", "-print"]),
            ["rm {}", "find . -name x -exec rm {} ; -print"]
        );
        assert!(plain(&["timeout", "5", "nohup", "setsid", "git", "status"]));
        assert!(!plain(&["sudo", "git", "status"]));
        assert!(!plain(&["xargs", "git", "status"]));
    }

    #[test]
    fn shell_scripts_are_split() {
        assert_eq!(
            texts_of(&[
                "bash",
                "-lc",
                "git status && sudo git push origin main; ls | wc -l"
            ]),
            ["git status", "git push origin main", "ls", "wc -l"]
        );
        assert_eq!(
            texts_of(&["sh", "-c", "echo 'a; b' \"c|d\""]),
            ["echo a; b c|d"]
        );
        assert_eq!(texts_of(&["sh", "-c", "make 2>&1 > out.log"]), ["make"]);
        assert_eq!(
            texts_of(&["env", "bash", "-c", "sh -c 'git push x'"]),
            ["git push x"]
        );
        assert_eq!(
            texts_of(&["sh", "-c", "echo $(git push)"]),
            ["git push", "echo $(git push)"]
        );
    }

    #[test]
    fn variables_that_change_what_runs() {
        assert!(!plain(&["env", "PATH=/x", "ls"]));
        assert!(!plain(&["sh", "-c", "LD_PRELOAD=x ls"]));
        assert!(!plain(&["sh", "-c", "export GIT_DIR=x; ls"]));
        assert!(plain(&["env", "LANG=C", "ls"]));
        let s = run(&["ls"], &[("NODE_OPTIONS", "--require x")]);
        assert_eq!(
            s[0].escalations,
            ["the Exec's environment sets NODE_OPTIONS"]
        );
        assert_eq!(s[0].key(), "ls [the Exec's environment sets NODE_OPTIONS]");
    }

    #[test]
    fn redirections() {
        assert!(plain(&["sh", "-c", "echo x > ../y 2>/dev/null"]));
        assert!(!plain(&["sh", "-c", "echo x > ../../y"]));
        assert!(!plain(&["sh", "-c", "echo x > /workspace/.git/config"]));
        assert!(!plain(&["sh", "-c", "> /etc/motd"]));
    }

    #[test]
    fn errors() {
        let ctx_env = BTreeMap::new();
        let ctx = ExecContext {
            workspace: Path::new("/w"),
            cwd: Path::new("/w"),
            env: &ctx_env,
        };
        assert_eq!(subjects(&[], &ctx), Err(CommandError::Empty));
        let argv: Vec<String> = ["sh", "-c", "echo 'open"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(subjects(&argv, &ctx), Err(CommandError::UnterminatedQuote));
        let argv: Vec<String> = ["sh", "-c", "eval eval 'git push'"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let found: Vec<String> = subjects(&argv, &ctx)
            .unwrap()
            .into_iter()
            .map(|s| s.text)
            .collect();
        assert_eq!(found, ["git push"]);
        let mut script = String::from("true");
        for _ in 0..10 {
            script = format!("sh -c {}", shell_quote(&script));
        }
        let argv: Vec<String> = vec!["sh".into(), "-c".into(), script];
        assert_eq!(subjects(&argv, &ctx), Err(CommandError::TooDeep(MAX_DEPTH)));
    }

    /// Scripts from a fixed pseudo-random sequence over shell's special
    /// characters: each is decided or refused with an error, never a panic;
    /// large inputs (a frame holds 4 MiB) are read in one pass.
    #[test]
    fn any_script_is_decided_or_refused() {
        const ALPHABET: &[&str] = &[
            " ",
            "\n",
            ";",
            "&",
            "|",
            "(",
            ")",
            "{",
            "}",
            "<",
            ">",
            "'",
            "\"",
            "`",
            "$",
            "$(",
            "${",
            "\\",
            "#",
            "*",
            "?",
            "[",
            "]",
            "~",
            "=",
            "2>",
            "<<",
            "EOF",
            "git",
            "push",
            "sh -c ",
            "env ",
            "PATH=x ",
            "find . -exec ",
            "xargs ",
            "-c",
            "{}",
            ",",
            "..",
            "/",
        ];
        let env = BTreeMap::new();
        let ctx = ExecContext {
            workspace: Path::new("/w"),
            cwd: Path::new("/w"),
            env: &env,
        };
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let (mut ok, mut refused) = (0, 0);
        for _ in 0..20_000 {
            let mut script = String::new();
            for _ in 0..(state % 24) {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                script.push_str(ALPHABET[(state >> 33) as usize % ALPHABET.len()]);
            }
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            match subjects(&["sh".into(), "-c".into(), script], &ctx) {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        assert!(ok > 1000 && refused > 1000, "ok {ok}, refused {refused}");
        for big in [
            "[".repeat(1 << 20),
            "A=1 ".repeat(1 << 18) + "ls",
            "echo ".to_string() + &"$x ".repeat(1 << 18),
            "echo ".to_string() + &">/tmp/x ".repeat(1 << 17),
            "{".repeat(1 << 20),
            "nohup ".repeat(400) + "echo " + &"x ".repeat(1 << 19),
        ] {
            let argv = vec!["sh".to_string(), "-c".to_string(), big];
            let s = subjects(&argv, &ctx).unwrap();
            assert!(s.iter().all(|s| s.escalations.len() <= MAX_REASONS + 1));
        }
        let many = vec!["ls".to_string(); 1 << 18].join(";");
        let argv = vec!["sh".to_string(), "-c".to_string(), many];
        assert_eq!(subjects(&argv, &ctx), Err(CommandError::TooLong(MAX_STEPS)));
    }

    fn shell_quote(s: &str) -> String {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}
