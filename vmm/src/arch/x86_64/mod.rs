//! x86_64 boot: memory map, kernel loading, boot structures and vCPU registers.

pub mod cpuid;
pub mod cpuid_cache;
pub mod e820;
pub mod gdt;
pub mod layout;
pub mod loader;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod regs;
