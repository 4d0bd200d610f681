//! Architecture-specific boot setup. Only x86_64 is supported.

pub mod x86_64;
