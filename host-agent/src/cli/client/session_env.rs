//! `--env`, `--secret`, `--secret-file`, `--secret-stdin` and
//! `--secret-ref` of `sessions create`. Names and values are checked by
//! host-agent; a value read here never goes into a message.

use std::collections::HashMap;
use std::io::Read;

/// Largest secret read from a file or standard input (host-agent's bound,
/// plus a line end).
const MAX_READ: u64 = (64 << 10) + 2;

/// The session's environment and secrets on the command line.
#[derive(clap::Args, Debug, Default)]
pub struct SessionEnvArgs {
    /// A variable for every command of the session, NAME=VALUE (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// A secret, NAME=VALUE (repeatable). The value is then in the shell's
    /// history and the process list: prefer --secret-file or --secret-stdin.
    #[arg(long = "secret", value_name = "NAME=VALUE")]
    secret: Vec<String>,
    /// A secret read from a file on this machine, NAME=PATH (repeatable; one
    /// trailing newline dropped).
    #[arg(long = "secret-file", value_name = "NAME=PATH")]
    secret_file: Vec<String>,
    /// A secret read from standard input (one trailing newline dropped).
    #[arg(long = "secret-stdin", value_name = "NAME")]
    secret_stdin: Option<String>,
    /// A secret the node reads from its secrets_dir: the file's name, which
    /// is the secret's name (repeatable).
    #[arg(long = "secret-ref", value_name = "NAME")]
    secret_ref: Vec<String>,
}

/// CreateSessionRequest's `env`, `secrets` and `secret_refs`.
pub type Fields = (
    HashMap<String, String>,
    HashMap<String, String>,
    Vec<String>,
);

impl SessionEnvArgs {
    /// The request's fields, reading files and (for `--secret-stdin`) `stdin`.
    pub fn fields(self, stdin: impl Read) -> Result<Fields, String> {
        let mut env = HashMap::new();
        for e in &self.env {
            let (k, v) = split("--env", e, "NAME=VALUE")?;
            if env.insert(k.to_string(), v.to_string()).is_some() {
                return Err(format!("--env: {k} given twice"));
            }
        }
        let mut secrets = HashMap::new();
        let mut add = |name: &str, value: String| {
            if secrets.insert(name.to_string(), value).is_some() {
                return Err(format!("the secret {name} is given twice"));
            }
            Ok(())
        };
        for s in &self.secret {
            // Never echo the argument: it holds the value.
            let (k, v) = s
                .split_once('=')
                .ok_or("--secret: expected NAME=VALUE (the value was not shown)")?;
            add(k, v.to_string())?;
        }
        for s in &self.secret_file {
            let (k, path) = split("--secret-file", s, "NAME=PATH")?;
            let file = std::fs::File::open(path)
                .map_err(|e| format!("--secret-file {k}: opening {path}: {e}"))?;
            add(k, read_value(file, &format!("--secret-file {k} ({path})"))?)?;
        }
        if let Some(k) = &self.secret_stdin {
            add(k, read_value(stdin, &format!("--secret-stdin {k}"))?)?;
        }
        Ok((env, secrets, self.secret_ref))
    }
}

/// `arg` split at its first `=`.
fn split<'a>(flag: &str, arg: &'a str, form: &str) -> Result<(&'a str, &'a str), String> {
    arg.split_once('=')
        .ok_or_else(|| format!("{flag} {arg:?}: expected {form}"))
}

/// A secret value from `r`: UTF-8, at most 64 KiB, one trailing newline
/// dropped.
fn read_value(r: impl Read, what: &str) -> Result<String, String> {
    let mut data = Vec::new();
    r.take(MAX_READ + 1)
        .read_to_end(&mut data)
        .map_err(|e| format!("{what}: {e}"))?;
    if data.len() as u64 > MAX_READ {
        return Err(format!("{what}: a secret is at most 65536 bytes"));
    }
    if data.ends_with(b"\n") {
        data.pop();
        if data.ends_with(b"\r") {
            data.pop();
        }
    }
    String::from_utf8(data).map_err(|_| format!("{what}: the secret is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(f: impl FnOnce(&mut SessionEnvArgs)) -> SessionEnvArgs {
        let mut a = SessionEnvArgs::default();
        f(&mut a);
        a
    }

    #[test]
    fn values_come_from_arguments_files_and_stdin() {
        let t = tempfile::tempdir().unwrap();
        let file = t.path().join("token");
        std::fs::write(&file, "from-file-3e\n").unwrap();
        let (env, secrets, refs) = args(|a| {
            a.env = vec!["GREETING=hello=world".into()];
            a.secret = vec!["INLINE=in-1".into()];
            a.secret_file = vec![format!("FILED={}", file.display())];
            a.secret_stdin = Some("PIPED".into());
            a.secret_ref = vec!["NODE_TOKEN".into()];
        })
        .fields(&b"from-stdin-4f\r\n"[..])
        .unwrap();
        assert_eq!(env["GREETING"], "hello=world");
        assert_eq!(secrets["INLINE"], "in-1");
        assert_eq!(secrets["FILED"], "from-file-3e");
        assert_eq!(secrets["PIPED"], "from-stdin-4f");
        assert_eq!(refs, ["NODE_TOKEN"]);
    }

    #[test]
    fn mistakes_are_named_without_the_value() {
        let e = args(|a| a.secret = vec!["no-equals-sign-value".into()])
            .fields(&b""[..])
            .unwrap_err();
        assert!(e.contains("NAME=VALUE") && !e.contains("no-equals"), "{e}");
        let e = args(|a| {
            a.secret = vec!["T=one".into()];
            a.secret_stdin = Some("T".into());
        })
        .fields(&b"two"[..])
        .unwrap_err();
        assert!(e.contains("T is given twice") && !e.contains("one"), "{e}");
        let e = args(|a| a.secret_file = vec!["T=/nonexistent/x".into()])
            .fields(&b""[..])
            .unwrap_err();
        assert!(e.contains("--secret-file T: opening /nonexistent/x"), "{e}");
        let big = vec![b'x'; 70_000];
        let e = args(|a| a.secret_stdin = Some("T".into()))
            .fields(&big[..])
            .unwrap_err();
        assert!(e.contains("at most 65536"), "{e}");
        let e = args(|a| a.env = vec!["A=1".into(), "A=2".into()])
            .fields(&b""[..])
            .unwrap_err();
        assert!(e.contains("A given twice"), "{e}");
    }
}
