//! The command policy against a table of commands: the README's rules and a
//! few more rule sets, with the bypass attempts of issue 13 (every bullet of
//! its section 1 is a case). Each case is (rules, command, Exec env, expected
//! decision); a failing run prints every case that went wrong at once.
//! (Over 700 lines: it is one table, kept whole so a case is found by
//! reading it top to bottom.)

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use guest_init::policy::rules::Action::{self, Allow, Ask, Deny};
use guest_init::policy::{ExecContext, Policy};

/// The README's example rules.
const README: &str =
    "---\npermission:\n  bash:\n    \"*\": ask\n    \"git *\": allow\n    \"git push *\": deny\n---\n";
/// Allow by default, with a few denials: every bypass shows up as allow.
const OPEN: &str = "---\npermission:\n  bash:\n    \"*\": allow\n    \"git push *\": deny\n    \"rm -rf *\": deny\n---\n";
/// Writers allowed, to test redirections.
const ECHO: &str = "---\npermission:\n  bash:\n    \"*\": ask\n    \"echo *\": allow\n    \"cat *\": allow\n    \"ls*\": allow\n---\n";
/// One value for the whole tool: no pattern to fool, so no escalation.
const SINGLE: &str = "---\npermission:\n  bash: allow\n---\n";
/// A workspace program allowed by its full path.
const TOOLS: &str =
    "---\npermission:\n  bash:\n    \"*\": ask\n    \"/workspace/scripts/test *\": allow\n---\n";

/// Tools allowed by name whose options, variables or start-up files can make
/// them run another program: every bypass of review item "Policy bypasses"
/// would show up as allow.
const BROAD: &str = "---\npermission:\n  bash:\n    \"*\": ask\n    \"git *\": allow\n    \"bash *\": allow\n    \"sh *\": allow\n    \"tar *\": allow\n    \"rsync *\": allow\n    \"ssh *\": allow\n    \"scp *\": allow\n    \"make *\": allow\n    \"vim *\": allow\n    \"cargo *\": allow\n---\n";

const WORKSPACE: &str = "/workspace";

enum Cmd {
    /// An Exec argv as given.
    Argv(&'static [&'static str]),
    /// `sh -c SCRIPT`.
    Sh(&'static str),
}
use Cmd::{Argv, Sh};

struct Case {
    rules: &'static str,
    cmd: Cmd,
    env: &'static [(&'static str, &'static str)],
    want: Action,
}

const fn c(rules: &'static str, cmd: Cmd, want: Action) -> Case {
    Case {
        rules,
        cmd,
        env: &[],
        want,
    }
}

const fn e(
    rules: &'static str,
    cmd: Cmd,
    env: &'static [(&'static str, &'static str)],
    want: Action,
) -> Case {
    Case {
        rules,
        cmd,
        env,
        want,
    }
}

const CASES: &[Case] = &[
    // The README's rules, plain.
    c(README, Argv(&["git", "status"]), Allow),
    c(README, Argv(&["git", "push", "origin", "main"]), Deny),
    c(README, Argv(&["ls", "-la"]), Ask),
    c(README, Argv(&["git", "--version"]), Allow),
    c(README, Argv(&["git", "pushy"]), Allow),
    c(README, Argv(&["/usr/bin/git", "status"]), Allow),
    // Issue bullet: variables that change what runs, as assignments or via env.
    c(
        README,
        Sh("GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=core.fsmonitor GIT_CONFIG_VALUE_0='id' git status"),
        Ask,
    ),
    c(
        README,
        Argv(&["env", "PATH=/workspace/bin", "git", "status"]),
        Ask,
    ),
    c(README, Sh("LD_PRELOAD=/workspace/x.so git status"), Ask),
    c(
        README,
        Argv(&["env", "-i", "PATH=/workspace/bin", "git", "status"]),
        Ask,
    ),
    c(
        README,
        Argv(&[
            "env",
            "-u",
            "HOME",
            "--",
            "LD_LIBRARY_PATH=/w",
            "git",
            "log",
        ]),
        Ask,
    ),
    c(
        README,
        Argv(&["env", "-S", "PATH=/workspace/bin git status"]),
        Ask,
    ),
    c(README, Sh("HOME=/workspace/evil git status"), Ask),
    c(
        README,
        Sh("GIT_CONFIG_PARAMETERS=\"'core.pager=id'\" git log"),
        Ask,
    ),
    c(README, Sh("PATH=/workspace/bin; git status"), Ask),
    c(README, Sh("export PATH=/workspace/bin; git status"), Ask),
    c(README, Argv(&["env", "FOO=bar", "git", "status"]), Allow),
    c(README, Sh("GIT_AUTHOR_NAME=x git commit -m m"), Allow),
    // Issue bullet: the Exec request's own env map.
    e(
        README,
        Argv(&["git", "status"]),
        &[("PATH", "/workspace/bin")],
        Ask,
    ),
    e(
        README,
        Argv(&["git", "status"]),
        &[("LD_PRELOAD", "/workspace/x.so")],
        Ask,
    ),
    e(
        README,
        Sh("git status"),
        &[("BASH_ENV", "/workspace/x.sh")],
        Ask,
    ),
    e(
        README,
        Argv(&["git", "fetch"]),
        &[("GIT_SSH_COMMAND", "id")],
        Ask,
    ),
    e(
        README,
        Argv(&["python3", "x.py"]),
        &[("PYTHONPATH", "/w")],
        Ask,
    ),
    e(README, Argv(&["git", "status"]), &[("FOO", "bar")], Allow),
    // Issue bullet: a program given with a path is decided as that path.
    c(README, Argv(&["./tools/git", "status"]), Ask),
    c(README, Argv(&["/workspace/evil/git", "status"]), Ask),
    c(
        README,
        Argv(&["/usr/bin/../../workspace/git", "status"]),
        Ask,
    ),
    c(README, Sh("tools/git status"), Ask),
    c(TOOLS, Argv(&["./scripts/test", "--all"]), Allow),
    c(TOOLS, Argv(&["scripts/../scripts/test", "--all"]), Allow),
    c(TOOLS, Argv(&["test", "--all"]), Ask),
    // Issue bullet: `git push` bare, and git's global options.
    c(README, Argv(&["git", "push"]), Deny),
    c(
        README,
        Argv(&["git", "-C", ".", "push", "origin", "main"]),
        Deny,
    ),
    c(README, Argv(&["git", "-c", "x=y", "push", "origin"]), Deny),
    c(README, Argv(&["git", "-c", "alias.p=!sh -c id", "p"]), Ask),
    c(
        README,
        Argv(&["git", "--git-dir=.git", "--work-tree", ".", "push"]),
        Deny,
    ),
    c(
        README,
        Argv(&["git", "--no-pager", "-p", "--bare", "push", "x"]),
        Deny,
    ),
    c(README, Argv(&["git", "--namespace", "n", "push"]), Deny),
    c(
        README,
        Argv(&["git", "--exec-path=/workspace/bin", "status"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "core.fsmonitor=id", "status"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "core.sshCommand=id", "fetch"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "credential.helper=!id", "fetch"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "user.name=x", "commit", "-m", "m"]),
        Allow,
    ),
    c(
        OPEN,
        Argv(&["git", "rebase", "-x", "git push origin main", "HEAD~1"]),
        Deny,
    ),
    c(OPEN, Argv(&["git", "bisect", "run", "git", "push"]), Deny),
    c(
        OPEN,
        Argv(&["git", "submodule", "foreach", "git push"]),
        Deny,
    ),
    c(OPEN, Argv(&["git", "config", "alias.p", "push"]), Ask),
    c(
        OPEN,
        Argv(&["git", "config", "core.hooksPath", "hooks"]),
        Ask,
    ),
    c(
        OPEN,
        Argv(&["git", "fetch", "--upload-pack=id", "origin"]),
        Ask,
    ),
    // Issue bullet: commands that run other commands.
    c(
        README,
        Argv(&["find", ".", "-exec", "git", "push", "origin", "main", ";"]),
        Deny,
    ),
    c(
        OPEN,
        Argv(&["find", ".", "-exec", "git", "push", "origin", "main", ";"]),
        Deny,
    ),
    c(
        OPEN,
        Sh("find . -name x -execdir git push origin main \\;"),
        Deny,
    ),
    c(
        OPEN,
        Argv(&["find", ".", "-exec", "git", "{}", "origin", "main", "+"]),
        Ask,
    ),
    c(README, Sh("echo push | xargs -I{} git {} origin main"), Ask),
    c(OPEN, Sh("echo push | xargs -I{} git {} origin main"), Ask),
    c(OPEN, Argv(&["xargs", "git", "push"]), Deny),
    c(OPEN, Argv(&["xargs", "-n", "1", "rm"]), Ask),
    c(OPEN, Argv(&["parallel", "git", "push", ":::", "a"]), Deny),
    c(OPEN, Argv(&["watch", "-n", "1", "git push"]), Deny),
    c(OPEN, Argv(&["nohup", "git", "push"]), Deny),
    c(OPEN, Argv(&["setsid", "-f", "git", "push"]), Deny),
    c(OPEN, Argv(&["stdbuf", "-oL", "git", "push"]), Deny),
    c(OPEN, Argv(&["ionice", "-c", "3", "git", "push"]), Deny),
    c(
        OPEN,
        Argv(&["timeout", "-k", "1", "5", "git", "push"]),
        Deny,
    ),
    c(OPEN, Argv(&["nice", "-n", "5", "git", "push"]), Deny),
    c(OPEN, Sh("command git push"), Deny),
    c(OPEN, Sh("exec git push"), Deny),
    c(OPEN, Sh("time -p git push"), Deny),
    c(OPEN, Argv(&["flock", "/workspace/l", "git", "push"]), Deny),
    c(
        OPEN,
        Argv(&["flock", "/workspace/l", "-c", "git push"]),
        Deny,
    ),
    c(OPEN, Argv(&["taskset", "1", "git", "push"]), Deny),
    c(OPEN, Argv(&["sudo", "ls"]), Ask),
    c(OPEN, Argv(&["sudo", "-u", "root", "git", "push"]), Deny),
    c(OPEN, Argv(&["doas", "ls"]), Ask),
    c(OPEN, Argv(&["su", "-c", "ls", "root"]), Ask),
    c(OPEN, Argv(&["su", "-c", "git push", "root"]), Deny),
    c(OPEN, Argv(&["chroot", "/", "ls"]), Ask),
    c(OPEN, Argv(&["unshare", "-r", "ls"]), Ask),
    c(OPEN, Argv(&["nsenter", "-t", "1", "-m", "ls"]), Ask),
    c(
        OPEN,
        Argv(&["strace", "-f", "-o", "/workspace/t", "git", "push"]),
        Deny,
    ),
    c(
        OPEN,
        Argv(&["strace", "-E", "LD_PRELOAD=/w/x.so", "ls"]),
        Ask,
    ),
    c(OPEN, Argv(&["ltrace", "git", "push"]), Deny),
    c(OPEN, Argv(&["busybox", "sh", "-c", "git push"]), Deny),
    c(
        OPEN,
        Argv(&["bash", "-o", "pipefail", "-c", "git push"]),
        Deny,
    ),
    c(OPEN, Argv(&["bash", "-e", "-c", "git push"]), Deny),
    c(OPEN, Argv(&["dash", "-c", "git push"]), Deny),
    c(OPEN, Argv(&["zsh", "-c", "git push"]), Deny),
    c(OPEN, Sh("bash -c \"sh -c 'git push'\""), Deny),
    c(OPEN, Argv(&["bash"]), Ask),
    c(OPEN, Sh("eval git push"), Deny),
    c(OPEN, Sh("eval 'git pu''sh'"), Deny),
    c(OPEN, Sh("source ./x.sh"), Ask),
    c(OPEN, Sh(". ./x.sh"), Ask),
    c(
        OPEN,
        Argv(&["bash", "-c", "\"$@\"", "_", "git", "push"]),
        Ask,
    ),
    // Words the policy cannot see through.
    c(OPEN, Sh("X=push; git $X origin"), Ask),
    c(OPEN, Sh("git p* origin"), Ask),
    c(OPEN, Sh("git {push,x} origin"), Ask),
    c(OPEN, Sh("git() { id; }; git status"), Ask),
    c(OPEN, Sh("f() { git push; }; f"), Deny),
    c(OPEN, Sh("if true; then git push; fi"), Deny),
    c(OPEN, Sh("cat <(git push)"), Deny),
    // Issue bullet: redirections.
    c(ECHO, Sh("echo x > /etc/passwd"), Ask),
    c(ECHO, Sh("echo x > out.txt"), Allow),
    c(ECHO, Sh("echo x > ../outside"), Ask),
    c(ECHO, Sh("echo x >> /workspace/a/../../etc/x"), Ask),
    c(ECHO, Sh("echo x 2>/dev/null"), Allow),
    c(ECHO, Sh("echo x >/dev/stderr 2>&1"), Allow),
    c(ECHO, Sh("echo x &> /tmp/y"), Ask),
    c(ECHO, Sh("echo x >| /tmp/y"), Ask),
    c(ECHO, Sh("cat <> /tmp/y"), Ask),
    c(ECHO, Sh("echo x > .git/hooks/pre-commit"), Ask),
    c(ECHO, Sh("echo x > $HOME/y"), Ask),
    c(OPEN, Sh("cd /tmp && echo x > y"), Ask),
    c(ECHO, Sh("cat < /etc/hostname"), Allow),
    // Lists, pipes, substitutions: strictest wins.
    c(README, Sh("git status; git push"), Deny),
    c(README, Sh("git status && git push"), Deny),
    c(README, Sh("git status || git push"), Deny),
    c(README, Sh("git log | git push"), Deny),
    c(README, Sh("git status & git push"), Deny),
    c(README, Sh("git status\ngit push"), Deny),
    c(README, Sh("(git push)"), Deny),
    c(OPEN, Sh("echo $(git push)"), Deny),
    c(OPEN, Sh("echo `git push`"), Deny),
    c(OPEN, Sh("echo \"$(git push)\""), Deny),
    c(OPEN, Sh("timeout 5 rm -rf /"), Deny),
    c(README, Sh("git status 2>&1 | head"), Ask),
    // More of the same kinds.
    c(
        README,
        Argv(&["git", "-c", "help.autocorrect=1", "psuh"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-cinclude.path=/tmp/x", "status"]),
        Ask,
    ),
    c(OPEN, Argv(&["find", ".", "-ok", "git", "push", ";"]), Deny),
    c(OPEN, Argv(&["find", ".", "-fprint", "/tmp/list"]), Ask),
    c(
        README,
        Argv(&["env", "--chdir=/tmp", "./git", "status"]),
        Ask,
    ),
    c(OPEN, Argv(&["env", "--split-string=git push"]), Deny),
    c(OPEN, Sh("exec >/tmp/log; ls"), Ask),
    c(OPEN, Sh("git push <<EOF\nx\nEOF"), Deny),
    c(OPEN, Sh("cat <<EOF\n$(git push)\nEOF"), Deny),
    c(OPEN, Sh("cat <<'EOF'\n$(git push)\nEOF"), Allow),
    // A workspace program is not the real sh: it is decided by its path
    // (allowed by "*" here, so allow-lists beat deny-lists).
    c(OPEN, Argv(&["./sh", "-c", "git push"]), Allow),
    c(README, Argv(&["./sh", "-c", "git status"]), Ask),
    // Review item "Policy bypasses": a `..` after a directory name that a
    // symbolic link in the workspace can redirect (`a -> /tmp/x/y` makes
    // `a/../../usr/bin/git` the agent's `/tmp/usr/bin/git`).
    c(README, Argv(&["a/../../usr/bin/git", "status"]), Ask),
    c(README, Sh("a/../../usr/bin/git status"), Ask),
    c(
        README,
        Argv(&["/workspace/a/../../usr/bin/git", "status"]),
        Ask,
    ),
    c(README, Argv(&["env", "a/../../usr/bin/git", "status"]), Ask),
    c(OPEN, Argv(&["a/../../usr/bin/git", "push"]), Deny),
    c(TOOLS, Argv(&["../workspace/scripts/test", "--all"]), Allow),
    // Shells that read start-up files the agent can write (~/.bashrc,
    // ~/.profile, --rcfile, ~/.zshenv).
    c(
        BROAD,
        Argv(&["bash", "--rcfile", "./x.sh", "-ic", "git status"]),
        Ask,
    ),
    c(BROAD, Argv(&["bash", "-lc", "git status"]), Ask),
    c(
        BROAD,
        Argv(&["bash", "--init-file", "./x.sh", "-c", "git status"]),
        Ask,
    ),
    c(BROAD, Argv(&["bash", "-i", "-c", "git status"]), Ask),
    c(BROAD, Argv(&["bash", "--login", "-c", "git status"]), Ask),
    c(BROAD, Argv(&["sh", "-l", "-c", "git status"]), Ask),
    c(BROAD, Sh("bash -ic 'git status'"), Ask),
    c(BROAD, Sh("exec -l bash -c 'git status'"), Ask),
    c(BROAD, Argv(&["zsh", "-c", "git status"]), Ask),
    c(BROAD, Argv(&["bash", "-c", "git status"]), Allow),
    c(BROAD, Argv(&["zsh", "-f", "-c", "git status"]), Ask),
    c(
        BROAD,
        Argv(&["bash", "-e", "-o", "pipefail", "-c", "git status"]),
        Allow,
    ),
    c(OPEN, Argv(&["bash", "-lc", "git push"]), Deny),
    // git configuration that runs a program, given on the command line.
    c(
        README,
        Argv(&["git", "-c", "interactive.diffFilter=id", "add", "-p"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "trailer.sign.cmd=id", "commit", "-m", "m"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "trailer.x.command=id", "interpret-trailers"]),
        Ask,
    ),
    c(
        README,
        Argv(&[
            "git",
            "-c",
            "gpg.ssh.defaultKeyCommand=id",
            "commit",
            "-S",
            "-m",
            "m",
        ]),
        Ask,
    ),
    c(
        README,
        Argv(&[
            "git",
            "-c",
            "tar.tgz.command=id",
            "archive",
            "--format=tgz",
            "HEAD",
        ]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "imap.tunnel=id", "imap-send"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "-c", "instaweb.httpd=id", "instaweb"]),
        Ask,
    ),
    c(
        README,
        Argv(&["git", "--config-env=trailer.a.cmd=X", "commit"]),
        Ask,
    ),
    c(
        README,
        Argv(&[
            "git",
            "--config-env",
            "interactive.diffFilter=X",
            "add",
            "-p",
        ]),
        Ask,
    ),
    c(README, Argv(&["git", "config", "trailer.a.cmd", "id"]), Ask),
    // Variables that make a tool run code.
    c(BROAD, Sh("TAR_OPTIONS=--to-command=id tar -xf a.tar"), Ask),
    c(
        BROAD,
        Argv(&["env", "TAR_OPTIONS=--to-command=id", "tar", "-xf", "a.tar"]),
        Ask,
    ),
    e(
        BROAD,
        Argv(&["tar", "-xf", "a.tar"]),
        &[("TAR_OPTIONS", "--to-command=id")],
        Ask,
    ),
    c(
        BROAD,
        Sh("export TAR_OPTIONS=--to-command=id; tar -xf a.tar"),
        Ask,
    ),
    c(BROAD, Sh("MAKEFLAGS=--eval=x make"), Ask),
    c(BROAD, Argv(&["env", "MAKEFILES=/tmp/m", "make"]), Ask),
    e(BROAD, Argv(&["make"]), &[("MAKEFLAGS", "-f/tmp/m")], Ask),
    c(BROAD, Sh("VIMINIT='!id' vim x"), Ask),
    e(BROAD, Argv(&["vim", "x"]), &[("EXINIT", "!id")], Ask),
    c(BROAD, Sh("RUSTFLAGS='-C linker=./x' cargo build"), Ask),
    e(
        BROAD,
        Argv(&["cargo", "build"]),
        &[("RUSTFLAGS", "-Clinker=./x")],
        Ask,
    ),
    c(
        BROAD,
        Argv(&["env", "RSYNC_RSH=id", "rsync", "a", "h:b"]),
        Ask,
    ),
    e(
        BROAD,
        Argv(&["tar", "-xf", "a.tar"]),
        &[("LANG", "C")],
        Allow,
    ),
    // Program options that name a program to run.
    c(
        BROAD,
        Argv(&["tar", "-xf", "a.tar", "--to-command=id"]),
        Ask,
    ),
    c(
        BROAD,
        Argv(&["tar", "-xf", "a.tar", "--to-command", "id"]),
        Ask,
    ),
    c(BROAD, Argv(&["tar", "-xf", "a.tar", "--to-c=id"]), Ask),
    c(
        BROAD,
        Argv(&[
            "tar",
            "-cf",
            "a.tar",
            "--checkpoint=1",
            "--checkpoint-action=exec=id",
            ".",
        ]),
        Ask,
    ),
    c(
        BROAD,
        Argv(&["tar", "-cf", "a.tar", "--checkpoint-action", "exec=id", "."]),
        Ask,
    ),
    c(BROAD, Argv(&["tar", "-xI", "id", "-f", "a.tar"]), Ask),
    c(BROAD, Argv(&["tar", "xIf", "id", "a.tar"]), Ask),
    c(
        BROAD,
        Argv(&["tar", "--use-compress-program=id", "-xf", "a.tar"]),
        Ask,
    ),
    c(BROAD, Argv(&["tar", "-xf", "a.tar", "-F", "id"]), Ask),
    c(
        BROAD,
        Argv(&["tar", "-xzf", "a.tar.gz", "--to-stdout"]),
        Allow,
    ),
    c(
        OPEN,
        Argv(&["tar", "-xf", "a.tar", "--to-command=git push"]),
        Deny,
    ),
    c(
        BROAD,
        Argv(&["rsync", "-e", "sh -c id", "a", "host:b"]),
        Ask,
    ),
    c(BROAD, Argv(&["rsync", "--rsh=id", "a", "host:b"]), Ask),
    c(BROAD, Argv(&["rsync", "--rsh", "id", "a", "host:b"]), Ask),
    c(BROAD, Argv(&["rsync", "-ave", "id", "a", "host:b"]), Ask),
    c(BROAD, Argv(&["rsync", "-av", "a/", "b/"]), Allow),
    c(
        OPEN,
        Argv(&["rsync", "-e", "git push", "a", "host:b"]),
        Deny,
    ),
    c(BROAD, Argv(&["ssh", "-o", "ProxyCommand=id", "host"]), Ask),
    c(BROAD, Argv(&["ssh", "-oProxyCommand=id", "host"]), Ask),
    c(BROAD, Argv(&["ssh", "-o", "proxycommand id", "host"]), Ask),
    c(BROAD, Argv(&["ssh", "-vo", "ProxyCommand=id", "host"]), Ask),
    c(BROAD, Argv(&["ssh", "host", "-o", "ProxyCommand=id"]), Ask),
    c(
        BROAD,
        Argv(&[
            "ssh",
            "-o",
            "PermitLocalCommand=yes",
            "-o",
            "LocalCommand=id",
            "host",
        ]),
        Ask,
    ),
    c(
        BROAD,
        Argv(&["ssh", "-o", "KnownHostsCommand=id", "host"]),
        Ask,
    ),
    c(BROAD, Argv(&["ssh", "-F", "./cfg", "host"]), Ask),
    c(BROAD, Argv(&["scp", "-S", "./x", "a", "host:b"]), Ask),
    c(
        BROAD,
        Argv(&["scp", "-o", "ProxyCommand=id", "a", "host:b"]),
        Ask,
    ),
    c(
        BROAD,
        Argv(&["ssh", "-o", "ConnectTimeout=5", "host", "ls"]),
        Allow,
    ),
    c(BROAD, Argv(&["ssh", "-J", "jump", "host"]), Allow),
    c(
        OPEN,
        Argv(&["ssh", "-o", "ProxyCommand=git push", "host"]),
        Deny,
    ),
    // flock's `-c` is only the word after the lock file; one further on
    // belongs to the command (found by the property test).
    c(
        OPEN,
        Argv(&[
            "flock",
            "/workspace/l",
            "git",
            "-c",
            "user.name=x",
            "push",
            "o",
        ]),
        Deny,
    ),
    c(
        OPEN,
        Argv(&["flock", "/workspace/l", "rm", "-rf", "/", "-c", "true"]),
        Deny,
    ),
    c(
        BROAD,
        Argv(&[
            "flock",
            "/workspace/l",
            "bash",
            "--init-file",
            "./x.sh",
            "-c",
            "git status",
        ]),
        Ask,
    ),
    c(BROAD, Sh("exec -a -bash bash -c 'git status'"), Ask),
    c(
        BROAD,
        Argv(&["ssh", "-o", "ProxyCommand=none", "host"]),
        Allow,
    ),
    // One value for the tool: no escalation.
    c(SINGLE, Sh("PATH=/workspace/bin git status"), Allow),
    c(SINGLE, Argv(&["git", "push"]), Allow),
];

fn policy(rules: &str) -> Policy {
    Policy::load("coder", "abc", |p| {
        Ok((p == "agents/coder.md").then(|| rules.to_string()))
    })
    .expect("rules parse")
}

fn argv(cmd: &Cmd) -> Vec<String> {
    match cmd {
        Argv(a) => a.iter().map(|s| s.to_string()).collect(),
        Sh(s) => vec!["sh".into(), "-c".into(), s.to_string()],
    }
}

fn decide(case: &Case) -> Result<(Action, String), String> {
    let env: BTreeMap<String, String> = case
        .env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let ctx = ExecContext {
        workspace: Path::new(WORKSPACE),
        cwd: Path::new(WORKSPACE),
        env: &env,
    };
    policy(case.rules)
        .decide_exec(&argv(&case.cmd), &ctx, &HashSet::new())
        .map(|d| (d.action, d.rule))
        .map_err(|e| e.to_string())
}

#[test]
fn command_policy_table() {
    assert!(CASES.len() >= 60, "{} cases", CASES.len());
    let mut wrong = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        match decide(case) {
            Ok((got, _)) if got == case.want => {}
            Ok((got, rule)) => wrong.push(format!(
                "case {i}: {:?} env {:?}: want {}, got {got} ({rule})",
                argv(&case.cmd),
                case.env,
                case.want
            )),
            Err(err) => wrong.push(format!(
                "case {i}: {:?}: want {}, got error {err}",
                argv(&case.cmd),
                case.want
            )),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} cases wrong:\n{}",
        wrong.len(),
        CASES.len(),
        wrong.join("\n")
    );
}
