/* Drives the first virtio-blk device: prints its capacity and features,
 * reads sector 0, writes a pattern to sector 1, reads it back, flushes and
 * asks for the disk ID; then resets. Polls the used ring throughout.
 * With `bulk=N` on the command line it then reads 1 KiB from sector 0 N
 * times, waiting as long as it takes for each (a rate-limited disk), and
 * prints blk.bulk_done=N; with `hold=1` it then spins instead of
 * resetting, so the host can read the vmm's counters. */
#include "virtio.h"

#define T_IN 0
#define T_OUT 1
#define T_FLUSH 4
#define T_GET_ID 8

struct req_hdr { u32 type; u32 reserved; u64 sector; };

static struct vring vq;
static struct req_hdr hdr;
static u8 data[1024] __attribute__((aligned(16)));
static volatile u8 status;

static u32 request(u64 base, u32 type, u64 sector, u32 len, int device_writes) {
    hdr.type = type;
    hdr.reserved = 0;
    hdr.sector = sector;
    status = 0xff;
    vq_desc_set(&vq, 0, (u64)&hdr, sizeof(hdr), VQ_F_NEXT, 1);
    if (len) {
        vq_desc_set(&vq, 1, (u64)data, len, (u16)(VQ_F_NEXT | (device_writes ? VQ_F_WRITE : 0)), 2);
        vq_desc_set(&vq, 2, (u64)&status, 1, VQ_F_WRITE, 0);
    } else {
        vq_desc_set(&vq, 1, (u64)&status, 1, VQ_F_WRITE, 0);
    }
    u32 used = vq_run(base, 0, &vq, 0);
    if (used == 0xffffffffu) puts("blk: timeout\n");
    return status;
}

void guest_main(const u8 *zp) {
    puts("blk: begin\n");
    u64 base = virtio_find(zp, 2);
    if (!base) { puts("blk: no device\n"); reset(); }
    long feats = virtio_init(base, (1u << 5) | (1u << 9));
    if (feats < 0) { puts("blk: features refused\n"); reset(); }
    kv_dec("blk.ro", ((u64)feats >> 5) & 1);
    kv_dec("blk.flush", ((u64)feats >> 9) & 1);
    u64 cap = (u64)mmio_r32(base + VIRTIO_CONFIG) | ((u64)mmio_r32(base + VIRTIO_CONFIG + 4) << 32);
    kv_dec("blk.capacity", cap);
    kv_dec("blk.queue_ready", vq_setup(base, 0, &vq, QSZ));
    kv_dec("blk.driver_ok", (virtio_driver_ok(base) & S_DRIVER_OK) != 0);

    kv_dec("blk.read_status", request(base, T_IN, 0, 512, 1));
    puts("blk.sector0=");
    for (int i = 0; i < 16 && data[i] >= 0x20 && data[i] < 0x7f; i++) putc((char)data[i]);
    putc('\n');

    for (int i = 0; i < 512; i++) data[i] = (u8)(i & 0xff);
    const char *msg = "written by the guest";
    for (int i = 0; msg[i]; i++) data[i] = (u8)msg[i];
    kv_dec("blk.write_status", request(base, T_OUT, 1, 512, 0));

    for (int i = 0; i < 512; i++) data[i] = 0;
    kv_dec("blk.readback_status", request(base, T_IN, 1, 512, 1));
    int same = 1;
    for (int i = 20; i < 512; i++) if (data[i] != (u8)(i & 0xff)) same = 0;
    for (int i = 0; msg[i]; i++) if (data[i] != (u8)msg[i]) same = 0;
    kv_dec("blk.readback_matches", (u64)same);

    kv_dec("blk.flush_status", request(base, T_FLUSH, 0, 0, 0));
    for (int i = 0; i < 21; i++) data[i] = 0;
    kv_dec("blk.id_status", request(base, T_GET_ID, 0, 20, 1));
    puts("blk.id=");
    puts((const char *)data);
    putc('\n');
    kv_dec("blk.interrupt_status", mmio_r32(base + VIRTIO_INTERRUPT_STATUS));

    u64 bulk = 0, hold = 0;
    cmdline_u64(guest_cmdline(zp), "bulk", &bulk);
    cmdline_u64(guest_cmdline(zp), "hold", &hold);
    for (u64 n = 0; n < bulk; n++) {
        hdr.type = T_IN;
        hdr.reserved = 0;
        hdr.sector = 0;
        status = 0xff;
        vq_desc_set(&vq, 0, (u64)&hdr, sizeof(hdr), VQ_F_NEXT, 1);
        vq_desc_set(&vq, 1, (u64)data, 1024, VQ_F_NEXT | VQ_F_WRITE, 2);
        vq_desc_set(&vq, 2, (u64)&status, 1, VQ_F_WRITE, 0);
        vq_offer(&vq, 0);
        vq_notify(base, 0);
        if (vq_wait(&vq, ~0ULL) == 0xffffffffu || status != 0) {
            kv_dec("blk.bulk_failed_at", n);
            break;
        }
    }
    if (bulk) kv_dec("blk.bulk_done", bulk);
    puts("blk: end\n");
    if (hold)
        for (;;) __asm__ volatile("pause");
    reset();
}
