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

fn push(buf: &mut [u8; 160], len: &mut usize, bytes: &[u8]) {
    for b in bytes {
        if *len < buf.len() {
            buf[*len] = *b;
            *len += 1;
        }
    }
}

fn push_decimal(buf: &mut [u8; 160], len: &mut usize, mut n: u64) {
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

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
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
    let mut buf = [0u8; 160];
    let mut len = 0;
    push(&mut buf, &mut len, b"vmm: seccomp: a ");
    push(&mut buf, &mut len, kind.as_bytes());
    push(&mut buf, &mut len, b" thread made forbidden system call ");
    push_decimal(&mut buf, &mut len, syscall.max(0) as u64);
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

/// Makes a system call no filter allows (the `--seccomp-selftest` hook).
pub(super) fn forbidden_call() {
    // SAFETY: getppid has no arguments and no side effects; it is simply not on any list.
    unsafe { libc::syscall(libc::SYS_getppid) };
}
