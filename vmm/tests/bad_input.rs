//! Bad CLI input gets a clear message and exit code 2, never a panic.

mod common;

use std::io::Write;

use common::*;

fn assert_bad_input(args: &[&str], expect: &str) {
    let out = run_vmm(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {err}");
    assert!(
        err.contains(expect),
        "args {args:?}: expected {expect:?} in {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn missing_kernel_file() {
    assert_bad_input(
        &["run", "--kernel", "/nonexistent/vmlinux"],
        "cannot read kernel /nonexistent/vmlinux: No such file or directory",
    );
}

#[test]
fn no_kernel_at_all() {
    assert_bad_input(&["run"], "no kernel given");
}

#[test]
fn a_file_that_is_not_a_kernel() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&[0x42u8; 4096]).unwrap();
    let path = f.path().to_str().unwrap().to_string();
    assert_bad_input(
        &["run", "--kernel", &path],
        "is not a kernel: it is neither an ELF vmlinux nor a bzImage",
    );
    let empty = tempfile::NamedTempFile::new().unwrap();
    assert_bad_input(
        &["run", "--kernel", empty.path().to_str().unwrap()],
        "is not a kernel",
    );
}

/// Writes a minimal ELF64 whose one PT_LOAD segment is `filesz` bytes at 1 MiB.
fn big_elf(filesz: u64) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    let mut h = Vec::new();
    h.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    h.extend_from_slice(&[0u8; 8]);
    h.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    h.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&0x10_0000u64.to_le_bytes()); // entry
    h.extend_from_slice(&64u64.to_le_bytes()); // phoff
    h.extend_from_slice(&0u64.to_le_bytes()); // shoff
    h.extend_from_slice(&0u32.to_le_bytes()); // flags
    h.extend_from_slice(&64u16.to_le_bytes()); // ehsize
    h.extend_from_slice(&56u16.to_le_bytes()); // phentsize
    h.extend_from_slice(&1u16.to_le_bytes()); // phnum
    h.extend_from_slice(&[0u8; 6]); // shentsize, shnum, shstrndx
    h.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    h.extend_from_slice(&7u32.to_le_bytes());
    h.extend_from_slice(&0x1000u64.to_le_bytes()); // offset
    h.extend_from_slice(&0x10_0000u64.to_le_bytes()); // vaddr
    h.extend_from_slice(&0x10_0000u64.to_le_bytes()); // paddr
    h.extend_from_slice(&filesz.to_le_bytes());
    h.extend_from_slice(&filesz.to_le_bytes());
    h.extend_from_slice(&0x1000u64.to_le_bytes());
    f.write_all(&h).unwrap();
    f.as_file().set_len(0x1000 + filesz).unwrap();
    f
}

#[test]
fn a_kernel_that_does_not_fit_in_memory() {
    let elf = big_elf(64 << 20);
    assert_bad_input(
        &[
            "run",
            "--kernel",
            elf.path().to_str().unwrap(),
            "--mem-mib",
            "16",
        ],
        "does not fit in guest memory of 16 MiB",
    );
}

#[test]
fn memory_sizes_out_of_range() {
    let g = guest("hello");
    let g = g.to_str().unwrap();
    assert_bad_input(
        &["run", "--kernel", g, "--mem-mib", "0"],
        "guest memory of 0 MiB is too small",
    );
    assert_bad_input(
        &["run", "--kernel", g, "--mem-mib", "100000000"],
        "is more than the host has",
    );
    assert_bad_input(
        &["run", "--kernel", g, "--mem-mib", "lots"],
        "invalid value 'lots'",
    );
}

#[test]
fn vcpu_counts_out_of_range() {
    let g = guest("hello");
    let g = g.to_str().unwrap();
    assert_bad_input(
        &["run", "--kernel", g, "--vcpus", "0"],
        "0 vCPUs requested: the VM needs between 1 and 32 vCPUs",
    );
    assert_bad_input(
        &["run", "--kernel", g, "--vcpus", "4096"],
        "4096 vCPUs requested",
    );
}

#[test]
fn command_line_longer_than_the_boot_protocol_allows() {
    let g = guest("hello");
    let long = format!("console=ttyS0 {}", "x".repeat(3000));
    assert_bad_input(
        &["run", "--kernel", g.to_str().unwrap(), "--cmdline", &long],
        "kernel command line is 3014 bytes; the boot protocol allows at most 2047",
    );
}

#[test]
fn bad_serial_and_config_files() {
    let g = guest("hello");
    let g = g.to_str().unwrap();
    assert_bad_input(
        &["run", "--kernel", g, "--serial", "tty"],
        "invalid serial output \"tty\": expected stdout, none or file:PATH",
    );
    assert_bad_input(
        &["run", "--config", "/nonexistent.json"],
        "cannot read config file /nonexistent.json",
    );
    let mut cfg = tempfile::NamedTempFile::new().unwrap();
    cfg.write_all(br#"{"kernal": "/x"}"#).unwrap();
    assert_bad_input(
        &["run", "--config", cfg.path().to_str().unwrap()],
        "unknown field `kernal`",
    );
    assert_bad_input(
        &[
            "run",
            "--kernel",
            g,
            "--serial",
            "file:/nonexistent-dir/serial.log",
        ],
        "cannot set up serial output file /nonexistent-dir/serial.log",
    );
}

#[test]
fn unknown_flags_are_usage_errors() {
    assert_bad_input(&["run", "--kernal", "x"], "unexpected argument '--kernal'");
}

#[test]
fn bad_fs_devices() {
    let g = guest("hello");
    let g = g.to_str().unwrap();
    let tag_rule = "expected 1 to 36 bytes of letters, digits, '_', '.' or '-'";
    let long = "t".repeat(37);
    let long_tag = format!("{long}:/tmp/fs.sock");
    let long_why = format!("invalid tag {long:?}: {tag_rule}");
    for (spec, why) in [
        (":/tmp/fs.sock", format!("invalid tag \"\": {tag_rule}").as_str()),
        (long_tag.as_str(), long_why.as_str()),
        ("share", "invalid fs \"share\": expected TAG:SOCKET[,queues=N]"),
        (
            "share:",
            "invalid socket \"share:\": expected TAG:SOCKET[,queues=N] with a non-empty SOCKET path",
        ),
        (
            "share:/tmp/fs.sock,queues=0",
            "invalid queues \"0\": expected a count of 1 to 16",
        ),
    ] {
        // The message quotes the option and says what is wrong and what the form is.
        assert_bad_input(
            &["run", "--kernel", g, "--fs", spec],
            &format!("invalid fs {spec:?}: {why} (the form is TAG:SOCKET[,queues=N])"),
        );
    }
    assert_bad_input(
        &[
            "run",
            "--kernel",
            g,
            "--fs",
            "a:/tmp/1.sock",
            "--fs",
            "a:/tmp/2.sock",
        ],
        "two --fs devices have the tag \"a\"",
    );
    // A restore checks its --fs options the same way, before reading the snapshot.
    assert_bad_input(
        &[
            "restore",
            "--snapshot",
            "/nonexistent",
            "--fs",
            ":/tmp/fs.sock",
        ],
        &format!("invalid fs \":/tmp/fs.sock\": invalid tag \"\": {tag_rule}"),
    );
    // The vhost-user backend maps guest memory: private memory cannot work.
    assert_bad_input(
        &[
            "run",
            "--kernel",
            g,
            "--fs",
            "a:/tmp/1.sock",
            "--memory",
            "private",
        ],
        "--memory private cannot be used with --fs",
    );
}
