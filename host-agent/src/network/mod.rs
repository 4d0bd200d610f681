//! Sessions' networks: every VM in a network namespace of its own, with the
//! same guest address in every clone of a snapshot ([`addressing`]), NAT to
//! a per-VM address of the node's pool, and egress enforced by nftables in
//! that namespace, on the host side ([`rules`], [`namespace`]).
//!
//! Not wired into session creation yet: the golden snapshot, the jail's
//! joining of the namespace and the per-session DNS resolver come next.

pub mod addressing;
pub mod dns;
pub mod namespace;
pub mod node;
pub mod rules;
