/* A misbehaving virtio-blk driver: refused queue sizes, DRIVER_OK without a
 * ready queue, a data buffer outside guest memory, a looping chain, a huge
 * length and a write to a read-only disk. The vmm must answer each with an
 * error status or a dropped request, and keep running. */
#include "virtio.h"

struct req_hdr { u32 type; u32 reserved; u64 sector; };

static struct vring vq;
static struct req_hdr hdr;
static u8 data[512] __attribute__((aligned(16)));
static volatile u8 status;

static u32 run(u64 base) {
    u32 used = vq_run(base, 0, &vq, 0);
    return used;
}

void guest_main(const u8 *zp) {
    puts("hostile: begin\n");
    u64 base = virtio_find(zp, 2);
    if (!base) { puts("hostile: no device\n"); reset(); }

    virtio_init(base, 1u << 5);
    kv_dec("hostile.size3_ready", vq_setup(base, 0, &vq, 3));
    kv_dec("hostile.size0_ready", vq_setup(base, 0, &vq, 0));
    u32 max = (mmio_r32(base + VIRTIO_QUEUE_NUM_MAX));
    kv_dec("hostile.oversize_ready", vq_setup(base, 0, &vq, max * 2));
    u32 st = virtio_driver_ok(base);
    kv_dec("hostile.needs_reset", (st & S_NEEDS_RESET) != 0);
    kv_dec("hostile.driver_ok_without_queue", (st & S_DRIVER_OK) != 0);

    /* Start over properly. */
    virtio_init(base, 1u << 5);
    vq_setup(base, 0, &vq, QSZ);
    kv_dec("hostile.driver_ok", (virtio_driver_ok(base) & S_DRIVER_OK) != 0);

    /* Read into a buffer at 64 GiB: outside guest memory. */
    hdr.type = 0; hdr.sector = 0; status = 0xff;
    vq_desc_set(&vq, 0, (u64)&hdr, sizeof(hdr), VQ_F_NEXT, 1);
    vq_desc_set(&vq, 1, 0x1000000000UL, 512, VQ_F_NEXT | VQ_F_WRITE, 2);
    vq_desc_set(&vq, 2, (u64)&status, 1, VQ_F_WRITE, 0);
    u32 used = run(base);
    kv_dec("hostile.oob_used", used);
    kv_dec("hostile.oob_status", status);

    /* Write from a buffer at 64 GiB. */
    hdr.type = 1; status = 0xff;
    vq_desc_set(&vq, 1, 0x1000000000UL, 512, VQ_F_NEXT, 2);
    run(base);
    kv_dec("hostile.oob_write_status", status);

    /* A chain that loops: 0 -> 1 -> 0. */
    status = 0xff;
    vq_desc_set(&vq, 0, (u64)&hdr, sizeof(hdr), VQ_F_NEXT, 1);
    vq_desc_set(&vq, 1, (u64)data, 512, VQ_F_NEXT | VQ_F_WRITE, 0);
    kv_dec("hostile.loop_used", run(base));

    /* A 3.75 GiB write buffer. */
    hdr.type = 1; status = 0xff;
    vq_desc_set(&vq, 0, (u64)&hdr, sizeof(hdr), VQ_F_NEXT, 1);
    vq_desc_set(&vq, 1, (u64)data, 0xf0000000u, VQ_F_NEXT, 2);
    vq_desc_set(&vq, 2, (u64)&status, 1, VQ_F_WRITE, 0);
    run(base);
    kv_dec("hostile.huge_status", status);

    /* A normal write: fails on a read-only disk. */
    for (int i = 0; i < 512; i++) data[i] = 0xee;
    hdr.type = 1; hdr.sector = 0; status = 0xff;
    vq_desc_set(&vq, 1, (u64)data, 512, VQ_F_NEXT, 2);
    run(base);
    kv_dec("hostile.write_status", status);

    /* Still alive: a normal read works. */
    hdr.type = 0; status = 0xff;
    vq_desc_set(&vq, 1, (u64)data, 512, VQ_F_NEXT | VQ_F_WRITE, 2);
    run(base);
    kv_dec("hostile.read_status", status);
    puts("hostile: end\n");
    reset();
}
