//! The system calls each kind of vmm thread may make. The lists come from
//! tracing every thread through boot, control requests, snapshots and both
//! restore backends (see the README's seccomp section); thread start-up calls
//! made before a filter is installed (stack mapping, naming) are not listed.

use super::bpf::{self, AllowList, ArgCheck};

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

/// `_IOC(dir, type, nr, size)` of the kernel's ioctl.h.
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const NONE: u64 = 0;
const WRITE: u64 = 1;
const READ: u64 = 2;
const fn io(ty: u64, nr: u64) -> u64 {
    ioc(NONE, ty, nr, 0)
}
const fn ior<T>(ty: u64, nr: u64) -> u64 {
    ioc(READ, ty, nr, std::mem::size_of::<T>())
}
const fn iow<T>(ty: u64, nr: u64) -> u64 {
    ioc(WRITE, ty, nr, std::mem::size_of::<T>())
}
const fn iowr<T>(ty: u64, nr: u64) -> u64 {
    ioc(READ | WRITE, ty, nr, std::mem::size_of::<T>())
}

/// KVM's ioctl type byte (`KVMIO`).
const KVMIO: u64 = 0xae;
/// userfaultfd's ioctl type byte.
const UFFDIO: u64 = 0xaa;

/// KVM_CREATE_VM: never made after setup (the selftest's forbidden ioctl).
pub(super) const KVM_CREATE_VM: u64 = kvm::CREATE_VM;

mod kvm {
    use super::{io, ior, iow, iowr, KVMIO};
    use kvm_bindings::{
        kvm_clock_data, kvm_coalesced_mmio_zone, kvm_cpuid2, kvm_debugregs, kvm_dirty_log, kvm_fpu,
        kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_list, kvm_msrs, kvm_pit_state2,
        kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    };

    /// KVM_RUN.
    pub const RUN: u64 = io(KVMIO, 0x80);
    /// KVM_CREATE_VM: never after setup (the selftest's forbidden ioctl).
    pub const CREATE_VM: u64 = io(KVMIO, 0x01);
    /// KVM_UNREGISTER_COALESCED_MMIO: a vCPU handling the guest's UART
    /// interrupt-enable write takes the console's data port out of the ring.
    pub const UNREGISTER_COALESCED: u64 = iow::<kvm_coalesced_mmio_zone>(KVMIO, 0x68);

    /// /dev/kvm requests a snapshot makes (the MSR list to save, capabilities).
    pub const SYSTEM: &[u64] = &[
        io(KVMIO, 0x03),                   // KVM_CHECK_EXTENSION
        iowr::<kvm_msr_list>(KVMIO, 0x02), // KVM_GET_MSR_INDEX_LIST
        iowr::<kvm_msr_list>(KVMIO, 0x0a), // KVM_GET_MSR_FEATURE_INDEX_LIST
        iowr::<kvm_cpuid2>(KVMIO, 0x05),   // KVM_GET_SUPPORTED_CPUID
    ];

    /// VM requests after setup: snapshots (clock, interrupt controllers,
    /// timer, dirty pages) and restores into a running VM.
    pub const VM: &[u64] = &[
        iow::<kvm_dirty_log>(KVMIO, 0x42),           // KVM_GET_DIRTY_LOG
        iowr::<kvm_irqchip>(KVMIO, 0x62),            // KVM_GET_IRQCHIP
        ior::<kvm_irqchip>(KVMIO, 0x63),             // KVM_SET_IRQCHIP
        iow::<kvm_clock_data>(KVMIO, 0x7b),          // KVM_SET_CLOCK
        ior::<kvm_clock_data>(KVMIO, 0x7c),          // KVM_GET_CLOCK
        ior::<kvm_pit_state2>(KVMIO, 0x9f),          // KVM_GET_PIT2
        iow::<kvm_pit_state2>(KVMIO, 0xa0),          // KVM_SET_PIT2
        iow::<kvm_coalesced_mmio_zone>(KVMIO, 0x67), // KVM_REGISTER_COALESCED_MMIO
        UNREGISTER_COALESCED,
    ];

    /// vCPU requests: running, and saving or loading a vCPU's state.
    pub const VCPU: &[u64] = &[
        RUN,
        ior::<kvm_regs>(KVMIO, 0x81),        // KVM_GET_REGS
        iow::<kvm_regs>(KVMIO, 0x82),        // KVM_SET_REGS
        ior::<kvm_sregs>(KVMIO, 0x83),       // KVM_GET_SREGS
        iow::<kvm_sregs>(KVMIO, 0x84),       // KVM_SET_SREGS
        iowr::<kvm_msrs>(KVMIO, 0x88),       // KVM_GET_MSRS
        iow::<kvm_msrs>(KVMIO, 0x89),        // KVM_SET_MSRS
        ior::<kvm_fpu>(KVMIO, 0x8c),         // KVM_GET_FPU
        iow::<kvm_fpu>(KVMIO, 0x8d),         // KVM_SET_FPU
        ior::<kvm_lapic_state>(KVMIO, 0x8e), // KVM_GET_LAPIC
        iow::<kvm_lapic_state>(KVMIO, 0x8f), // KVM_SET_LAPIC
        iow::<kvm_cpuid2>(KVMIO, 0x90),      // KVM_SET_CPUID2
        iowr::<kvm_cpuid2>(KVMIO, 0x91),     // KVM_GET_CPUID2
        ior::<kvm_mp_state>(KVMIO, 0x98),    // KVM_GET_MP_STATE
        iow::<kvm_mp_state>(KVMIO, 0x99),    // KVM_SET_MP_STATE
        ior::<kvm_vcpu_events>(KVMIO, 0x9f), // KVM_GET_VCPU_EVENTS
        iow::<kvm_vcpu_events>(KVMIO, 0xa0), // KVM_SET_VCPU_EVENTS
        ior::<kvm_debugregs>(KVMIO, 0xa1),   // KVM_GET_DEBUGREGS
        iow::<kvm_debugregs>(KVMIO, 0xa2),   // KVM_SET_DEBUGREGS
        io(KVMIO, 0xa2),                     // KVM_SET_TSC_KHZ
        io(KVMIO, 0xa3),                     // KVM_GET_TSC_KHZ
        ior::<kvm_xsave>(KVMIO, 0xa4),       // KVM_GET_XSAVE
        iow::<kvm_xsave>(KVMIO, 0xa5),       // KVM_SET_XSAVE
        ior::<kvm_xcrs>(KVMIO, 0xa6),        // KVM_GET_XCRS
        iow::<kvm_xcrs>(KVMIO, 0xa7),        // KVM_SET_XCRS
        io(KVMIO, 0xad),                     // KVM_KVMCLOCK_CTRL
    ];
}

/// userfaultfd requests: serving faults of a uffd restore.
const UFFD: &[u64] = &[
    iowr::<[u64; 3]>(UFFDIO, 0x3f), // UFFDIO_API
    iowr::<[u64; 4]>(UFFDIO, 0x00), // UFFDIO_REGISTER
    ior::<[u64; 2]>(UFFDIO, 0x01),  // UFFDIO_UNREGISTER
    ior::<[u64; 2]>(UFFDIO, 0x02),  // UFFDIO_WAKE
    iowr::<[u64; 5]>(UFFDIO, 0x03), // UFFDIO_COPY
    iowr::<[u64; 4]>(UFFDIO, 0x04), // UFFDIO_ZEROPAGE
];

/// Terminal requests of the serial console on a terminal (raw mode and back).
const TERMINAL: &[u64] = &[
    0x5401, // TCGETS
    0x5402, // TCSETS
    0x5403, // TCSETSW
    0x5404, // TCSETSF
    0x5413, // TIOCGWINSZ
];

/// tun requests a tap back end makes after setup.
const TUN: &[u64] = &[
    0x400454ca, // TUNSETIFF
    0x800454d2, // TUNGETIFF
    0x400454d0, // TUNSETOFFLOAD
    0x400454d8, // TUNSETVNETHDRSZ
];

/// Descriptor requests the standard library makes (non-blocking, close-on-exec).
const FILE_FLAGS: &[u64] = &[
    0x5421, // FIONBIO
    0x5451, // FIOCLEX
];

/// The thread-creation flags of glibc's pthread_create (and so of Rust's
/// threads): CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD
/// | CLONE_SYSVSEM | CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID.
pub(super) const THREAD_CLONE_FLAGS: u64 = 0x3d0f00;
/// musl's (the node's static vmm): the same and CLONE_DETACHED, which the
/// kernel ignores.
pub(super) const MUSL_THREAD_CLONE_FLAGS: u64 = THREAD_CLONE_FLAGS | 0x40_0000;

/// prctl options used once filters are on: naming a new thread, and the two
/// steps of installing a thread's own filter (no-new-privs is set by
/// seccompiler; the filter itself goes through seccomp(2)).
const PRCTL_OPTIONS: &[u64] = &[libc::PR_SET_NAME as u64, libc::PR_SET_NO_NEW_PRIVS as u64];

/// fcntl commands: descriptor and status flags, close-on-exec duplicates.
const FCNTL_COMMANDS: &[u64] = &[
    libc::F_GETFD as u64,
    libc::F_SETFD as u64,
    libc::F_GETFL as u64,
    libc::F_SETFL as u64,
    libc::F_DUPFD_CLOEXEC as u64,
];

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
    // musl's pthread_kill (the kick of a vCPU thread).
    libc::SYS_tkill,
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
    // Starting write-back of a snapshot's memory file while it is written.
    libc::SYS_sync_file_range,
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
    // musl (the node's static vmm) calls these where glibc calls openat,
    // newfstatat and statx.
    libc::SYS_open,
    libc::SYS_stat,
    libc::SYS_lstat,
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

/// vhost-user requests (virtio-fs): messages with descriptors, and the pipe
/// a backend's state moves through for a snapshot or restore.
const VHOST_USER: &[i64] = &[
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_pipe2,
    libc::SYS_read,
    libc::SYS_write,
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

/// Argument `arg`'s low 32 bits (an `int` or `unsigned int`) equal one of `values`.
fn dword_in(arg: u8, values: &[u64]) -> ArgCheck {
    ArgCheck::OneOf {
        arg,
        qword: false,
        values: values.to_vec(),
    }
}

/// The allow list of `kind`: `ArgCheck::Any` allows the call with any
/// arguments; the calls below are allowed only with the arguments the vmm
/// uses (any other value raises SIGSYS like an unlisted call).
pub fn rules(kind: ThreadKind) -> AllowList {
    let mut map = AllowList::new();
    let mut allow = |calls: &[i64]| {
        for c in calls {
            map.entry(*c).or_insert(ArgCheck::Any);
        }
    };
    allow(COMMON);
    let mut ioctls: Vec<u64> = FILE_FLAGS.to_vec();
    ioctls.extend(kvm::SYSTEM);
    match kind {
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
            // A driver starting or resetting a virtio-fs device: the vhost-user
            // requests to its backend (file descriptors travel with sendmsg).
            allow(VHOST_USER);
            ioctls.extend(kvm::VCPU);
            ioctls.push(kvm::UNREGISTER_COALESCED);
        }
        ThreadKind::Main => {
            allow(FILES);
            allow(EVENTS);
            allow(SPAWN);
            ioctls.extend(kvm::VM);
            ioctls.extend(kvm::VCPU);
            ioctls.extend(TERMINAL);
        }
        ThreadKind::Control => {
            allow(FILES);
            allow(SOCKETS);
            allow(VHOST_USER);
            allow(SPAWN);
            allow(EVENTS);
            ioctls.extend(kvm::VM);
            ioctls.extend(kvm::VCPU);
        }
        ThreadKind::Device => {
            allow(FILES);
            allow(SOCKETS);
            allow(VHOST_USER);
            allow(EVENTS);
            allow(SPAWN);
            ioctls.extend(kvm::VM);
            ioctls.extend(UFFD);
            ioctls.extend(TERMINAL);
            ioctls.extend(TUN);
        }
    };
    ioctls.sort_unstable();
    ioctls.dedup();
    map.insert(libc::SYS_ioctl, dword_in(1, &ioctls));
    // Guest memory and allocations are never executable.
    let no_exec = ArgCheck::Lacks {
        arg: 2,
        mask: libc::PROT_EXEC as u64,
    };
    map.insert(libc::SYS_mmap, no_exec.clone());
    map.insert(libc::SYS_mprotect, no_exec);
    let mut restrict = |call: i64, check: ArgCheck| {
        if let Some(entry) = map.get_mut(&call) {
            *entry = check;
        }
    };
    // Only Unix sockets: the control socket and the vsock back end.
    restrict(libc::SYS_socket, dword_in(0, &[libc::AF_UNIX as u64]));
    // Threads only, never a new process.
    restrict(
        libc::SYS_clone,
        ArgCheck::OneOf {
            arg: 0,
            qword: true,
            values: vec![THREAD_CLONE_FLAGS, MUSL_THREAD_CLONE_FLAGS],
        },
    );
    restrict(libc::SYS_prctl, dword_in(0, PRCTL_OPTIONS));
    restrict(libc::SYS_fcntl, dword_in(1, FCNTL_COMMANDS));
    map
}

/// The second filter every thread gets: clone3 fails with ENOSYS. Its flags
/// are in memory, out of a filter's reach, so it cannot be checked like clone;
/// glibc then falls back to clone, whose flags the main filter checks. (The
/// main filter of a thread kind that starts threads lets clone3 through to
/// this one; seccomp takes the stricter answer of the two.)
pub fn clone3_rules() -> AllowList {
    AllowList::from([(libc::SYS_clone3, ArgCheck::Any)])
}

/// The BPF program of `kind`: its allow list, anything else raises SIGSYS.
/// Compiled by the build script (`build.rs`), which embeds the result.
pub fn program(kind: ThreadKind) -> Result<Vec<seccompiler::sock_filter>, String> {
    bpf::compile(&rules(kind), bpf::RET_ALLOW, bpf::RET_TRAP).map_err(|e| e.to_string())
}

/// The BPF program every thread inherits from the main thread: clone3 fails
/// with ENOSYS (so glibc falls back to clone, whose flags the kinds check),
/// everything else passes on to the thread's own filter.
pub fn clone3_program() -> Result<Vec<seccompiler::sock_filter>, String> {
    bpf::compile(
        &clone3_rules(),
        bpf::RET_ERRNO | libc::ENOSYS as u32,
        bpf::RET_ALLOW,
    )
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // Values from <linux/kvm.h> on x86_64.
        assert_eq!(kvm::RUN, 0xae80);
        assert_eq!(kvm::CREATE_VM, 0xae01);
        assert!(kvm::VCPU.contains(&0x8090_ae81)); // KVM_GET_REGS
        assert!(kvm::VCPU.contains(&0x4138_ae84)); // KVM_SET_SREGS
        assert!(kvm::VM.contains(&0x4010_ae42)); // KVM_GET_DIRTY_LOG
        assert!(UFFD.contains(&0xc028_aa03)); // UFFDIO_COPY
    }

    /// The same list compiled by seccompiler, the reference for the verdicts.
    fn reference(list: &AllowList, matched: u32, mismatch: u32) -> Vec<seccompiler::sock_filter> {
        use seccompiler::{
            SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
            SeccompRule, TargetArch,
        };
        let action = |ret: u32| match ret {
            bpf::RET_ALLOW => SeccompAction::Allow,
            bpf::RET_TRAP => SeccompAction::Trap,
            e => SeccompAction::Errno(e & 0xffff),
        };
        let rule = |arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, v: u64| {
            SeccompRule::new(vec![SeccompCondition::new(arg, len, op, v).unwrap()]).unwrap()
        };
        let rules = list
            .iter()
            .map(|(nr, check)| {
                let rules = match check {
                    ArgCheck::Any => Vec::new(),
                    ArgCheck::OneOf { arg, qword, values } => values
                        .iter()
                        .map(|v| {
                            let len = if *qword {
                                SeccompCmpArgLen::Qword
                            } else {
                                SeccompCmpArgLen::Dword
                            };
                            rule(*arg, len, SeccompCmpOp::Eq, *v)
                        })
                        .collect(),
                    ArgCheck::Lacks { arg, mask } => vec![rule(
                        *arg,
                        SeccompCmpArgLen::Qword,
                        SeccompCmpOp::MaskedEq(*mask),
                        0,
                    )],
                };
                (*nr, rules)
            })
            .collect();
        let filter =
            SeccompFilter::new(rules, action(mismatch), action(matched), TargetArch::x86_64)
                .unwrap();
        seccompiler::BpfProgram::try_from(filter).unwrap()
    }

    /// Argument values around `v`: itself, its neighbours, other high halves.
    fn around(v: u64) -> [u64; 6] {
        [
            v,
            v.wrapping_add(1),
            v.wrapping_sub(1),
            v | 1 << 32,
            v | 0xffff_ffff_0000_0000,
            v & 0xffff_ffff,
        ]
    }

    /// Compares the verdicts of `ours` and `theirs` over every system call
    /// number (and x32's), and, for each listed call, over the values around
    /// every allowed value and mask bit in each argument.
    fn same_verdicts(
        list: &AllowList,
        ours: &[seccompiler::sock_filter],
        theirs: &[seccompiler::sock_filter],
    ) -> usize {
        use bpf::interpreter::{run, Data};
        let mut values: Vec<u64> = vec![0, 1, 7, u64::MAX, 1 << 40];
        for check in list.values() {
            match check {
                ArgCheck::Any => {}
                ArgCheck::OneOf { values: vs, .. } => {
                    vs.iter().for_each(|v| values.extend(around(*v)))
                }
                ArgCheck::Lacks { mask, .. } => values.extend(around(*mask)),
            }
        }
        values.sort_unstable();
        values.dedup();
        let mut cases = 0;
        let mut compare = |data: Data| {
            assert_eq!(run(ours, &data), run(theirs, &data), "{data:?}");
            cases += 1;
        };
        for nr in (0..600u32).chain((0..600).map(|n| n | 0x4000_0000)) {
            let mut data = Data {
                nr,
                arch: bpf::AUDIT_ARCH_X86_64,
                args: [0; 6],
            };
            compare(data);
            if !list.contains_key(&i64::from(nr)) {
                continue;
            }
            for arg in 0..6 {
                for v in &values {
                    data.args = [0; 6];
                    data.args[arg] = *v;
                    compare(data);
                }
            }
        }
        compare(Data {
            nr: 0,
            arch: 0x4000_0003,
            args: [0; 6],
        });
        cases
    }

    #[test]
    fn the_compact_programs_answer_as_seccompiler_would() {
        for kind in ThreadKind::ALL {
            let list = rules(kind);
            let ours = program(kind).unwrap();
            let theirs = reference(&list, bpf::RET_ALLOW, bpf::RET_TRAP);
            let cases = same_verdicts(&list, &ours, &theirs);
            println!(
                "{}: {} instructions (seccompiler: {}), {cases} inputs compared",
                kind.name(),
                ours.len(),
                theirs.len()
            );
            assert!(ours.len() < theirs.len(), "{kind:?}");
        }
        let list = clone3_rules();
        let errno = bpf::RET_ERRNO | libc::ENOSYS as u32;
        let theirs = reference(&list, errno, bpf::RET_ALLOW);
        same_verdicts(&list, &clone3_program().unwrap(), &theirs);
    }
}
