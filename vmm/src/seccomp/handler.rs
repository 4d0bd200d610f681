//! The SIGSYS handler: reports which thread kind made which forbidden call,
//! then ends the process. Only async-signal-safe work happens here: a
//! const-initialised thread-local read, a stack buffer, write(2) and _exit(2).

use std::cell::Cell;

use vmm_sys_util::signal::register_signal_handler;

use super::rules::ThreadKind;
use crate::exit::EXIT_VM_FAILURE;

thread_local! {
    static KIND: Cell<&'static str> = const { Cell::new("unfiltered") };
}

/// Records the calling thread's kind for the handler's message.
pub(super) fn set_thread_kind(kind: ThreadKind) {
    KIND.with(|k| k.set(kind.name()));
}

/// Offset of `si_syscall` in x86_64 `siginfo_t` (after si_signo, si_errno,
/// si_code, padding and the `_call_addr` pointer of the SIGSYS union member).
const SI_SYSCALL_OFFSET: usize = 24;

/// Size of the handler's message buffer.
const MESSAGE: usize = 256;

fn push(buf: &mut [u8; MESSAGE], len: &mut usize, bytes: &[u8]) {
    for b in bytes {
        if *len < buf.len() {
            buf[*len] = *b;
            *len += 1;
        }
    }
}

fn push_decimal(buf: &mut [u8; MESSAGE], len: &mut usize, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    push(buf, len, &digits[i..]);
}

fn push_hex(buf: &mut [u8; MESSAGE], len: &mut usize, n: u64) {
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[(n & 0xf) as usize];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    push(buf, len, b"0x");
    push(buf, len, &digits[i..]);
}

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let syscall = if info.is_null() {
        -1
    } else {
        // SAFETY: the kernel passes a valid siginfo_t for SIGSYS; si_syscall is an int at
        // SI_SYSCALL_OFFSET inside it (x86_64 layout), read unaligned to be safe.
        unsafe {
            std::ptr::read_unaligned((info as *const u8).add(SI_SYSCALL_OFFSET) as *const i32)
        }
    };
    let kind = KIND.with(|k| k.get());
    let mut buf = [0u8; MESSAGE];
    let mut len = 0;
    push(&mut buf, &mut len, b"vmm: seccomp: a ");
    push(&mut buf, &mut len, kind.as_bytes());
    push(&mut buf, &mut len, b" thread made forbidden system call ");
    push_decimal(&mut buf, &mut len, syscall.max(0) as u64);
    if !context.is_null() {
        // SAFETY: for an SA_SIGINFO handler the kernel passes the interrupted
        // thread's ucontext_t; its general registers hold the call's arguments
        // (x86_64: rdi, rsi, rdx, r10).
        let regs = unsafe { (*(context as *const libc::ucontext_t)).uc_mcontext.gregs };
        push(&mut buf, &mut len, b" (arguments ");
        for (i, reg) in [libc::REG_RDI, libc::REG_RSI, libc::REG_RDX, libc::REG_R10]
            .into_iter()
            .enumerate()
        {
            if i > 0 {
                push(&mut buf, &mut len, b", ");
            }
            push_hex(&mut buf, &mut len, regs[reg as usize] as u64);
        }
        push(&mut buf, &mut len, b")");
    }
    push(&mut buf, &mut len, b"; ending the VM\n");
    // SAFETY: write(2) and _exit(2) are async-signal-safe; `buf[..len]` is initialised.
    unsafe {
        libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), len);
        libc::_exit(EXIT_VM_FAILURE);
    }
}

/// Installs the SIGSYS handler (process-wide).
pub(super) fn install() -> std::io::Result<()> {
    register_signal_handler(libc::SIGSYS, on_sigsys)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

/// The forbidden calls `--seccomp-selftest KIND[:CALL]` can make. Each is
/// harmless where a filter lets it through (it fails or changes nothing), so a
/// missing rule shows as a VM that keeps running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelftestCall {
    /// getppid: on no list.
    Getppid,
    /// socket(AF_INET, SOCK_STREAM): only Unix sockets are allowed.
    SocketInet,
    /// clone with process (not thread) flags; the flags given (CLONE_THREAD
    /// without CLONE_SIGHAND) are invalid, so the kernel refuses it if it gets there.
    CloneProcess,
    /// prctl(PR_GET_DUMPABLE): an option the vmm does not use.
    Prctl,
    /// ioctl(-1, KVM_CREATE_VM): a KVM request never made after setup.
    Ioctl,
    /// mprotect(NULL, 4096, PROT_READ | PROT_EXEC): executable memory.
    MprotectExec,
}

impl SelftestCall {
    /// Every call, with its name for `--seccomp-selftest KIND:NAME`.
    pub const ALL: [(&'static str, SelftestCall); 6] = [
        ("getppid", SelftestCall::Getppid),
        ("socket-inet", SelftestCall::SocketInet),
        ("clone-process", SelftestCall::CloneProcess),
        ("prctl", SelftestCall::Prctl),
        ("ioctl", SelftestCall::Ioctl),
        ("mprotect-exec", SelftestCall::MprotectExec),
    ];

    /// Parses a call name.
    pub fn from_name(name: &str) -> Option<SelftestCall> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
    }
}

/// Exit code of a selftest whose forbidden call was let through.
pub const SELFTEST_LET_THROUGH: i32 = 3;

/// Makes the forbidden call `call` (the `--seccomp-selftest` hook). If the
/// filter lets it through, says so and ends the process with
/// [`SELFTEST_LET_THROUGH`].
pub(super) fn forbidden_call(call: SelftestCall) {
    // SAFETY (every arm): plain system calls with constant arguments; each one
    // fails or changes nothing where it is allowed (see SelftestCall).
    unsafe {
        match call {
            SelftestCall::Getppid => libc::syscall(libc::SYS_getppid),
            SelftestCall::SocketInet => {
                libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0)
            }
            SelftestCall::CloneProcess => libc::syscall(
                libc::SYS_clone,
                libc::CLONE_THREAD as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            ),
            SelftestCall::Prctl => {
                libc::syscall(libc::SYS_prctl, libc::PR_GET_DUMPABLE, 0, 0, 0, 0)
            }
            SelftestCall::Ioctl => {
                libc::syscall(libc::SYS_ioctl, -1, super::rules::KVM_CREATE_VM, 0)
            }
            SelftestCall::MprotectExec => libc::syscall(
                libc::SYS_mprotect,
                0usize,
                4096usize,
                libc::PROT_READ | libc::PROT_EXEC,
            ),
        };
    }
    let name = SelftestCall::ALL
        .iter()
        .find(|(_, c)| *c == call)
        .map_or("?", |(n, _)| n);
    eprintln!("vmm: seccomp selftest: the forbidden call {name} was let through");
    // SAFETY: _exit ends the process at once, as the SIGSYS handler would have.
    unsafe { libc::_exit(SELFTEST_LET_THROUGH) };
}
