//! Environment variable names: which ones change *what a program runs*
//! (read by guest-init's command policy), and which ones a session's
//! operator-given environment and secrets may use (checked by host-agent at
//! CreateSession and by guest-init at StartSession, the same rule in both).
//!
//! A risky variable is one that changes which binary a name resolves to,
//! which libraries or start-up files get loaded, which helper programs
//! (pager, editor, ssh, credential helper) are started, or which
//! configuration is read. A command that sets one of them, however it sets
//! it (`VAR=x cmd`, `env VAR=x cmd`, `export VAR=x`, the Exec's `env` map),
//! needs at least approval, since the rule that matched the command was
//! written for the program it names, not for what the variable makes it
//! run. A session's own environment and secrets reach every command
//! without any such decision, so they may not set one at all.

/// Exact names.
pub const RISKY_NAMES: &[&str] = &[
    // Program lookup and shell start-up.
    "PATH",
    "ENV",
    "BASH_ENV",
    "ZDOTDIR",
    "SHELLOPTS",
    "BASHOPTS",
    "IFS",
    "PS4",
    "PROMPT_COMMAND",
    "INPUTRC",
    "SHELL",
    "CDPATH",
    // Configuration read from the home directory (git reads ~/.gitconfig).
    "HOME",
    "XDG_CONFIG_HOME",
    // Helper programs.
    "EDITOR",
    "VISUAL",
    "PAGER",
    "MANPAGER",
    "LESSOPEN",
    "LESSCLOSE",
    "BROWSER",
    "SSH_ASKPASS",
    "SUDO_ASKPASS",
    // The C library and loaders.
    "GCONV_PATH",
    "GLIBC_TUNABLES",
    "LOCPATH",
    "NLSPATH",
    "HOSTALIASES",
    "OPENSSL_CONF",
    "OPENSSL_ENGINES",
    // Language runtimes.
    "NODE_OPTIONS",
    "NODE_PATH",
    "PERLLIB",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "CLASSPATH",
    "PHPRC",
    "PHP_INI_SCAN_DIR",
    "GOFLAGS",
    "GOTOOLCHAIN",
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTDOC",
    "CARGO_HOME",
    "CARGO_BUILD_RUSTC_WRAPPER",
];

/// Name prefixes: every variable starting with one of these.
pub const RISKY_PREFIXES: &[&str] = &[
    "LD_",
    "DYLD_",
    "BASH_FUNC_",
    "GIT_",
    "PYTHON",
    "PERL5",
    "RUBY",
    "LUA_",
    "npm_config_",
    "NPM_CONFIG_",
];

/// `GIT_*` variables that only name the author or committer.
pub const SAFE_GIT_NAMES: &[&str] = &[
    "GIT_AUTHOR_NAME",
    "GIT_AUTHOR_EMAIL",
    "GIT_AUTHOR_DATE",
    "GIT_COMMITTER_NAME",
    "GIT_COMMITTER_EMAIL",
    "GIT_COMMITTER_DATE",
    "GIT_TERMINAL_PROMPT",
];

/// Variables holding a tool's options or start-up commands, which can make
/// the tool run a program of the command's choosing
/// (`TAR_OPTIONS=--to-command=x`, `MAKEFLAGS=--eval=...`, `VIMINIT='!x'`,
/// `RUSTFLAGS='-C linker=x'`, `RSYNC_RSH=x`). They count as risky like [`RISKY_NAMES`].
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

/// True when setting `name` can change what a command runs. Names that are
/// not plain identifiers (exported bash functions such as `BASH_FUNC_x%%`)
/// count as risky.
pub fn is_risky(name: &str) -> bool {
    if !is_identifier(name) {
        return true;
    }
    if SAFE_GIT_NAMES.contains(&name) {
        return false;
    }
    RISKY_NAMES.contains(&name)
        || TOOL_OPTION_NAMES.contains(&name)
        || RISKY_PREFIXES.iter().any(|p| name.starts_with(p))
        || (name.starts_with("CARGO_") && CARGO_RISKY_SUFFIXES.iter().any(|s| name.ends_with(s)))
}

/// A shell variable name: letters, digits and `_`, not starting with a digit.
pub fn is_identifier(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Names guest-init sets itself on every command (the turn's tag).
pub const RESERVED_NAMES: &[&str] = &["GUEST_INIT_TURN"];

/// Longest variable name a session's environment or secrets may use.
pub const MAX_SESSION_NAME_BYTES: usize = 128;

/// Why `name` cannot be a variable of a session's environment or the name
/// of one of its secrets, or `None` when it can: it must be a plain
/// identifier of at most [`MAX_SESSION_NAME_BYTES`], not one guest-init
/// sets itself, and not risky ([`is_risky`]): the session's variables reach
/// every command unexamined, while the repository's rules decide what a
/// command may run.
pub fn session_name_problem(name: &str) -> Option<&'static str> {
    if !is_identifier(name) {
        Some("is not a variable name (letters, digits and '_', not starting with a digit)")
    } else if name.len() > MAX_SESSION_NAME_BYTES {
        Some("is longer than 128 bytes")
    } else if RESERVED_NAMES.contains(&name) {
        Some("is set by guest-init itself")
    } else if is_risky(name) {
        Some(
            "changes what commands run (PATH, HOME, LD_*, GIT_*, ...), which only the \
             repository's rules may decide",
        )
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_may_not_set_a_tool_s_options() {
        // The command policy asks for these; a session's environment would
        // reach every command without a decision.
        for n in [
            "TAR_OPTIONS",
            "MAKEFLAGS",
            "VIMINIT",
            "RUSTFLAGS",
            "CARGO_TARGET_X_RUSTFLAGS",
        ] {
            assert!(session_name_problem(n).is_some(), "{n}");
        }
        for n in ["CARGO_TARGET_DIR", "CARGO_TERM_COLOR", "RUST_LOG"] {
            assert_eq!(session_name_problem(n), None, "{n}");
        }
    }

    #[test]
    fn risky_names() {
        for n in [
            "PATH",
            "LD_PRELOAD",
            "GIT_CONFIG_COUNT",
            "GIT_SSH_COMMAND",
            "PYTHONPATH",
            "NODE_OPTIONS",
            "PERL5OPT",
            "RUBYOPT",
            "BASH_ENV",
            "BASH_FUNC_git%%",
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER",
        ] {
            assert!(is_risky(n), "{n}");
        }
        for n in [
            "FOO",
            "GIT_AUTHOR_NAME",
            "CARGO_TARGET_DIR",
            "RUST_LOG",
            "TERM",
        ] {
            assert!(!is_risky(n), "{n}");
        }
    }

    #[test]
    fn session_names() {
        for n in [
            "GITHUB_TOKEN",
            "NPM_TOKEN",
            "RUST_LOG",
            "GIT_AUTHOR_NAME",
            "_X1",
        ] {
            assert_eq!(session_name_problem(n), None, "{n}");
        }
        for n in [
            "",
            "1X",
            "A-B",
            "A=B",
            "PATH",
            "LD_PRELOAD",
            "GIT_SSH_COMMAND",
            "GUEST_INIT_TURN",
        ] {
            assert!(session_name_problem(n).is_some(), "{n:?}");
        }
        assert!(session_name_problem(&"A".repeat(129)).is_some());
        assert_eq!(session_name_problem(&"A".repeat(128)), None);
    }
}
