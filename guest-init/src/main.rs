//! guest-init: PID 1 of every guest and the session agent (work in progress).

fn main() {}
