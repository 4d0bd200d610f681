//! Programs whose options name another program to run: `tar --to-command`,
//! `--checkpoint-action=exec=`, `-I`/`--use-compress-program`, `-F`/
//! `--info-script`, `--rsh-command`; `rsync -e`/`--rsh`, `--rsync-path`;
//! `ssh`/`scp`/`sftp -o ProxyCommand=` (and `LocalCommand`,
//! `PermitLocalCommand`, `KnownHostsCommand`, `PKCS11Provider`,
//! `SecurityKeyProvider`), `-F` (a configuration file, which can name any
//! of those), `-I`, and `scp`/`sftp -S`/`-D`. Such an option needs approval
//! (the rule that allowed `tar *` was written for tar) and the program it
//! names is decided too, so a denied command stays denied.
//!
//! Options are read the way getopt reads them, with options after operands
//! (GNU tar and rsync permute them; ssh reads them after the host, up to
//! the remote command) and abbreviated long options. Only options that do
//! take a value are listed as taking one, so a value is never skipped past
//! an option it hides; a word that is really another option's value may be
//! taken for an option, which only asks more.

use super::*;

/// What an option makes the program run.
enum Runs {
    /// A command line the program hands to a shell or splits into words.
    Script(String),
    /// A program run with arguments of its own.
    Program(String),
    /// Nothing the policy can read (a configuration file, a library, a
    /// program on the remote host).
    Opaque,
}

/// An option that makes the program run something.
struct Found {
    /// The option as written, for the reason shown.
    option: String,
    runs: Runs,
}

/// One option of a command line and its value (empty for a flag).
type Opt = (String, String);

/// `given` is `full` or an abbreviation of it (`--to-c` for `--to-command`)
/// and not another option's exact name listed in `exact`.
fn abbreviates(given: &str, full: &str, exact: &[&str]) -> bool {
    given.len() > 2 && full.starts_with(given) && (given == full || !exact.contains(&given))
}

/// The options in `args`. `short` lists the letters taking a value
/// (attached or in the next word), `long` the long options taking one
/// (`--opt=value` or `--opt value`, abbreviations included; `exact` lists
/// other options whose full names are abbreviations of them). With
/// `operands` set, reading stops at the operand after that many (ssh's
/// remote command).
fn scan(
    args: &[Word],
    short: &str,
    long: &[&str],
    exact: &[&str],
    operands: Option<usize>,
) -> Vec<Opt> {
    let mut out = Vec::new();
    let mut seen = 0usize;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].text.as_str();
        let next = || args.get(i + 1).map(|w| w.text.clone()).unwrap_or_default();
        if a == "--" {
            break;
        }
        if let Some(body) = a.strip_prefix("--") {
            match body.split_once('=') {
                Some((name, value)) => out.push((format!("--{name}"), value.to_string())),
                None if long.iter().any(|l| abbreviates(a, l, exact)) => {
                    out.push((a.to_string(), next()));
                    i += 1;
                }
                None => out.push((a.to_string(), String::new())),
            }
        } else if a.len() > 1 && a.starts_with('-') {
            let letters: Vec<char> = a[1..].chars().collect();
            for (j, l) in letters.iter().enumerate() {
                if short.contains(*l) {
                    let attached: String = letters[j + 1..].iter().collect();
                    if attached.is_empty() {
                        out.push((format!("-{l}"), next()));
                        i += 1;
                    } else {
                        out.push((format!("-{l}"), attached));
                    }
                    break;
                }
                out.push((format!("-{l}"), String::new()));
            }
        } else {
            seen += 1;
            if operands.is_some_and(|n| seen > n) {
                break;
            }
        }
        i += 1;
    }
    out
}

/// GNU tar's options with a value (short letters, long names).
const TAR_SHORT: &str = "bCfFgHIKLNTVX";
/// tar's long options that run a program.
const TAR_LONG: &[&str] = &[
    "--to-command",
    "--checkpoint-action",
    "--use-compress-program",
    "--info-script",
    "--new-volume-script",
    "--rsh-command",
    "--rmt-command",
];
/// tar options whose names are abbreviations of [`TAR_LONG`] ones.
const TAR_EXACT: &[&str] = &["--checkpoint"];

/// What `tar ARGS` runs besides itself.
fn tar(args: &[Word]) -> Vec<Found> {
    let mut opts = Vec::new();
    if let Some(first) = args.first().filter(|w| !w.text.starts_with('-')) {
        // Old style (`tar xIf PROG FILE`): the letters' values follow in order.
        let mut values = args[1..].iter();
        for l in first.text.chars() {
            let value = if TAR_SHORT.contains(l) {
                values.next().map(|w| w.text.clone()).unwrap_or_default()
            } else {
                String::new()
            };
            opts.push((format!("-{l}"), value));
        }
    }
    opts.extend(scan(args, TAR_SHORT, TAR_LONG, TAR_EXACT, None));
    let is = |given: &str, full: &str| abbreviates(given, full, TAR_EXACT);
    let mut found = Vec::new();
    for (o, v) in opts {
        let runs = if is(&o, "--to-command")
            || is(&o, "--use-compress-program")
            || is(&o, "--info-script")
            || is(&o, "--new-volume-script")
            || is(&o, "--rsh-command")
            || o == "-I"
            || o == "-F"
        {
            Runs::Script(v)
        } else if is(&o, "--checkpoint-action") && v.starts_with("exec") {
            let script = v.trim_start_matches("exec").trim_start_matches('=');
            Runs::Script(script.to_string())
        } else if is(&o, "--rmt-command") {
            Runs::Opaque
        } else {
            continue;
        };
        found.push(Found { option: o, runs });
    }
    found
}

/// What `rsync ARGS` runs besides itself.
fn rsync(args: &[Word]) -> Vec<Found> {
    let long = ["--rsh", "--rsync-path"];
    let mut found = Vec::new();
    for (o, v) in scan(args, "e", &long, &[], None) {
        let runs = if o == "-e" || abbreviates(&o, "--rsh", &[]) {
            Runs::Script(v)
        } else if abbreviates(&o, "--rsync-path", &[]) {
            // Run by the remote shell, on the other host.
            Runs::Opaque
        } else {
            continue;
        };
        found.push(Found { option: o, runs });
    }
    found
}

/// ssh, scp and sftp's option letters that take a value.
fn ssh_value_letters(name: &str) -> &'static str {
    match name {
        "ssh" => "bceilmopBDEFIJLOPQRSwW",
        "scp" => "cDFiJlMoPSX",
        _ => "bBcDFiJlNoPRsSX",
    }
}

/// `-o` keywords (lowercase) whose value is a command ssh runs locally.
const SSH_COMMAND_KEYWORDS: &[&str] = &["proxycommand", "localcommand", "knownhostscommand"];

/// `-o` keywords (lowercase) that load a library or let a command run.
const SSH_OPAQUE_KEYWORDS: &[&str] = &[
    "permitlocalcommand",
    "pkcs11provider",
    "securitykeyprovider",
    "include",
    "match",
];

/// `Keyword=value`, `Keyword value` or `Keyword = value` of `ssh -o`:
/// the keyword as written and the value.
fn ssh_setting(text: &str) -> (&str, &str) {
    let text = text.trim_start();
    let end = text.find(['=', ' ', '\t']).unwrap_or(text.len());
    let value = text[end..].trim_start_matches([' ', '\t']);
    let value = value.strip_prefix('=').unwrap_or(value).trim();
    (&text[..end], value)
}

/// What `ssh`/`scp`/`sftp ARGS` runs besides itself.
fn ssh(name: &str, args: &[Word]) -> Vec<Found> {
    // ssh reads options before and after the host, up to the remote command.
    let operands = (name == "ssh").then_some(1);
    let mut found = Vec::new();
    for (o, v) in scan(args, ssh_value_letters(name), &[], &[], operands) {
        let mut option = o.clone();
        let runs = match o.as_str() {
            "-o" => {
                let (key, value) = ssh_setting(&v);
                let lower = key.to_ascii_lowercase();
                let none = value.eq_ignore_ascii_case("none");
                option = format!("-o {key}");
                if SSH_COMMAND_KEYWORDS.contains(&lower.as_str()) && !none {
                    Runs::Script(value.to_string())
                } else if SSH_OPAQUE_KEYWORDS.contains(&lower.as_str())
                    && !none
                    && !value.eq_ignore_ascii_case("no")
                {
                    Runs::Opaque
                } else {
                    continue;
                }
            }
            "-F" if v != "none" && v != "/dev/null" => Runs::Opaque,
            "-I" if name == "ssh" => Runs::Opaque,
            "-S" if name != "ssh" => Runs::Program(v),
            // A local sftp server command line, run instead of ssh.
            "-D" if name != "ssh" => Runs::Script(v),
            _ => continue,
        };
        found.push(Found { option, runs });
    }
    found
}

impl Walker<'_> {
    /// Adds why `name ARGS` needs approval for the programs its options name,
    /// and decides those programs.
    pub(super) fn program_options(
        &mut self,
        name: &str,
        rest: &[Word],
        esc: &mut Vec<String>,
        depth: usize,
    ) -> Result<(), CommandError> {
        let found = match name {
            "tar" => tar(rest),
            "rsync" => rsync(rest),
            _ => ssh(name, rest),
        };
        if name == "sftp" {
            esc.push("sftp runs `!` commands from its input or batch file in a local shell".into());
        }
        for f in found {
            esc.push(format!("{name} {} names a program to run", f.option));
            match f.runs {
                Runs::Script(s) if !s.trim().is_empty() => self.script(&s, esc, depth + 1)?,
                Runs::Program(p) if !p.is_empty() => {
                    self.command(vec![Word::literal(&p)], esc.clone(), depth + 1)?
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(a: &[&str]) -> Vec<Word> {
        a.iter().map(|s| Word::literal(s)).collect()
    }

    fn options_of(found: Vec<Found>) -> Vec<String> {
        found.into_iter().map(|f| f.option).collect()
    }

    #[test]
    fn tar_programs() {
        assert_eq!(
            options_of(tar(&words(&["-xf", "a", "--to-c", "id", "-I", "gz"]))),
            ["--to-c", "-I"]
        );
        assert_eq!(
            options_of(tar(&words(&["cIf", "prog", "a.tar", "."]))),
            ["-I"]
        );
        assert!(tar(&words(&[
            "--checkpoint",
            "--checkpoint-action=dot",
            "-cf",
            "a"
        ]))
        .is_empty());
        assert_eq!(
            options_of(tar(&words(&[
                "--checkpoint",
                "--checkpoint-action=exec=id"
            ]))),
            ["--checkpoint-action"]
        );
        assert!(tar(&words(&[
            "-xzf",
            "a.tgz",
            "--to-stdout",
            "--",
            "--to-command=x"
        ]))
        .is_empty());
    }

    #[test]
    fn rsync_and_ssh_programs() {
        assert_eq!(
            options_of(rsync(&words(&["-ave", "ssh -p 2", "a", "h:b"]))),
            ["-e"]
        );
        assert_eq!(
            options_of(rsync(&words(&["a", "h:b", "--rsync-path=sudo rsync"]))),
            ["--rsync-path"]
        );
        assert_eq!(
            ssh_setting(" ProxyCommand = nc %h %p"),
            ("ProxyCommand", "nc %h %p")
        );
        let found = ssh(
            "ssh",
            &words(&["-p", "22", "h", "-oProxyCommand=id", "ls", "-F", "x"]),
        );
        assert_eq!(options_of(found), ["-o ProxyCommand"]);
        assert!(ssh(
            "ssh",
            &words(&["-o", "ProxyCommand=none", "-F", "none", "h"])
        )
        .is_empty());
        assert_eq!(
            options_of(ssh("scp", &words(&["a", "h:b", "-S", "./x"]))),
            ["-S"]
        );
    }
}
