//! Suites that cross crates (host-agent, guest-init and the vmm together,
//! each as its own process) live in `tests/`; this library is empty. The
//! shared harness is the `test-harness` crate (`tests/harness`).
