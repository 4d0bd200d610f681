//! KVM integration tests for the virtio devices: the vmm binary runs test
//! guests that drive virtio-mmio devices by polling, and the tests check the
//! guests' serial output and the host-side effects (disk file, tap frames).

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The vmm under test: Cargo's build, or the one `AGENTVM_TEST_VMM` names.
fn vmm_path() -> std::ffi::OsString {
    std::env::var_os("AGENTVM_TEST_VMM").unwrap_or_else(|| env!("CARGO_BIN_EXE_vmm").into())
}

/// Runs `guest` with `args`; returns (exit code, serial output, stderr).
fn run_guest(guest: &str, args: &[&str], cmdline: &str) -> (i32, String, String) {
    let kernel = test_guests::path(guest).expect("known test guest");
    let mut child = Command::new(vmm_path())
        .arg("run")
        .arg("--kernel")
        .arg(&kernel)
        .args(["--serial", "stdout", "--cmdline", cmdline])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vmm");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait vmm") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{guest} did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    let mut err = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code().unwrap_or(-1), out, err)
}

/// The value of `key=` on its own line of guest output.
fn value<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

struct TempFile(PathBuf);

impl TempFile {
    fn disk(name: &str, sectors: usize) -> TempFile {
        let path = std::env::temp_dir().join(format!("vmm-it-{}-{name}.img", std::process::id()));
        let mut bytes = vec![0u8; sectors * 512];
        bytes[..8].copy_from_slice(b"VMMDISK0");
        std::fs::write(&path, bytes).unwrap();
        TempFile(path)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The block guest on a fresh disk; `extra` vmm flags.
fn block_reads_and_writes(name: &str, extra: &[&str]) {
    let disk = TempFile::disk(name, 64);
    let spec = disk.path().display().to_string();
    let mut args = vec!["--disk", &spec];
    args.extend_from_slice(extra);
    let (code, out, err) = run_guest("virtio_blk", &args, "console=ttyS0");
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(value(&out, "blk.capacity"), Some("64"), "{out}");
    assert_eq!(value(&out, "blk.ro"), Some("0"));
    assert_eq!(value(&out, "blk.sector0"), Some("VMMDISK0"));
    assert_eq!(value(&out, "blk.write_status"), Some("0"));
    assert_eq!(value(&out, "blk.readback_matches"), Some("1"));
    assert_eq!(value(&out, "blk.flush_status"), Some("0"));
    assert_eq!(value(&out, "blk.id_status"), Some("0"));
    assert!(
        value(&out, "blk.id").is_some_and(|id| id.starts_with("vmm")),
        "{out}"
    );
    assert!(out.contains("blk: end"));
    let file = std::fs::read(disk.path()).unwrap();
    assert_eq!(&file[512..532], b"written by the guest");
    for (i, b) in file[512 + 20..1024].iter().enumerate() {
        assert_eq!(*b, ((i + 20) & 0xff) as u8);
    }
    assert_eq!(&file[..8], b"VMMDISK0");
}

#[test]
fn block_guest_reads_and_writes_sectors_of_the_host_file() {
    // The guest finds the disk in the ACPI DSDT (ACPI is on by default).
    block_reads_and_writes("rw", &[]);
}

#[test]
fn block_guest_finds_its_disk_on_the_command_line_with_acpi_off() {
    block_reads_and_writes("rw-noacpi", &["--acpi", "off"]);
}

#[test]
fn block_guest_writes_to_a_read_only_disk_fail() {
    let disk = TempFile::disk("ro", 64);
    let before = std::fs::read(disk.path()).unwrap();
    let spec = format!("{},ro", disk.path().display());
    let (code, out, err) = run_guest("virtio_blk", &["--disk", &spec], "console=ttyS0");
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(value(&out, "blk.ro"), Some("1"), "{out}");
    assert_eq!(value(&out, "blk.read_status"), Some("0"));
    assert_eq!(
        value(&out, "blk.write_status"),
        Some("1"),
        "VIRTIO_BLK_S_IOERR"
    );
    assert_eq!(std::fs::read(disk.path()).unwrap(), before);
}

#[test]
fn hostile_block_driver_gets_errors_and_the_vmm_survives() {
    let disk = TempFile::disk("hostile", 64);
    let before = std::fs::read(disk.path()).unwrap();
    let spec = format!("{},ro", disk.path().display());
    let (code, out, err) = run_guest("virtio_hostile", &["--disk", &spec], "console=ttyS0");
    assert_eq!(code, 0, "{out}\n{err}");
    // Queue sizes that are not powers of two, zero, or above the maximum are refused.
    assert_eq!(value(&out, "hostile.size3_ready"), Some("0"), "{out}");
    assert_eq!(value(&out, "hostile.size0_ready"), Some("0"));
    assert_eq!(value(&out, "hostile.oversize_ready"), Some("0"));
    assert_eq!(value(&out, "hostile.needs_reset"), Some("1"));
    assert_eq!(value(&out, "hostile.driver_ok_without_queue"), Some("0"));
    assert_eq!(value(&out, "hostile.driver_ok"), Some("1"));
    // A buffer outside guest memory: dropped (used length 0, status untouched) or IOERR.
    assert_eq!(value(&out, "hostile.oob_used"), Some("0"));
    assert_eq!(value(&out, "hostile.oob_write_status"), Some("1"));
    // A looping chain is cut and answered.
    assert!(
        value(&out, "hostile.loop_used").is_some_and(|v| v != "4294967295"),
        "{out}"
    );
    assert_eq!(value(&out, "hostile.huge_status"), Some("1"));
    assert_eq!(value(&out, "hostile.write_status"), Some("1"));
    assert_eq!(value(&out, "hostile.read_status"), Some("0"));
    assert!(out.contains("hostile: end"));
    assert_eq!(std::fs::read(disk.path()).unwrap(), before);
}

#[test]
fn rng_guest_reads_random_bytes() {
    let (code, out, err) = run_guest("virtio_rng", &["--rng"], "console=ttyS0");
    assert_eq!(code, 0, "{out}\n{err}");
    let lens: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("rng.len="))
        .collect();
    assert_eq!(lens, ["64", "64"], "{out}");
    let bytes: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("rng.bytes="))
        .collect();
    assert_eq!(bytes.len(), 2);
    assert_eq!(bytes[0].len(), 128);
    assert_ne!(bytes[0], bytes[1], "two reads of 64 random bytes are equal");
    assert_ne!(bytes[0], "0".repeat(128));
}

#[test]
fn virtio_devices_are_announced_on_the_kernel_command_line_with_acpi_off() {
    let disk = TempFile::disk("cmdline", 8);
    let spec = disk.path().display().to_string();
    let (code, out, err) = run_guest(
        "report",
        &["--disk", &spec, "--rng", "--acpi", "off"],
        "console=ttyS0",
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let cmdline = value(&out, "cmdline").unwrap();
    assert!(
        cmdline.ends_with("virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6"),
        "{cmdline}"
    );
}

#[test]
fn a_missing_disk_is_a_clear_input_error() {
    let (code, _out, err) = run_guest(
        "hello",
        &["--disk", "/nonexistent/disk.img"],
        "console=ttyS0",
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("cannot open disk image /nonexistent/disk.img"),
        "{err}"
    );
}

mod net {
    use super::*;

    use crate::common::tap::{HostTap, PacketSocket};

    #[test]
    fn net_guest_frame_reaches_the_tap_and_a_host_frame_reaches_the_guest() {
        let name = format!("vmmt{}", std::process::id() % 100_000);
        let tap = match HostTap::create(&name) {
            Ok(tap) => tap,
            Err(why) => {
                println!("SKIPPED net integration test: cannot create a tap ({why})");
                return;
            }
        };
        let sock = PacketSocket::bind(&tap.0);
        let kernel = test_guests::path("virtio_net").unwrap();
        let net = format!("{},mac=02:11:22:33:44:55", tap.0);
        let child = Command::new(vmm_path())
            .arg("run")
            .arg("--kernel")
            .arg(&kernel)
            .args([
                "--serial",
                "stdout",
                "--cmdline",
                "console=ttyS0 rx_spins=20000000",
            ])
            .args(["--net", &net])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = None;
        while Instant::now() < deadline {
            if let Some(frame) = sock.recv() {
                if frame.len() > 14 && frame[12..14] == [0x88, 0xb5] {
                    seen = Some(frame);
                    break;
                }
            }
        }
        let frame = seen.expect("the guest's frame never reached the tap");
        assert_eq!(&frame[..6], &[0xff; 6]);
        assert_eq!(&frame[6..12], &[0x02, 0x11, 0x22, 0x33, 0x44, 0x55]);
        assert_eq!(&frame[14..34], b"hello from the guest");

        let mut reply = vec![
            0x02, 0x11, 0x22, 0x33, 0x44, 0x55, 0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x88, 0xb5,
        ];
        reply.extend_from_slice(b"hello from the host");
        reply.resize(64, 0);
        sock.send(&reply);

        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            value(&stdout, "net.mac"),
            Some("02:11:22:33:44:55"),
            "{stdout}"
        );
        assert_eq!(
            value(&stdout, "net.rx_payload"),
            Some("hello from the host"),
            "{stdout}"
        );
        assert_eq!(
            value(&stdout, "net.rx_len"),
            Some("76"),
            "12-byte header + 64-byte frame"
        );
    }
}

mod vsock {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::{UnixListener, UnixStream};

    fn socket_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("vmm-it-{}-{name}.sock", std::process::id()))
    }

    #[test]
    fn guest_connects_to_a_host_listener_and_accepts_a_host_connect() {
        let uds = socket_path("vsock");
        let listener_path = PathBuf::from(format!("{}_5000", uds.display()));
        let _ = std::fs::remove_file(&listener_path);
        let host_listener = UnixListener::bind(&listener_path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = host_listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            s.write_all(b"pong from host\n").unwrap();
            line
        });

        let kernel = test_guests::path("virtio_vsock").unwrap();
        let mut child = Command::new(vmm_path())
            .arg("run")
            .arg("--kernel")
            .arg(&kernel)
            .args(["--serial", "stdout"])
            .args([
                "--cmdline",
                "console=ttyS0 vsock_port=5000 vsock_listen=6000",
            ])
            .arg("--vsock")
            .arg(format!("3:{}", uds.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut out = String::new();
        let mut host_side = None;
        for line in stdout.lines() {
            let line = line.unwrap();
            out.push_str(&line);
            out.push('\n');
            if line == "vsock: listening" {
                // The host connects with Firecracker's handshake.
                let mut s = UnixStream::connect(&uds).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                s.write_all(b"CONNECT 6000\n").unwrap();
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut ok = String::new();
                r.read_line(&mut ok).unwrap();
                s.write_all(b"hello guest\n")
                    .unwrap_or_else(|e| panic!("{e}: ok line {ok:?}; guest output so far:\n{out}"));
                let mut reply = String::new();
                r.read_line(&mut reply).unwrap();
                host_side = Some((ok, reply));
            }
        }
        let status = child.wait().unwrap();
        assert!(status.success(), "{out}");
        assert_eq!(server.join().unwrap(), "ping from guest\n");
        assert_eq!(value(&out, "vsock.cid"), Some("3"), "{out}");
        assert_eq!(
            value(&out, "vsock.connect_op"),
            Some("2"),
            "RESPONSE: {out}"
        );
        assert_eq!(value(&out, "vsock.reply"), Some("pong from host"));
        assert_eq!(
            value(&out, "vsock.shutdown_answer_op"),
            Some("3"),
            "RST after SHUTDOWN"
        );
        assert_eq!(value(&out, "vsock.incoming_op"), Some("1"), "REQUEST");
        assert_eq!(value(&out, "vsock.incoming_dst_port"), Some("6000"));
        assert_eq!(value(&out, "vsock.incoming_data"), Some("hello guest"));
        let (ok, reply) = host_side.expect("the guest never listened");
        let port: u32 = ok.strip_prefix("OK ").unwrap().trim().parse().unwrap();
        assert!(port >= 1 << 30, "{ok}");
        assert_eq!(reply, "hello host\n");
        let _ = std::fs::remove_file(&listener_path);
        let _ = std::fs::remove_file(&uds);
    }

    #[test]
    fn guest_connecting_to_a_port_nobody_listens_on_gets_a_reset() {
        let uds = socket_path("vsock-rst");
        let (code, out, err) = run_guest(
            "virtio_vsock",
            &["--vsock", &format!("3:{}", uds.display())],
            "console=ttyS0 vsock_port=5999",
        );
        assert_eq!(code, 0, "{out}\n{err}");
        assert_eq!(value(&out, "vsock.connect_op"), Some("3"), "{out}");
        let _ = std::fs::remove_file(&uds);
    }
}
