//! ACPI under real KVM with the `acpi` test guest, which walks the tables as
//! a kernel does: what it finds for 1 and 3 vCPUs and a few virtio devices,
//! power-off and reset through the FADT's registers, `--acpi off`, and the
//! refusal of machines the tables cannot describe.

mod common;

use common::*;

struct TempDisk(std::path::PathBuf);

impl TempDisk {
    fn new(name: &str) -> TempDisk {
        let path = std::env::temp_dir().join(format!("vmm-acpi-{}-{name}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 64 * 512]).unwrap();
        TempDisk(path)
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempDisk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn run_acpi_guest(args: &[&str]) -> (std::process::Output, String) {
    let g = guest("acpi");
    let mut all = vec![
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--log-level",
        "info",
    ];
    all.extend_from_slice(args);
    let out = run_vmm(&all);
    let text = stdout(&out);
    (out, text)
}

fn values<'a>(kvs: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    kvs.iter()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .collect()
}

fn check_tables(vcpus: u32) {
    let disk = TempDisk::new(&format!("tables{vcpus}"));
    let n = vcpus.to_string();
    let (out, text) = run_acpi_guest(&["--vcpus", &n, "--disk", disk.arg(), "--rng"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let kvs = kv_lines(&text);
    // The zero page points at the RSDP, and a scan finds the same one.
    assert_eq!(kv(&kvs, "rsdp.zero_page"), "0xe0000");
    assert_eq!(kv(&kvs, "rsdp.scan"), "0xe0000");
    for key in [
        "rsdp.checksum_ok",
        "rsdp.ext_checksum_ok",
        "xsdt.ok",
        "fadt.hw_reduced",
        "fadt.reset_reg_sup",
        "madt.walk_ok",
        "madt.pcat_compat",
        "dsdt.com1",
    ] {
        assert_eq!(kv(&kvs, key), "1", "{key}\n{text}");
    }
    assert_eq!(kv(&kvs, "rsdp.revision"), "2");
    assert_eq!(kv(&kvs, "rsdp.length"), "36");
    // Every table's checksum holds and its length is what it says.
    let tables = values(&kvs, "table");
    assert_eq!(tables.len(), 3, "{text}");
    assert_eq!(tables[0], "FACP 1 276");
    let madt_len = 44 + 8 * vcpus + 12 + 6;
    assert_eq!(tables[1], format!("APIC 1 {madt_len}"));
    assert!(tables[2].starts_with("DSDT 1 "), "{}", tables[2]);
    assert_eq!(kv(&kvs, "xsdt.entries"), "2", "FADT and MADT; no MCFG");
    assert_eq!(kv(&kvs, "fadt.sleep_control"), "1:8:0:1:0x600");
    assert_eq!(kv(&kvs, "fadt.sleep_status"), "1:8:0:1:0x601");
    assert_eq!(kv(&kvs, "fadt.reset_reg"), "1:8:0:1:0x602");
    assert_eq!(kv(&kvs, "fadt.reset_value"), "1");
    assert_eq!(kv(&kvs, "madt.lapics"), n, "one local APIC per vCPU");
    assert_eq!(kv(&kvs, "madt.ioapics"), "1");
    assert_eq!(kv(&kvs, "madt.ioapic"), "0xfec00000");
    assert_eq!(kv(&kvs, "madt.lapic_addr"), "0xfee00000");
    assert_eq!(kv(&kvs, "dsdt.s5"), "5");
    // Each device at its window with its GSI, and a virtio device of the
    // right type (2 = block, 4 = rng) answers there.
    assert_eq!(
        values(&kvs, "dsdt.virtio"),
        ["0xd0000000 5 2", "0xd0001000 6 4"]
    );
    assert_eq!(kv(&kvs, "vmgenid.addr"), "0xe0040");
    assert_eq!(kv(&kvs, "ged.port"), "0x604");
    let id = kv(&kvs, "vmgenid");
    assert_eq!(id.len(), 32);
    assert_ne!(id, "0".repeat(32), "the generation ID is written at boot");
    assert!(text.ends_with("acpi: end\n"), "{text}");
}

#[test]
fn the_guest_finds_checks_and_walks_the_tables_with_one_vcpu() {
    check_tables(1);
}

#[test]
fn the_guest_finds_checks_and_walks_the_tables_with_three_vcpus() {
    check_tables(3);
}

#[test]
fn every_boot_has_its_own_generation_id() {
    let (_, a) = run_acpi_guest(&[]);
    let (_, b) = run_acpi_guest(&[]);
    let id = |t: &str| kv(&kv_lines(t), "vmgenid").to_string();
    assert_ne!(id(&a), id(&b));
}

#[test]
fn the_guest_powers_off_through_the_sleep_control_register() {
    let (out, text) = run_acpi_guest(&["--cmdline", "console=ttyS0 action=1"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{text}\n{err}");
    assert!(text.ends_with("acpi: end\n"), "{text}");
    assert!(err.contains("\"acpi_poweroff\""), "{err}");
}

#[test]
fn the_guest_resets_through_the_reset_register() {
    let (out, text) = run_acpi_guest(&["--cmdline", "console=ttyS0 action=2", "--vcpus", "2"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{text}\n{err}");
    assert!(text.ends_with("acpi: end\n"), "{text}");
    assert!(err.contains("\"acpi_reset\""), "{err}");
}

#[test]
fn acpi_off_gives_no_tables_and_announces_devices_on_the_command_line() {
    let disk = TempDisk::new("off");
    let (out, text) = run_acpi_guest(&["--acpi", "off", "--disk", disk.arg()]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let kvs = kv_lines(&text);
    assert_eq!(kv(&kvs, "rsdp.zero_page"), "0x0");
    assert_eq!(kv(&kvs, "rsdp.scan"), "0x0");
    assert!(text.ends_with("acpi: none\n"), "{text}");

    let g = guest("report");
    let out = run_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--acpi",
        "off",
        "--disk",
        disk.arg(),
        "--cmdline",
        "console=ttyS0",
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let kvs = kv_lines(&stdout(&out));
    assert_eq!(
        kv(&kvs, "cmdline"),
        "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5"
    );
    // The MP table is there with ACPI off, and stays with ACPI on.
    assert_eq!(kv(&kvs, "mp.signature"), "_MP_");
}

#[test]
fn with_acpi_on_the_devices_stay_off_the_command_line_and_the_mp_table_stays() {
    let disk = TempDisk::new("on");
    let g = guest("report");
    let out = run_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--disk",
        disk.arg(),
        "--cmdline",
        "console=ttyS0",
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let kvs = kv_lines(&stdout(&out));
    assert_eq!(kv(&kvs, "cmdline"), "console=ttyS0");
    assert_eq!(kv(&kvs, "mp.signature"), "_MP_");
}

#[test]
fn machines_the_tables_cannot_describe_are_refused_before_they_start() {
    let g = guest("acpi");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap(), "--vcpus", "33"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("33 vCPUs requested: the VM needs between 1 and 32 vCPUs"),
        "{}",
        stderr(&out)
    );
    let disks: Vec<TempDisk> = (0..19)
        .map(|i| TempDisk::new(&format!("many{i}")))
        .collect();
    let mut args = vec!["run", "--kernel", g.to_str().unwrap()];
    for d in &disks {
        args.extend(["--disk", d.arg()]);
    }
    let out = run_vmm(&args);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(
            "19 virtio devices configured: at most 18 fit (one IOAPIC interrupt line each)"
        ),
        "{}",
        stderr(&out)
    );
    assert_eq!(stdout(&out), "", "the guest never ran");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap(), "--acpi", "maybe"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("invalid ACPI setting \"maybe\": expected on or off"));
}
