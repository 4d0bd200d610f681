//! git's command line as the policy sees it: global options before the
//! subcommand are taken out (`git -C . push` is decided as `git push`),
//! configuration given on the command line that makes git run a program
//! (`-c alias.*`, `-c core.fsmonitor=...`) needs approval, and subcommands
//! that run commands of their own (`rebase -x`, `bisect run`,
//! `submodule foreach`) hand those commands back to be decided too.

use super::glob::glob_match;

/// What the policy makes of `git ARGS...`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct GitCommand {
    /// The arguments from the subcommand on, global options removed.
    pub args: Vec<String>,
    /// Why the command needs approval, if it does.
    pub escalations: Vec<String>,
    /// Shell scripts git will run (`rebase --exec`, `submodule foreach`).
    pub scripts: Vec<String>,
    /// Commands (argv) git will run (`bisect run`).
    pub commands: Vec<Vec<String>>,
}

/// Configuration keys (lowercase, `*` any run of characters) whose value is
/// a program git runs, or that change which configuration or commands git
/// uses.
pub const RISKY_CONFIG_KEYS: &[&str] = &[
    "alias.*",
    "core.fsmonitor",
    "core.sshcommand",
    "core.pager",
    "core.editor",
    "core.hookspath",
    "core.gitproxy",
    "core.askpass",
    "core.alternaterefscommand",
    "core.worktree",
    "credential.*",
    "*.helper",
    "diff.external",
    "diff.*.command",
    "diff.*.textconv",
    "merge.*.driver",
    "filter.*",
    "sequence.editor",
    "gpg.program",
    "gpg.*.program",
    "pager.*",
    "uploadpack.packobjectshook",
    "remote.*.uploadpack",
    "remote.*.receivepack",
    "remote.*.vcs",
    "protocol.*",
    "include.*",
    "includeif.*",
    "ssh.variant",
    "difftool.*",
    "mergetool.*",
    "web.browser",
    "browser.*",
    "man.*",
    "sendemail.*",
    "init.templatedir",
    "submodule.*.update",
    "url.*",
    // `help.autocorrect` runs a mistyped command as the one git guesses.
    "help.*",
    // `add -p` pipes the diff through it.
    "interactive.difffilter",
    // `commit --trailer`, `interpret-trailers` run them.
    "trailer.*.cmd",
    "trailer.*.command",
    "gpg.ssh.defaultkeycommand",
    // `archive --format=NAME` pipes through it.
    "tar.*.command",
    "imap.tunnel",
    "instaweb.*",
    "guitool.*",
    // Hooks defined in configuration (`hook.NAME.command`).
    "hook.*",
    // git-lfs: custom transfer agents and file extensions are programs.
    "lfs.customtransfer.*",
    "lfs.extension.*",
];

/// True when setting `key` on the command line or with `git config` can
/// make git run a program or read other configuration.
pub fn is_risky_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    RISKY_CONFIG_KEYS.iter().any(|p| glob_match(p, &key))
}

/// Global options taking a value (as `--opt=value` or `--opt value`).
const GLOBAL_WITH_VALUE: &[&str] = &[
    "--git-dir",
    "--work-tree",
    "--namespace",
    "--super-prefix",
    "--attr-source",
    "--list-cmds",
];

/// Global options without a value.
const GLOBAL_FLAGS: &[&str] = &[
    "-p",
    "--paginate",
    "-P",
    "--no-pager",
    "--bare",
    "--no-replace-objects",
    "--no-lazy-fetch",
    "--literal-pathspecs",
    "--glob-pathspecs",
    "--noglob-pathspecs",
    "--icase-pathspecs",
    "--no-optional-locks",
    "--no-advice",
];

/// Options that print something and stop; they stay in the subject.
const GLOBAL_TERMINAL: &[&str] = &[
    "--version",
    "-v",
    "--help",
    "-h",
    "--html-path",
    "--man-path",
    "--info-path",
    "--exec-path",
];

/// Options of transport commands naming a program to run on the remote
/// side or locally.
const PROGRAM_OPTIONS: &[&str] = &["--upload-pack", "--receive-pack", "--exec", "-u"];

/// Reads `args` (everything after `git`).
pub fn parse(args: &[String]) -> GitCommand {
    let mut out = GitCommand::default();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        let value_of = |i: usize| args.get(i + 1).cloned().unwrap_or_default();
        if a == "-C" {
            i += 2;
        } else if a == "-c" {
            check_assignment(&value_of(i), "-c", &mut out);
            i += 2;
        } else if let Some(v) = a
            .strip_prefix("-c")
            .filter(|v| !v.is_empty() && !a.starts_with("--"))
        {
            check_assignment(v, "-c", &mut out);
            i += 1;
        } else if a == "--config-env" {
            check_assignment(&value_of(i), "--config-env", &mut out);
            i += 2;
        } else if let Some(v) = a.strip_prefix("--config-env=") {
            check_assignment(v, "--config-env", &mut out);
            i += 1;
        } else if let Some(v) = a.strip_prefix("--exec-path=") {
            out.escalations.push(format!(
                "git --exec-path={v} runs git's commands from another directory"
            ));
            i += 1;
        } else if GLOBAL_FLAGS.contains(&a) {
            i += 1;
        } else if GLOBAL_WITH_VALUE.contains(&a) {
            i += 2;
        } else if GLOBAL_WITH_VALUE
            .iter()
            .any(|o| a.strip_prefix(o).is_some_and(|r| r.starts_with('=')))
        {
            i += 1;
        } else if GLOBAL_TERMINAL.contains(&a) || a == "--" || !a.starts_with('-') {
            break;
        } else {
            out.escalations
                .push(format!("git option {a:?} is not one the policy knows"));
            i += 1;
        }
    }
    out.args = args[i.min(args.len())..].to_vec();
    subcommand(&mut out);
    out
}

/// `-c name=value` / `--config-env name=VAR`.
fn check_assignment(assignment: &str, option: &str, out: &mut GitCommand) {
    let key = assignment.split('=').next().unwrap_or_default();
    if key.to_ascii_lowercase().starts_with("alias.") {
        out.escalations.push(format!(
            "git {option} {key} defines an alias on the command line"
        ));
    } else if is_risky_key(key) {
        out.escalations
            .push(format!("git {option} {key} can make git run a program"));
    }
}

fn subcommand(out: &mut GitCommand) {
    let args = out.args.clone();
    let Some(sub) = args.first() else { return };
    let rest = &args[1..];
    match sub.as_str() {
        "rebase" => {
            let mut i = 0;
            while i < rest.len() {
                let a = rest[i].as_str();
                if a == "-x" || a == "--exec" {
                    if let Some(s) = rest.get(i + 1) {
                        out.scripts.push(s.clone());
                    }
                    i += 2;
                    continue;
                }
                if let Some(s) = a
                    .strip_prefix("--exec=")
                    .or_else(|| a.strip_prefix("-x").filter(|s| !s.is_empty()))
                {
                    out.scripts.push(s.to_string());
                }
                i += 1;
            }
        }
        "bisect" if rest.len() > 1 && rest[0] == "run" => {
            out.commands.push(rest[1..].to_vec());
        }
        "submodule" => {
            if let Some(p) = rest.iter().position(|a| a == "foreach") {
                let script: Vec<&str> = rest[p + 1..]
                    .iter()
                    .map(String::as_str)
                    .skip_while(|a| a.starts_with("--"))
                    .collect();
                if !script.is_empty() {
                    out.scripts.push(script.join(" "));
                }
            }
        }
        "filter-branch" => out
            .escalations
            .push("git filter-branch runs filter commands".into()),
        "difftool" | "mergetool" => out
            .escalations
            .push(format!("git {sub} runs external tools")),
        "grep"
            if rest
                .iter()
                .any(|a| a.starts_with("-O") || a.starts_with("--open-files-in-pager")) =>
        {
            out.escalations
                .push("git grep --open-files-in-pager runs a program".into());
        }
        "config" => {
            if let Some(key) = rest.iter().find(|a| !a.starts_with('-') && is_risky_key(a)) {
                out.escalations
                    .push(format!("git config {key} can make git run a program"));
            }
        }
        _ => {}
    }
    if matches!(
        sub.as_str(),
        "fetch" | "pull" | "push" | "clone" | "ls-remote" | "archive" | "remote" | "submodule"
    ) {
        for (i, a) in rest.iter().enumerate() {
            let program_option = PROGRAM_OPTIONS
                .iter()
                .any(|o| a == o || a.strip_prefix(o).is_some_and(|r| r.starts_with('=')))
                && !(a == "-u" && sub != "clone");
            if program_option {
                out.escalations
                    .push(format!("git {sub} {a} names a program to run"));
            }
            if a.starts_with("ext::") {
                out.escalations
                    .push(format!("git {sub} with an ext:: URL runs a program"));
            }
            if sub == "clone" && (a == "-c" || a == "--config") {
                if let Some(v) = rest.get(i + 1) {
                    check_assignment(v, a, out);
                }
            } else if let Some(v) = a.strip_prefix("--config=") {
                check_assignment(v, "--config", out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(a: &[&str]) -> GitCommand {
        parse(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn global_options_are_removed() {
        assert_eq!(p(&["-C", ".", "push", "o"]).args, ["push", "o"]);
        assert_eq!(p(&["-c", "x=y", "--no-pager", "push"]).args, ["push"]);
        assert_eq!(
            p(&["--git-dir=.git", "--work-tree", ".", "log"]).args,
            ["log"]
        );
        assert_eq!(p(&["--version"]).args, ["--version"]);
        assert!(p(&["-c", "user.name=x", "commit"]).escalations.is_empty());
    }

    #[test]
    fn risky_configuration() {
        assert_eq!(p(&["-c", "alias.p=!id", "p"]).escalations.len(), 1);
        assert_eq!(
            p(&["-c", "core.fsMonitor=id", "status"]).escalations.len(),
            1
        );
        assert_eq!(
            p(&["-c", "credential.helper=!id", "fetch"])
                .escalations
                .len(),
            1
        );
        assert_eq!(p(&["--exec-path=/w", "status"]).escalations.len(), 1);
        assert_eq!(p(&["config", "alias.p", "push"]).escalations.len(), 1);
        assert_eq!(p(&["fetch", "--upload-pack=id"]).escalations.len(), 1);
    }

    #[test]
    fn keys_that_run_programs() {
        for key in [
            "interactive.diffFilter",
            "trailer.sign.cmd",
            "trailer.a.b.command",
            "gpg.ssh.defaultKeyCommand",
            "tar.tgz.command",
            "imap.tunnel",
            "instaweb.httpd",
            "core.sshCommand",
            "core.pager",
        ] {
            assert!(is_risky_key(key), "{key}");
            let with_c = p(&["-c", &format!("{key}=id"), "status"]);
            assert_eq!(with_c.escalations.len(), 1, "{key}");
            let env = p(&[&format!("--config-env={key}=X"), "status"]);
            assert_eq!(env.escalations.len(), 1, "{key}");
        }
        for key in ["trailer.sign.key", "tar.umask", "user.name", "imap.host"] {
            assert!(!is_risky_key(key), "{key}");
        }
    }

    #[test]
    fn inner_commands() {
        assert_eq!(
            p(&["rebase", "-x", "make test", "main"]).scripts,
            ["make test"]
        );
        assert_eq!(
            p(&["bisect", "run", "make", "t"]).commands,
            [vec!["make", "t"]]
        );
        assert_eq!(
            p(&["submodule", "foreach", "--recursive", "git", "push"]).scripts,
            ["git push"]
        );
    }
}
