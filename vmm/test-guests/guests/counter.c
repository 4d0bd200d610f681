/* Counts in memory forever and prints the count every `interval=N`
 * increments (command line; default 100000). The counter lives at a fixed
 * symbol in .data so snapshot tests can also find it in guest memory. */
#include "guest.h"

volatile u64 counter_value = 0;

void guest_main(const u8 *zero_page) {
    const char *cmdline = (const char *)(u64)bp32(zero_page, BP_CMD_LINE_PTR);
    u64 interval = 100000;
    if (!cmdline_u64(cmdline, "interval", &interval) || interval == 0) interval = 100000;
    puts("counter: start\n");
    u64 next = interval;
    for (;;) {
        u64 v = counter_value + 1;
        counter_value = v;
        if (v == next) {
            puts("count=");
            put_dec(v);
            putc('\n');
            next += interval;
        }
    }
}
