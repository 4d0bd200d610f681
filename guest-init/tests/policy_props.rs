//! Property tests of the command policy (review item "Policy bypasses"):
//! a command the rules deny, or one that needs approval although its
//! pattern allows it, stays denied or asked however it is wrapped: any
//! stack of wrappers (`env A=b`, `nice`, `timeout 5`, `sudo`, `xargs`,
//! `find -exec`, ...), shells (`bash -c`, `sh -ec`, `eval`, `watch`),
//! script contexts (`true; CMD`, `CMD | cat`, `$(CMD)`, `if ...; fi`),
//! system-directory paths for any program, and every quoting style for the
//! words a shell reads. Failing inputs are shrunk to the smallest stack.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use guest_init::policy::rules::Action;
use guest_init::policy::{ExecContext, Policy};
use proptest::prelude::*;

/// Everything allowed but a few denials: a wrapper that hides the denied
/// command shows up as allow.
const OPEN: &str = "---\npermission:\n  bash:\n    \"*\": allow\n    \"git push *\": deny\n    \"rm -rf *\": deny\n---\n";

/// Tools allowed by name, everything else asked (as in `policy_table.rs`).
const BROAD: &str = "---\npermission:\n  bash:\n    \"*\": ask\n    \"git *\": allow\n    \"bash *\": allow\n    \"sh *\": allow\n    \"tar *\": allow\n    \"rsync *\": allow\n    \"ssh *\": allow\n    \"make *\": allow\n    \"vim *\": allow\n    \"cargo *\": allow\n---\n";

/// Commands `OPEN` denies.
const DENIED: &[&[&str]] = &[
    &["git", "push"],
    &["git", "push", "origin", "main"],
    &["git", "-C", ".", "push", "--force"],
    &["git", "-c", "user.name=x", "push", "o"],
    &["rm", "-rf", "/"],
];

/// Commands `BROAD` allows by pattern but that need approval: each bypass of
/// the review item.
const NEEDS_APPROVAL: &[&[&str]] = &[
    &["a/../../usr/bin/git", "status"],
    &["bash", "-lc", "git status"],
    &["bash", "--rcfile", "./x.sh", "-ic", "git status"],
    &["bash", "--init-file", "./x.sh", "-c", "git status"],
    &["git", "-c", "trailer.a.cmd=id", "commit"],
    &["git", "-c", "interactive.diffFilter=id", "add", "-p"],
    &["git", "--config-env=imap.tunnel=X", "imap-send"],
    &["env", "TAR_OPTIONS=--to-command=id", "tar", "-xf", "a.tar"],
    &["env", "MAKEFLAGS=--eval=x", "make"],
    &["env", "VIMINIT=!id", "vim", "x"],
    &["env", "RUSTFLAGS=-Clinker=./x", "cargo", "build"],
    &["tar", "-xf", "a.tar", "--to-command=id"],
    &["tar", "-cf", "a.tar", "--checkpoint-action=exec=id", "."],
    &["rsync", "-e", "id", "a", "host:b"],
    &["ssh", "-oProxyCommand=id", "host"],
    &[
        "ssh",
        "-o",
        "LocalCommand=id",
        "-o",
        "PermitLocalCommand=yes",
        "host",
    ],
];

/// Wrappers put in front of a command as they are.
const PREFIXES: &[&[&str]] = &[
    &["env", "A=b"],
    &["env", "-i", "LANG=C"],
    &["env", "-u", "HOME"],
    &["env", "--"],
    &["nice"],
    &["nice", "-n", "5"],
    &["timeout", "5"],
    &["timeout", "-s", "KILL", "5"],
    &["nohup"],
    &["setsid"],
    &["stdbuf", "-oL"],
    &["ionice", "-c", "3"],
    &["taskset", "1"],
    &["command"],
    &["exec"],
    &["builtin"],
    &["time", "-p"],
    &["sudo"],
    &["sudo", "-u", "root"],
    &["xargs"],
    &["flock", "/workspace/l"],
    &["strace", "-f"],
    &["ltrace"],
    &["busybox"],
    &["env", "-C", "/workspace"],
    &["nice", "-5"],
    &["runuser", "-u", "root", "--"],
    &["chroot", "/"],
    &["unshare", "-r"],
    &["nsenter", "-t", "1", "-m"],
    &["setpriv", "--reuid=1000"],
    &["prlimit", "--nofile=10"],
    &["fakeroot"],
    &["valgrind"],
    &["parallel"],
];

/// Shells and the options before their script.
const SHELLS: &[&[&str]] = &[
    &["sh", "-c"],
    &["bash", "-c"],
    &["dash", "-c"],
    &["sh", "-ec"],
    &["bash", "-e", "-o", "pipefail", "-c"],
    &["bash", "--norc", "-c"],
    &["bash", "-lc"],
    &["zsh", "-c"],
    &["busybox", "sh", "-c"],
    &["su", "-c"],
    &["flock", "/workspace/l", "-c"],
];

/// Places for a command in a script; `@` is the command, `#` the command
/// quoted again as one word (for `eval`, which reads its words once more).
const CONTEXTS: &[&str] = &[
    "@",
    "true; @",
    "@ | cat",
    "echo x && @",
    "false || @",
    "A=b @",
    "(@)",
    "{ @; }",
    "if true; then @; fi",
    "while true; do @; done",
    "echo $(@)",
    "cat <(@)",
    "x=1\n@",
    "@ 2>/dev/null",
    "eval #",
    "command @",
    "exec @",
    "nohup @ &",
    "time @",
    "! @",
    "case x in x) @;; esac",
    "for i in 1; do @; done",
    "f() { @; }; f",
];

/// Directories a program path may be given in, all leading to a system
/// directory (a program elsewhere is another program, decided by its path).
const PATHS: &[&str] = &[
    "/usr/bin/",
    "/bin/",
    "/usr/local/bin/../../bin/",
    "/usr/bin/./",
    "//usr//bin/",
    "a/../../usr/bin/",
    "../../usr/bin/",
];

/// How a word is written in a script.
#[derive(Debug, Clone, Copy)]
enum Quote {
    Plain,
    Single,
    Double,
    Backslash,
    Split,
}

/// One layer around a command.
#[derive(Debug, Clone)]
enum Layer {
    /// Wrapper words in front.
    Prefix(usize),
    /// A shell running the command as its script, in a context.
    Shell {
        shell: usize,
        context: usize,
        quotes: Vec<Quote>,
    },
    /// `eval` with the command's words quoted.
    Eval(Vec<Quote>),
    /// `watch -n 1 WORDS...` (watch runs them with `sh -c`).
    Watch(Vec<Quote>),
    /// `env -S 'WORDS'` (env splits the string into words; it only knows
    /// single and double quotes, so words are written plain or in single
    /// quotes).
    EnvSplit(Vec<Quote>),
    /// `find . -exec COMMAND ;`.
    FindExec,
    /// The program given by a path in a system directory.
    Path(usize),
}

fn quote_strategy() -> impl Strategy<Value = Quote> {
    prop_oneof![
        Just(Quote::Plain),
        Just(Quote::Single),
        Just(Quote::Double),
        Just(Quote::Backslash),
        Just(Quote::Split),
    ]
}

fn quotes() -> impl Strategy<Value = Vec<Quote>> {
    prop::collection::vec(quote_strategy(), 1..8)
}

fn layer() -> impl Strategy<Value = Layer> {
    prop_oneof![
        3 => (0..PREFIXES.len()).prop_map(Layer::Prefix),
        3 => (0..SHELLS.len(), 0..CONTEXTS.len(), quotes())
            .prop_map(|(shell, context, quotes)| Layer::Shell { shell, context, quotes }),
        1 => quotes().prop_map(Layer::Eval),
        1 => quotes().prop_map(Layer::Watch),
        1 => quotes().prop_map(Layer::EnvSplit),
        1 => Just(Layer::FindExec),
        2 => (0..PATHS.len()).prop_map(Layer::Path),
    ]
}

/// True when the shell reads `word` unquoted as itself.
fn plain_safe(word: &str) -> bool {
    !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
}

fn single(word: &str) -> String {
    format!("'{}'", word.replace('\'', "'\\''"))
}

fn double(word: &str) -> String {
    let mut out = String::from("\"");
    for c in word.chars() {
        if matches!(c, '"' | '\\' | '$' | '`') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `word` written with `how`; falls back to single quotes where `how`
/// cannot write it.
fn quote(word: &str, how: Quote) -> String {
    match how {
        Quote::Plain if plain_safe(word) => word.to_string(),
        Quote::Double => double(word),
        Quote::Backslash if !word.is_empty() && !word.contains('\n') => {
            word.chars().map(|c| format!("\\{c}")).collect()
        }
        Quote::Split if word.chars().count() > 1 => {
            let mid = word.char_indices().nth(word.chars().count() / 2);
            let mid = mid.map_or(word.len(), |(i, _)| i);
            format!("{}{}", single(&word[..mid]), double(&word[mid..]))
        }
        _ => single(word),
    }
}

/// The words of `argv` as one line of a script.
fn script_of(argv: &[String], quotes: &[Quote]) -> String {
    argv.iter()
        .enumerate()
        .map(|(i, w)| quote(w, quotes[i % quotes.len()]))
        .collect::<Vec<_>>()
        .join(" ")
}

fn words(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// `argv` wrapped in `layer`.
fn wrap(argv: Vec<String>, layer: &Layer) -> Vec<String> {
    match layer {
        Layer::Prefix(i) => [words(PREFIXES[*i]), argv].concat(),
        Layer::Shell {
            shell,
            context,
            quotes,
        } => {
            let line = script_of(&argv, quotes);
            let script = CONTEXTS[*context]
                .replace('#', &single(&line))
                .replace('@', &line);
            [words(SHELLS[*shell]), vec![script]].concat()
        }
        Layer::Eval(quotes) => vec!["eval".into(), script_of(&argv, quotes)],
        Layer::Watch(quotes) => {
            let script = script_of(&argv, quotes);
            [words(&["watch", "-n", "1"]), vec![script]].concat()
        }
        Layer::EnvSplit(quotes) => {
            let quotes: Vec<Quote> = quotes
                .iter()
                .map(|q| match q {
                    Quote::Plain => Quote::Plain,
                    _ => Quote::Single,
                })
                .collect();
            vec!["env".into(), "-S".into(), script_of(&argv, &quotes)]
        }
        Layer::FindExec => [words(&["find", ".", "-exec"]), argv, words(&[";"])].concat(),
        Layer::Path(i) => {
            let mut argv = argv;
            if let Some(first) = argv.first_mut().filter(|p| !p.contains('/')) {
                *first = format!("{}{first}", PATHS[*i]);
            }
            argv
        }
    }
}

fn policy(rules: &str) -> Policy {
    Policy::load("coder", "abc", |p| {
        Ok((p == "agents/coder.md").then(|| rules.to_string()))
    })
    .expect("rules parse")
}

/// The action for `argv`, `None` when it cannot be decided (the Exec is
/// refused with an error and does not run).
fn action(policy: &Policy, argv: &[String]) -> Option<Action> {
    let env = BTreeMap::new();
    let ctx = ExecContext {
        workspace: Path::new("/workspace"),
        cwd: Path::new("/workspace"),
        env: &env,
    };
    policy
        .decide_exec(argv, &ctx, &HashSet::new())
        .ok()
        .map(|d| d.action)
}

fn wrapped(core: &[&str], layers: &[Layer]) -> Vec<String> {
    layers.iter().fold(words(core), wrap)
}

proptest! {
    // A failure prints its shrunk input; nothing is written to the tree.
    #![proptest_config(ProptestConfig {
        cases: 2000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn wrapped_denied_commands_are_never_allowed(
        core in 0..DENIED.len(),
        layers in prop::collection::vec(layer(), 0..5),
    ) {
        let argv = wrapped(DENIED[core], &layers);
        let got = action(&policy(OPEN), &argv);
        prop_assert_ne!(got, Some(Action::Allow), "{:?}", argv);
    }

    #[test]
    fn wrapped_bypasses_are_never_allowed(
        core in 0..NEEDS_APPROVAL.len(),
        layers in prop::collection::vec(layer(), 0..5),
    ) {
        let argv = wrapped(NEEDS_APPROVAL[core], &layers);
        let got = action(&policy(BROAD), &argv);
        prop_assert_ne!(got, Some(Action::Allow), "{:?}", argv);
    }
}

/// The quoting helpers write what the policy's shell reader reads back.
#[test]
fn quoting_round_trips() {
    let p = policy("---\npermission:\n  bash:\n    \"*\": ask\n    \"echo *\": allow\n---\n");
    for how in [
        Quote::Plain,
        Quote::Single,
        Quote::Double,
        Quote::Backslash,
        Quote::Split,
    ] {
        for word in ["push", "it's", "a \"b\" c", "$HOME", "x\\y", "`id`"] {
            let script = format!("echo {}", quote(word, how));
            let argv = words(&["sh", "-c", &script]);
            let env = BTreeMap::new();
            let ctx = ExecContext {
                workspace: Path::new("/workspace"),
                cwd: Path::new("/workspace"),
                env: &env,
            };
            let d = p
                .decide_exec(&argv, &ctx, &HashSet::new())
                .expect("decided");
            assert_eq!(d.keys, [format!("echo {word}")], "{how:?} {script}");
            assert_eq!(d.action, Action::Allow, "{how:?} {script}");
        }
    }
}
