//! The system calls each kind of vmm thread may make. The lists come from
//! tracing every thread through boot, control requests, snapshots and both
//! restore backends (see the README's seccomp section); thread start-up calls
//! made before a filter is installed (stack mapping, naming) are not listed.

use std::collections::BTreeMap;

use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

/// The kinds of threads in a vmm process, each with its own filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThreadKind {
    /// The main thread once the VM runs: waits for the end, then tears down.
    Main,
    /// A vCPU thread: KVM_RUN and the device exits it dispatches.
    Vcpu,
    /// The control socket: accepts clients and serves requests, snapshots included.
    Control,
    /// Device event loops and helpers (serial input, signals, userfaultfd, virtio).
    Device,
}

impl ThreadKind {
    /// Every kind.
    pub const ALL: [ThreadKind; 4] = [
        ThreadKind::Main,
        ThreadKind::Vcpu,
        ThreadKind::Control,
        ThreadKind::Device,
    ];

    /// Name used in messages.
    pub fn name(&self) -> &'static str {
        match self {
            ThreadKind::Main => "main",
            ThreadKind::Vcpu => "vCPU",
            ThreadKind::Control => "control",
            ThreadKind::Device => "device",
        }
    }

    /// Parses a kind name (for `--seccomp-selftest`).
    pub fn from_name(name: &str) -> Option<ThreadKind> {
        match name {
            "main" => Some(ThreadKind::Main),
            "vcpu" => Some(ThreadKind::Vcpu),
            "control" => Some(ThreadKind::Control),
            "device" => Some(ThreadKind::Device),
            _ => None,
        }
    }
}

/// KVM's ioctl type byte (`KVMIO`).
const KVMIO: u64 = 0xae;
/// userfaultfd's ioctl type byte.
const UFFDIO: u64 = 0xaa;
/// KVM_RUN = _IO(KVMIO, 0x80).
const KVM_RUN: u64 = 0xae80;

/// Calls every thread needs: memory management by the allocator, locks,
/// signals, thread exit, logging to stderr, closing files and kicking vCPUs.
const COMMON: &[i64] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_getrandom,
    libc::SYS_rseq,
];

/// Calls that create threads (the control socket spawns one per client, device
/// setup may start event loops).
const SPAWN: &[i64] = &[
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_prctl,
    libc::SYS_sched_getaffinity,
];

/// File-system work of snapshots: create, write, sync, rename, clean up.
const FILES: &[i64] = &[
    libc::SYS_openat,
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_getdents64,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_fcntl,
    libc::SYS_getcwd,
];

/// Sockets: the control socket and device back ends (vsock, tap).
const SOCKETS: &[i64] = &[
    libc::SYS_socket,
    libc::SYS_accept4,
    libc::SYS_accept,
    libc::SYS_connect,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_read,
    libc::SYS_readv,
];

/// Event loops: epoll and eventfds.
const EVENTS: &[i64] = &[
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
    // The vsock device's reset-hold timer is armed from the control thread
    // (a paused restore's first resume) and cleared on the event thread.
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_rt_sigtimedwait,
];

fn ioctl_type_is(ty: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(0xff00),
        ty << 8,
    )?])
}

fn ioctl_is(request: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        request,
    )?])
}

/// The rule map seccompiler compiles for `kind`: an empty rule list allows the call
/// with any arguments; ioctl is limited by request number or type.
pub fn rules(
    kind: ThreadKind,
) -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let mut allow = |calls: &[i64]| {
        for c in calls {
            map.entry(*c).or_default();
        }
    };
    allow(COMMON);
    let ioctls = match kind {
        ThreadKind::Vcpu => {
            // MMIO exits reach virtio devices, which may signal eventfds and queue work.
            allow(EVENTS);
            allow(&[
                libc::SYS_read,
                libc::SYS_pread64,
                libc::SYS_pwrite64,
                libc::SYS_fsync,
                libc::SYS_fdatasync,
            ]);
            vec![ioctl_is(KVM_RUN)?, ioctl_type_is(KVMIO)?]
        }
        ThreadKind::Main => {
            allow(FILES);
            allow(EVENTS);
            allow(SPAWN);
            vec![ioctl_type_is(KVMIO)?]
        }
        ThreadKind::Control => {
            allow(FILES);
            allow(SOCKETS);
            allow(SPAWN);
            allow(EVENTS);
            vec![ioctl_type_is(KVMIO)?]
        }
        ThreadKind::Device => {
            allow(FILES);
            allow(SOCKETS);
            allow(EVENTS);
            allow(SPAWN);
            vec![
                ioctl_type_is(UFFDIO)?,
                ioctl_type_is(KVMIO)?,
                ioctl_type_is(b'T' as u64)?,
            ]
        }
    };
    map.insert(libc::SYS_ioctl, ioctls);
    Ok(map)
}
