//! uids for jailed VMs: one per VM from the configured range (gid = uid), so
//! two jailed vmm processes never share an identity (one cannot signal,
//! ptrace or open the files of another).
//!
//! A uid is taken when a VM is started (a session's, or a warm VM's, which
//! hands it to the session that takes it) and given back when the session
//! ends or the warm VM is dropped. Sessions record theirs in the database, so
//! a restarted host-agent marks the uids of every session that is not over
//! as taken before it hands out any.

use std::collections::BTreeSet;
use std::sync::Mutex;

use crate::config::UidRange;
use crate::error::{Error, Result};

/// The uids in use, out of a range.
#[derive(Debug)]
pub struct JailUids {
    range: UidRange,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    used: BTreeSet<u32>,
    /// Where the next search starts: ids are handed out round-robin, so a
    /// released one is not reused at once.
    next: u32,
}

impl JailUids {
    /// An allocator with nothing taken.
    pub fn new(range: UidRange) -> JailUids {
        JailUids {
            range,
            inner: Mutex::new(Inner {
                used: BTreeSet::new(),
                next: range.first,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a free uid.
    pub fn allocate(&self) -> Result<u32> {
        let mut inner = self.lock();
        let start = inner.next.clamp(self.range.first, self.range.last);
        let found = (start..=self.range.last)
            .chain(self.range.first..start)
            .find(|uid| !inner.used.contains(uid))
            .ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "every uid of the jail range {} is in use by a VM: widen jail.uid_range \
                     (--jail-uid-range) or stop sessions",
                    self.range
                ))
            })?;
        inner.used.insert(found);
        inner.next = if found == self.range.last {
            self.range.first
        } else {
            found + 1
        };
        Ok(found)
    }

    /// Marks `uid` as taken (a persisted session's, at startup). A uid outside
    /// the range is remembered too, so it is never handed out should the range
    /// grow to include it.
    pub fn mark_used(&self, uid: u32) {
        if uid != 0 {
            self.lock().used.insert(uid);
        }
    }

    /// Gives `uid` back (0, "not jailed", is ignored).
    pub fn release(&self, uid: u32) {
        if uid != 0 {
            self.lock().used.remove(&uid);
        }
    }

    /// Whether `uid` is taken.
    pub fn is_used(&self, uid: u32) -> bool {
        self.lock().used.contains(&uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u32, last: u32) -> UidRange {
        UidRange { first, last }
    }

    #[test]
    fn every_vm_gets_a_distinct_uid_until_the_range_is_used_up() {
        let uids = JailUids::new(range(500, 502));
        let a = uids.allocate().unwrap();
        let b = uids.allocate().unwrap();
        let c = uids.allocate().unwrap();
        assert_eq!(BTreeSet::from([a, b, c]), BTreeSet::from([500, 501, 502]));
        let err = uids.allocate().unwrap_err().to_string();
        assert!(err.contains("--jail-uid-range"), "{err}");
        uids.release(b);
        assert_eq!(uids.allocate().unwrap(), b);
    }

    #[test]
    fn persisted_uids_are_skipped_and_released_ones_not_reused_at_once() {
        let uids = JailUids::new(range(10, 13));
        uids.mark_used(10);
        uids.mark_used(12);
        assert_eq!(uids.allocate().unwrap(), 11);
        uids.release(11);
        // Round robin: 13 before 11 again.
        assert_eq!(uids.allocate().unwrap(), 13);
        assert_eq!(uids.allocate().unwrap(), 11);
        assert!(uids.allocate().is_err());
        uids.release(0);
        assert!(uids.is_used(10));
    }
}
