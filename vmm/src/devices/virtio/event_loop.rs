//! The device event thread: one event-manager loop that runs every virtio
//! device's work when its queue eventfds (or backend fds: tap, sockets) fire.
//!
//! A restored VM's loop starts held ([`EventLoop::start_held`]): until its
//! [`EventGate`] opens, when the VM first runs, no device serves its backend
//! (a frame on the tap, a host vsock connection), so a `--paused` restore's
//! memory stays the snapshot's until it is resumed. What arrives meanwhile
//! waits in the backend (the tap's queue, the socket's backlog).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::eventfd::EventFd;

/// A device (or backend) the event thread serves.
pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

/// Errors starting the event thread.
#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    /// epoll could not be set up.
    #[error("cannot create the device event loop: {0:?}")]
    Create(event_manager::Error),
    /// The stop eventfd could not be created.
    #[error("cannot create the device event loop stop eventfd: {0}")]
    Eventfd(#[source] std::io::Error),
    /// The thread could not be spawned.
    #[error("cannot spawn the device event thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// Stops the loop when its eventfd fires.
struct Stopper {
    evt: EventFd,
    stop: Arc<AtomicBool>,
}

impl MutEventSubscriber for Stopper {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.evt.read();
        self.stop.store(true, Ordering::SeqCst);
    }
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.evt, EventSet::IN)) {
            tracing::error!(error = ?e, "cannot watch the event loop stop eventfd");
        }
    }
}

/// Where a held event thread stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GateState {
    /// Waiting to serve its devices.
    Held,
    /// Serving them.
    Open,
    /// Told to end before it ever served them.
    Stopped,
}

/// Lets a held event thread start serving its devices (see the module
/// comment). Opening twice, or after the loop ended, does nothing.
#[derive(Clone)]
pub struct EventGate(Arc<(Mutex<GateState>, Condvar)>);

impl EventGate {
    fn new(state: GateState) -> EventGate {
        EventGate(Arc::new((Mutex::new(state), Condvar::new())))
    }

    /// Lets the thread serve its devices.
    pub fn open(&self) {
        self.set(GateState::Open);
    }

    /// Moves a held gate to `to`; an open or stopped one stays as it is.
    fn set(&self, to: GateState) {
        let (state, changed) = &*self.0;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        if *s == GateState::Held {
            *s = to;
            changed.notify_all();
        }
    }

    /// Blocks while held; whether the thread may serve its devices.
    fn wait(&self) -> bool {
        let (state, changed) = &*self.0;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        while *s == GateState::Held {
            s = changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        *s == GateState::Open
    }

    /// Whether the thread serves its devices (for the tests).
    #[cfg(test)]
    fn is_open(&self) -> bool {
        let (state, _) = &*self.0;
        *state.lock().unwrap_or_else(|p| p.into_inner()) == GateState::Open
    }
}

/// The running event thread; dropping it stops the thread.
pub struct EventLoop {
    stop_evt: EventFd,
    gate: EventGate,
    thread: Option<JoinHandle<()>>,
}

impl EventLoop {
    /// Starts a thread serving `subscribers` at once.
    pub fn start(subscribers: Vec<Subscriber>) -> Result<EventLoop, EventLoopError> {
        EventLoop::spawn(subscribers, GateState::Open)
    }

    /// Starts a thread that serves `subscribers` once [`EventLoop::gate`]
    /// opens (see the module comment).
    pub fn start_held(subscribers: Vec<Subscriber>) -> Result<EventLoop, EventLoopError> {
        EventLoop::spawn(subscribers, GateState::Held)
    }

    /// The gate that lets a held thread serve its devices.
    pub fn gate(&self) -> EventGate {
        self.gate.clone()
    }

    fn spawn(subscribers: Vec<Subscriber>, gate: GateState) -> Result<EventLoop, EventLoopError> {
        let mut manager: EventManager<Subscriber> =
            EventManager::new().map_err(EventLoopError::Create)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(EventLoopError::Eventfd)?;
        let stopper = Stopper {
            evt: stop_evt.try_clone().map_err(EventLoopError::Eventfd)?,
            stop: stop.clone(),
        };
        manager.add_subscriber(Arc::new(Mutex::new(stopper)));
        for s in subscribers {
            manager.add_subscriber(s);
        }
        let gate = EventGate::new(gate);
        let held = gate.clone();
        let thread = std::thread::Builder::new()
            .name("virtio-events".into())
            .spawn(move || {
                crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
                if !held.wait() {
                    return;
                }
                while !stop.load(Ordering::SeqCst) {
                    if let Err(e) = manager.run() {
                        tracing::error!(error = ?e, "device event loop failed");
                        return;
                    }
                }
            })
            .map_err(EventLoopError::Spawn)?;
        Ok(EventLoop {
            stop_evt,
            gate,
            thread: Some(thread),
        })
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        // A thread still held ends without serving; a serving one at its
        // stop eventfd.
        self.gate.set(GateState::Stopped);
        let _ = self.stop_evt.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    /// Counts how often its eventfd was served.
    struct Counter {
        evt: EventFd,
        served: Arc<AtomicUsize>,
    }

    impl MutEventSubscriber for Counter {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            let _ = self.evt.read();
            self.served.fetch_add(1, Ordering::SeqCst);
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.evt, EventSet::IN)).unwrap();
        }
    }

    fn counter() -> (Subscriber, EventFd, Arc<AtomicUsize>) {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let served = Arc::new(AtomicUsize::new(0));
        let sub: Subscriber = Arc::new(Mutex::new(Counter {
            evt: evt.try_clone().unwrap(),
            served: served.clone(),
        }));
        (sub, evt, served)
    }

    fn wait_served(served: &AtomicUsize) {
        let start = Instant::now();
        while served.load(Ordering::SeqCst) == 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "never served");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Drops `l` on another thread; panics if that does not end in 10 s.
    fn drop_within_10s(l: EventLoop) {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(l);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("dropping the event loop did not end its thread");
    }

    #[test]
    fn a_started_loop_serves_at_once() {
        let (sub, evt, served) = counter();
        let l = EventLoop::start(vec![sub]).unwrap();
        assert!(l.gate().is_open());
        evt.write(1).unwrap();
        wait_served(&served);
        drop_within_10s(l);
    }

    #[test]
    fn a_held_loop_serves_nothing_until_its_gate_opens() {
        let (sub, evt, served) = counter();
        let l = EventLoop::start_held(vec![sub]).unwrap();
        evt.write(1).unwrap();
        // Every chance to serve it anyway.
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(served.load(Ordering::SeqCst), 0, "served while held");
        assert!(!l.gate().is_open());
        // What fired while held is served once the gate opens.
        l.gate().open();
        l.gate().open();
        assert!(l.gate().is_open());
        wait_served(&served);
        drop_within_10s(l);
    }

    #[test]
    fn a_held_loop_that_never_opened_ends_when_dropped() {
        let (sub, evt, served) = counter();
        let l = EventLoop::start_held(vec![sub]).unwrap();
        let gate = l.gate();
        evt.write(1).unwrap();
        drop_within_10s(l);
        // Opening after the end serves nothing.
        gate.open();
        assert!(!gate.is_open());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(served.load(Ordering::SeqCst), 0);
    }
}
