//! The Hello exchange that opens every guest channel, on both sides' terms:
//! the host sends [`host_hello`], and accepts the guest's answer only
//! through [`accept_guest_hello`]. Every host-side client (host-agent's
//! session channel, the images golden builder and tools) uses these two, so
//! the version rule lives in one place.

use crate::guest::{
    guest_message, host_message, GuestMessage, Hello, HostMessage, PROTOCOL_VERSION,
};

/// Why the guest's first message does not open the channel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The guest answered with an error.
    #[error("guest refused Hello: {0}")]
    Refused(String),
    /// The guest speaks another protocol version.
    #[error("guest speaks protocol {guest}, we speak {ours}")]
    Version {
        /// The guest's version.
        guest: u32,
        /// Ours ([`PROTOCOL_VERSION`]).
        ours: u32,
    },
    /// Something else came first.
    #[error("expected Hello from the guest, got {0}")]
    Unexpected(String),
}

/// The host's Hello, naming the host-side `software` (e.g. "host-agent 0.1.0").
pub fn host_hello(software: impl Into<String>) -> HostMessage {
    HostMessage {
        kind: Some(host_message::Kind::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            software: software.into(),
        })),
    }
}

/// Checks the guest's first message: a Hello of our protocol version.
pub fn accept_guest_hello(msg: GuestMessage) -> Result<Hello, HelloError> {
    match msg.kind {
        Some(guest_message::Kind::Hello(h)) if h.protocol_version == PROTOCOL_VERSION => Ok(h),
        Some(guest_message::Kind::Hello(h)) => Err(HelloError::Version {
            guest: h.protocol_version,
            ours: PROTOCOL_VERSION,
        }),
        Some(guest_message::Kind::Error(e)) => Err(HelloError::Refused(e.message)),
        Some(other) => Err(HelloError::Unexpected(format!("{other:?}"))),
        None => Err(HelloError::Unexpected("an empty message".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::Error as GuestError;

    fn hello(v: u32) -> GuestMessage {
        GuestMessage {
            kind: Some(guest_message::Kind::Hello(Hello {
                protocol_version: v,
                software: "guest-init".into(),
            })),
        }
    }

    #[test]
    fn only_a_hello_of_our_version_opens_the_channel() {
        assert_eq!(
            accept_guest_hello(hello(PROTOCOL_VERSION))
                .unwrap()
                .software,
            "guest-init"
        );
        assert_eq!(
            accept_guest_hello(hello(PROTOCOL_VERSION + 1)),
            Err(HelloError::Version {
                guest: PROTOCOL_VERSION + 1,
                ours: PROTOCOL_VERSION
            })
        );
        let refused = GuestMessage {
            kind: Some(guest_message::Kind::Error(GuestError {
                message: "busy".into(),
                ..Default::default()
            })),
        };
        assert_eq!(
            accept_guest_hello(refused).unwrap_err().to_string(),
            "guest refused Hello: busy"
        );
        assert!(matches!(
            accept_guest_hello(GuestMessage { kind: None }),
            Err(HelloError::Unexpected(_))
        ));
        match host_hello("t").kind {
            Some(host_message::Kind::Hello(h)) => assert_eq!(h.protocol_version, PROTOCOL_VERSION),
            other => panic!("{other:?}"),
        }
    }
}
