//! Guest image recipes for agentvm microVMs.
//!
//! * [`kernel`]: Debian's linux-source (6.12) with the checked-in microVM
//!   config, checked option by option after `olddefconfig`, built to vmlinux.
//! * [`rootfs`]: a debootstrap minbase tree with git, bash, coreutils,
//!   ca-certificates and nftables, an unprivileged `agent` user and a static
//!   guest-init as /sbin/init, as an ext4 image made without mounting.
//! * [`golden`]: boot both under vmm, wait for guest-init on vsock, pause,
//!   full snapshot.
//!
//! Every output directory carries a [`manifest`] of pinned inputs (package
//! versions, config and binary hashes) and is cached by their hash
//! ([`cache`]). External programs run through [`progress`], which shows
//! progress and turns a full disk into a clear error; [`tools`] checks what
//! each step needs first and names the package to install.

pub mod cache;
pub mod capture;
pub mod debian;
pub mod disk;
pub mod elf;
pub mod error;
pub mod golden;
pub mod guest_channel;
pub mod hash;
pub mod kernel;
pub mod manifest;
pub mod progress;
pub mod rootfs;
pub mod tools;

pub use error::{Error, Result};

/// Version of the recipes; part of every input hash, bumped when a recipe
/// changes what it produces.
pub const RECIPE_VERSION: &str = "1";
