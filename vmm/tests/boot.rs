//! Boots each test guest under real KVM and checks its serial output, the
//! exit reason and the process exit code.

mod common;

use common::*;

#[test]
fn hello_guest_prints_and_resets_cleanly() {
    let g = guest("hello");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert_eq!(stdout(&out), "Hello from the hello test guest!\n");
}

#[test]
fn report_guest_sees_zero_page_cmdline_e820_cpuid_and_mp_table() {
    let g = guest("report");
    let out = run_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--mem-mib",
        "256",
        "--vcpus",
        "2",
        "--cmdline",
        "console=ttyS0 marker=42",
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    let kvs = kv_lines(&text);
    assert_eq!(kv(&kvs, "boot.zero_page"), "0x7000");
    assert_eq!(kv(&kvs, "boot.flag"), "0xaa55");
    assert_eq!(kv(&kvs, "boot.header"), "0x53726448");
    assert_eq!(kv(&kvs, "boot.loader"), "0xff");
    assert_eq!(kv(&kvs, "boot.cmdline_ptr"), "0x20000");
    assert_eq!(kv(&kvs, "cmdline"), "console=ttyS0 marker=42");
    assert_eq!(kv(&kvs, "boot.cmdline_size"), "23");
    let e820: Vec<&str> = kvs
        .iter()
        .filter(|(k, _)| k == "e820")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(
        e820,
        vec!["0x0 0x9fc00 1", "0x9fc00 0x60400 2", "0x100000 0xff00000 1"]
    );
    assert_eq!(kv(&kvs, "e820.count"), "3");
    assert_eq!(kv(&kvs, "cpuid.hypervisor"), "1");
    assert_eq!(kv(&kvs, "cpuid.hv_signature"), "KVMKVMKVM");
    assert_eq!(kv(&kvs, "cpuid.apic_id"), "0");
    assert_eq!(kv(&kvs, "cpuid.logical_count"), "2");
    let vendor = kv(&kvs, "cpuid.vendor");
    assert!(
        vendor == "GenuineIntel" || vendor == "AuthenticAMD",
        "vendor {vendor}"
    );
    assert_eq!(kv(&kvs, "mp.signature"), "_MP_");
    // 2 processors, 1 bus, 1 IOAPIC, 24 interrupt sources, 2 local interrupts.
    assert_eq!(kv(&kvs, "mp.entries"), "30");
    assert!(text.ends_with("report: end\n"));
}

#[test]
fn guest_above_the_mmio_hole_gets_high_ram_in_e820() {
    let g = guest("report");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap(), "--mem-mib", "4096"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let kvs = kv_lines(&stdout(&out));
    let e820: Vec<&str> = kvs
        .iter()
        .filter(|(k, _)| k == "e820")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(
        e820,
        vec![
            "0x0 0x9fc00 1",
            "0x9fc00 0x60400 2",
            "0x100000 0xbff00000 1",
            "0x100000000 0x40000000 1"
        ]
    );
}

#[test]
fn triple_fault_is_a_vm_failure_with_exit_code_one() {
    let g = guest("triplefault");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("loading an empty IDT"));
    assert!(!stdout(&out).contains("still alive"));
    assert!(
        stderr(&out).contains("vCPU 0 triple-faulted"),
        "stderr: {}",
        stderr(&out)
    );
    // The vCPU's state is logged: the empty IDT the guest loaded, and the
    // long-mode code segment it ran in.
    let err = stderr(&out);
    let state = err
        .lines()
        .find(|l| l.contains("vCPU 0 at the failure:"))
        .unwrap_or_else(|| panic!("no vCPU state in stderr: {err}"));
    assert!(state.contains(" idt=0x0+0x0"), "{state}");
    assert!(state.contains("64-bit"), "{state}");
    assert!(state.contains(" rip=0x"), "{state}");
    // The pending interrupt state, read from KVM and the in-kernel LAPIC.
    assert!(state.contains("; interrupt: "), "{state}");
    assert!(state.contains("; nmi: "), "{state}");
    assert!(state.contains("; lapic: irr "), "{state}");
    // The exits before the fault: the guest polled the serial line status
    // register (port 0x3fd) while printing, so the fault did not come on
    // the first entry after the vmm wrote the vCPU's state.
    assert!(state.contains("; last exits: "), "{state}");
    assert!(state.contains("io_in 0x3fd"), "{state}");
    let exits: u64 = state
        .split("; exits since the vmm set this vCPU's state: ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exit count in {state}"));
    assert!(exits > 0, "{state}");
    assert!(
        !state.contains("on the first entry after the vmm wrote its state"),
        "{state}"
    );
}

#[test]
fn serial_output_goes_to_a_file_or_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serial.log");
    let g = guest("hello");
    let serial = format!("file:{}", log.display());
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap(), "--serial", &serial]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert_eq!(stdout(&out), "");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "Hello from the hello test guest!\n"
    );

    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap(), "--serial", "none"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stdout(&out), "");
}

#[test]
fn config_file_provides_the_same_fields_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("vm.json");
    let g = guest("report");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "kernel": g,
            "mem_mib": 64,
            "vcpus": 3,
            "cmdline": "from=file",
            "serial": "stdout"
        })
        .to_string(),
    )
    .unwrap();
    let out = run_vmm(&[
        "run",
        "--config",
        cfg.to_str().unwrap(),
        "--cmdline",
        "from=flag",
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let kvs = kv_lines(&stdout(&out));
    assert_eq!(kv(&kvs, "cmdline"), "from=flag");
    assert_eq!(kv(&kvs, "cpuid.logical_count"), "3");
    assert!(stdout(&out).contains("e820=0x100000 0x3f00000 1"));
}

#[test]
fn sigterm_stops_the_vm_cleanly() {
    let g = guest("counter");
    let child = vmm()
        .args(["run", "--kernel", g.to_str().unwrap(), "--serial", "none"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let out = wait_with_deadline(child, std::time::Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
}

/// The KVM VM is held by a keeper process as well, which holds nothing else
/// and does not read as a vmm, so the kernel's teardown of the VM happens
/// when the keeper lets go, after the vmm is gone (vmm/src/keeper.rs).
#[test]
fn the_vm_is_torn_down_by_its_keeper_after_the_vmm() {
    let t = tempfile::tempdir().unwrap();
    let mut vm = common::counter::boot_counter(t.path(), "kept");
    common::counter::wait_for_counts(&vm.log, 1);
    let pid = vm.child.id();
    let keepers: Vec<u32> = test_harness::process::children(pid)
        .into_iter()
        .filter(|(_, comm)| comm == vmm::keeper::NAME)
        .map(|(p, _)| p)
        .collect();
    assert_eq!(
        keepers.len(),
        1,
        "children: {:?}",
        test_harness::process::children(pid)
    );
    let keeper = keepers[0];
    // What each of the keeper's descriptors links to, read once.
    let links: Vec<String> = std::fs::read_dir(format!("/proc/{keeper}/fd"))
        .unwrap()
        .flatten()
        .map(|e| {
            std::fs::read_link(e.path())
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    // socket:[inode] -> socket
    let mut held: Vec<&str> = links
        .iter()
        .map(|l| l.split(':').next().unwrap_or_default())
        .collect();
    held.sort();
    // The VM fd and the vmm's pidfd (it waits on it for the vmm's whole exit).
    assert_eq!(
        held,
        ["anon_inode", "anon_inode", "socket"],
        "the keeper holds more"
    );
    let holds = |target: &str| links.iter().any(|l| l == target);
    assert!(
        holds("anon_inode:[pidfd]"),
        "the keeper has no pidfd of its vmm"
    );
    assert!(holds("anon_inode:kvm-vm"), "the keeper has no VM fd");
    let cmdline = std::fs::read(format!("/proc/{keeper}/cmdline")).unwrap();
    let shown = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert_eq!(shown.trim(), vmm::keeper::NAME, "the keeper's command line");

    vm.child.kill().unwrap();
    vm.child.wait().unwrap();
    let start = std::time::Instant::now();
    while !test_harness::process::is_gone(keeper) {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "the keeper outlived its vmm by 10 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
