//! A shell-script reader for the command policy: splits a `sh -c` script into
//! simple commands, their words (quotes removed) and redirections, and finds
//! the scripts run by command and process substitution.
//!
//! It is not a shell. It reads as much of POSIX/bash syntax as deciding a
//! command needs and marks everything whose value only the running shell
//! knows (variables, substitutions, file name patterns, brace expansion) as
//! *dynamic*, so the policy can ask instead of guessing.

use super::command::CommandError;

/// One word of a command, quotes removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Word {
    /// The text with quotes and escapes removed; substitutions stay as written.
    pub text: String,
    /// Why the shell may turn this word into something else, if it may.
    pub dynamic: Option<&'static str>,
}

impl Word {
    /// A literal word (from an argv, where no shell expands anything).
    pub fn literal(text: &str) -> Self {
        Self {
            text: text.to_string(),
            dynamic: None,
        }
    }
}

/// A redirection such as `> out.txt` or `2>&1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    /// The operator without its file descriptor number: `>`, `>>`, `>|`,
    /// `<>`, `&>`, `&>>`, `>&`, `<`, `<&`, `<<`, `<<-`, `<<<`.
    pub op: String,
    /// The file (or descriptor, or here-document delimiter).
    pub target: Word,
}

impl Redirect {
    /// True when the redirection writes to a file (not a descriptor copy).
    pub fn writes_file(&self) -> bool {
        match self.op.as_str() {
            ">" | ">>" | ">|" | "<>" | "&>" | "&>>" => true,
            // `>&2` copies a descriptor; `>&file` is `&>file`.
            ">&" => !is_descriptor(&self.target.text),
            _ => false,
        }
    }
}

fn is_descriptor(s: &str) -> bool {
    s == "-" || (!s.is_empty() && s.trim_end_matches('-').chars().all(|c| c.is_ascii_digit()))
}

/// One simple command of a script.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimpleCommand {
    /// Words, assignments included, redirections removed.
    pub words: Vec<Word>,
    /// Redirections in order.
    pub redirects: Vec<Redirect>,
    /// Scripts of `$(...)`, backticks, `<(...)` and `>(...)` in this command.
    pub substitutions: Vec<String>,
    /// Things about the command that need approval (a function definition,
    /// a here-document with expansions).
    pub notes: Vec<&'static str>,
}

/// Splits `script` into its simple commands, in order.
pub fn parse(script: &str) -> Result<Vec<SimpleCommand>, CommandError> {
    let mut lexer = Lexer {
        chars: script.chars().collect(),
        pos: 0,
        commands: Vec::new(),
        current: SimpleCommand::default(),
        heredocs: Vec::new(),
    };
    lexer.run()?;
    Ok(lexer.commands)
}

struct PendingHeredoc {
    delimiter: String,
    strip_tabs: bool,
    expands: bool,
}

struct Lexer {
    chars: Vec<char>,
    pos: usize,
    commands: Vec<SimpleCommand>,
    current: SimpleCommand,
    heredocs: Vec<PendingHeredoc>,
}

fn is_meta(c: char) -> bool {
    matches!(
        c,
        ' ' | '\t' | '\n' | ';' | '&' | '|' | '(' | ')' | '<' | '>'
    )
}

impl Lexer {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.chars.get(self.pos + n).copied()
    }

    fn finish(&mut self) {
        let cmd = std::mem::take(&mut self.current);
        if !cmd.words.is_empty()
            || !cmd.redirects.is_empty()
            || !cmd.substitutions.is_empty()
            || !cmd.notes.is_empty()
        {
            self.commands.push(cmd);
        }
    }

    fn run(&mut self) -> Result<(), CommandError> {
        loop {
            while matches!(self.peek(), Some(' ' | '\t')) {
                self.pos += 1;
            }
            let Some(c) = self.peek() else {
                self.finish();
                return Ok(());
            };
            match c {
                '\n' => {
                    self.pos += 1;
                    self.finish();
                    self.read_heredoc_bodies()?;
                }
                '&' if self.peek_at(1) == Some('>') => self.redirect()?,
                ';' | '&' | '|' => {
                    self.pos += 1;
                    // `&&`, `||`, `;;`, `|&` are one operator.
                    if matches!(self.peek(), Some(n) if n == c || (c == '|' && n == '&')) {
                        self.pos += 1;
                    }
                    self.finish();
                }
                '(' => {
                    self.pos += 1;
                    let mut look = self.pos;
                    while matches!(self.chars.get(look), Some(' ' | '\t')) {
                        look += 1;
                    }
                    if self.current.words.len() == 1 && self.chars.get(look) == Some(&')') {
                        // `name() { ...; }` defines a function that can shadow any program.
                        self.pos = look + 1;
                        self.current
                            .notes
                            .push("defines a shell function, which can stand in for any command");
                    }
                    self.finish();
                }
                ')' => {
                    self.pos += 1;
                    self.finish();
                }
                '#' => {
                    while !matches!(self.peek(), None | Some('\n')) {
                        self.pos += 1;
                    }
                }
                '<' | '>' if self.peek_at(1) == Some('(') => {
                    self.pos += 2;
                    let inner = self.balanced(')')?;
                    self.current.substitutions.push(inner);
                    self.current.words.push(Word {
                        text: format!("{c}(...)"),
                        dynamic: Some("a process substitution"),
                    });
                }
                '<' | '>' => self.redirect()?,
                _ => {
                    let word = self.word()?;
                    let fd_number = !word.text.is_empty()
                        && word.dynamic.is_none()
                        && word.text.chars().all(|c| c.is_ascii_digit());
                    if fd_number && matches!(self.peek(), Some('<' | '>')) {
                        // `2>file`: the number belongs to the redirection.
                        self.redirect()?;
                    } else {
                        self.current.words.push(word);
                    }
                }
            }
        }
    }

    fn redirect(&mut self) -> Result<(), CommandError> {
        let mut op = String::new();
        for candidate in [
            "&>>", "&>", "<<<", "<<-", "<<", "<>", "<&", "<", ">>", ">|", ">&", ">",
        ] {
            let n = candidate.chars().count();
            if self.chars[self.pos..]
                .iter()
                .take(n)
                .copied()
                .eq(candidate.chars())
            {
                op = candidate.to_string();
                self.pos += n;
                break;
            }
        }
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.pos += 1;
        }
        let target = self.word()?;
        if op == "<<" || op == "<<-" {
            // A quoted delimiter keeps the body literal.
            let quoted = self.chars[..self.pos]
                .iter()
                .rev()
                .take_while(|c| !matches!(c, ' ' | '\t' | '<'))
                .any(|c| matches!(c, '\'' | '"' | '\\'));
            self.heredocs.push(PendingHeredoc {
                delimiter: target.text.clone(),
                strip_tabs: op == "<<-",
                expands: !quoted,
            });
        }
        self.current.redirects.push(Redirect { op, target });
        Ok(())
    }

    fn read_heredoc_bodies(&mut self) -> Result<(), CommandError> {
        for doc in std::mem::take(&mut self.heredocs) {
            let mut body = String::new();
            loop {
                if self.pos >= self.chars.len() {
                    break;
                }
                let start = self.pos;
                while !matches!(self.peek(), None | Some('\n')) {
                    self.pos += 1;
                }
                let line: String = self.chars[start..self.pos].iter().collect();
                if self.peek() == Some('\n') {
                    self.pos += 1;
                }
                let line = if doc.strip_tabs {
                    line.trim_start_matches('\t')
                } else {
                    line.as_str()
                };
                if line == doc.delimiter {
                    break;
                }
                if doc.expands {
                    body.push_str(line);
                    body.push('\n');
                }
            }
            if body.contains(['$', '`']) {
                // An unquoted delimiter: the body's substitutions run.
                let subs = body_substitutions(&body)?;
                let note = "has a here-document with substitutions in it";
                let cmd = match self.commands.last_mut() {
                    Some(cmd) => cmd,
                    None => &mut self.current,
                };
                cmd.notes.push(note);
                cmd.substitutions.extend(subs);
            }
        }
        Ok(())
    }

    /// Reads one word; stops at an unquoted metacharacter.
    fn word(&mut self) -> Result<Word, CommandError> {
        let mut w = Word::default();
        // Unquoted text, to find brace expansion (`{a,b}`, `{1..3}`).
        let mut unquoted = String::new();
        let mut saw_bracket = false;
        let start = self.pos;
        while let Some(c) = self.peek() {
            if is_meta(c) {
                break;
            }
            self.pos += 1;
            match c {
                '\\' => match self.peek() {
                    Some('\n') => self.pos += 1,
                    Some(n) => {
                        self.pos += 1;
                        w.text.push(n);
                        unquoted.push('_');
                    }
                    None => {}
                },
                '\'' => loop {
                    match self.peek() {
                        Some('\'') => {
                            self.pos += 1;
                            break;
                        }
                        Some(n) => {
                            self.pos += 1;
                            w.text.push(n);
                        }
                        None => return Err(CommandError::UnterminatedQuote),
                    }
                },
                '"' => self.double_quoted(&mut w)?,
                '$' => self.dollar(&mut w)?,
                '`' => self.backtick(&mut w)?,
                '*' | '?' => {
                    w.dynamic.get_or_insert("a file name pattern");
                    w.text.push(c);
                    unquoted.push(c);
                }
                '[' => {
                    // A pattern unless the word is the `[`/`[[` test command
                    // (decided after the word, to stay linear).
                    saw_bracket = true;
                    w.text.push(c);
                    unquoted.push(c);
                }
                '~' if self.pos - 1 == start => {
                    w.dynamic.get_or_insert("a home directory (~)");
                    w.text.push(c);
                }
                c => {
                    w.text.push(c);
                    unquoted.push(c);
                }
            }
        }
        if saw_bracket && unquoted.contains(']') && w.text != "[[" {
            w.dynamic.get_or_insert("a file name pattern");
        }
        if has_brace_expansion(&unquoted) {
            w.dynamic.get_or_insert("brace expansion");
        }
        Ok(w)
    }

    fn double_quoted(&mut self, w: &mut Word) -> Result<(), CommandError> {
        loop {
            let Some(c) = self.peek() else {
                return Err(CommandError::UnterminatedQuote);
            };
            self.pos += 1;
            match c {
                '"' => return Ok(()),
                '\\' => match self.peek() {
                    Some(n @ ('$' | '`' | '"' | '\\')) => {
                        self.pos += 1;
                        w.text.push(n);
                    }
                    Some('\n') => self.pos += 1,
                    _ => w.text.push('\\'),
                },
                '$' => self.dollar(w)?,
                '`' => self.backtick(w)?,
                c => w.text.push(c),
            }
        }
    }

    /// After an unquoted or double-quoted `$`.
    fn dollar(&mut self, w: &mut Word) -> Result<(), CommandError> {
        match self.peek() {
            Some('(') => {
                self.pos += 1;
                let arithmetic = self.peek() == Some('(');
                let inner = self.balanced(')')?;
                if arithmetic {
                    // `$((...))`: only a substitution inside it runs anything.
                    if inner.contains("$(") || inner.contains('`') {
                        self.current.substitutions.push(inner.clone());
                    }
                    w.dynamic.get_or_insert("arithmetic expansion");
                } else {
                    self.current.substitutions.push(inner.clone());
                    w.dynamic.get_or_insert("command substitution");
                }
                w.text.push_str(&format!("$({inner})"));
            }
            Some('{') => {
                self.pos += 1;
                let inner = self.balanced('}')?;
                if inner.contains("$(") || inner.contains('`') {
                    self.current.substitutions.push(inner.clone());
                }
                w.dynamic.get_or_insert("a variable");
                w.text.push_str(&format!("${{{inner}}}"));
            }
            Some('\'') => {
                // `$'...'`: ANSI-C quoting; its escapes are not decoded here.
                self.pos += 1;
                w.text.push_str("$'");
                loop {
                    match self.peek() {
                        Some('\\') => {
                            w.text.push('\\');
                            self.pos += 1;
                            if let Some(n) = self.peek() {
                                w.text.push(n);
                                self.pos += 1;
                            }
                        }
                        Some('\'') => {
                            self.pos += 1;
                            w.text.push('\'');
                            break;
                        }
                        Some(n) => {
                            self.pos += 1;
                            w.text.push(n);
                        }
                        None => return Err(CommandError::UnterminatedQuote),
                    }
                }
                w.dynamic.get_or_insert("ANSI-C quoting ($'...')");
            }
            Some('"') => {
                // `$"..."`: a translated string, read as a double-quoted one.
                self.pos += 1;
                self.double_quoted(w)?;
            }
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                w.text.push('$');
                while let Some(c) = self
                    .peek()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
                {
                    self.pos += 1;
                    w.text.push(c);
                }
                w.dynamic.get_or_insert("a variable");
            }
            Some(c) if c.is_ascii_digit() || "@*#?$!-".contains(c) => {
                self.pos += 1;
                w.text.push('$');
                w.text.push(c);
                w.dynamic.get_or_insert("a variable");
            }
            _ => w.text.push('$'),
        }
        Ok(())
    }

    fn backtick(&mut self, w: &mut Word) -> Result<(), CommandError> {
        let mut inner = String::new();
        loop {
            match self.peek() {
                None => return Err(CommandError::UnterminatedQuote),
                Some('`') => {
                    self.pos += 1;
                    break;
                }
                Some('\\') => {
                    self.pos += 1;
                    match self.peek() {
                        Some(n @ ('`' | '\\' | '$')) => {
                            self.pos += 1;
                            inner.push(n);
                        }
                        _ => inner.push('\\'),
                    }
                }
                Some(c) => {
                    self.pos += 1;
                    inner.push(c);
                }
            }
        }
        w.text.push_str(&format!("`{inner}`"));
        w.dynamic.get_or_insert("command substitution");
        self.current.substitutions.push(inner);
        Ok(())
    }

    /// Reads up to the `close` matching an opening just consumed, respecting
    /// quotes and nesting; returns the text between them.
    fn balanced(&mut self, close: char) -> Result<String, CommandError> {
        let open = if close == ')' { '(' } else { '{' };
        let mut depth = 1usize;
        let start = self.pos;
        while let Some(c) = self.peek() {
            self.pos += 1;
            match c {
                '\\' => self.pos += 1,
                '\'' => {
                    while self.peek().is_some_and(|c| c != '\'') {
                        self.pos += 1;
                    }
                    self.pos += 1;
                }
                '"' => {
                    while let Some(c) = self.peek() {
                        self.pos += 1;
                        if c == '\\' {
                            self.pos += 1;
                        } else if c == '"' {
                            break;
                        }
                    }
                }
                c if c == open => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(self.chars[start..self.pos - 1].iter().collect());
                    }
                }
                _ => {}
            }
        }
        Err(CommandError::UnterminatedQuote)
    }
}

/// The scripts of the substitutions in an expanding here-document body
/// (read like the inside of double quotes, where `"` is plain text).
fn body_substitutions(body: &str) -> Result<Vec<String>, CommandError> {
    let mut lexer = Lexer {
        chars: body.chars().chain(['"']).collect(),
        pos: 0,
        commands: Vec::new(),
        current: SimpleCommand::default(),
        heredocs: Vec::new(),
    };
    let mut scratch = Word::default();
    while lexer.pos < lexer.chars.len() {
        lexer.double_quoted(&mut scratch)?;
    }
    Ok(lexer.current.substitutions)
}

/// `{a,b}` or `{1..3}` outside quotes.
fn has_brace_expansion(unquoted: &str) -> bool {
    let mut rest = unquoted;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) => {
                let inner = &after[..close];
                if inner.contains(',') || inner.contains("..") {
                    return true;
                }
                rest = &after[close + 1..];
            }
            None => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(script: &str) -> Vec<Vec<String>> {
        parse(script)
            .unwrap()
            .into_iter()
            .map(|c| c.words.into_iter().map(|w| w.text).collect())
            .collect()
    }

    #[test]
    fn splits_lists_pipes_and_subshells() {
        assert_eq!(
            words("a 1; b && c || d | e & f\ng (h) { i; }"),
            [
                vec!["a", "1"],
                vec!["b"],
                vec!["c"],
                vec!["d"],
                vec!["e"],
                vec!["f"],
                vec!["g"],
                vec!["h"],
                vec!["{", "i"],
                vec!["}"],
            ]
        );
        assert_eq!(
            words("echo 'a; b' \"c|d\" e\\ f"),
            [vec!["echo", "a; b", "c|d", "e f"]]
        );
        assert_eq!(words("# comment\necho x # y"), [vec!["echo", "x"]]);
    }

    #[test]
    fn redirections_are_taken_out() {
        let cmds = parse("make 2>&1 >out.txt &>>/tmp/log <in").unwrap();
        assert_eq!(cmds[0].words, [Word::literal("make")]);
        let r: Vec<(&str, &str, bool)> = cmds[0]
            .redirects
            .iter()
            .map(|r| (r.op.as_str(), r.target.text.as_str(), r.writes_file()))
            .collect();
        assert_eq!(
            r,
            [
                (">&", "1", false),
                (">", "out.txt", true),
                ("&>>", "/tmp/log", true),
                ("<", "in", false)
            ]
        );
    }

    #[test]
    fn substitutions_and_dynamic_words() {
        let cmds = parse("echo $(git push) `id` \"$X\" *.rs {a,b} {} ~/x plain").unwrap();
        assert_eq!(cmds[0].substitutions, ["git push", "id"]);
        let dynamic: Vec<bool> = cmds[0].words.iter().map(|w| w.dynamic.is_some()).collect();
        assert_eq!(
            dynamic,
            [false, true, true, true, true, true, false, true, false]
        );
        let c = &parse("cat <(ls)").unwrap()[0];
        assert_eq!(c.substitutions, ["ls"]);
    }

    #[test]
    fn heredocs_and_functions() {
        let cmds = parse("cat <<'EOF'\nit's $(x)\nEOF\necho done").unwrap();
        assert_eq!(cmds.len(), 2);
        assert!(cmds[0].notes.is_empty());
        let cmds = parse("cat <<EOF\n\"$(id)\" `ls`\nEOF\n").unwrap();
        assert_eq!(cmds[0].notes.len(), 1);
        assert_eq!(cmds[0].substitutions, ["id", "ls"]);
        let cmds = parse("f() { id; }; f").unwrap();
        assert_eq!(cmds[0].notes.len(), 1);
    }

    #[test]
    fn unterminated() {
        assert_eq!(parse("echo 'x"), Err(CommandError::UnterminatedQuote));
        assert_eq!(parse("echo $(x"), Err(CommandError::UnterminatedQuote));
    }
}
