//! Legacy PC devices: the 8250 serial console and the i8042 controller.

pub mod i8042;
pub mod serial;
