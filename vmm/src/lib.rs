//! `vmm`: a KVM virtual machine monitor for agent-session microVMs, one
//! process per VM. Boots a Linux kernel (or a test guest) directly, with an
//! 8250 serial console, an i8042 for guest reset, and a JSON-lines control
//! socket.

pub mod acpi;
pub mod arch;
pub mod config;
pub mod control;
pub mod devices;
pub mod exit;
pub mod jail;
pub mod keeper;
pub mod kvm;
pub mod logfile;
pub mod machine;
pub mod memory;
pub mod persist;
pub mod random;
pub mod seccomp;
pub mod signals;
pub mod snapshot;
pub mod timing;
pub mod vcpu;
pub mod vm;
