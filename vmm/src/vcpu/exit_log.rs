//! The last exits of one vCPU, for its crash report: a fixed ring its run
//! loop writes after every KVM_RUN (no allocation, no lock: the log belongs
//! to the vCPU's thread), and the number of exits since the vmm last wrote
//! the vCPU's state. A triple fault right after a restore (count 0) points
//! at the state the vmm wrote; one after thousands of exits at the guest.

use std::fmt;

use kvm_ioctls::VcpuExit;

/// How many exits a log keeps.
pub const KEPT: usize = 8;

/// One return from KVM_RUN, compact: the exit's kind and, where it has
/// one, the port, address, event type, hardware reason or errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// A port read (KVM_EXIT_IO in), at this port.
    IoIn(u16),
    /// A port write (KVM_EXIT_IO out), at this port.
    IoOut(u16),
    /// An MMIO read, at this guest physical address.
    MmioRead(u64),
    /// An MMIO write, at this guest physical address.
    MmioWrite(u64),
    /// KVM_EXIT_HLT.
    Hlt,
    /// KVM_EXIT_SHUTDOWN (a triple fault).
    Shutdown,
    /// KVM_EXIT_SYSTEM_EVENT, of this type.
    SystemEvent(u32),
    /// KVM_EXIT_INTERNAL_ERROR.
    InternalError,
    /// KVM_EXIT_FAIL_ENTRY, with this hardware reason.
    FailEntry(u64),
    /// KVM_RUN was interrupted (EINTR, EAGAIN, KVM_EXIT_INTR): a kick, a
    /// pause, or the end of an I/O completion.
    Interrupted,
    /// Any other exit KVM reported.
    Other,
    /// KVM_RUN failed with this errno.
    RunFailed(i32),
}

impl Exit {
    /// The compact form of what KVM_RUN returned.
    pub fn of(ran: &Result<VcpuExit<'_>, kvm_ioctls::Error>) -> Exit {
        match ran {
            Ok(VcpuExit::IoIn(port, _)) => Exit::IoIn(*port),
            Ok(VcpuExit::IoOut(port, _)) => Exit::IoOut(*port),
            Ok(VcpuExit::MmioRead(addr, _)) => Exit::MmioRead(*addr),
            Ok(VcpuExit::MmioWrite(addr, _)) => Exit::MmioWrite(*addr),
            Ok(VcpuExit::Hlt) => Exit::Hlt,
            Ok(VcpuExit::Shutdown) => Exit::Shutdown,
            Ok(VcpuExit::SystemEvent(kind, _)) => Exit::SystemEvent(*kind),
            Ok(VcpuExit::InternalError) => Exit::InternalError,
            Ok(VcpuExit::FailEntry(reason, _)) => Exit::FailEntry(*reason),
            Ok(VcpuExit::Intr) => Exit::Interrupted,
            Ok(_) => Exit::Other,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Exit::Interrupted,
            Err(e) => Exit::RunFailed(e.errno()),
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::IoIn(port) => write!(f, "io_in {port:#x}"),
            Exit::IoOut(port) => write!(f, "io_out {port:#x}"),
            Exit::MmioRead(addr) => write!(f, "mmio_read {addr:#x}"),
            Exit::MmioWrite(addr) => write!(f, "mmio_write {addr:#x}"),
            Exit::Hlt => f.write_str("hlt"),
            Exit::Shutdown => f.write_str("shutdown"),
            Exit::SystemEvent(kind) => write!(f, "system_event {kind}"),
            Exit::InternalError => f.write_str("internal_error"),
            Exit::FailEntry(reason) => write!(f, "fail_entry {reason:#x}"),
            Exit::Interrupted => f.write_str("interrupted"),
            Exit::Other => f.write_str("other"),
            Exit::RunFailed(errno) => write!(f, "run_failed errno {errno}"),
        }
    }
}

/// The last [`KEPT`] exits of a vCPU and how many it made in all since the
/// vmm last wrote its state.
///
/// The vmm writes a vCPU's state (`Vcpu::configure` at boot,
/// `persist::restore` at a restore) only before handing the vCPU to its
/// thread, so the run loop starts a new log when it starts; code that ever
/// writes the state of a vCPU whose loop is running must start a new one.
#[derive(Debug, Clone)]
pub struct ExitLog {
    /// Exit `i` (counting from 0) is at `last[i % KEPT]`.
    last: [Exit; KEPT],
    /// Exits recorded. Wraps only after 2^64 of them (centuries at any
    /// exit rate), and `KEPT` divides 2^64, so the ring stays in order.
    count: u64,
}

impl Default for ExitLog {
    fn default() -> Self {
        Self::new()
    }
}

impl ExitLog {
    /// An empty log, for a vCPU whose state the vmm has just written.
    pub const fn new() -> Self {
        ExitLog {
            last: [Exit::Other; KEPT],
            count: 0,
        }
    }

    /// Records one exit, forgetting the oldest kept once [`KEPT`] are.
    pub fn record(&mut self, exit: Exit) {
        self.last[slot(self.count)] = exit;
        self.count = self.count.wrapping_add(1);
    }

    /// How many exits were recorded since the log started.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The kept exits, oldest first.
    pub fn recent(&self) -> impl Iterator<Item = Exit> + '_ {
        let kept = self.count.min(KEPT as u64);
        (self.count - kept..self.count).map(|i| self.last[slot(i)])
    }
}

/// Where exit number `i` lives in the ring.
fn slot(i: u64) -> usize {
    // The remainder is below KEPT, so it fits a usize.
    (i % KEPT as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recent(log: &ExitLog) -> Vec<Exit> {
        log.recent().collect()
    }

    #[test]
    fn a_new_log_is_empty() {
        let log = ExitLog::new();
        assert_eq!(log.count(), 0);
        assert!(recent(&log).is_empty());
    }

    #[test]
    fn the_log_keeps_exits_in_order_until_it_is_full() {
        let mut log = ExitLog::new();
        log.record(Exit::IoOut(0x3f8));
        log.record(Exit::MmioWrite(0xd000_0000));
        log.record(Exit::Hlt);
        assert_eq!(log.count(), 3);
        assert_eq!(
            recent(&log),
            [Exit::IoOut(0x3f8), Exit::MmioWrite(0xd000_0000), Exit::Hlt]
        );
    }

    #[test]
    fn a_full_log_wraps_keeping_the_last_exits_oldest_first() {
        let mut log = ExitLog::new();
        let total = 3 * KEPT as u16 + 3;
        for port in 0..total {
            log.record(Exit::IoIn(port));
        }
        assert_eq!(log.count(), u64::from(total));
        let expected: Vec<Exit> = (total - KEPT as u16..total).map(Exit::IoIn).collect();
        assert_eq!(recent(&log), expected);
        // Exactly full: all of them, in order.
        let mut log = ExitLog::new();
        for port in 0..KEPT as u16 {
            log.record(Exit::IoIn(port));
        }
        let expected: Vec<Exit> = (0..KEPT as u16).map(Exit::IoIn).collect();
        assert_eq!(recent(&log), expected);
    }

    #[test]
    fn kvm_run_results_become_compact_exits() {
        let mut data = [0u8; 4];
        assert_eq!(
            Exit::of(&Ok(VcpuExit::IoIn(0x3fd, &mut data))),
            Exit::IoIn(0x3fd)
        );
        assert_eq!(
            Exit::of(&Ok(VcpuExit::MmioWrite(0xd000_0000, &data))),
            Exit::MmioWrite(0xd000_0000)
        );
        assert_eq!(Exit::of(&Ok(VcpuExit::Shutdown)), Exit::Shutdown);
        assert_eq!(Exit::of(&Ok(VcpuExit::Intr)), Exit::Interrupted);
        let eintr = kvm_ioctls::Error::new(libc::EINTR);
        assert_eq!(Exit::of(&Err(eintr)), Exit::Interrupted);
        let efault = kvm_ioctls::Error::new(libc::EFAULT);
        assert_eq!(Exit::of(&Err(efault)), Exit::RunFailed(libc::EFAULT));
    }

    #[test]
    fn exits_are_named_with_their_port_or_address() {
        let names: Vec<String> = [
            Exit::IoOut(0x3f8),
            Exit::IoIn(0x3fd),
            Exit::MmioWrite(0xd000_0000),
            Exit::MmioRead(0xfec0_0000),
            Exit::Hlt,
            Exit::Interrupted,
            Exit::FailEntry(0x21),
        ]
        .iter()
        .map(Exit::to_string)
        .collect();
        assert_eq!(
            names,
            [
                "io_out 0x3f8",
                "io_in 0x3fd",
                "mmio_write 0xd0000000",
                "mmio_read 0xfec00000",
                "hlt",
                "interrupted",
                "fail_entry 0x21",
            ]
        );
    }
}
