//! The device event thread: one event-manager loop that runs every virtio
//! device's work when its queue eventfds (or backend fds: tap, sockets) fire.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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

/// The running event thread; dropping it stops the thread.
pub struct EventLoop {
    stop_evt: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl EventLoop {
    /// Starts a thread serving `subscribers`.
    pub fn start(subscribers: Vec<Subscriber>) -> Result<EventLoop, EventLoopError> {
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
        let thread = std::thread::Builder::new()
            .name("virtio-events".into())
            .spawn(move || {
                crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
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
            thread: Some(thread),
        })
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        let _ = self.stop_evt.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
