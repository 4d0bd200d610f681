//! Commands that run other commands: how each wrapper's options are read
//! and its inner command found ([`super::WRAPPERS`]), shells with `-c`,
//! `find -exec` and git.

use super::*;

impl Walker<'_> {
    pub(super) fn unwrap(
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
            "exec" => {
                let (opts, next) = Self::simple(name, rest, "a", &[], 0, esc);
                let dash_name = has(&opts, &["-a"]).is_some_and(|a| a.starts_with('-'));
                if has(&opts, &["-l"]).is_some() || dash_name {
                    esc.push(r(
                        "exec -l (or -a -NAME) starts a login shell, which reads start-up files",
                    ));
                }
                next
            }
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
                // `flock [OPTIONS] FILE COMMAND...` or `flock [OPTIONS] FILE -c
                // SCRIPT`: only the word after FILE can be flock's `-c` (a
                // `-c` further on belongs to COMMAND).
                let (i, opts) = options(
                    rest,
                    "wEc",
                    &["--wait", "--timeout", "--conflict-exit-code", "--command"],
                );
                Self::check_skipped(&rest[..(i + 1).min(rest.len())], name, esc);
                let after_file = rest.get(i + 1..).unwrap_or_default();
                let first = after_file.first().map_or("", |w| w.text.as_str());
                if let Some(script) = has(&opts, &["-c", "--command"]) {
                    Next::Script(script)
                } else if let Some(script) = first.strip_prefix("--command=") {
                    self.check_dynamic(&after_file[..1], name, esc);
                    Next::Script(script.to_string())
                } else if first == "-c" || first == "--command" {
                    self.check_dynamic(after_file.get(..2).unwrap_or(after_file), name, esc);
                    match after_file.get(1) {
                        Some(w) => Next::Script(w.text.clone()),
                        None => Next::Itself,
                    }
                } else {
                    Next::Skip(i + 1)
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
            "tar" | "rsync" | "ssh" | "scp" | "sftp" => {
                self.program_options(name, rest, esc, depth)?;
                Next::Itself
            }
            "git" => return self.git(rest, esc, depth),
            s if SHELLS.contains(&s) => self.shell(name, rest, esc),
            _ => Next::Itself,
        })
    }

    pub(super) fn check_dynamic(&self, words: &[Word], name: &str, esc: &mut Vec<String>) {
        for w in words {
            if let Some(why) = w.dynamic {
                esc.push(format!("the command {name} runs comes from {why}"));
            }
        }
    }

    pub(super) fn shell(&mut self, name: &str, rest: &[Word], esc: &mut Vec<String>) -> Next {
        let mut i = 0;
        let mut has_c = false;
        let mut stdin = false;
        let mut startup = StartupFiles::new(name);
        while i < rest.len() {
            let a = rest[i].text.as_str();
            if a == "--" || a == "-" {
                i += 1;
                break;
            }
            if a.starts_with("--") {
                startup.long(a);
                if a == "--command" {
                    has_c = true;
                    i += 1;
                    continue;
                }
                if let Some(s) = a.strip_prefix("--command=") {
                    startup.reasons(name, esc);
                    return Next::Script(s.to_string());
                }
                i += if matches!(a, "--rcfile" | "--init-file" | "--init-command") {
                    2
                } else {
                    1
                };
                continue;
            }
            if (a.starts_with('-') || a.starts_with('+')) && a.len() > 1 {
                let letters = &a[1..];
                if a.starts_with('-') {
                    startup.short(letters);
                }
                has_c |= a.starts_with('-') && letters.contains('c');
                stdin |= letters.contains('s');
                i += if letters.contains(['o', 'O']) { 2 } else { 1 };
                continue;
            }
            break;
        }
        startup.reasons(name, esc);
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

    pub(super) fn find(
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

    pub(super) fn git(
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

/// What a shell's options say about the start-up files it reads. bash and
/// the other sh-like shells read them when interactive (`-i`: `~/.bashrc`,
/// `--rcfile`, `$ENV`) or a login shell (`-l`, `--login`: `~/.profile`);
/// zsh (`~/.zshenv`), fish (`config.fish`) and csh (`~/.cshrc`) read them on
/// every start (their opt-outs, such as `zsh -f`, can be undone by later
/// options, so they are not trusted). The agent can write all of those (its
/// home directory, the workspace), so such a shell can run anything before
/// the script the policy reads.
struct StartupFiles {
    /// The options that make the shell read them.
    why: Vec<String>,
    /// The shell reads them on every start.
    always: bool,
}

impl StartupFiles {
    fn new(shell: &str) -> Self {
        Self {
            why: Vec::new(),
            always: matches!(shell, "zsh" | "fish" | "csh" | "tcsh"),
        }
    }

    /// `--login`, `--rcfile FILE`, `--init-file FILE`, ...
    fn long(&mut self, option: &str) {
        let name = option.split('=').next().unwrap_or(option);
        if matches!(
            name,
            "--login" | "--interactive" | "--rcfile" | "--init-file" | "--profile"
        ) {
            self.why.push(name.to_string());
        }
    }

    /// The letters of a `-xyz` option cluster.
    fn short(&mut self, letters: &str) {
        for l in ['i', 'l'] {
            if letters.contains(l) {
                self.why.push(format!("-{l}"));
            }
        }
    }

    /// Adds why the shell needs approval, if it does.
    fn reasons(&self, shell: &str, esc: &mut Vec<String>) {
        if !self.why.is_empty() {
            esc.push(format!(
                "{shell} {} reads start-up files the agent can write",
                self.why.join(" ")
            ));
        } else if self.always {
            esc.push(format!(
                "{shell} reads start-up files the agent can write on every start"
            ));
        }
    }
}
