/* Sends one Ethernet frame (ethertype 0x88b5, payload "hello from the
 * guest") through the first virtio-net device and waits for the tx buffer
 * to come back; then waits a while for one received frame. With
 * `tx_count=N` it then sends the frame N more times, waiting as long as it
 * takes for each (a rate-limited device), and prints net.tx_done=N; with
 * `hold=1` it then spins instead of resetting, so the host can read the
 * vmm's counters. */
#include "virtio.h"

static struct vring rxq, txq;
static u8 tx[12 + 14 + 64] __attribute__((aligned(16)));
static u8 rx[1600] __attribute__((aligned(16)));

void guest_main(const u8 *zp) {
    puts("net: begin\n");
    u64 base = virtio_find(zp, 1);
    if (!base) { puts("net: no device\n"); reset(); }
    long feats = virtio_init(base, 1u << 5);
    if (feats < 0) { puts("net: features refused\n"); reset(); }
    u8 mac[6];
    for (int i = 0; i < 6; i++) mac[i] = *(volatile u8 *)(base + VIRTIO_CONFIG + i);
    puts("net.mac=");
    for (int i = 0; i < 6; i++) {
        putc("0123456789abcdef"[mac[i] >> 4]);
        putc("0123456789abcdef"[mac[i] & 15]);
        if (i < 5) putc(':');
    }
    putc('\n');
    vq_setup(base, 0, &rxq, QSZ);
    vq_setup(base, 1, &txq, QSZ);
    kv_dec("net.driver_ok", (virtio_driver_ok(base) & S_DRIVER_OK) != 0);

    vq_desc_set(&rxq, 0, (u64)rx, sizeof(rx), VQ_F_WRITE, 0);
    vq_offer(&rxq, 0);
    vq_notify(base, 0);

    for (u64 i = 0; i < sizeof(tx); i++) tx[i] = 0;
    u8 *eth = tx + 12;
    for (int i = 0; i < 6; i++) { eth[i] = 0xff; eth[6 + i] = mac[i]; }
    eth[12] = 0x88;
    eth[13] = 0xb5;
    const char *msg = "hello from the guest";
    for (int i = 0; msg[i]; i++) eth[14 + i] = (u8)msg[i];
    vq_desc_set(&txq, 0, (u64)tx, sizeof(tx), 0, 0);
    kv_dec("net.tx_used", vq_run(base, 1, &txq, 0));
    puts("net: sent\n");
    u64 spins = 0;
    cmdline_u64(guest_cmdline(zp), "rx_spins", &spins);
    /* Waits for a frame with ethertype 0x88b5, skipping others (IPv6 chatter). */
    for (int n = 0; spins && n < 8; n++) {
        u32 len = vq_wait(&rxq, spins);
        if (len == 0xffffffffu) { puts("net: rx timeout\n"); break; }
        if (len > 12 + 14 && rx[12 + 12] == 0x88 && rx[12 + 13] == 0xb5) {
            kv_dec("net.rx_len", len);
            puts("net.rx_payload=");
            for (u32 i = 12 + 14; i < len && rx[i] >= 0x20 && rx[i] < 0x7f; i++) putc((char)rx[i]);
            putc('\n');
            break;
        }
        vq_desc_set(&rxq, 0, (u64)rx, sizeof(rx), VQ_F_WRITE, 0);
        vq_offer(&rxq, 0);
        vq_notify(base, 0);
    }
    u64 tx_count = 0, hold = 0;
    cmdline_u64(guest_cmdline(zp), "tx_count", &tx_count);
    cmdline_u64(guest_cmdline(zp), "hold", &hold);
    for (u64 n = 0; n < tx_count; n++) {
        vq_desc_set(&txq, 0, (u64)tx, sizeof(tx), 0, 0);
        vq_offer(&txq, 0);
        vq_notify(base, 1);
        if (vq_wait(&txq, ~0ULL) == 0xffffffffu) break;
    }
    if (tx_count) kv_dec("net.tx_done", tx_count);
    puts("net: end\n");
    if (hold)
        for (;;) __asm__ volatile("pause");
    reset();
}
