//! Coordinates the vCPU threads with the rest of the VMM: pause, resume and
//! stop requests, and the one reason the VM ended.
//!
//! A request is recorded under a mutex first and the vCPU threads are then
//! kicked out of KVM_RUN with a signal (see `kick`), so a vCPU either sees the
//! request before entering the guest or is interrupted inside it.
//!
//! A VM may also have one piece of work that must happen right before its
//! vCPUs first run guest code (a restored VM announcing its new generation
//! ID): it runs when a VM that starts running is launched, or on the first
//! resume of a VM restored paused, and no vCPU runs before it has finished.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::exit::ExitReason;
use crate::vcpu::kick::{self, ThreadHandle};

/// What the VM's vCPUs are doing (the control protocol's state names).
pub use vmm_api::protocol::VmState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    Run,
    Pause,
    Stop,
}

/// What a vCPU thread should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Enter the guest.
    Run,
    /// Re-enter KVM_RUN without running the guest (immediate_exit set) to
    /// finish the I/O exit just handled, then ask again: the VM is pausing.
    CompleteIo,
    /// Leave the run loop.
    Exit,
}

/// Errors answering a control request.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CoordinatorError {
    /// The VM is already ending.
    #[error("the VM is stopping")]
    Stopping,
    /// Resume on a VM that is not paused.
    #[error("the VM is not paused")]
    NotPaused,
    /// Pause on a VM that is already paused.
    #[error("the VM is already paused")]
    AlreadyPaused,
    /// The work before the first run failed; the VM is ending.
    #[error("the VM is ending: {0}")]
    FirstRun(String),
}

/// Work to do once, right before the vCPUs first run guest code.
pub type FirstRunHook = Box<dyn FnOnce() -> Result<(), String> + Send>;

struct Inner {
    request: Request,
    parked: usize,
    exited: usize,
    exit: Option<ExitReason>,
    threads: Vec<ThreadHandle>,
    /// Work to do right before the vCPUs first run, in the order added.
    first_run: Vec<FirstRunHook>,
    /// The thread waiting for the VM's end, and the signal that wakes it
    /// (see [`Coordinator::wake_on_exit`]).
    exit_waker: Option<(ThreadHandle, libc::c_int)>,
}

/// Shared by the vCPU threads, the control socket and the main thread.
pub struct Coordinator {
    vcpus: usize,
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl Coordinator {
    /// A coordinator for `vcpus` vCPU threads, starting in `Run`.
    pub fn new(vcpus: usize) -> Self {
        Coordinator {
            vcpus,
            inner: Mutex::new(Inner {
                request: Request::Run,
                parked: 0,
                exited: 0,
                exit: None,
                threads: Vec::with_capacity(vcpus),
                first_run: Vec::new(),
                exit_waker: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.changed.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the condition's waiters, and once the VM is ending the thread
    /// registered with [`Coordinator::wake_on_exit`].
    fn notify(&self, inner: &Inner) {
        self.changed.notify_all();
        if inner.exit.is_some() {
            if let Some((thread, signal)) = inner.exit_waker {
                // SAFETY: the registered thread is the main thread, which
                // lives until the process ends; pthread_kill only queues the
                // signal, which that thread keeps blocked and takes with sigwait.
                unsafe { thread.signal(signal) };
            }
        }
    }

    /// Registers the calling thread to get `signal` (blocked in it, taken
    /// with `sigwait`) whenever the VM's end comes nearer: its exit reason is
    /// set, or one more vCPU has left its loop. Lets the main thread wait for
    /// the end and for termination signals at once, without a thread of its own.
    pub fn wake_on_exit(&self, signal: libc::c_int) {
        self.lock().exit_waker = Some((ThreadHandle::current(), signal));
    }

    /// Whether the VM has ended: an exit reason is set and every vCPU has left its loop.
    pub fn has_ended(&self) -> bool {
        let inner = self.lock();
        inner.exit.is_some() && inner.exited >= self.vcpus
    }

    fn kick_all(&self, inner: &Inner) {
        for thread in &inner.threads {
            kick::kick(*thread);
        }
    }

    /// A coordinator whose vCPUs park before their first instruction (restore --paused).
    pub fn new_paused(vcpus: usize) -> Self {
        let c = Coordinator::new(vcpus);
        c.lock().request = Request::Pause;
        c
    }

    /// Number of vCPUs.
    pub fn vcpu_count(&self) -> usize {
        self.vcpus
    }

    /// Called by a vCPU thread once, before its first run, so it can be kicked.
    pub fn register_current_thread(&self) {
        self.lock().threads.push(ThreadHandle::current());
    }

    /// Called by a vCPU thread before each KVM_RUN: parks while paused.
    pub fn next(&self) -> Next {
        self.next_after(false)
    }

    /// [`Coordinator::next`] for a vCPU whose last exit may be an I/O exit
    /// (`io_pending`). KVM finishes such an instruction (stores what an IN
    /// or MMIO read returned, moves RIP past an OUT) only when KVM_RUN is
    /// entered again, and its saved state is not consistent before that:
    /// a snapshot of a vCPU parked right after an OUT would replay that
    /// OUT when restored. So a pausing vCPU with I/O pending is told to
    /// complete it first ([`Next::CompleteIo`]) and parks on its next call.
    pub fn next_after(&self, io_pending: bool) -> Next {
        let mut inner = self.lock();
        loop {
            match inner.request {
                Request::Run => return Next::Run,
                Request::Stop => return Next::Exit,
                Request::Pause if io_pending => return Next::CompleteIo,
                Request::Pause => {
                    inner.parked += 1;
                    self.notify(&inner);
                    while inner.request == Request::Pause {
                        inner = self.wait(inner);
                    }
                    inner.parked -= 1;
                }
            }
        }
    }

    /// Called by a vCPU thread when it leaves its run loop.
    pub fn vcpu_exited(&self) {
        let me = ThreadHandle::current();
        let mut inner = self.lock();
        // Forget this thread so it is never signalled after it ends.
        inner.threads.retain(|t| !t.same(&me));
        inner.exited += 1;
        self.notify(&inner);
    }

    /// Records why the VM ends (the first reason wins) and stops every vCPU.
    pub fn request_exit(&self, reason: ExitReason) {
        let mut inner = self.lock();
        if inner.exit.is_none() {
            inner.exit = Some(reason);
        }
        inner.request = Request::Stop;
        self.kick_all(&inner);
        self.notify(&inner);
    }

    /// Parks every vCPU outside KVM_RUN and returns once all are parked.
    pub fn pause(&self) -> Result<(), CoordinatorError> {
        let mut inner = self.lock();
        match inner.request {
            Request::Stop => return Err(CoordinatorError::Stopping),
            Request::Pause => return Err(CoordinatorError::AlreadyPaused),
            Request::Run => {}
        }
        inner.request = Request::Pause;
        self.kick_all(&inner);
        while inner.request == Request::Pause && inner.parked + inner.exited < self.vcpus {
            inner = self.wait(inner);
        }
        if inner.request == Request::Stop {
            return Err(CoordinatorError::Stopping);
        }
        Ok(())
    }

    /// Returns once every vCPU is parked, or an error if the VM is not paused.
    pub fn wait_until_parked(&self) -> Result<(), CoordinatorError> {
        let mut inner = self.lock();
        loop {
            match inner.request {
                Request::Run => return Err(CoordinatorError::NotPaused),
                Request::Stop => return Err(CoordinatorError::Stopping),
                Request::Pause if inner.parked + inner.exited >= self.vcpus => return Ok(()),
                Request::Pause => inner = self.wait(inner),
            }
        }
    }

    /// Adds work to do right before the vCPUs first run guest code (after
    /// what was added before). Call before the vCPU threads start.
    pub fn add_first_run(&self, hook: FirstRunHook) {
        self.lock().first_run.push(hook);
    }

    /// Runs the first-run work, if it has not run yet, while `inner` is
    /// locked (so no vCPU can be released before it has finished). A
    /// failure ends the VM.
    fn first_run(&self, inner: &mut Inner) -> Result<(), CoordinatorError> {
        for hook in std::mem::take(&mut inner.first_run) {
            hook().map_err(|message| {
                if inner.exit.is_none() {
                    inner.exit = Some(ExitReason::VmmError {
                        vcpu: None,
                        message: message.clone(),
                    });
                }
                inner.request = Request::Stop;
                self.kick_all(inner);
                self.notify(inner);
                CoordinatorError::FirstRun(message)
            })?;
        }
        Ok(())
    }

    /// For a VM about to start running (not paused): runs the first-run
    /// work. Call before the vCPU threads start.
    pub fn before_start(&self) -> Result<(), CoordinatorError> {
        let mut inner = self.lock();
        if inner.request == Request::Run {
            self.first_run(&mut inner)?;
        }
        Ok(())
    }

    /// Lets paused vCPUs run again (after the first-run work, the first time).
    pub fn resume(&self) -> Result<(), CoordinatorError> {
        let mut inner = self.lock();
        match inner.request {
            Request::Stop => Err(CoordinatorError::Stopping),
            Request::Run => Err(CoordinatorError::NotPaused),
            Request::Pause => {
                self.first_run(&mut inner)?;
                inner.request = Request::Run;
                self.notify(&inner);
                Ok(())
            }
        }
    }

    /// The current run state.
    pub fn state(&self) -> VmState {
        let inner = self.lock();
        match inner.request {
            Request::Run => VmState::Running,
            Request::Pause => VmState::Paused,
            Request::Stop => VmState::Stopping,
        }
    }

    /// Blocks until an exit reason is recorded and every vCPU thread has left its loop.
    pub fn wait_for_exit(&self) -> ExitReason {
        let mut inner = self.lock();
        loop {
            if let Some(reason) = &inner.exit {
                if inner.exited >= self.vcpus {
                    return reason.clone();
                }
            }
            inner = self.wait(inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn pause_waits_for_every_vcpu_and_resume_releases_them() {
        kick::install_handler().unwrap();
        let coord = Arc::new(Coordinator::new(2));
        let mut handles = Vec::new();
        for _ in 0..2 {
            let c = coord.clone();
            handles.push(std::thread::spawn(move || {
                c.register_current_thread();
                let mut runs = 0u64;
                while c.next() == Next::Run {
                    runs += 1;
                    std::thread::yield_now();
                }
                c.vcpu_exited();
                runs
            }));
        }
        coord.pause().unwrap();
        assert_eq!(coord.state(), VmState::Paused);
        assert_eq!(coord.pause(), Err(CoordinatorError::AlreadyPaused));
        coord.resume().unwrap();
        assert_eq!(coord.resume(), Err(CoordinatorError::NotPaused));
        coord.request_exit(ExitReason::StopRequested);
        coord.request_exit(ExitReason::TripleFault { vcpu: 0 });
        assert_eq!(coord.wait_for_exit(), ExitReason::StopRequested);
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(coord.pause(), Err(CoordinatorError::Stopping));
    }

    #[test]
    fn a_pausing_vcpu_with_io_pending_completes_it_before_it_parks() {
        let coord = Arc::new(Coordinator::new(1));
        assert_eq!(coord.next_after(true), Next::Run, "running: no detour");
        let pauser = {
            let c = coord.clone();
            std::thread::spawn(move || c.pause())
        };
        while coord.state() != VmState::Paused {
            std::thread::yield_now();
        }
        // Told to finish the I/O first; only then does it park (and the
        // pause, waiting for every vCPU to park, returns).
        assert_eq!(coord.next_after(true), Next::CompleteIo);
        assert!(!pauser.is_finished(), "not parked yet");
        let vcpu = {
            let c = coord.clone();
            std::thread::spawn(move || c.next_after(false))
        };
        pauser.join().unwrap().unwrap();
        coord.resume().unwrap();
        assert_eq!(vcpu.join().unwrap(), Next::Run);
        coord.request_exit(ExitReason::StopRequested);
        assert_eq!(coord.next_after(true), Next::Exit, "stopping: no detour");
    }

    fn counting_hook(count: &Arc<std::sync::atomic::AtomicUsize>) -> FirstRunHook {
        let count = count.clone();
        Box::new(move || {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        })
    }

    #[test]
    fn the_first_run_work_runs_once_before_a_paused_vm_first_resumes() {
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let coord = Coordinator::new_paused(0);
        coord.add_first_run(counting_hook(&count));
        coord.before_start().unwrap();
        assert_eq!(
            count.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "paused: not yet"
        );
        coord.resume().unwrap();
        assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
        coord.pause().unwrap();
        coord.resume().unwrap();
        assert_eq!(
            count.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "only once"
        );

        let running = Coordinator::new(0);
        running.add_first_run(counting_hook(&count));
        running.before_start().unwrap();
        assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn every_piece_of_first_run_work_runs_in_the_order_added() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let coord = Coordinator::new_paused(0);
        for i in 0..3 {
            let order = order.clone();
            coord.add_first_run(Box::new(move || {
                order.lock().unwrap().push(i);
                Ok(())
            }));
        }
        coord.resume().unwrap();
        assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
    }

    #[test]
    fn failed_first_run_work_ends_the_vm() {
        let coord = Coordinator::new_paused(0);
        coord.add_first_run(Box::new(|| Err("no entropy".into())));
        assert_eq!(
            coord.resume(),
            Err(CoordinatorError::FirstRun("no entropy".into()))
        );
        assert_eq!(coord.state(), VmState::Stopping);
        assert_eq!(
            coord.wait_for_exit(),
            ExitReason::VmmError {
                vcpu: None,
                message: "no entropy".into()
            }
        );
    }
}
