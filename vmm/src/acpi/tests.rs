//! The tables checked byte by byte against the ACPI 6.5 layouts: checksums,
//! lengths, pointers, the MADT's entries, and the DSDT's key AML objects as
//! the encodings the spec (section 20, "ACPI Machine Language") gives them.

use super::*;
use crate::arch::x86_64::layout::{ACPI_AREA_START, ACPI_VMGENID_START};

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}
fn sum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
}

fn virtio(n: u32) -> Vec<VirtioDescription> {
    (0..n)
        .map(|i| VirtioDescription {
            addr: 0xd000_0000 + u64::from(i) * 0x1000,
            gsi: crate::devices::virtio::setup::virtio_gsi(i as usize).unwrap(),
        })
        .collect()
}

fn tables(vcpus: u8, devices: &[VirtioDescription]) -> AcpiTables {
    build(&MachineDescription {
        vcpus,
        virtio: devices,
        vmgenid_addr: ACPI_VMGENID_START,
        ged_gsi: 3,
    })
    .unwrap()
}

/// Where `needle` starts in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Decodes a PkgLength at `b[0..]`: (value, bytes it takes).
fn pkg_length(b: &[u8]) -> (usize, usize) {
    let extra = usize::from(b[0] >> 6);
    if extra == 0 {
        return (usize::from(b[0] & 0x3f), 1);
    }
    let mut v = usize::from(b[0] & 0x0f);
    for i in 0..extra {
        v |= usize::from(b[1 + i]) << (4 + 8 * i);
    }
    (v, 1 + extra)
}

/// The body of `Device (\_SB.<name>)`, bounds-checked by its PkgLength.
fn device<'a>(dsdt: &'a [u8], name: &[u8; 4]) -> &'a [u8] {
    let mut path = b"\\\x2e_SB_".to_vec();
    path.extend_from_slice(name);
    let at = find(dsdt, &path).unwrap_or_else(|| panic!("no device {name:?}"));
    // ExtOpPrefix DeviceOp PkgLength, then the path.
    let mut start = at - 1;
    while !(dsdt[start - 2] == 0x5b && dsdt[start - 1] == 0x82) {
        start -= 1;
    }
    let (len, len_bytes) = pkg_length(&dsdt[start..]);
    assert_eq!(start + len_bytes, at, "PkgLength runs up to the name");
    let end = start + len;
    assert!(end <= dsdt.len(), "device {name:?} overruns the DSDT");
    &dsdt[at + path.len()..end]
}

#[test]
fn every_table_has_its_signature_length_checksum_and_place() {
    let t = tables(3, &virtio(2));
    let rsdp = t.rsdp();
    assert_eq!(&rsdp[0..8], b"RSD PTR ");
    assert_eq!(sum(&rsdp[0..20]), 0, "ACPI 1.0 checksum");
    assert_eq!(rsdp[15], 2, "revision 2: XSDT");
    assert_eq!(u32_at(rsdp, 20) as usize, rsdp.len());
    assert_eq!(rsdp.len(), 36);
    assert_eq!(sum(rsdp), 0, "extended checksum");
    assert_eq!(t.rsdp_addr(), ACPI_AREA_START);
    assert_eq!(t.rsdp_addr() % 16, 0, "Linux scans 16-byte boundaries");

    let mut end = ACPI_TABLES_START;
    for sig in [b"DSDT", b"FACP", b"APIC", b"XSDT"] {
        let (addr, bytes) = t.table(sig).unwrap();
        assert_eq!(&bytes[0..4], sig);
        assert_eq!(u32_at(bytes, 4) as usize, bytes.len(), "{sig:?} length");
        assert_eq!(sum(bytes), 0, "{sig:?} checksum");
        assert_eq!(&bytes[10..16], b"AGNTVM");
        assert_eq!(addr % 8, 0);
        assert!(addr >= end, "{sig:?} overlaps the table before it");
        end = addr + bytes.len() as u64;
    }
    assert!(end <= ACPI_AREA_END);
    assert_eq!(t.tables_len(), end - ACPI_TABLES_START);

    let (xsdt_addr, xsdt) = t.table(b"XSDT").unwrap();
    assert_eq!(u64_at(rsdp, 24), xsdt_addr);
    let entries: Vec<u64> = (36..xsdt.len())
        .step_by(8)
        .map(|o| u64_at(xsdt, o))
        .collect();
    assert_eq!(
        entries,
        vec![t.table(b"FACP").unwrap().0, t.table(b"APIC").unwrap().0],
        "the XSDT lists the FADT and the MADT (no MCFG: no PCI)"
    );
}

#[test]
fn the_area_is_reserved_in_the_e820_map() {
    use crate::arch::x86_64::e820::{entries, E820_RESERVED};
    let mem = GuestMemoryMmap::from_ranges(&crate::memory::ram_ranges(64 << 20)).unwrap();
    let reserved = entries(&mem)
        .into_iter()
        .find(|e| e.addr <= ACPI_AREA_START && ACPI_AREA_END <= e.addr + e.size)
        .expect("an e820 entry covers the ACPI area");
    assert_eq!(reserved.kind, E820_RESERVED);
}

#[test]
fn the_fadt_is_hardware_reduced_with_sleep_and_reset_registers_on_ports() {
    let t = tables(1, &[]);
    let (dsdt_addr, _) = t.table(b"DSDT").unwrap();
    let (_, f) = t.table(b"FACP").unwrap();
    assert_eq!(f.len(), 276, "ACPI 6.5 FADT");
    assert_eq!((f[8], f[131]), (6, 5), "FADT version 6.5");
    assert_eq!(u64_at(f, 140), dsdt_addr, "X_DSDT");
    let flags = u32_at(f, 112);
    assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
    assert_ne!(flags & (1 << 10), 0, "RESET_REG_SUP");
    // GAS: SystemIO, 8 bits, offset 0, byte access, port.
    let gas = |o: usize| (f[o], f[o + 1], f[o + 2], f[o + 3], u64_at(f, o + 4));
    assert_eq!(gas(116), (1, 8, 0, 1, 0x602), "RESET_REG");
    assert_eq!(f[128], 1, "RESET_VALUE");
    assert_eq!(gas(244), (1, 8, 0, 1, 0x600), "SLEEP_CONTROL_REG");
    assert_eq!(gas(256), (1, 8, 0, 1, 0x601), "SLEEP_STATUS_REG");
    // IAPC_BOOT_ARCH: 8042, no VGA, no CMOS RTC.
    assert_eq!(u16_at(f, 109), 0b10_0110);
    assert_eq!(&f[268..276], b"AGENTVM ");
}

#[test]
fn the_madt_lists_one_local_apic_per_vcpu_the_ioapic_and_lint1_nmi() {
    for vcpus in [1u8, 3, 32] {
        let t = tables(vcpus, &[]);
        let (_, m) = t.table(b"APIC").unwrap();
        assert_eq!(u32_at(m, 36), 0xfee0_0000, "local APIC address");
        assert_eq!(u32_at(m, 40), 1, "PCAT_COMPAT");
        let mut o = 44;
        let mut lapics = Vec::new();
        let mut ioapics = Vec::new();
        let mut nmis = 0;
        while o < m.len() {
            let (kind, len) = (m[o], usize::from(m[o + 1]));
            assert!(len >= 2 && o + len <= m.len(), "entry at {o} overruns");
            match kind {
                0 => {
                    assert_eq!(len, 8);
                    assert_eq!(u32_at(m, o + 4), 1, "enabled");
                    lapics.push((m[o + 2], m[o + 3]));
                }
                1 => {
                    assert_eq!(len, 12);
                    ioapics.push((m[o + 2], u32_at(m, o + 4), u32_at(m, o + 8)));
                }
                4 => {
                    assert_eq!(&m[o..o + len], &[4, 6, 0xff, 0, 0, 1]);
                    nmis += 1;
                }
                other => panic!("unexpected MADT entry type {other}"),
            }
            o += len;
        }
        assert_eq!(o, m.len());
        let expected: Vec<(u8, u8)> = (0..vcpus).map(|i| (i, i)).collect();
        assert_eq!(lapics, expected, "UID = APIC ID = index");
        assert_eq!(ioapics, vec![(vcpus, 0xfec0_0000, 0)]);
        assert_eq!(nmis, 1);
    }
}

#[test]
fn the_dsdt_has_s5_com1_and_every_virtio_device() {
    let devices = virtio(3);
    let t = tables(2, &devices);
    let (_, d) = t.table(b"DSDT").unwrap();
    assert_eq!(d[8], 2, "revision 2: 64-bit integers");
    // Name (\_S5, Package (4) { 5, 0, 0, 0 }): NameOp '\' "_S5_" PackageOp
    // PkgLength(7) NumElements(4) BytePrefix 5, ZeroOp x3.
    assert!(find(d, b"\x08\\_S5_\x12\x07\x04\x0a\x05\x00\x00\x00").is_some());

    let com1 = device(d, b"COM1");
    // _HID EISAID("PNP0501") = 0x0105d041, a DWordConst.
    assert!(find(com1, b"_HID\x0c\x41\xd0\x05\x01").is_some());
    // IO (Decode16, 0x3f8, 0x3f8, 1, 8) and Interrupt (consumer, edge, high) {4}.
    assert!(find(com1, b"\x47\x01\xf8\x03\xf8\x03\x01\x08").is_some());
    assert!(find(com1, b"\x89\x06\x00\x03\x01\x04\x00\x00\x00").is_some());

    // The keyboard controller: EISAID("PNP0303") = 0x0303d041, IO 0x60 and
    // 0x64 (one port each) and Interrupt {1}, so Linux maps its IRQ.
    let kbd = device(d, b"PS2K");
    assert!(find(kbd, b"_HID\x0c\x41\xd0\x03\x03").is_some());
    assert!(find(kbd, b"\x47\x01\x60\x00\x60\x00\x01\x01").is_some());
    assert!(find(kbd, b"\x47\x01\x64\x00\x64\x00\x01\x01").is_some());
    assert!(find(kbd, b"\x89\x06\x00\x03\x01\x01\x00\x00\x00").is_some());

    for (i, dev) in devices.iter().enumerate() {
        let name = format!("V{i:03}");
        let body = device(d, name.as_bytes().try_into().unwrap());
        assert!(find(body, b"_HID\x0dLNRO0005\x00").is_some(), "{name}");
        // Memory32Fixed (ReadWrite, addr, 0x1000).
        let mut mem = vec![0x86, 0x09, 0x00, 0x01];
        mem.extend_from_slice(&(dev.addr as u32).to_le_bytes());
        mem.extend_from_slice(&0x1000u32.to_le_bytes());
        assert!(find(body, &mem).is_some(), "{name} window");
        let mut irq = vec![0x89, 0x06, 0x00, 0x03, 0x01];
        irq.extend_from_slice(&dev.gsi.to_le_bytes());
        assert!(find(body, &irq).is_some(), "{name} interrupt");
    }
    assert!(
        find(d, b"_SB_V003").is_none(),
        "only the configured devices"
    );
    assert!(
        find(d, b"PNP0A03").is_none() && find(d, b"PNP0A08").is_none(),
        "no PCI"
    );
}

#[test]
fn the_dsdt_has_the_vmgenid_device_and_the_ged_that_notifies_it() {
    let t = tables(1, &[]);
    let (_, d) = t.table(b"DSDT").unwrap();
    let vgen = device(d, b"VGEN");
    assert!(find(vgen, b"_HID\x0dVMGENCTR\x00").is_some());
    assert!(find(vgen, b"_CID\x0dVM_Gen_Counter\x00").is_some());
    // Method (ADDR, 0) { Return (Package (2) { 0xe0040, 0 }) }: MethodOp
    // PkgLength(16) "ADDR" flags(0) ReturnOp PackageOp PkgLength(8)
    // NumElements(2) DWordPrefix 0x000e0040 ZeroOp.
    assert!(find(
        vgen,
        b"\x14\x10ADDR\x00\xa4\x12\x08\x02\x0c\x40\x00\x0e\x00\x00"
    )
    .is_some());

    let ged = device(d, b"GED_");
    assert!(find(ged, b"_HID\x0dACPI0013\x00").is_some());
    assert!(
        find(ged, b"\x89\x06\x00\x03\x01\x03\x00\x00\x00").is_some(),
        "GSI 3"
    );
    // OperationRegion (GDST, SystemIO, 0x604, 1).
    assert!(find(ged, b"\x5b\x80GDST\x01\x0b\x04\x06\x01").is_some());
    // Field (GDST, ByteAcc, NoLock, WriteAsZeros) { GDAT, 8 }.
    assert!(find(ged, b"\x5b\x81\x0bGDST\x41GDAT\x08").is_some());
    // Method (_EVT, 1, Serialized) { Store (GDAT, Local0); And (Local0, 1, Local1);
    //   If (LEqual (Local1, 1)) { Notify (\_SB.VGEN, 0x80) } }
    let evt = b"\x14\x22_EVT\x09\x70GDAT\x60\x7b\x60\x01\x61\xa0\x11\x93\x61\x01\x86\\\x2e_SB_VGEN\x0a\x80";
    assert!(find(ged, evt).is_some());
}

#[test]
fn the_largest_machine_fits_and_impossible_ones_are_refused() {
    let t = tables(
        MAX_VCPUS,
        &virtio(crate::devices::virtio::setup::MAX_DEVICES as u32),
    );
    assert!(t.tables_len() < ACPI_AREA_END - ACPI_TABLES_START);
    fn desc(vcpus: u8, virtio: &[VirtioDescription]) -> MachineDescription<'_> {
        MachineDescription {
            vcpus,
            virtio,
            vmgenid_addr: ACPI_VMGENID_START,
            ged_gsi: 3,
        }
    }
    let err = build(&desc(MAX_VCPUS + 1, &[])).unwrap_err();
    assert!(matches!(err, AcpiError::TooManyVcpus { requested: 255 }));
    assert!(err.to_string().contains("at most 254"), "{err}");
    let many: Vec<VirtioDescription> = (0..25)
        .map(|i| VirtioDescription {
            addr: 0xd000_0000 + i * 0x1000,
            gsi: 5,
        })
        .collect();
    assert!(matches!(
        build(&desc(1, &many)),
        Err(AcpiError::TooManyDevices { count: 25 })
    ));
    for bad in [
        VirtioDescription {
            addr: 0xd000_0000,
            gsi: 24,
        },
        VirtioDescription {
            addr: 0xd000_0000,
            gsi: 4,
        },
        VirtioDescription {
            addr: 0xd000_0000,
            gsi: 3,
        },
        VirtioDescription {
            addr: 0xd000_0000,
            gsi: 12,
        },
        VirtioDescription {
            addr: 0xffff_f001,
            gsi: 5,
        },
    ] {
        let err = build(&desc(1, &[bad])).unwrap_err();
        assert!(matches!(err, AcpiError::Device { .. }), "{bad:?}");
    }
}

#[test]
fn the_tables_land_in_guest_memory_where_they_say() {
    let mem = GuestMemoryMmap::from_ranges(&crate::memory::ram_ranges(2 << 20)).unwrap();
    let t = tables(2, &virtio(1));
    t.write(&mem).unwrap();
    let mut rsdp = [0u8; 36];
    mem.read_slice(&mut rsdp, GuestAddress(ACPI_RSDP_START))
        .unwrap();
    assert_eq!(&rsdp[..], t.rsdp());
    let (addr, dsdt) = t.table(b"DSDT").unwrap();
    let mut back = vec![0u8; dsdt.len()];
    mem.read_slice(&mut back, GuestAddress(addr)).unwrap();
    assert_eq!(back, dsdt);
}
