/* net_perf: moves Ethernet frames through the first virtio-net device as
 * fast as its rings allow, for perf's net-throughput and net-latency
 * scenarios. It runs under this repository's vmm and under Firecracker:
 * the device is found from the command line's virtio_mmio.device= entries
 * (Firecracker's, or the vmm's with --acpi off) or from the ACPI DSDT.
 *
 * Command line:
 *   mode=tx    waits for a frame of kind 'G' (go), then sends count=N
 *              frames of size=S bytes (Ethernet header included, 60 to
 *              1514; default 1000 frames of 1514 bytes), keeping the
 *              transmit ring full (every descriptor points at the same
 *              frame, so nothing is copied per frame); prints
 *              "net_perf: tx done frames=N" when the device has used them all
 *   mode=rx    posts a receive buffer per ring slot and counts the frames
 *              of kind 'D' until count=N arrived, reposting buffers as they
 *              are used; every 64 frames, and at the N-th, it sends a
 *              64-byte ack frame (kind 'A') carrying the counts; prints
 *              "net_perf: rx done frames=N bytes=B"
 *   mode=echo  sends every received frame of type 0x88b5 back unchanged
 *              (from the buffer it arrived in, its virtio-net header
 *              cleared), until the VM is killed
 * "net_perf: ready mode=M queue=Q" is printed once the rings are set up
 * and the receive buffers posted; tx and rx reset the VM at the end.
 *
 * Frames: Ethernet type 0x88b5; byte 14 says what the frame is: 'G' go
 * and 'T' guest data (tx), 'D' host data and 'A' ack (rx), 'P' ping (echo). An ack holds the
 * frames counted at byte 16 and their bytes (Ethernet header included,
 * virtio-net header not) at byte 24, each a little-endian u64. */
#include "virtio.h"

#define NQ 256u          /* ring slots wanted (both VMMs offer 256) */
#define HDR 12u          /* struct virtio_net_hdr_v1 */
#define BUF 2048u        /* receive buffer: HDR + 1514, rounded up */
#define FRAME_MIN 60u
#define FRAME_MAX 1514u
#define ACK_EVERY 64u
#define ACKS 32u         /* ack frames in flight at most */
#define ACK_LEN 64u
#define CMDLINE_MAX 4096u

/* A split virtqueue of up to NQ entries (virtio.h's struct vring has 16). */
struct ring {
    struct vq_desc desc[NQ];
    volatile u16 avail_flags;
    volatile u16 avail_idx;
    volatile u16 avail_ring[NQ];
    volatile u16 used_event;
    struct {
        volatile u16 flags;
        volatile u16 idx;
        volatile struct vq_used_elem ring[NQ];
        volatile u16 avail_event;
    } __attribute__((aligned(4))) used;
} __attribute__((aligned(4096)));

static struct ring rxq, txq;
static u8 rxbuf[NQ][BUF] __attribute__((aligned(64)));
static u8 txframe[HDR + FRAME_MAX] __attribute__((aligned(64)));
static u8 ackbuf[ACKS][HDR + ACK_LEN] __attribute__((aligned(64)));
static u8 ack_busy[ACKS];
static u32 nacks;          /* ack slots in use: ACKS, or q if smaller */

static u64 base;
static u32 q;              /* ring size in use: a power of two <= NQ */
static u16 rx_avail, rx_last, tx_avail, tx_last;
static u8 mac[6];

/* The value of "key=" on the command line, or 0. */
static const char *arg(const char *cmdline, const char *key) {
    for (u32 i = 0; i < CMDLINE_MAX && cmdline[i]; i++) {
        if (i && cmdline[i - 1] != ' ') continue;
        u32 k = 0;
        while (key[k] && i + k < CMDLINE_MAX && cmdline[i + k] == key[k]) k++;
        if (key[k] || i + k >= CMDLINE_MAX || cmdline[i + k] != '=') continue;
        return cmdline + i + k + 1;
    }
    return 0;
}

/* Whether the word at `v` is exactly `word`. */
static int is_word(const char *v, const char *word) {
    while (*word && *v == *word) { v++; word++; }
    return !*word && (*v == 0 || *v == ' ');
}

static void fail(const char *why) {
    puts("net_perf: error: ");
    puts(why);
    putc('\n');
    reset();
}

/* Configures queue `idx` with `size` entries in `r` (all zero: bss). */
static void ring_setup(u32 idx, struct ring *r, u32 size) {
    mmio_w32(base + VIRTIO_QUEUE_SEL, idx);
    mmio_w32(base + VIRTIO_QUEUE_NUM, size);
    mmio_w32(base + VIRTIO_QUEUE_DESC_LOW, (u32)(u64)r->desc);
    mmio_w32(base + VIRTIO_QUEUE_DESC_HIGH, (u32)((u64)r->desc >> 32));
    mmio_w32(base + VIRTIO_QUEUE_DRIVER_LOW, (u32)(u64)&r->avail_flags);
    mmio_w32(base + VIRTIO_QUEUE_DRIVER_HIGH, (u32)((u64)&r->avail_flags >> 32));
    mmio_w32(base + VIRTIO_QUEUE_DEVICE_LOW, (u32)(u64)&r->used);
    mmio_w32(base + VIRTIO_QUEUE_DEVICE_HIGH, (u32)((u64)&r->used >> 32));
    mmio_w32(base + VIRTIO_QUEUE_READY, 1);
    if (mmio_r32(base + VIRTIO_QUEUE_READY) != 1) fail("queue not ready");
}

/* The largest power of two <= both NQ and every queue's maximum. */
static u32 ring_size(void) {
    u32 size = NQ;
    for (u32 idx = 0; idx < 2; idx++) {
        mmio_w32(base + VIRTIO_QUEUE_SEL, idx);
        u32 max = mmio_r32(base + VIRTIO_QUEUE_NUM_MAX);
        while (size > max) size >>= 1;
    }
    return size;
}

/* Makes descriptor `id` available on `r` (the index is published later). */
static inline void offer(struct ring *r, u16 *avail, u16 id) {
    r->avail_ring[*avail & (q - 1)] = id;
    *avail = (u16)(*avail + 1);
}

/* Publishes what was offered on queue `idx` and tells the device. */
static inline void publish(struct ring *r, u16 avail, u32 idx) {
    barrier();
    r->avail_idx = avail;
    barrier();
    mmio_w32(base + VIRTIO_QUEUE_NOTIFY, idx);
}

static void put_le64(u8 *p, u64 v) {
    for (int i = 0; i < 8; i++) { p[i] = (u8)v; v >>= 8; }
}

/* Ethernet header to broadcast from our MAC, type 0x88b5, kind `kind`. */
static void eth_header(u8 *eth, u8 kind) {
    for (int i = 0; i < 6; i++) { eth[i] = 0xff; eth[6 + i] = mac[i]; }
    eth[12] = 0x88;
    eth[13] = 0xb5;
    eth[14] = kind;
}

static int ours(const u8 *eth, u32 len, u8 kind) {
    return len >= 15 && eth[12] == 0x88 && eth[13] == 0xb5 && (kind == 0 || eth[14] == kind);
}

/* Waits for a frame of kind 'G', reposting every buffer used. */
static void wait_go(void) {
    for (;;) {
        u16 used = rxq.used.idx;
        if (used == rx_last) continue;
        barrier();
        int go = 0;
        while (rx_last != used) {
            u32 id = rxq.used.ring[rx_last & (q - 1)].id;
            u32 len = rxq.used.ring[rx_last & (q - 1)].len;
            rx_last = (u16)(rx_last + 1);
            if (id >= q) continue;
            if (len > HDR && len <= BUF && ours(rxbuf[id] + HDR, len - HDR, 'G')) go = 1;
            offer(&rxq, &rx_avail, (u16)id);
        }
        publish(&rxq, rx_avail, 0);
        if (go) return;
    }
}

static void tx_mode(u64 count, u32 size) {
    eth_header(txframe + HDR, 'T');
    u16 free[NQ];
    u32 nfree = 0;
    for (u32 i = 0; i < q; i++) {
        txq.desc[i].addr = (u64)txframe;
        txq.desc[i].len = HDR + size;
        txq.desc[i].flags = 0;
        txq.desc[i].next = 0;
        free[nfree++] = (u16)i;
    }
    kv_dec("net_perf: ready mode=tx queue", q);
    wait_go();
    u64 offered = 0, done = 0;
    while (done < count) {
        u16 used = txq.used.idx;
        barrier();
        while (tx_last != used) {
            u32 id = txq.used.ring[tx_last & (q - 1)].id;
            tx_last = (u16)(tx_last + 1);
            done++;
            if (id < q && nfree < q) free[nfree++] = (u16)id;
        }
        u32 added = 0;
        while (nfree && offered < count) {
            offer(&txq, &tx_avail, free[--nfree]);
            offered++;
            added++;
        }
        if (added) publish(&txq, tx_avail, 1);
    }
    kv_dec("net_perf: tx done frames", done);
}

/* Takes back the ack frames the device has sent. */
static void reclaim_acks(void) {
    u16 used = txq.used.idx;
    barrier();
    while (tx_last != used) {
        u32 id = txq.used.ring[tx_last & (q - 1)].id;
        tx_last = (u16)(tx_last + 1);
        if (id < nacks) ack_busy[id] = 0;
    }
}

static void send_ack(u32 *next, u64 frames, u64 bytes) {
    u32 slot = *next;
    while (ack_busy[slot]) reclaim_acks();
    *next = (slot + 1) % nacks;
    put_le64(ackbuf[slot] + HDR + 16, frames);
    put_le64(ackbuf[slot] + HDR + 24, bytes);
    ack_busy[slot] = 1;
    offer(&txq, &tx_avail, (u16)slot);
    publish(&txq, tx_avail, 1);
}

static void rx_mode(u64 count) {
    nacks = q < ACKS ? q : ACKS;
    for (u32 i = 0; i < nacks; i++) {
        eth_header(ackbuf[i] + HDR, 'A');
        txq.desc[i].addr = (u64)ackbuf[i];
        txq.desc[i].len = HDR + ACK_LEN;
    }
    kv_dec("net_perf: ready mode=rx queue", q);
    u64 frames = 0, bytes = 0;
    u32 since_ack = 0, next_ack = 0;
    while (frames < count) {
        u16 used = rxq.used.idx;
        if (used == rx_last) continue;
        barrier();
        while (rx_last != used) {
            u32 id = rxq.used.ring[rx_last & (q - 1)].id;
            u32 len = rxq.used.ring[rx_last & (q - 1)].len;
            rx_last = (u16)(rx_last + 1);
            if (id >= q) continue; /* not ours to repost */
            if (len > HDR && len <= BUF && ours(rxbuf[id] + HDR, len - HDR, 'D') && frames < count) {
                frames++;
                bytes += len - HDR;
                since_ack++;
            }
            offer(&rxq, &rx_avail, (u16)id);
        }
        publish(&rxq, rx_avail, 0);
        if (since_ack >= ACK_EVERY || (frames == count && since_ack)) {
            send_ack(&next_ack, frames, bytes);
            since_ack = 0;
        }
    }
    /* The last ack has left before the VM resets. */
    for (u32 i = 0; i < nacks; i++)
        while (ack_busy[i]) reclaim_acks();
    puts("net_perf: rx done frames=");
    put_dec(frames);
    puts(" bytes=");
    put_dec(bytes);
    putc('\n');
}

static void echo_mode(void) {
    kv_dec("net_perf: ready mode=echo queue", q);
    for (;;) {
        u32 rx_added = 0, tx_added = 0;
        u16 used = rxq.used.idx;
        barrier();
        while (rx_last != used) {
            u32 id = rxq.used.ring[rx_last & (q - 1)].id;
            u32 len = rxq.used.ring[rx_last & (q - 1)].len;
            rx_last = (u16)(rx_last + 1);
            if (id >= q) continue;
            if (len > HDR && len <= BUF && ours(rxbuf[id] + HDR, len - HDR, 0)) {
                u32 *hdr = (u32 *)rxbuf[id];
                hdr[0] = 0;
                hdr[1] = 0;
                hdr[2] = 0;
                txq.desc[id].addr = (u64)rxbuf[id];
                txq.desc[id].len = len;
                txq.desc[id].flags = 0;
                txq.desc[id].next = 0;
                offer(&txq, &tx_avail, (u16)id);
                tx_added++;
            } else {
                offer(&rxq, &rx_avail, (u16)id);
                rx_added++;
            }
        }
        if (tx_added) publish(&txq, tx_avail, 1);
        /* A buffer sent back is free to receive again. */
        used = txq.used.idx;
        barrier();
        while (tx_last != used) {
            u32 id = txq.used.ring[tx_last & (q - 1)].id;
            tx_last = (u16)(tx_last + 1);
            if (id >= q) continue;
            offer(&rxq, &rx_avail, (u16)id);
            rx_added++;
        }
        if (rx_added) publish(&rxq, rx_avail, 0);
    }
}

void guest_main(const u8 *zp) {
    const char *cmdline = guest_cmdline(zp);
    const char *mode = arg(cmdline, "mode");
    u64 count = 1000, size = FRAME_MAX;
    cmdline_u64(cmdline, "count", &count);
    cmdline_u64(cmdline, "size", &size);
    if (!mode) fail("no mode= on the command line (tx, rx or echo)");
    if (size < FRAME_MIN || size > FRAME_MAX) fail("size= must be 60 to 1514");

    base = virtio_find(zp, 1);
    if (!base) fail("no virtio-net device");
    long feats = virtio_init(base, 1u << 5);
    if (feats < 0) fail("features refused");
    /* Without VIRTIO_NET_F_MAC: a fixed locally administered address. */
    static const u8 fallback[6] = {0x02, 0x00, 0x00, 0x00, 0x00, 0x01};
    for (int i = 0; i < 6; i++)
        mac[i] = (feats & (1 << 5)) ? *(volatile u8 *)(base + VIRTIO_CONFIG + i) : fallback[i];
    q = ring_size();
    if (q < 2) fail("queues too small");
    ring_setup(0, &rxq, q);
    ring_setup(1, &txq, q);
    if (!(virtio_driver_ok(base) & S_DRIVER_OK)) fail("driver not ok");

    /* A buffer in every receive slot. */
    for (u32 i = 0; i < q; i++) {
        rxq.desc[i].addr = (u64)rxbuf[i];
        rxq.desc[i].len = BUF;
        rxq.desc[i].flags = VQ_F_WRITE;
        rxq.desc[i].next = 0;
        offer(&rxq, &rx_avail, (u16)i);
    }
    publish(&rxq, rx_avail, 0);
    if (is_word(mode, "tx")) {
        tx_mode(count, (u32)size);
        reset();
    }
    if (is_word(mode, "rx")) {
        rx_mode(count);
        reset();
    }
    if (is_word(mode, "echo")) echo_mode();
    fail("mode= must be tx, rx or echo");
}
