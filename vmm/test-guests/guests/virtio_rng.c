/* Reads 64 bytes from the first virtio-rng device, twice, and prints them. */
#include "virtio.h"

static struct vring vq;
static u8 buf[2][64] __attribute__((aligned(16)));

void guest_main(const u8 *zp) {
    puts("rng: begin\n");
    u64 base = virtio_find(zp, 4);
    if (!base) { puts("rng: no device\n"); reset(); }
    if (virtio_init(base, 0) < 0) { puts("rng: features refused\n"); reset(); }
    vq_setup(base, 0, &vq, QSZ);
    kv_dec("rng.driver_ok", (virtio_driver_ok(base) & S_DRIVER_OK) != 0);
    for (int r = 0; r < 2; r++) {
        vq_desc_set(&vq, (u16)r, (u64)buf[r], 64, VQ_F_WRITE, 0);
        kv_dec("rng.len", vq_run(base, 0, &vq, (u16)r));
        puts("rng.bytes=");
        for (int i = 0; i < 64; i++) {
            putc("0123456789abcdef"[buf[r][i] >> 4]);
            putc("0123456789abcdef"[buf[r][i] & 15]);
        }
        putc('\n');
    }
    puts("rng: end\n");
    reset();
}
