//! A session's environment and secrets: CreateSession's `env` (plain
//! variables for every command), `secrets` (name -> value) and
//! `secret_refs` (names of files in the node's `secrets_dir`, read at
//! create), checked and held for the one message that needs them.
//!
//! Where the values live: in this process's memory from the request until
//! the session's StartSession has been sent (the [`SessionEnv`] is dropped
//! when CreateSession ends, however it ends), then only in guest-init's
//! memory. They are never written to the database, the logs, the events,
//! the audit, usage records or any file of the session: the idempotency
//! fingerprint holds a keyed digest of them ([`fingerprint`]), and
//! [`SecretValues`] prints names only. Only the secrets the repository's
//! manifest grants the session's agent leave the host ([`SessionEnv::granted`]);
//! guest-init applies the same grant again.
//!
//! Names follow one rule on both sides ([`agent_manifest::env::session_name_problem`]):
//! a plain identifier that changes nothing about what a command runs.

pub mod fingerprint;
mod refs;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use agent_manifest::env::session_name_problem;

use crate::error::Error;

/// Most variables in `env`.
pub const MAX_ENV_ENTRIES: usize = 128;
/// Largest value of one `env` variable, bytes.
pub const MAX_ENV_VALUE_BYTES: usize = 32 << 10;
/// Largest `env` in all (names and values), bytes.
pub const MAX_ENV_BYTES: usize = 256 << 10;
/// Most secrets, `secrets` and `secret_refs` together.
pub const MAX_SECRETS: usize = 64;
/// Largest secret value (inline or a file of `secrets_dir`), bytes.
pub const MAX_SECRET_BYTES: usize = 64 << 10;
/// Largest secrets in all (names and values), bytes. With the environment
/// this keeps StartSession well inside one 4 MiB channel frame.
pub const MAX_SECRETS_BYTES: usize = 1 << 20;

/// Why a session's environment or secrets were refused. Messages name the
/// request field and the variable, never a value.
#[derive(Debug, thiserror::Error)]
pub enum SessionEnvError {
    /// A name, value or count in the request is not acceptable.
    #[error("{field}: {message}")]
    Invalid {
        /// The request field (`env`, `secrets["NAME"]`, `secret_refs`, ...).
        field: String,
        /// What is wrong, and the bound where there is one.
        message: String,
    },
    /// `secret_refs` was given, but the node has no `secrets_dir`.
    #[error(
        "secret_refs: this node has no secrets_dir configured (`secrets_dir` in host-agent's \
         configuration, or --secrets-dir); pass the values in `secrets` instead"
    )]
    NoSecretsDir,
    /// A ref names no file in `secrets_dir`.
    #[error("secret_refs: {name:?} is not a file in the node's secrets_dir")]
    RefMissing {
        /// The ref as given.
        name: String,
    },
    /// A ref's file exists but cannot be used.
    #[error("secret_refs: {name:?} in the node's secrets_dir {why}")]
    RefUnusable {
        /// The ref as given.
        name: String,
        /// Why (a link, not a regular file, too large, not UTF-8, ...).
        why: String,
    },
    /// Reading a ref's file failed.
    #[error("secret_refs: reading {name:?} from the node's secrets_dir: {source}")]
    RefIo {
        /// The ref as given.
        name: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl From<SessionEnvError> for Error {
    fn from(e: SessionEnvError) -> Self {
        match e {
            SessionEnvError::Invalid { .. } => Error::InvalidArgument(e.to_string()),
            SessionEnvError::NoSecretsDir
            | SessionEnvError::RefMissing { .. }
            | SessionEnvError::RefUnusable { .. } => Error::FailedPrecondition(e.to_string()),
            SessionEnvError::RefIo { name, source } => Error::io(
                format!("secret_refs: reading {name:?} from the node's secrets_dir"),
                source,
            ),
        }
    }
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> SessionEnvError {
    SessionEnvError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Secret values by name. `Debug` shows the names only, so a value cannot
/// reach a log through a `{:?}`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretValues(BTreeMap<String, String>);

impl std::fmt::Debug for SecretValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretValues")
            .field("names", &self.0.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl SecretValues {
    /// The names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.0.keys()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A session's checked environment and secrets (see the module's doc).
#[derive(Debug, Clone, Default)]
pub struct SessionEnv {
    /// Variables for every command of the session.
    pub env: BTreeMap<String, String>,
    /// `secrets` as given.
    inline: SecretValues,
    /// `secret_refs` as given (sorted), for the fingerprint.
    refs: Vec<String>,
    /// Every secret: `secrets`, and the files `secret_refs` name.
    all: SecretValues,
}

impl SessionEnv {
    /// Checks CreateSession's `env`, `secrets` and `secret_refs`, then reads
    /// the refs from `secrets_dir` (`None`: the node has none).
    pub fn from_request(
        env: HashMap<String, String>,
        secrets: HashMap<String, String>,
        secret_refs: Vec<String>,
        secrets_dir: Option<&Path>,
    ) -> Result<SessionEnv, SessionEnvError> {
        let env: BTreeMap<String, String> = env.into_iter().collect();
        let inline: BTreeMap<String, String> = secrets.into_iter().collect();
        check_env(&env)?;
        let refs = check_secrets(&env, &inline, &secret_refs)?;
        let mut all = inline.clone();
        if !refs.is_empty() {
            let dir = secrets_dir.ok_or(SessionEnvError::NoSecretsDir)?;
            for name in &refs {
                all.insert(name.clone(), refs::read(dir, name)?);
            }
        }
        let total: usize = all.iter().map(|(k, v)| k.len() + v.len()).sum();
        if total > MAX_SECRETS_BYTES {
            return Err(invalid(
                "secrets",
                format!(
                    "{total} bytes of names and values with secret_refs' files; at most \
                     {MAX_SECRETS_BYTES}"
                ),
            ));
        }
        Ok(SessionEnv {
            env,
            inline: SecretValues(inline),
            refs,
            all: SecretValues(all),
        })
    }

    /// Whether the request gave no environment and no secrets.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.all.is_empty()
    }

    /// Every secret (names only in `Debug`).
    pub fn secrets(&self) -> &SecretValues {
        &self.all
    }

    /// What StartSession carries for an agent whose manifest grants
    /// `grant`: the names (its `secret_allowlist`) and values of the
    /// requested secrets the grant names. The others never leave the host.
    pub fn granted(&self, grant: &[String]) -> (Vec<String>, HashMap<String, String>) {
        let grant: BTreeSet<&String> = grant.iter().collect();
        let values: HashMap<String, String> = self
            .all
            .0
            .iter()
            .filter(|(name, _)| grant.contains(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let mut names: Vec<String> = values.keys().cloned().collect();
        names.sort();
        (names, values)
    }

    /// The request's env, secrets and secret_refs (names: a file's content
    /// may change between a call and its retry) as a digest keyed with
    /// `key`, for the idempotency fingerprint; empty when there are none.
    pub fn fingerprint(&self, key: &fingerprint::Key) -> String {
        if self.env.is_empty() && self.inline.is_empty() && self.refs.is_empty() {
            return String::new();
        }
        let mut msg = Vec::new();
        let mut put = |b: &[u8]| {
            msg.extend_from_slice(&(b.len() as u64).to_le_bytes());
            msg.extend_from_slice(b);
        };
        for (section, map) in [("env", &self.env), ("secrets", &self.inline.0)] {
            put(section.as_bytes());
            put(&(map.len() as u64).to_le_bytes());
            for (k, v) in map {
                put(k.as_bytes());
                put(v.as_bytes());
            }
        }
        put(b"secret_refs");
        put(&(self.refs.len() as u64).to_le_bytes());
        for r in &self.refs {
            put(r.as_bytes());
        }
        key.digest(&msg)
    }
}

/// Checks `env`: names, values, count and size.
fn check_env(env: &BTreeMap<String, String>) -> Result<(), SessionEnvError> {
    if env.len() > MAX_ENV_ENTRIES {
        return Err(invalid(
            "env",
            format!("{} variables; at most {MAX_ENV_ENTRIES}", env.len()),
        ));
    }
    let mut total = 0;
    for (k, v) in env {
        if let Some(why) = session_name_problem(k) {
            return Err(invalid("env", format!("the name {k:?} {why}")));
        }
        let field = format!("env[{k:?}]");
        if v.len() > MAX_ENV_VALUE_BYTES {
            return Err(invalid(
                field,
                format!(
                    "the value is {} bytes; at most {MAX_ENV_VALUE_BYTES}",
                    v.len()
                ),
            ));
        }
        if v.contains('\0') {
            return Err(invalid(field, "the value holds a NUL byte"));
        }
        total += k.len() + v.len();
    }
    if total > MAX_ENV_BYTES {
        return Err(invalid(
            "env",
            format!("{total} bytes of names and values; at most {MAX_ENV_BYTES}"),
        ));
    }
    Ok(())
}

/// Checks `secrets` and `secret_refs` (and that no name is given twice,
/// also across `env`); returns the refs sorted.
fn check_secrets(
    env: &BTreeMap<String, String>,
    inline: &BTreeMap<String, String>,
    refs: &[String],
) -> Result<Vec<String>, SessionEnvError> {
    if inline.len() + refs.len() > MAX_SECRETS {
        return Err(invalid(
            "secrets",
            format!(
                "{} secrets with secret_refs; at most {MAX_SECRETS}",
                inline.len() + refs.len()
            ),
        ));
    }
    for (k, v) in inline {
        if let Some(why) = session_name_problem(k) {
            return Err(invalid("secrets", format!("the name {k:?} {why}")));
        }
        let field = format!("secrets[{k:?}]");
        if v.is_empty() {
            return Err(invalid(field, "the value is empty"));
        }
        if v.len() > MAX_SECRET_BYTES {
            return Err(invalid(
                field,
                format!("the value is {} bytes; at most {MAX_SECRET_BYTES}", v.len()),
            ));
        }
        if v.contains('\0') {
            return Err(invalid(field, "the value holds a NUL byte"));
        }
        if env.contains_key(k) {
            return Err(invalid(field, "the name is in env too; give it once"));
        }
    }
    let mut sorted: Vec<String> = refs.to_vec();
    sorted.sort();
    for (i, r) in sorted.iter().enumerate() {
        // A ref is a file name in secrets_dir and the secret's name: a
        // plain identifier, so never a path (no '/', no "..").
        if let Some(why) = session_name_problem(r) {
            return Err(invalid(
                "secret_refs",
                format!("the name {r:?} {why} (a ref is the name of a file in secrets_dir)"),
            ));
        }
        if i > 0 && sorted[i - 1] == *r {
            return Err(invalid("secret_refs", format!("{r:?} is given twice")));
        }
        if inline.contains_key(r) {
            return Err(invalid(
                "secret_refs",
                format!("{r:?} is in secrets too; give it once"),
            ));
        }
        if env.contains_key(r) {
            return Err(invalid(
                "secret_refs",
                format!("{r:?} is in env too; give it once"),
            ));
        }
    }
    Ok(sorted)
}

#[cfg(test)]
mod tests;
