//! Turns an Exec's argv into the subjects that permission rules match.
//!
//! * `sh -c SCRIPT` / `bash -lc SCRIPT` (any shell flag cluster holding `c`)
//!   is split into its commands at unquoted `;`, `&`, `|`, `&&`, `||` and
//!   newlines; every command is a subject of its own.
//! * Leading `NAME=value` assignments and the wrappers `env`, `sudo`,
//!   `timeout`, `nice` and `xargs` (with their options) are unwrapped, also
//!   nested (`sudo env X=1 timeout 5 git push`), and a path to a program
//!   (`/usr/bin/git`) is reduced to its name.
//! * A command using command substitution (`$(...)` or backticks) gets
//!   `needs_approval`, since its inner command is not matched on its own.
//!
//! The subject is the remaining words joined by single spaces.

/// One command found in an Exec, as rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    /// Words joined by single spaces, wrappers removed.
    pub text: String,
    /// The command holds a command substitution that rules cannot see into.
    pub needs_approval: bool,
}

/// Problems with a command line that make it impossible to decide.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CommandError {
    /// The argv is empty.
    #[error("empty command: argv needs at least one element")]
    Empty,
    /// A shell script with an unterminated quote.
    #[error("unterminated quote in shell script")]
    UnterminatedQuote,
    /// Shells nested deeper than the limit.
    #[error("shell scripts nested more than {0} levels deep")]
    TooDeep(usize),
}

const MAX_DEPTH: usize = 8;

/// The subjects of `argv`, in order.
pub fn subjects(argv: &[String]) -> Result<Vec<Subject>, CommandError> {
    if argv.is_empty() {
        return Err(CommandError::Empty);
    }
    let mut out = Vec::new();
    collect(argv.to_vec(), false, 0, &mut out)?;
    Ok(out)
}

fn collect(
    words: Vec<String>,
    needs_approval: bool,
    depth: usize,
    out: &mut Vec<Subject>,
) -> Result<(), CommandError> {
    if depth > MAX_DEPTH {
        return Err(CommandError::TooDeep(MAX_DEPTH));
    }
    let words = unwrap_wrappers(words);
    if words.is_empty() {
        return Ok(());
    }
    if let Some(script) = shell_script(&words) {
        for segment in split_script(&script)? {
            let subst = has_substitution(&segment);
            let words = shell_words(&segment)?;
            collect(words, needs_approval || subst, depth + 1, out)?;
        }
        return Ok(());
    }
    out.push(Subject {
        text: words.join(" "),
        needs_approval,
    });
    Ok(())
}

fn program_name(word: &str) -> &str {
    word.rsplit('/').next().unwrap_or(word)
}

fn is_assignment(word: &str) -> bool {
    match word.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        }
        None => false,
    }
}

/// Removes leading assignments and wrapper programs with their options.
pub fn unwrap_wrappers(mut words: Vec<String>) -> Vec<String> {
    loop {
        while words.first().is_some_and(|w| is_assignment(w)) {
            words.remove(0);
        }
        let Some(first) = words.first() else {
            return words;
        };
        let name = program_name(first).to_string();
        let rest = &words[1..];
        let skip = match name.as_str() {
            "env" => skip_options(
                rest,
                &["-u", "-C", "-S", "--unset", "--chdir", "--split-string"],
                true,
            ),
            "sudo" => skip_options(
                rest,
                &[
                    "-u", "-g", "-h", "-p", "-C", "-D", "-r", "-t", "-U", "-T", "--user",
                    "--group", "--host", "--prompt", "--chdir",
                ],
                true,
            ),
            "nice" => skip_options(rest, &["-n", "--adjustment"], false),
            "timeout" => {
                let n = skip_options(rest, &["-s", "-k", "--signal", "--kill-after"], false);
                // The duration operand.
                (n + 1).min(rest.len())
            }
            "xargs" => skip_options(
                rest,
                &[
                    "-a",
                    "-d",
                    "-E",
                    "-I",
                    "-L",
                    "-n",
                    "-P",
                    "-s",
                    "--arg-file",
                    "--delimiter",
                    "--max-args",
                    "--max-procs",
                    "--max-chars",
                    "--max-lines",
                    "--replace",
                    "--eof",
                ],
                false,
            ),
            _ => {
                if first != &name {
                    words[0] = name;
                }
                return words;
            }
        };
        if 1 + skip >= words.len() {
            // A wrapper with no command runs itself (`env` prints the environment).
            words[0] = name;
            return words;
        }
        words.drain(..1 + skip);
    }
}

/// Counts leading options (and their arguments) in `rest`. `with_args` lists
/// options that take a separate argument. `assignments` also skips
/// `NAME=value` words (env, sudo).
fn skip_options(rest: &[String], with_args: &[&str], assignments: bool) -> usize {
    let mut i = 0;
    while i < rest.len() {
        let w = rest[i].as_str();
        if w == "--" {
            return i + 1;
        }
        if assignments && is_assignment(w) {
            i += 1;
            continue;
        }
        if w == "-" || !w.starts_with('-') {
            // `env -` is `env -i`.
            if w == "-" {
                i += 1;
                continue;
            }
            return i;
        }
        if w.contains('=') {
            i += 1;
            continue;
        }
        // `nice -5`: the old adjustment syntax.
        if w[1..].chars().all(|c| c.is_ascii_digit()) {
            i += 1;
            continue;
        }
        if with_args.contains(&w) {
            i += 2;
            continue;
        }
        i += 1;
    }
    rest.len()
}

/// The script of `sh -c SCRIPT`-like commands.
fn shell_script(words: &[String]) -> Option<String> {
    let shell = program_name(&words[0]);
    if !matches!(shell, "sh" | "bash" | "dash" | "zsh" | "ksh") {
        return None;
    }
    let mut i = 1;
    while i < words.len() {
        let w = &words[i];
        if w.starts_with('-') && !w.starts_with("--") && w.len() > 1 {
            if w.contains('c') {
                return words.get(i + 1).cloned();
            }
            i += 1;
            continue;
        }
        break;
    }
    None
}

/// Splits a shell script at unquoted command separators.
pub fn split_script(script: &str) -> Result<Vec<String>, CommandError> {
    let mut segments = Vec::new();
    let mut cur = String::new();
    let mut chars = script.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match quote {
            Some('\'') => {
                cur.push(c);
                if c == '\'' {
                    quote = None;
                }
            }
            Some(_) => {
                cur.push(c);
                if c == '\\' {
                    if let Some(n) = chars.next() {
                        cur.push(n);
                    }
                } else if c == '"' {
                    quote = None;
                }
            }
            None => match c {
                '\'' | '"' => {
                    quote = Some(c);
                    cur.push(c);
                }
                '\\' => {
                    cur.push(c);
                    if let Some(n) = chars.next() {
                        cur.push(n);
                    }
                }
                ';' | '&' | '|' | '\n' => {
                    // `2>&1` and `>|` are redirections, not separators.
                    if c == '&' && cur.ends_with('>') || c == '|' && cur.ends_with('>') {
                        cur.push(c);
                        continue;
                    }
                    if matches!(chars.peek(), Some(&n) if n == c && c != '\n') {
                        chars.next();
                    }
                    segments.push(std::mem::take(&mut cur));
                }
                _ => cur.push(c),
            },
        }
    }
    if quote.is_some() {
        return Err(CommandError::UnterminatedQuote);
    }
    segments.push(cur);
    Ok(segments
        .into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

fn has_substitution(segment: &str) -> bool {
    let mut in_single = false;
    let mut prev = '\0';
    for c in segment.chars() {
        if c == '\'' && prev != '\\' {
            in_single = !in_single;
        } else if !in_single
            && (c == '`'
                || (prev == '$' && c == '(')
                || (prev == '<' && c == '(')
                || (prev == '>' && c == '('))
        {
            return true;
        }
        prev = c;
    }
    false
}

/// Splits one command into words the way a shell would (quotes removed).
pub fn shell_words(segment: &str) -> Result<Vec<String>, CommandError> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = segment.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(n) => cur.push(n),
                        None => return Err(CommandError::UnterminatedQuote),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(n) => cur.push(n),
                            None => return Err(CommandError::UnterminatedQuote),
                        },
                        Some(n) => cur.push(n),
                        None => return Err(CommandError::UnterminatedQuote),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(argv: &[&str]) -> Vec<String> {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        subjects(&argv)
            .unwrap()
            .into_iter()
            .map(|s| s.text)
            .collect()
    }

    #[test]
    fn plain_argv() {
        assert_eq!(texts(&["git", "status"]), ["git status"]);
        assert_eq!(
            texts(&["/usr/bin/git", "push", "origin"]),
            ["git push origin"]
        );
    }

    #[test]
    fn wrappers_are_unwrapped() {
        assert_eq!(texts(&["env", "-i", "A=1", "git", "push"]), ["git push"]);
        assert_eq!(
            texts(&["sudo", "-u", "root", "-E", "git", "push"]),
            ["git push"]
        );
        assert_eq!(
            texts(&["timeout", "-s", "KILL", "10s", "git", "push"]),
            ["git push"]
        );
        assert_eq!(texts(&["nice", "-n", "5", "git", "push"]), ["git push"]);
        assert_eq!(texts(&["nice", "-5", "git", "push"]), ["git push"]);
        assert_eq!(texts(&["xargs", "-n", "1", "rm", "-f"]), ["rm -f"]);
        assert_eq!(
            texts(&[
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
        assert_eq!(texts(&["A=1", "B=2", "git", "push"]), ["git push"]);
        assert_eq!(texts(&["env"]), ["env"]);
        assert_eq!(texts(&["/usr/bin/env", "-i"]), ["env -i"]);
    }

    #[test]
    fn shell_scripts_are_split() {
        assert_eq!(
            texts(&[
                "bash",
                "-lc",
                "git status && sudo git push origin main; ls | wc -l"
            ]),
            ["git status", "git push origin main", "ls", "wc -l"]
        );
        assert_eq!(
            texts(&["sh", "-c", "echo 'a; b' \"c|d\""]),
            ["echo a; b c|d"]
        );
        assert_eq!(texts(&["sh", "-c", "make 2>&1"]), ["make 2>&1"]);
        assert_eq!(
            texts(&["env", "bash", "-c", "sh -c 'git push x'"]),
            ["git push x"]
        );
    }

    #[test]
    fn substitution_needs_approval() {
        let argv: Vec<String> = ["sh", "-c", "echo $(git push)"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let s = subjects(&argv).unwrap();
        assert!(s[0].needs_approval);
        let argv: Vec<String> = ["sh", "-c", "echo '$(literal)'"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert!(!subjects(&argv).unwrap()[0].needs_approval);
    }

    #[test]
    fn errors() {
        assert_eq!(subjects(&[]), Err(CommandError::Empty));
        let argv: Vec<String> = ["sh", "-c", "echo 'open"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(subjects(&argv), Err(CommandError::UnterminatedQuote));
    }
}
