//! What one guest channel may make host-agent hold. A frame is at most
//! [`proto::framing::DEFAULT_MAX_FRAME`] (4 MiB); larger ones are discarded
//! unread.

use std::time::Duration;

/// Messages queued per exec for its gRPC client. When the queue is full
/// the channel is not read until the client takes one (backpressure).
pub const EXEC_OUTPUT_QUEUE: usize = 4;
/// Pending asks per session; more are answered REJECT at once.
pub const MAX_PENDING_ASKS: usize = 64;
/// Largest ask (encoded); a larger one is answered REJECT at once.
pub const MAX_ASK_BYTES: usize = 64 * 1024;
/// Control messages (Ready, Error, ...) kept for a waiter; when more
/// arrive, the oldest are dropped.
pub const CONTROL_QUEUE: usize = 32;
/// Largest control message (encoded); a larger one is dropped.
pub const MAX_CONTROL_BYTES: usize = 64 * 1024;
/// Ask notices ([`super::AskNotice`]) queued for the session's events; when
/// the queue is full, more are dropped and counted.
pub const ASK_NOTICE_QUEUE: usize = 128;
/// Bundle chunks queued for the file the branch is written to.
pub const BUNDLE_QUEUE: usize = 4;
/// Longest a branch fetch may take, however the chunks trickle in.
pub const BUNDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a message to the guest may wait for room in its channel: a
/// guest that stops reading cannot hold a call (a Stop) forever.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection waits for the guest's Hello before it is taken
/// for dead and a new one is opened (guest-init lets a new connection
/// supersede an old one). A connection the guest dropped without telling
/// the host (a vsock connection reset on the guest's side sends nothing)
/// would otherwise hold the caller for its whole timeout.
pub const HELLO_ATTEMPT: Duration = Duration::from_secs(10);
