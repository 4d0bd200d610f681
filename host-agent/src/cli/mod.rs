//! The `host-agent` binary's subcommands that are more than a few lines.

pub mod client;
pub mod demo;
pub mod output;
pub mod serve;
