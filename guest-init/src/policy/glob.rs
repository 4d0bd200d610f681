//! Glob patterns for permission rules: `*` matches any run of characters
//! (spaces and `/` included), `?` matches one character, `\` makes the next
//! character literal. Everything else matches itself. The whole subject must
//! match.

/// True when `pattern` matches all of `text`.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let pat = parse(pattern);
    let txt: Vec<char> = text.chars().collect();
    let (mut p, mut t) = (0usize, 0usize);
    // Position after the last `*` seen, and the text position it matched up to.
    let mut star: Option<(usize, usize)> = None;
    while t < txt.len() {
        match pat.get(p) {
            Some(Token::Any) => {
                star = Some((p + 1, t));
                p += 1;
            }
            Some(Token::One) => {
                p += 1;
                t += 1;
            }
            Some(Token::Lit(c)) if *c == txt[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pat[p..].iter().all(|tok| matches!(tok, Token::Any))
}

enum Token {
    Any,
    One,
    Lit(char),
}

fn parse(pattern: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        out.push(match c {
            '*' => Token::Any,
            '?' => Token::One,
            '\\' => Token::Lit(chars.next().unwrap_or('\\')),
            c => Token::Lit(c),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn matches() {
        assert!(glob_match("*", ""));
        assert!(glob_match("*", "rm -rf /"));
        assert!(glob_match("git status", "git status"));
        assert!(!glob_match("git status", "git status --short"));
        assert!(glob_match("git status*", "git status --short"));
        assert!(glob_match("git push *", "git push origin main"));
        assert!(!glob_match("git push *", "git pushy"));
        assert!(glob_match("git * main", "git push origin main"));
        assert!(glob_match("ls ?", "ls a"));
        assert!(!glob_match("ls ?", "ls ab"));
        assert!(glob_match(r"echo \*", "echo *"));
        assert!(!glob_match(r"echo \*", "echo x"));
        assert!(glob_match("a*b*c", "aXXbYYbZc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("é*", "école"));
    }
}
