/* Drives the first virtio-vsock device by polling:
 * 1. connects to host port `vsock_port=` (command line), sends "ping from
 *    guest", prints the reply, shuts down and waits for the reset;
 * 2. prints "vsock: listening" and accepts one host-initiated connection to
 *    port `vsock_listen=`, prints what the host sends and answers it;
 * 3. with `vsock_idle=1`, prints "vsock: idle" and spins forever, printing
 *    "vsock: transport reset event" whenever the device uses the event
 *    buffer (what a restored device owes the guest once it runs). */
#include "virtio.h"

#define HOST_CID 2
#define OP_REQUEST 1
#define OP_RESPONSE 2
#define OP_RST 3
#define OP_SHUTDOWN 4
#define OP_RW 5
#define OP_CREDIT_UPDATE 6

struct hdr {
    u64 src_cid, dst_cid;
    u32 src_port, dst_port, len;
    u16 type, op;
    u32 flags, buf_alloc, fwd_cnt;
} __attribute__((packed));

#define RXBUF 300
#define NRX 8
static struct vring rxq, txq, evq;
static u8 rxbuf[NRX][RXBUF] __attribute__((aligned(16)));
static u8 txbuf[44 + 256] __attribute__((aligned(16)));
static u8 evbuf[4];
static u64 cid;
static u32 fwd_cnt;
static u64 base;
static u64 wait_spins = SPINS;

static void post_rx(u16 i) {
    vq_desc_set(&rxq, i, (u64)rxbuf[i], RXBUF, VQ_F_WRITE, 0);
    vq_offer(&rxq, i);
}

static void send(u16 op, u32 src_port, u32 dst_port, u32 flags, const char *data) {
    struct hdr *h = (struct hdr *)txbuf;
    u32 len = 0;
    while (data && data[len]) { txbuf[44 + len] = (u8)data[len]; len++; }
    h->src_cid = cid; h->dst_cid = HOST_CID;
    h->src_port = src_port; h->dst_port = dst_port;
    h->len = len; h->type = 1; h->op = op; h->flags = flags;
    h->buf_alloc = 65536; h->fwd_cnt = fwd_cnt;
    vq_desc_set(&txq, 0, (u64)txbuf, 44 + len, 0, 0);
    vq_run(base, 1, &txq, 0);
}

/* Waits for the next received packet, skipping credit updates; copies its
 * header into *out and its payload (NUL-terminated) into data. */
static int recv(struct hdr *out, char *data, u32 max) {
    for (;;) {
        u32 len = vq_wait(&rxq, wait_spins);
        if (len == 0xffffffffu) return 0;
        u16 id = (u16)rxq.used.ring[(u16)(rxq.last_used - 1) % QSZ].id;
        struct hdr *h = (struct hdr *)rxbuf[id];
        *out = *h;
        u32 n = 0;
        if (h->op == OP_RW) {
            for (; n < h->len && n + 1 < max; n++) data[n] = (char)rxbuf[id][44 + n];
            fwd_cnt += h->len;
        }
        data[n] = 0;
        post_rx(id);
        vq_notify(base, 0);
        if (out->op != OP_CREDIT_UPDATE) return 1;
    }
}

void guest_main(const u8 *zp) {
    puts("vsock: begin\n");
    base = virtio_find(zp, 19);
    if (!base) { puts("vsock: no device\n"); reset(); }
    if (virtio_init(base, 0) < 0) { puts("vsock: features refused\n"); reset(); }
    cid = (u64)mmio_r32(base + VIRTIO_CONFIG) | ((u64)mmio_r32(base + VIRTIO_CONFIG + 4) << 32);
    kv_dec("vsock.cid", cid);
    vq_setup(base, 0, &rxq, QSZ);
    vq_setup(base, 1, &txq, QSZ);
    vq_setup(base, 2, &evq, QSZ);
    for (u16 i = 0; i < NRX; i++) post_rx(i);
    vq_desc_set(&evq, 0, (u64)evbuf, 4, VQ_F_WRITE, 0);
    vq_offer(&evq, 0);
    kv_dec("vsock.driver_ok", (virtio_driver_ok(base) & S_DRIVER_OK) != 0);
    vq_notify(base, 0);
    vq_notify(base, 2);

    const char *cl = guest_cmdline(zp);
    u64 port = 0, listen = 0;
    cmdline_u64(cl, "vsock_port", &port);
    cmdline_u64(cl, "vsock_listen", &listen);
    cmdline_u64(cl, "vsock_spins", &wait_spins);
    u64 idle = 0;
    cmdline_u64(cl, "vsock_idle", &idle);
    struct hdr h;
    char data[260];

    if (port) {
        send(OP_REQUEST, 1234, (u32)port, 0, 0);
        if (!recv(&h, data, sizeof(data))) { puts("vsock: no answer\n"); reset(); }
        kv_dec("vsock.connect_op", h.op);
        if (h.op == OP_RESPONSE) {
            send(OP_RW, 1234, (u32)port, 0, "ping from guest\n");
            if (recv(&h, data, sizeof(data))) {
                kv_dec("vsock.reply_op", h.op);
                puts("vsock.reply="); puts(data);
            }
            send(OP_SHUTDOWN, 1234, (u32)port, 3, 0);
            /* The host may have shut down its side first; the connection ends with a reset. */
            while (recv(&h, data, sizeof(data)) && h.op != OP_RST) { }
            kv_dec("vsock.shutdown_answer_op", h.op);
        }
    }
    if (listen) {
        puts("vsock: listening\n");
        do {
            if (!recv(&h, data, sizeof(data))) { puts("vsock: nobody connected\n"); reset(); }
        } while (h.op != OP_REQUEST);
        kv_dec("vsock.incoming_op", h.op);
        kv_dec("vsock.incoming_dst_port", h.dst_port);
        u32 hport = h.src_port;
        fwd_cnt = 0;
        send(OP_RESPONSE, (u32)listen, hport, 0, 0);
        if (recv(&h, data, sizeof(data))) {
            kv_dec("vsock.incoming_data_op", h.op);
            puts("vsock.incoming_data="); puts(data);
        }
        send(OP_RW, (u32)listen, hport, 0, "hello host\n");
        send(OP_RST, (u32)listen, hport, 0, 0);
    }
    if (idle) {
        puts("vsock: idle\n");
        for (;;) {
            barrier();
            u16 used = *(volatile u16 *)&evq.used.idx;
            if (used != evq.last_used) {
                evq.last_used = used;
                kv_dec("vsock.event", *(volatile u32 *)evbuf);
                puts("vsock: transport reset event\n");
                vq_offer(&evq, 0);
                vq_notify(base, 2);
            }
        }
    }
    puts("vsock: end\n");
    reset();
}
