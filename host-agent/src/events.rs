//! Lifecycle events: persisted with a per-node seq (SQLite AUTOINCREMENT,
//! assigned in commit order under one connection), and streamed to watchers.
//!
//! A watcher reads the database for seq > its last, then waits for the
//! "latest seq" signal and reads again. Because it always resumes from the
//! last seq it sent, a reconnecting client that passes the last seq it saw
//! misses nothing and sees nothing twice.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use crate::error::Result;
use crate::store::{EventFilter, EventRow, Store};

/// Signals watchers that new events were committed.
pub struct EventBus {
    latest: watch::Sender<u64>,
}

impl EventBus {
    /// A bus starting at the database's latest seq.
    pub fn new(store: &Store) -> Result<EventBus> {
        let (latest, _) = watch::channel(store.last_event_seq()?);
        Ok(EventBus { latest })
    }

    /// Tells watchers that `seq` was committed.
    pub fn committed(&self, seq: u64) {
        self.latest.send_modify(|v| *v = (*v).max(seq));
    }

    /// The latest committed seq.
    pub fn latest(&self) -> u64 {
        *self.latest.borrow()
    }

    /// Streams events with seq > `since` that `filter` lets through into a
    /// channel until the receiver is dropped.
    pub fn watch(
        &self,
        store: Arc<Store>,
        since: u64,
        filter: EventFilter,
    ) -> mpsc::Receiver<Result<EventRow>> {
        let (tx, rx) = mpsc::channel(256);
        let mut latest = self.latest.subscribe();
        tokio::spawn(async move {
            let mut last = since;
            loop {
                // Mark the current value seen before reading, so a commit
                // after the read wakes us.
                latest.borrow_and_update();
                let rows = match store.events_since(last, &filter, 512) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let full = rows.len() == 512;
                for row in rows {
                    last = row.seq;
                    if tx.send(Ok(row)).await.is_err() {
                        return;
                    }
                }
                if full {
                    continue;
                }
                tokio::select! {
                    r = latest.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                }
            }
        });
        rx
    }
}
