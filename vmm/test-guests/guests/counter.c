/* Counts in memory forever and prints the count every `interval=N`
 * increments (command line; default 100000). The counter lives at a fixed
 * symbol in .data so snapshot tests can also find it in guest memory.
 *
 * `halt_after=K` (K > 0): once it has printed its K-th count it prints
 * `counter: idle` and stops in a HLT loop with interrupts off, so the vCPU
 * sleeps for good. A snapshot taken before that (perf's density scenario)
 * restores into a guest that prints its remaining counts, then idles. */
#include "guest.h"

volatile u64 counter_value = 0;

static void idle(void) {
    puts("counter: idle\n");
    for (;;) __asm__ volatile("hlt");
}

void guest_main(const u8 *zero_page) {
    const char *cmdline = (const char *)(u64)bp32(zero_page, BP_CMD_LINE_PTR);
    u64 interval = 100000;
    if (!cmdline_u64(cmdline, "interval", &interval) || interval == 0) interval = 100000;
    u64 halt_after = 0;
    if (!cmdline_u64(cmdline, "halt_after", &halt_after)) halt_after = 0;
    puts("counter: start\n");
    u64 next = interval;
    u64 printed = 0;
    for (;;) {
        u64 v = counter_value + 1;
        counter_value = v;
        if (v == next) {
            puts("count=");
            put_dec(v);
            putc('\n');
            next += interval;
            printed++;
            if (halt_after && printed == halt_after) idle();
        }
    }
}
