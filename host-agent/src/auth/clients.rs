//! The clients file: who may call host-agent, how they prove it, and what
//! they may do.
//!
//! One client credential per line; blank lines and `#` comments are ignored:
//!
//! ```text
//! # name     scopes          credential
//! ci-runner  sessions        sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! billing    read            sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752
//! ops        admin           mtls
//! ```
//!
//! * `name`: 1..=128 of `[A-Za-z0-9._@-]`; it owns the sessions the client
//!   creates. `legacy` and `local` are reserved.
//! * `scopes`: `admin`, `sessions` or `read`, comma-separated (scopes nest,
//!   the broadest counts).
//! * credential: `sha256:HEX` for a bearer token whose SHA-256 is HEX (the
//!   file never holds a token, so it need not be secret), or `mtls` for a
//!   client certificate (signed by `tls.ca`) whose subject CN is `name`.
//!
//! A name may have several lines (e.g. two tokens while one is rotated).

use std::collections::HashMap;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::{Caller, Scope, LEGACY_OWNER, LOCAL_CLIENT};
use crate::error::{Error, Result};

/// Longest accepted client name.
const MAX_NAME: usize = 128;
/// Most lines read from a clients file.
const MAX_LINES: usize = 100_000;

/// The parsed clients file.
#[derive(Debug, Default, Clone)]
pub struct Clients {
    tokens: HashMap<[u8; 32], Caller>,
    certs: HashMap<String, Caller>,
}

/// Whether `name` is a valid client name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'-'))
}

impl Clients {
    /// Reads and checks the clients file at `path`.
    pub fn load(path: &Path) -> Result<Clients> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading clients file {}", path.display()), e))?;
        Clients::parse(&text)
            .map_err(|e| Error::invalid(format!("clients file {}: {e}", path.display())))
    }

    /// Parses the text of a clients file; the error names the line.
    pub fn parse(text: &str) -> std::result::Result<Clients, String> {
        let mut c = Clients::default();
        for (n, line) in text.lines().enumerate() {
            if n >= MAX_LINES {
                return Err(format!("more than {MAX_LINES} lines"));
            }
            let at = n + 1;
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, scopes, credential] = fields[..] else {
                return Err(format!(
                    "line {at}: expected `NAME SCOPES CREDENTIAL`, got {} fields",
                    fields.len()
                ));
            };
            if !valid_name(name) {
                return Err(format!(
                    "line {at}: client name {name:?} must be 1..={MAX_NAME} of [A-Za-z0-9._@-]"
                ));
            }
            if name == LEGACY_OWNER || name == LOCAL_CLIENT {
                return Err(format!("line {at}: client name {name:?} is reserved"));
            }
            let mut scope = None;
            for s in scopes.split(',') {
                let s = Scope::parse(s).ok_or_else(|| {
                    format!("line {at}: scope {s:?} is not admin, sessions or read")
                })?;
                scope = scope.max(Some(s));
            }
            let Some(scope) = scope else {
                return Err(format!("line {at}: no scope"));
            };
            let caller = Caller {
                name: name.to_string(),
                scope,
            };
            if credential == "mtls" {
                if c.certs.insert(name.to_string(), caller).is_some() {
                    return Err(format!("line {at}: client {name:?} has `mtls` twice"));
                }
            } else if let Some(h) = credential.strip_prefix("sha256:") {
                let mut hash = [0u8; 32];
                hex::decode_to_slice(h, &mut hash).map_err(|_| {
                    format!("line {at}: sha256: takes 64 hex digits (the token's SHA-256)")
                })?;
                if c.tokens.insert(hash, caller).is_some() {
                    return Err(format!("line {at}: this token hash is listed twice"));
                }
            } else {
                return Err(format!(
                    "line {at}: credential must be `sha256:HEX` (a token's SHA-256) or `mtls`"
                ));
            }
        }
        Ok(c)
    }

    /// The client holding bearer token `token`.
    pub fn by_token(&self, token: &str) -> Option<&Caller> {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.tokens.get(&hash)
    }

    /// The client whose certificate subject CN is `cn`.
    pub fn by_cert(&self, cn: &str) -> Option<&Caller> {
        self.certs.get(cn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(t: &str) -> String {
        hex::encode(Sha256::digest(t.as_bytes()))
    }

    #[test]
    fn lines_give_tokens_and_certificates_their_scopes() {
        let text = format!(
            "# comment\n\nci  sessions,read  sha256:{}\nbill read sha256:{} # trailing\nops admin mtls\n",
            sha("tok-ci"),
            sha("tok-bill")
        );
        let c = Clients::parse(&text).unwrap();
        let ci = c.by_token("tok-ci").unwrap();
        assert_eq!((ci.name.as_str(), ci.scope), ("ci", Scope::Sessions));
        assert_eq!(c.by_token("tok-bill").unwrap().scope, Scope::Read);
        assert!(c.by_token("tok-other").is_none());
        assert!(
            c.by_token(&sha("tok-ci")).is_none(),
            "the hash is not the token"
        );
        assert_eq!(c.by_cert("ops").unwrap().scope, Scope::Admin);
        assert!(c.by_cert("ci").is_none());
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        for (text, want) in [
            ("a read", "line 1: expected"),
            ("a write mtls", "scope \"write\""),
            ("a read plain-token", "credential must be"),
            ("a read sha256:abc", "64 hex digits"),
            ("a/b read mtls", "client name"),
            ("legacy admin mtls", "reserved"),
            ("local admin mtls", "reserved"),
            (
                "\na read mtls\na admin mtls",
                "line 3: client \"a\" has `mtls` twice",
            ),
        ] {
            let err = Clients::parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let h = sha("t");
        let err = Clients::parse(&format!("a read sha256:{h}\nb read sha256:{h}")).unwrap_err();
        assert!(err.contains("line 2") && err.contains("twice"), "{err}");
    }
}
