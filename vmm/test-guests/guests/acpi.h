/* Finds and checks the ACPI tables the vmm gives a guest, the way a kernel
 * does: the RSDP from the zero page's acpi_rsdp_addr (or by scanning
 * 0xe0000..0xfffff on 16-byte boundaries), then RSDP -> XSDT -> tables, and
 * the few DSDT objects the tests need, found in the AML bytes (a test guest
 * cannot run AML). Plain integer code only. */
#ifndef ACPI_H
#define ACPI_H

#include "guest.h"

/* boot_params.acpi_rsdp_addr (Linux bootparam.h). */
#define BP_ACPI_RSDP_ADDR 0x070
#define ACPI_SCAN_START 0xe0000UL
#define ACPI_SCAN_END 0x100000UL
/* Longest table the checks accept: the vmm's ACPI area is 128 KiB. */
#define ACPI_MAX_TABLE 0x20000u

static inline u8 acpi_sum(const u8 *p, u64 len) {
    u8 s = 0;
    for (u64 i = 0; i < len; i++) s = (u8)(s + p[i]);
    return s;
}

static inline int acpi_sig(const u8 *p, const char *sig, u32 n) {
    for (u32 i = 0; i < n; i++)
        if (p[i] != (u8)sig[i]) return 0;
    return 1;
}

/* The RSDP the zero page points at, or 0. */
static inline const u8 *acpi_rsdp_from_zero_page(const u8 *zp) {
    return (const u8 *)bp64(zp, BP_ACPI_RSDP_ADDR);
}

/* The first RSDP (signature and 20-byte checksum) on a 16-byte boundary in
 * 0xe0000..0xfffff, where Linux looks without a pointer; or 0. */
static inline const u8 *acpi_rsdp_scan(void) {
    for (u64 a = ACPI_SCAN_START; a + 20 <= ACPI_SCAN_END; a += 16) {
        const u8 *p = (const u8 *)a;
        if (acpi_sig(p, "RSD PTR ", 8) && acpi_sum(p, 20) == 0) return p;
    }
    return 0;
}

/* A table whose length is sane and whose bytes sum to zero. */
static inline int acpi_table_ok(const u8 *t) {
    u32 len = bp32(t, 4);
    return len >= 36 && len <= ACPI_MAX_TABLE && acpi_sum(t, len) == 0;
}

static inline const u8 *acpi_xsdt(const u8 *rsdp) { return (const u8 *)bp64(rsdp, 24); }

/* The table with signature `sig` listed in the XSDT, or 0. */
static inline const u8 *acpi_find(const u8 *rsdp, const char *sig) {
    const u8 *xsdt = acpi_xsdt(rsdp);
    u32 len = bp32(xsdt, 4);
    for (u32 o = 36; o + 8 <= len && o < ACPI_MAX_TABLE; o += 8) {
        const u8 *t = (const u8 *)bp64(xsdt, o);
        if (acpi_sig(t, sig, 4)) return t;
    }
    return 0;
}

/* The DSDT the FADT points at (X_DSDT, else DSDT). */
static inline const u8 *acpi_dsdt(const u8 *fadt) {
    u64 x = bp64(fadt, 140);
    return (const u8 *)(x ? x : (u64)bp32(fadt, 40));
}

/* Offset of the first `n` bytes equal to `needle` in table `t` at or after
 * `from`, or -1. */
static inline long acpi_search(const u8 *t, u32 from, const char *needle, u32 n) {
    u32 len = bp32(t, 4);
    for (u32 o = from; o + n <= len; o++)
        if (acpi_sig(t + o, needle, n)) return (long)o;
    return -1;
}

/* Decodes the AML integer at p (ZeroOp, OneOp, OnesOp or a Byte/Word/DWord/
 * QWord constant): returns the bytes it takes (0 if it is none of those). */
static inline u32 aml_int(const u8 *p, u64 *v) {
    switch (p[0]) {
    case 0x00: *v = 0; return 1;
    case 0x01: *v = 1; return 1;
    case 0xff: *v = ~0UL; return 1;
    case 0x0a: *v = p[1]; return 2;
    case 0x0b: *v = bp16(p, 1); return 3;
    case 0x0c: *v = bp32(p, 1); return 5;
    case 0x0e: *v = bp64(p, 1); return 9;
    default: return 0;
    }
}

/* The first element of the package named `name` (e.g. "_S5_"), or -1. */
static inline long aml_package_first(const u8 *dsdt, const char *name) {
    long at = acpi_search(dsdt, 36, name, 4);
    if (at < 0) return -1;
    const u8 *p = dsdt + at + 4;
    if (p[0] != 0x12) return -1;             /* PackageOp */
    p += 1 + ((p[1] >> 6) + 1);              /* PkgLength */
    p += 1;                                  /* NumElements */
    u64 v;
    return aml_int(p, &v) ? (long)v : -1;
}

/* The next virtio-mmio device (_HID "LNRO0005") after offset *cursor: its
 * Memory32Fixed base and its extended interrupt's GSI. Returns 0 at the end. */
static inline int acpi_next_virtio(const u8 *dsdt, u32 *cursor, u64 *addr, u32 *gsi) {
    long hid = acpi_search(dsdt, *cursor, "LNRO0005", 8);
    if (hid < 0) return 0;
    long mem = acpi_search(dsdt, (u32)hid, "\x86\x09\x00", 3);
    long irq = acpi_search(dsdt, (u32)hid, "\x89\x06\x00", 3);
    if (mem < 0 || irq < 0) return 0;
    *addr = bp32(dsdt, (u32)mem + 4);
    *gsi = bp32(dsdt, (u32)irq + 5);
    *cursor = (u32)hid + 8;
    return 1;
}

/* The VM generation ID's address from `Method (ADDR) { Return (Package (2)
 * { low, high }) }` in the VMGENCTR device, or 0. */
static inline u64 acpi_vmgenid_addr(const u8 *dsdt) {
    long dev = acpi_search(dsdt, 36, "VMGENCTR", 8);
    if (dev < 0) return 0;
    long m = acpi_search(dsdt, (u32)dev, "ADDR", 4);
    if (m < 0) return 0;
    const u8 *p = dsdt + m + 4 + 1;          /* name, method flags */
    if (p[0] != 0xa4 || p[1] != 0x12) return 0; /* ReturnOp PackageOp */
    p += 2 + ((p[2] >> 6) + 1);              /* PkgLength */
    if (p[0] != 2) return 0;                 /* NumElements */
    u64 low, high;
    u32 n = aml_int(p + 1, &low);
    if (!n || !aml_int(p + 1 + n, &high)) return 0;
    return (low & 0xffffffffUL) | (high << 32);
}

/* The port of the GED's event register (OperationRegion GDST, SystemIO), or 0. */
static inline u16 acpi_ged_port(const u8 *dsdt) {
    long r = acpi_search(dsdt, 36, "\x5b\x80GDST\x01", 7);
    u64 port;
    if (r < 0 || !aml_int(dsdt + r + 7, &port)) return 0;
    return (u16)port;
}

#endif
