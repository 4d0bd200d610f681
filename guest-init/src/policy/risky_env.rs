//! Environment variables that change *what a program runs*, and the names a
//! session's environment and secrets may use: shared with host-agent, so
//! both apply the same list (see [`agent_manifest::env`]).

pub use agent_manifest::env::*;

#[cfg(test)]
mod tests {
    #[test]
    fn the_turn_variable_is_reserved() {
        assert!(super::RESERVED_NAMES.contains(&crate::turn::TURN_ENV));
    }
}
