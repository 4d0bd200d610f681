//! The vmm's test guests (the `test-guests` crate): tiny freestanding
//! x86_64 ELF images a test boots in a real vmm.

use std::path::PathBuf;

/// Path of test guest `name` (see `test_guests::ALL`); panics on an unknown
/// name.
pub fn path(name: &str) -> PathBuf {
    test_guests::path(name).unwrap_or_else(|| panic!("no test guest {name:?}"))
}

/// The `counter` guest's path as text (image registrations take strings).
pub fn counter_kernel() -> String {
    path("counter").display().to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_counter_guest_is_built() {
        assert!(std::path::Path::new(&super::counter_kernel()).is_file());
    }
}
