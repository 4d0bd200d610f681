//! The `host-agent` binary's subcommands that are more than a few lines.

pub mod demo;
pub mod serve;
