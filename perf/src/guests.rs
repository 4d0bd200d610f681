//! The test guests the scenarios boot, from the `test-guests` crate.

use std::path::PathBuf;

use crate::error::{PerfError, Result};

/// Prints one line and resets: the cold-boot guest.
pub const HELLO: &str = "hello";
/// The line the hello guest prints.
pub const HELLO_LINE: &str = "Hello from the hello test guest!";
/// Counts forever, printing `count=N`: the restore guest.
pub const COUNTER: &str = "counter";
/// Command line of the counter guest: print on every increment, so a
/// restored guest prints within microseconds of running again.
pub const COUNTER_CMDLINE: &str = "interval=1";
/// Dirties `permille=N` thousandths of its pages per pass, printing `pass=K`.
pub const DIRTIER: &str = "dirtier";
/// Moves frames through virtio-net (`mode=tx|rx|echo`): the network guest.
pub const NET_PERF: &str = "net_perf";

/// Path of the built test guest `name`.
pub fn path(name: &str) -> Result<PathBuf> {
    let path = test_guests::path(name).ok_or_else(|| PerfError::GuestMissing {
        name: name.into(),
        detail: "this perf binary was built without it".into(),
    })?;
    if !path.is_file() {
        return Err(PerfError::GuestMissing {
            name: name.into(),
            detail: format!("{} does not exist", path.display()),
        });
    }
    Ok(path)
}
