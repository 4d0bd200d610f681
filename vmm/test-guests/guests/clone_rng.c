/* Random numbers in a cloned VM. The guest seeds a generator (splitmix64)
 * once at boot, from the VM generation ID it booted with, and keeps its
 * state only in memory, as a kernel keeps its CRNG's. It prints
 * `clone_rng: waiting` and watches the generation ID. When the ID changes
 * (the vmm writes a new one when a restored VM first runs, before any of
 * its guest code) it prints
 *   vmgenid=<the new ID, 32 hex digits>
 *   memory_only=<the generator's next 4 outputs: its memory state alone>
 *   reseeded=<4 outputs of that same state with the new ID mixed in>
 * and watches again. Every restore of one snapshot prints the same
 * memory_only line (the clones share their "random" state) and its own
 * reseeded line: only something fresh per restore tells clones apart,
 * which is what Linux's vmgenid driver and guest-init's CRNG reseed do for
 * a real guest. Without a generation ID (`--acpi off`) it says so and
 * resets. */
#include "acpi.h"

static u64 rng_state;

static u64 splitmix64(u64 *state) {
    u64 z = (*state += 0x9e3779b97f4a7c15UL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9UL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebUL;
    return z ^ (z >> 31);
}

/* The 16-byte ID folded into 64 bits. */
static u64 fold(const volatile u8 *id) {
    u64 lo = 0, hi = 0;
    for (int i = 7; i >= 0; i--) {
        lo = (lo << 8) | id[i];
        hi = (hi << 8) | id[8 + i];
    }
    return lo ^ ((hi << 32) | (hi >> 32));
}

static void put_draws(const char *key, u64 *state) {
    puts(key);
    putc('=');
    for (int i = 0; i < 4; i++) {
        if (i) putc(',');
        put_hex(splitmix64(state));
    }
    putc('\n');
}

static void put_id(const u8 *id) {
    static const char digits[] = "0123456789abcdef";
    puts("vmgenid=");
    for (int i = 0; i < 16; i++) { putc(digits[id[i] >> 4]); putc(digits[id[i] & 0xf]); }
    putc('\n');
}

void guest_main(const u8 *zp) {
    const u8 *rsdp = acpi_rsdp_from_zero_page(zp);
    if (!rsdp) rsdp = acpi_rsdp_scan();
    const u8 *fadt = rsdp ? acpi_find(rsdp, "FACP") : 0;
    u64 addr = fadt ? acpi_vmgenid_addr(acpi_dsdt(fadt)) : 0;
    if (!addr) { puts("clone_rng: no vmgenid\n"); reset(); }
    const volatile u8 *id = (const volatile u8 *)addr;

    u64 seed = fold(id);
    rng_state = splitmix64(&seed);
    u8 last[16];
    for (int i = 0; i < 16; i++) last[i] = id[i];
    puts("clone_rng: waiting\n");
    for (;;) {
        for (volatile u64 spin = 0; spin < 20000; spin++) { }
        int changed = 0;
        for (int i = 0; i < 16; i++) if (id[i] != last[i]) changed = 1;
        if (!changed) continue;
        for (int i = 0; i < 16; i++) last[i] = id[i];
        put_id(last);
        u64 mixed = rng_state ^ fold(last);
        put_draws("memory_only", &rng_state);
        put_draws("reseeded", &mixed);
    }
}
