//! Environment variables that change *what a program runs*, and the names a
//! session's environment and secrets may use: shared with host-agent, so
//! both apply the same list (see [`agent_manifest::env`]). The command
//! policy adds [`TOOL_OPTION_NAMES`] on top (see [`is_risky`]).

pub use agent_manifest::env::*;

/// Variables holding a tool's options or start-up commands, which can make
/// the tool run a program of the command's choosing
/// (`TAR_OPTIONS=--to-command=x`, `MAKEFLAGS=--eval=...`, `VIMINIT='!x'`,
/// `RUSTFLAGS='-C linker=x'`, `RSYNC_RSH=x`). The command policy treats them
/// like [`RISKY_NAMES`].
pub const TOOL_OPTION_NAMES: &[&str] = &[
    "TAR_OPTIONS",
    "MAKEFLAGS",
    "MFLAGS",
    "GNUMAKEFLAGS",
    "MAKEFILES",
    "VIMINIT",
    "EXINIT",
    "GVIMINIT",
    "MYVIMRC",
    "MYGVIMRC",
    "VIM",
    "VIMRUNTIME",
    "XDG_CONFIG_DIRS",
    "XDG_DATA_HOME",
    "XDG_DATA_DIRS",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_ENCODED_RUSTDOCFLAGS",
    "CARGO_BUILD_RUSTC",
    "CARGO_BUILD_RUSTDOC",
    "RUSTUP_HOME",
    "RUSTUP_TOOLCHAIN",
    "RSYNC_RSH",
    "RSYNC_CONNECT_PROG",
    "CVS_RSH",
    "MANOPT",
    "ZIPOPT",
    "WGETRC",
];

/// Endings of `CARGO_*` configuration variables that name a program or pass
/// flags to the compiler (`CARGO_TARGET_<triple>_RUSTFLAGS`,
/// `CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER`, a registry's credential provider).
const CARGO_RISKY_SUFFIXES: &[&str] = &[
    "_RUSTFLAGS",
    "_RUSTDOCFLAGS",
    "_WRAPPER",
    "_RUNNER",
    "_LINKER",
    "_CREDENTIAL_PROVIDER",
    "_CREDENTIAL_PROVIDERS",
];

/// True when setting `name` on a command can change what it runs: the shared
/// list ([`agent_manifest::env::is_risky`]) or one of [`TOOL_OPTION_NAMES`].
pub fn is_risky(name: &str) -> bool {
    agent_manifest::env::is_risky(name)
        || TOOL_OPTION_NAMES.contains(&name)
        || (name.starts_with("CARGO_") && CARGO_RISKY_SUFFIXES.iter().any(|s| name.ends_with(s)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_turn_variable_is_reserved() {
        assert!(super::RESERVED_NAMES.contains(&crate::turn::TURN_ENV));
    }

    #[test]
    fn tool_options_are_risky() {
        for n in [
            "TAR_OPTIONS",
            "MAKEFLAGS",
            "MAKEFILES",
            "VIMINIT",
            "EXINIT",
            "RUSTFLAGS",
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
            "CARGO_REGISTRIES_X_CREDENTIAL_PROVIDER",
            "PATH",
            "GIT_SSH_COMMAND",
        ] {
            assert!(super::is_risky(n), "{n}");
        }
        for n in ["CARGO_TARGET_DIR", "CARGO_TERM_COLOR", "RUST_LOG", "LANG"] {
            assert!(!super::is_risky(n), "{n}");
        }
    }
}
