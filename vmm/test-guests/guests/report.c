/* Reports what the vmm gave it: zero-page fields, the command line, the
 * e820 map, CPUID identity and feature flags (leaves 1 and 7) and the MP
 * table signature; then resets. */
#include "guest.h"

static void kv_hex(const char *k, u64 v) { puts(k); putc('='); put_hex(v); putc('\n'); }
static void kv_dec(const char *k, u64 v) { puts(k); putc('='); put_dec(v); putc('\n'); }

static void put_reg_chars(u32 r) {
    for (int i = 0; i < 4; i++) {
        char c = (char)((r >> (8 * i)) & 0xff);
        if (c) putc(c);
    }
}

void guest_main(const u8 *zp) {
    puts("report: begin\n");
    kv_hex("boot.zero_page", (u64)zp);
    kv_hex("boot.flag", bp16(zp, BP_BOOT_FLAG));
    kv_hex("boot.header", bp32(zp, BP_HEADER));
    kv_hex("boot.loader", bp8(zp, BP_TYPE_OF_LOADER));
    kv_hex("boot.cmdline_ptr", bp32(zp, BP_CMD_LINE_PTR));
    kv_dec("boot.cmdline_size", bp32(zp, BP_CMDLINE_SIZE));
    puts("cmdline=");
    puts((const char *)(u64)bp32(zp, BP_CMD_LINE_PTR));
    putc('\n');

    u8 n = bp8(zp, BP_E820_ENTRIES);
    kv_dec("e820.count", n);
    for (u8 i = 0; i < n && i < 128; i++) {
        u32 off = BP_E820_TABLE + 20u * i;
        puts("e820=");
        put_hex(bp64(zp, off));
        putc(' ');
        put_hex(bp64(zp, off + 8));
        putc(' ');
        put_dec(bp32(zp, off + 16));
        putc('\n');
    }

    u32 a, b, c, d;
    cpuid(0, 0, &a, &b, &c, &d);
    puts("cpuid.vendor=");
    put_reg_chars(b); put_reg_chars(d); put_reg_chars(c);
    putc('\n');
    cpuid(1, 0, &a, &b, &c, &d);
    kv_dec("cpuid.hypervisor", (c >> 31) & 1);
    kv_dec("cpuid.apic_id", b >> 24);
    kv_dec("cpuid.logical_count", (b >> 16) & 0xff);
    kv_hex("cpuid.1.ecx", c);
    kv_hex("cpuid.1.edx", d);
    cpuid(7, 0, &a, &b, &c, &d);
    kv_hex("cpuid.7.ebx", b);
    kv_hex("cpuid.7.ecx", c);
    kv_hex("cpuid.7.edx", d);
    cpuid(0x40000000, 0, &a, &b, &c, &d);
    puts("cpuid.hv_signature=");
    put_reg_chars(b); put_reg_chars(c); put_reg_chars(d);
    putc('\n');

    const u8 *mp = (const u8 *)0x9fc00;
    puts("mp.signature=");
    for (int i = 0; i < 4; i++) putc((char)mp[i]);
    putc('\n');
    kv_dec("mp.entries", mp[16 + 34] | (mp[16 + 35] << 8));

    puts("report: end\n");
    reset();
}
