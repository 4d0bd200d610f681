/* Walks the ACPI tables as a kernel would and reports what it finds, then
 * acts according to `action=N` on the command line:
 *   0 (default) reset through the i8042;
 *   1 power off through the FADT's sleep control register with the DSDT's S5 type;
 *   2 reset through the FADT's reset register;
 *   3 watch the VM generation ID: print it (and the GED's event register)
 *     whenever it changes, forever.
 * Checks: the RSDP from the zero page and by scanning 0xe0000..0xfffff, every
 * checksum and length, the MADT's local APICs and IOAPIC, every virtio
 * device in the DSDT (and that a virtio device answers there). */
#include "virtio.h"

static void kv_hex(const char *k, u64 v) { puts(k); putc('='); put_hex(v); putc('\n'); }

static void put_sig(const u8 *p) { for (int i = 0; i < 4; i++) putc((char)p[i]); }

static void put_bytes(const u8 *p, u32 n) {
    static const char digits[] = "0123456789abcdef";
    for (u32 i = 0; i < n; i++) { putc(digits[p[i] >> 4]); putc(digits[p[i] & 0xf]); }
}

/* A Generic Address Structure: "space:width:offset:access:address". */
static void kv_gas(const char *k, const u8 *g) {
    puts(k); putc('=');
    put_dec(g[0]); putc(':'); put_dec(g[1]); putc(':'); put_dec(g[2]); putc(':'); put_dec(g[3]);
    putc(':'); put_hex(bp64(g, 4)); putc('\n');
}

/* Walks the MADT's entries; reports enabled local APICs and the IOAPIC. */
static void madt(const u8 *m) {
    u32 len = bp32(m, 4), o = 44, lapics = 0, ioapics = 0;
    int walk_ok = 1;
    kv_hex("madt.lapic_addr", bp32(m, 36));
    kv_dec("madt.pcat_compat", bp32(m, 40) & 1);
    while (o + 2 <= len) {
        u8 type = m[o], elen = m[o + 1];
        if (elen < 2 || o + elen > len) { walk_ok = 0; break; }
        if (type == 0 && (bp32(m, o + 4) & 1)) {
            if (m[o + 3] != lapics) walk_ok = 0; /* APIC IDs 0, 1, 2, ... */
            lapics++;
        }
        if (type == 1) { ioapics++; kv_hex("madt.ioapic", bp32(m, o + 4)); }
        o += elen;
    }
    kv_dec("madt.walk_ok", walk_ok && o == len);
    kv_dec("madt.lapics", lapics);
    kv_dec("madt.ioapics", ioapics);
}

static void watch_vmgenid(const u8 *id, u16 ged_port) {
    u8 last[16];
    for (int i = 0; i < 16; i++) last[i] = id[i];
    puts("acpi: watching\n");
    for (;;) {
        for (volatile u64 spin = 0; spin < 20000; spin++) { }
        int changed = 0;
        for (int i = 0; i < 16; i++) if (((volatile const u8 *)id)[i] != last[i]) changed = 1;
        if (!changed) continue;
        for (int i = 0; i < 16; i++) last[i] = ((volatile const u8 *)id)[i];
        puts("vmgenid="); put_bytes(last, 16);
        puts(" ged="); put_dec(inb(ged_port)); putc('\n');
    }
}

void guest_main(const u8 *zp) {
    const char *cmdline = guest_cmdline(zp);
    u64 action = 0;
    cmdline_u64(cmdline, "action", &action);
    puts("acpi: begin\n");
    const u8 *from_zp = acpi_rsdp_from_zero_page(zp);
    const u8 *scanned = acpi_rsdp_scan();
    kv_hex("rsdp.zero_page", (u64)from_zp);
    kv_hex("rsdp.scan", (u64)scanned);
    const u8 *rsdp = from_zp ? from_zp : scanned;
    if (!rsdp) { puts("acpi: none\n"); reset(); }
    kv_dec("rsdp.checksum_ok", acpi_sig(rsdp, "RSD PTR ", 8) && acpi_sum(rsdp, 20) == 0);
    kv_dec("rsdp.revision", rsdp[15]);
    kv_dec("rsdp.length", bp32(rsdp, 20));
    kv_dec("rsdp.ext_checksum_ok", bp32(rsdp, 20) == 36 && acpi_sum(rsdp, 36) == 0);

    const u8 *xsdt = acpi_xsdt(rsdp);
    kv_dec("xsdt.ok", acpi_sig(xsdt, "XSDT", 4) && acpi_table_ok(xsdt));
    u32 entries = (bp32(xsdt, 4) - 36) / 8;
    kv_dec("xsdt.entries", entries);
    for (u32 i = 0; i < entries && i < 16; i++) {
        const u8 *t = (const u8 *)bp64(xsdt, 36 + 8 * i);
        puts("table="); put_sig(t); putc(' ');
        put_dec(acpi_table_ok(t)); putc(' '); put_dec(bp32(t, 4)); putc('\n');
    }

    const u8 *fadt = acpi_find(rsdp, "FACP");
    const u8 *m = acpi_find(rsdp, "APIC");
    if (!fadt || !m) { puts("acpi: FADT or MADT missing\n"); reset(); }
    kv_dec("fadt.hw_reduced", (bp32(fadt, 112) >> 20) & 1);
    kv_dec("fadt.reset_reg_sup", (bp32(fadt, 112) >> 10) & 1);
    kv_gas("fadt.reset_reg", fadt + 116);
    kv_dec("fadt.reset_value", fadt[128]);
    kv_gas("fadt.sleep_control", fadt + 244);
    kv_gas("fadt.sleep_status", fadt + 256);
    madt(m);

    const u8 *dsdt = acpi_dsdt(fadt);
    puts("table="); put_sig(dsdt); putc(' ');
    put_dec(acpi_table_ok(dsdt)); putc(' '); put_dec(bp32(dsdt, 4)); putc('\n');
    long s5 = aml_package_first(dsdt, "_S5_");
    kv_dec("dsdt.s5", (u64)s5);
    kv_dec("dsdt.com1", acpi_search(dsdt, 36, "COM1", 4) >= 0);
    map_mmio_hole();
    u32 cursor = 36, gsi;
    u64 addr;
    while (acpi_next_virtio(dsdt, &cursor, &addr, &gsi)) {
        puts("dsdt.virtio="); put_hex(addr); putc(' '); put_dec(gsi); putc(' ');
        /* The device ID a virtio-mmio device answers with at that address. */
        put_dec(mmio_r32(addr + VIRTIO_MAGIC) == 0x74726976 ? mmio_r32(addr + VIRTIO_DEVICE_ID) : 0);
        putc('\n');
    }
    u64 vmgenid = acpi_vmgenid_addr(dsdt);
    u16 ged_port = acpi_ged_port(dsdt);
    kv_hex("vmgenid.addr", vmgenid);
    kv_hex("ged.port", ged_port);
    if (vmgenid) { puts("vmgenid="); put_bytes((const u8 *)vmgenid, 16); putc('\n'); }
    puts("acpi: end\n");

    if (action == 1) {
        const u8 *ctl = fadt + 244;
        if (ctl[0] != 1 || s5 < 0) { puts("acpi: cannot power off\n"); reset(); }
        outb((u16)bp64(ctl, 4), (u8)(((u64)s5 << 2) | (1 << 5)));
        puts("acpi: power-off ignored\n");
        for (;;) __asm__ volatile("hlt");
    }
    if (action == 2) {
        const u8 *rr = fadt + 116;
        if (rr[0] != 1) { puts("acpi: cannot reset\n"); reset(); }
        outb((u16)bp64(rr, 4), fadt[128]);
        puts("acpi: reset ignored\n");
        for (;;) __asm__ volatile("hlt");
    }
    if (action == 3 && vmgenid && ged_port) watch_vmgenid((const u8 *)vmgenid, ged_port);
    reset();
}
