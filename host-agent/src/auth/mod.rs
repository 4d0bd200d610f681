//! Who is calling and what they may do.
//!
//! Every gRPC request passes [`layer::AuthLayer`] first: it resolves the
//! caller once (a bearer token from the clients file, the mutual-TLS client
//! certificate's subject, or, where the operator allows it, an
//! unauthenticated local connection), looks the method up in
//! [`methods::required`] and refuses the call there when the caller lacks the
//! scope. The resolved [`Caller`] travels in the request's extensions; the
//! services use it for ownership (a session belongs to the client that
//! created it; other non-admin clients are told it does not exist).

pub mod cert;
pub mod clients;
pub mod layer;
pub mod methods;

use std::fmt;

use serde::Deserialize;

/// Owner recorded for sessions created before owners existed (database
/// migration); only admin clients see them.
pub use crate::store::LEGACY_OWNER;

/// The client name of an unauthenticated local caller (Unix socket or
/// loopback without credentials, where `unauthenticated_local` allows it).
pub const LOCAL_CLIENT: &str = "local";

/// What a client may do. Scopes nest: `admin` includes `sessions`, which
/// includes `read`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// List and get its own sessions, images, its own events and usage.
    Read,
    /// Create, exec in, pause, resume, snapshot, restore, stop and delete its
    /// own sessions; answer its own sessions' asks; everything `read` allows.
    Sessions,
    /// Everything: images, and every client's sessions, events and usage.
    Admin,
}

impl Scope {
    /// The scope named `s` (`admin`, `sessions`, `read`).
    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "admin" => Some(Scope::Admin),
            "sessions" => Some(Scope::Sessions),
            "read" => Some(Scope::Read),
            _ => None,
        }
    }

    /// The scope's name as written in the clients file.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Admin => "admin",
            Scope::Sessions => "sessions",
            Scope::Read => "read",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An identified client: its name (the owner of the sessions it creates)
/// and the highest scope it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Client name from the clients file (or [`LOCAL_CLIENT`]).
    pub name: String,
    /// The broadest scope granted (scopes nest).
    pub scope: Scope,
}

impl Caller {
    /// Whether the caller holds `need` (or a scope that includes it).
    pub fn may(&self, need: Scope) -> bool {
        self.scope >= need
    }

    /// Whether the caller sees and acts on every client's sessions.
    pub fn is_admin(&self) -> bool {
        self.scope == Scope::Admin
    }

    /// Whether the caller may see an object owned by `owner`.
    pub fn owns(&self, owner: &str) -> bool {
        self.is_admin() || self.name == owner
    }

    /// The owner filter for listings: `None` (everything) for admins.
    pub fn owner_filter(&self) -> Option<&str> {
        (!self.is_admin()).then_some(self.name.as_str())
    }

    /// An idempotency key as stored: scoped by the client, so that one
    /// client's key never returns another client's answer. Empty stays empty.
    pub fn scoped_key(&self, key: &str) -> String {
        if key.is_empty() {
            String::new()
        } else {
            format!("{}:{key}", self.name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest() {
        let c = |scope| Caller {
            name: "c".into(),
            scope,
        };
        assert!(c(Scope::Admin).may(Scope::Sessions) && c(Scope::Admin).may(Scope::Read));
        assert!(c(Scope::Sessions).may(Scope::Read) && !c(Scope::Sessions).may(Scope::Admin));
        assert!(!c(Scope::Read).may(Scope::Sessions));
        assert!(c(Scope::Read).owns("c") && !c(Scope::Read).owns("d"));
        assert!(c(Scope::Admin).owns("d"));
        assert_eq!(c(Scope::Read).scoped_key("k"), "c:k");
        assert_eq!(c(Scope::Read).scoped_key(""), "");
    }
}
