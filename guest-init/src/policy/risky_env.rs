//! Environment variables that change *what a program runs*, and the names a
//! session's environment and secrets may use: shared with host-agent, so
//! both apply the same list (see [`agent_manifest::env`]).

pub use agent_manifest::env::*;

#[cfg(test)]
mod tests {
    use super::is_risky;

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
            assert!(is_risky(n), "{n}");
        }
        for n in ["CARGO_TARGET_DIR", "CARGO_TERM_COLOR", "RUST_LOG", "LANG"] {
            assert!(!is_risky(n), "{n}");
        }
    }
}
