//! Sessions' networks: every VM in a network namespace of its own, with the
//! same guest address in every clone of a snapshot ([`addressing`]), NAT to
//! a per-VM address of the node's pool, and egress enforced by nftables in
//! that namespace, on the host side ([`rules`], [`namespace`]): what the
//! repository's manifest grants within the node's allowlist ([`grants`]),
//! host names through a per-session resolver ([`dns`]). Exposed guest ports
//! are node listeners carried into the namespace ([`expose`], [`netns`]).

pub mod addressing;
pub mod dns;
pub mod expose;
pub mod grants;
pub mod namespace;
pub mod netns;
pub mod node;
pub mod rules;
