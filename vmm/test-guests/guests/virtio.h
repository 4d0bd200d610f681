/* A polling virtio-mmio (version 2) driver for test guests: maps the MMIO
 * hole, finds a device announced on the command line
 * (virtio_mmio.device=4K@0xADDR:GSI, with --acpi off) or in the ACPI DSDT
 * (the default), negotiates VERSION_1, sets up split queues in guest memory
 * and polls the used ring (no interrupts). */
#ifndef VIRTIO_H
#define VIRTIO_H

#include "acpi.h"
#include "guest.h"

#define VIRTIO_MAGIC 0x000
#define VIRTIO_VERSION 0x004
#define VIRTIO_DEVICE_ID 0x008
#define VIRTIO_DEVICE_FEATURES 0x010
#define VIRTIO_DEVICE_FEATURES_SEL 0x014
#define VIRTIO_DRIVER_FEATURES 0x020
#define VIRTIO_DRIVER_FEATURES_SEL 0x024
#define VIRTIO_QUEUE_SEL 0x030
#define VIRTIO_QUEUE_NUM_MAX 0x034
#define VIRTIO_QUEUE_NUM 0x038
#define VIRTIO_QUEUE_READY 0x044
#define VIRTIO_QUEUE_NOTIFY 0x050
#define VIRTIO_INTERRUPT_STATUS 0x060
#define VIRTIO_INTERRUPT_ACK 0x064
#define VIRTIO_STATUS 0x070
#define VIRTIO_QUEUE_DESC_LOW 0x080
#define VIRTIO_QUEUE_DESC_HIGH 0x084
#define VIRTIO_QUEUE_DRIVER_LOW 0x090
#define VIRTIO_QUEUE_DRIVER_HIGH 0x094
#define VIRTIO_QUEUE_DEVICE_LOW 0x0a0
#define VIRTIO_QUEUE_DEVICE_HIGH 0x0a4
#define VIRTIO_CONFIG 0x100

#define S_ACK 1
#define S_DRIVER 2
#define S_DRIVER_OK 4
#define S_FEATURES_OK 8
#define S_NEEDS_RESET 0x40

#define VQ_F_NEXT 1
#define VQ_F_WRITE 2

#define QSZ 16

static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }
static inline u32 mmio_r32(u64 a) { return *(volatile u32 *)a; }
static inline void mmio_w32(u64 a, u32 v) { *(volatile u32 *)a = v; }

struct vq_desc { u64 addr; u32 len; u16 flags; u16 next; };
struct vq_used_elem { u32 id; u32 len; };

struct vring {
    struct vq_desc desc[QSZ];
    volatile u16 avail_flags;
    volatile u16 avail_idx;
    volatile u16 avail_ring[QSZ];
    volatile u16 used_event;
    struct {
        volatile u16 flags;
        volatile u16 idx;
        volatile struct vq_used_elem ring[QSZ];
        volatile u16 avail_event;
    } __attribute__((aligned(4))) used;
    u16 last_used;
} __attribute__((aligned(4096)));

static u64 mmio_pd[512] __attribute__((aligned(4096)));

/* Maps 3..4 GiB (the MMIO hole) with uncached 2 MiB pages. */
static inline void map_mmio_hole(void) {
    u64 cr3;
    __asm__ volatile("mov %%cr3, %0" : "=r"(cr3));
    u64 *pml4 = (u64 *)(cr3 & ~0xfffUL);
    u64 *pdpt = (u64 *)(pml4[0] & ~0xfffUL);
    for (u64 i = 0; i < 512; i++) mmio_pd[i] = (0xC0000000UL + (i << 21)) | 0x83 | 0x18;
    pdpt[3] = (u64)mmio_pd | 3;
    __asm__ volatile("mov %0, %%cr3" : : "r"(cr3) : "memory");
}

static inline const char *guest_cmdline(const u8 *zp) {
    return (const char *)(u64)bp32(zp, BP_CMD_LINE_PTR);
}

static inline int is_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static inline u64 hex_digit(char c) {
    if (c >= '0' && c <= '9') return (u64)(c - '0');
    if (c >= 'a' && c <= 'f') return (u64)(c - 'a' + 10);
    return (u64)(c - 'A' + 10);
}

/* Whether a virtio-mmio version 2 device with `device_id` answers at `addr`. */
static inline int virtio_is(u64 addr, u32 device_id) {
    return mmio_r32(addr + VIRTIO_MAGIC) == 0x74726976 && mmio_r32(addr + VIRTIO_VERSION) == 2 &&
           mmio_r32(addr + VIRTIO_DEVICE_ID) == device_id;
}

/* Whether `addr` is a device page inside the MMIO hole map_mmio_hole maps
 * (anything else would fault: a bad command line must not crash the guest). */
static inline int in_mmio_hole(u64 addr) {
    return addr >= 0xC0000000UL && addr <= 0xFFFFF000UL && (addr & 0xfff) == 0;
}

/* The first device with `device_id` the DSDT describes, or 0. */
static inline u64 virtio_find_acpi(const u8 *zp, u32 device_id) {
    const u8 *rsdp = acpi_rsdp_from_zero_page(zp);
    if (!rsdp) return 0;
    const u8 *fadt = acpi_find(rsdp, "FACP");
    if (!fadt) return 0;
    const u8 *dsdt = acpi_dsdt(fadt);
    if (!acpi_table_ok(dsdt)) return 0;
    u32 cursor = 36, gsi;
    u64 addr;
    while (acpi_next_virtio(dsdt, &cursor, &addr, &gsi))
        if (in_mmio_hole(addr) && virtio_is(addr, device_id)) return addr;
    return 0;
}

/* Returns the base of the first announced virtio-mmio device with `device_id`
 * (command line first, then ACPI), or 0. The command line's entries are
 * `virtio_mmio.device=SIZE@0xADDR:GSI`, as the vmm writes them with --acpi
 * off and as Firecracker always writes them (its devices sit at
 * 0xc0001000, 0xc0002000, ...); the DSDT is the vmm's default. */
static inline u64 virtio_find(const u8 *zp, u32 device_id) {
    static int mapped = 0;
    if (!mapped) { map_mmio_hole(); mapped = 1; }
    const char *key = "virtio_mmio.device=";
    for (const char *p = guest_cmdline(zp); *p; p++) {
        const char *k = key, *q = p;
        while (*k && *q == *k) { k++; q++; }
        if (*k) continue;
        while (*q && *q != '@' && *q != ' ') q++;
        if (q[0] != '@' || q[1] != '0' || q[2] != 'x') continue;
        q += 3;
        u64 addr = 0;
        for (int digits = 0; is_hex(*q) && digits < 16; digits++) addr = addr * 16 + hex_digit(*q++);
        if (in_mmio_hole(addr) && virtio_is(addr, device_id)) return addr;
    }
    return virtio_find_acpi(zp, device_id);
}

/* Reset, ACK, DRIVER, features (VERSION_1 plus the offered ones in `want_lo`), FEATURES_OK.
 * Returns the accepted low feature word, or -1 when FEATURES_OK is refused. */
static inline long virtio_init(u64 base, u32 want_lo) {
    mmio_w32(base + VIRTIO_STATUS, 0);
    mmio_w32(base + VIRTIO_STATUS, S_ACK);
    mmio_w32(base + VIRTIO_STATUS, S_ACK | S_DRIVER);
    mmio_w32(base + VIRTIO_DEVICE_FEATURES_SEL, 0);
    u32 lo = mmio_r32(base + VIRTIO_DEVICE_FEATURES) & want_lo;
    mmio_w32(base + VIRTIO_DEVICE_FEATURES_SEL, 1);
    u32 hi = mmio_r32(base + VIRTIO_DEVICE_FEATURES) & 1; /* VERSION_1 is bit 32 */
    mmio_w32(base + VIRTIO_DRIVER_FEATURES_SEL, 0);
    mmio_w32(base + VIRTIO_DRIVER_FEATURES, lo);
    mmio_w32(base + VIRTIO_DRIVER_FEATURES_SEL, 1);
    mmio_w32(base + VIRTIO_DRIVER_FEATURES, hi);
    mmio_w32(base + VIRTIO_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
    if (!(mmio_r32(base + VIRTIO_STATUS) & S_FEATURES_OK)) return -1;
    return lo;
}

/* Configures queue `idx` with `size` entries in `r`; returns QueueReady as read back. */
static inline u32 vq_setup(u64 base, u32 idx, struct vring *r, u32 size) {
    u8 *bytes = (u8 *)r;
    for (u64 i = 0; i < sizeof(*r); i++) bytes[i] = 0;
    mmio_w32(base + VIRTIO_QUEUE_SEL, idx);
    mmio_w32(base + VIRTIO_QUEUE_NUM, size);
    mmio_w32(base + VIRTIO_QUEUE_DESC_LOW, (u32)(u64)r->desc);
    mmio_w32(base + VIRTIO_QUEUE_DESC_HIGH, (u32)((u64)r->desc >> 32));
    mmio_w32(base + VIRTIO_QUEUE_DRIVER_LOW, (u32)(u64)&r->avail_flags);
    mmio_w32(base + VIRTIO_QUEUE_DRIVER_HIGH, (u32)((u64)&r->avail_flags >> 32));
    mmio_w32(base + VIRTIO_QUEUE_DEVICE_LOW, (u32)(u64)&r->used);
    mmio_w32(base + VIRTIO_QUEUE_DEVICE_HIGH, (u32)((u64)&r->used >> 32));
    mmio_w32(base + VIRTIO_QUEUE_READY, 1);
    return mmio_r32(base + VIRTIO_QUEUE_READY);
}

static inline u32 virtio_driver_ok(u64 base) {
    mmio_w32(base + VIRTIO_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
    return mmio_r32(base + VIRTIO_STATUS);
}

static inline void vq_desc_set(struct vring *r, u16 i, u64 addr, u32 len, u16 flags, u16 next) {
    r->desc[i].addr = addr;
    r->desc[i].len = len;
    r->desc[i].flags = flags;
    r->desc[i].next = next;
}

/* Makes chain `head` available (no notify). */
static inline void vq_offer(struct vring *r, u16 head) {
    r->avail_ring[r->avail_idx % QSZ] = head;
    barrier();
    r->avail_idx = (u16)(r->avail_idx + 1);
    barrier();
}

static inline void vq_notify(u64 base, u32 qidx) { mmio_w32(base + VIRTIO_QUEUE_NOTIFY, qidx); }

/* Polls for the next used entry; returns its length or 0xffffffff after `spins` polls. */
static inline u32 vq_wait(struct vring *r, u64 spins) {
    for (u64 i = 0; i < spins; i++) {
        if (r->used.idx != r->last_used) {
            barrier();
            u32 len = r->used.ring[r->last_used % QSZ].len;
            r->last_used = (u16)(r->last_used + 1);
            return len;
        }
    }
    return 0xffffffffu;
}

#define SPINS 20000000UL

/* Offers chain `head` on queue `qidx`, notifies and waits for it to be used. */
static inline u32 vq_run(u64 base, u32 qidx, struct vring *r, u16 head) {
    vq_offer(r, head);
    vq_notify(base, qidx);
    return vq_wait(r, SPINS);
}

static inline void kv_dec(const char *k, u64 v) { puts(k); putc('='); put_dec(v); putc('\n'); }

#endif
