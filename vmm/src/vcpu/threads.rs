//! vCPU threads started before their vCPUs exist.
//!
//! A vCPU thread must install its seccomp filter before it runs the guest,
//! and the kernel takes a while over a filter (it checks the program,
//! converts and compiles it, and works out which calls it always allows):
//! 0.2-0.4 ms on this project's development machine, the largest single
//! step between a restore's last ioctl and the guest's first instruction.
//! So the threads are started as soon as the vCPU count is known (a cold
//! boot's start, a restore's state file read, a standby vmm's preparation),
//! install their filters while the main thread builds the VM, and then wait
//! for their vCPU.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::coordinator::Coordinator;
use super::{Vcpu, VcpuError};
use crate::seccomp::{self, ThreadKind};

/// What a waiting thread gets: its vCPU, and who tells it when to run.
struct Start {
    vcpu: Vcpu,
    coordinator: Arc<Coordinator>,
}

/// The threads already running a vCPU when handing out the rest failed.
pub type Started = Vec<JoinHandle<()>>;

/// Threads `0..count`, each filtered and waiting for its vCPU. Dropped
/// without [`VcpuThreads::start`] (a restore that failed), they end.
pub struct VcpuThreads {
    starts: Vec<SyncSender<Start>>,
    handles: Vec<JoinHandle<()>>,
}

impl VcpuThreads {
    /// Starts `count` threads named `vcpu0`, `vcpu1`, ... Call after
    /// `seccomp::init` (the threads inherit its clone3 filter).
    pub fn spawn(count: usize) -> Result<Self, VcpuError> {
        let mut threads = VcpuThreads {
            starts: Vec::with_capacity(count),
            handles: Vec::with_capacity(count),
        };
        for index in 0..count {
            // The caller bounds the count by KVM's vCPU limit, below 256.
            let index = u8::try_from(index).unwrap_or(u8::MAX);
            let (start, wait) = sync_channel(1);
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{index}"))
                .spawn(move || thread_main(&wait))
                .map_err(|source| VcpuError::Spawn { index, source })?;
            threads.starts.push(start);
            threads.handles.push(handle);
        }
        Ok(threads)
    }

    /// How many threads there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Hands each thread its vCPU (`vcpus[i]` to thread `i`); they run it
    /// as `coordinator` says. Returns the threads to join at the VM's end.
    /// On an error the threads already handed a vCPU are still running:
    /// the caller ends the VM through `coordinator` and joins them.
    pub fn start(
        self,
        vcpus: Vec<Vcpu>,
        coordinator: &Arc<Coordinator>,
    ) -> Result<Vec<JoinHandle<()>>, (VcpuError, Started)> {
        if vcpus.len() != self.handles.len() {
            let index = u8::try_from(vcpus.len().min(self.handles.len())).unwrap_or(u8::MAX);
            return Err((VcpuError::Thread { index }, Vec::new()));
        }
        let mut started = Vec::with_capacity(vcpus.len());
        let mut handles = self.handles.into_iter();
        for (vcpu, start) in vcpus.into_iter().zip(&self.starts) {
            let index = vcpu.index();
            let sent = start.send(Start {
                vcpu,
                coordinator: coordinator.clone(),
            });
            if let Some(h) = handles.next() {
                started.push(h);
            }
            if sent.is_err() {
                // Threads not handed a vCPU end when `self.starts` drops.
                return Err((VcpuError::Thread { index }, started));
            }
        }
        Ok(started)
    }
}

/// A vCPU thread: the signal mask the vmm's threads have, the filter, then
/// the vCPU's run loop once it comes.
fn thread_main(wait: &Receiver<Start>) {
    // The same mask as a thread spawned by the main thread after it blocked
    // the termination signals (a standby vmm spawns these before that).
    if let Err(e) = crate::signals::block_termination_signals() {
        tracing::error!("a vCPU thread cannot block termination signals: {e}");
    }
    seccomp::apply_or_die(ThreadKind::Vcpu);
    if let Ok(Start { vcpu, coordinator }) = wait.recv() {
        vcpu.run_loop(&coordinator);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_never_handed_a_vcpu_end_when_their_starts_go() {
        let threads = VcpuThreads::spawn(3).unwrap();
        assert_eq!(threads.len(), 3);
        let VcpuThreads { starts, handles } = threads;
        assert!(handles.iter().all(|h| !h.is_finished()), "they wait");
        let names: Vec<_> = handles
            .iter()
            .map(|h| h.thread().name().unwrap_or_default().to_string())
            .collect();
        assert_eq!(names, ["vcpu0", "vcpu1", "vcpu2"]);
        drop(starts);
        // Joining returns only because each thread saw its start dropped.
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn vcpus_that_do_not_pair_with_the_threads_are_refused() {
        let threads = VcpuThreads::spawn(2).unwrap();
        let coordinator = Arc::new(Coordinator::new(2));
        let Err((e, started)) = threads.start(Vec::new(), &coordinator) else {
            panic!("two threads and no vCPUs started");
        };
        assert!(matches!(e, VcpuError::Thread { index: 0 }), "{e}");
        assert!(started.is_empty());
    }
}
