/* Dirties guest memory for snapshot benchmarks: writes one byte into each of
 * `permille=N` thousandths of the guest's RAM pages (command line; default
 * 10, i.e. 1 %), prints `pass=K`, and does it again, forever. Pages are taken
 * from RAM (e820) starting at 4 MiB, inside the identity-mapped first GiB, so
 * the dirty set is the same pages on every pass. */
#include "guest.h"

#define PAGE 4096UL
#define FIRST_PAGE 0x400000UL
#define MAPPED_END 0x40000000UL
#define E820_RAM 1

static u64 dirty_pass(const u8 *zero_page, u64 want, u8 value) {
    u8 entries = bp8(zero_page, BP_E820_ENTRIES);
    u64 done = 0;
    for (u8 i = 0; i < entries && done < want; i++) {
        u32 off = BP_E820_TABLE + 20 * (u32)i;
        if (bp32(zero_page, off + 16) != E820_RAM) continue;
        u64 start = bp64(zero_page, off);
        u64 end = start + bp64(zero_page, off + 8);
        if (start < FIRST_PAGE) start = FIRST_PAGE;
        start = (start + PAGE - 1) & ~(PAGE - 1);
        if (end > MAPPED_END) end = MAPPED_END;
        for (u64 p = start; p + PAGE <= end && done < want; p += PAGE, done++)
            *(volatile u8 *)p = value;
    }
    return done;
}

void guest_main(const u8 *zero_page) {
    const char *cmdline = (const char *)(u64)bp32(zero_page, BP_CMD_LINE_PTR);
    u64 permille = 10;
    if (!cmdline_u64(cmdline, "permille", &permille) || permille > 1000) permille = 10;
    u8 entries = bp8(zero_page, BP_E820_ENTRIES);
    u64 ram = 0;
    for (u8 i = 0; i < entries; i++) {
        u32 off = BP_E820_TABLE + 20 * (u32)i;
        if (bp32(zero_page, off + 16) == E820_RAM) ram += bp64(zero_page, off + 8);
    }
    u64 want = ram / PAGE * permille / 1000;
    puts("dirtier: start pages=");
    put_dec(want);
    putc('\n');
    for (u64 pass = 1;; pass++) {
        u64 done = dirty_pass(zero_page, want, (u8)pass);
        if (done < want) {
            puts("dirtier: only ");
            put_dec(done);
            puts(" pages fit below 1 GiB\n");
        }
        puts("pass=");
        put_dec(pass);
        putc('\n');
    }
}
