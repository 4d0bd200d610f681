/* Drives the first virtio-fs device (device ID 26) by polling: prints the
 * tag and the number of request queues from its config space, accepts only
 * VERSION_1, sets up the hiprio queue (0) and the first request queue (1)
 * and speaks FUSE on queue 1:
 *   INIT (protocol 7.31)                 fs.init_error= fs.init_major= fs.init_minor=
 *   LOOKUP `file=` (default hello.txt)   fs.lookup_error= fs.size=
 *   OPEN, READ (up to 4 KiB), RELEASE    fs.open_error= fs.read_error= fs.read_len=
 *                                        fs.data=<printable prefix> fs.release_error=
 *   CREATE new.txt (then RELEASE)        fs.create_error= (-30, EROFS, on a read-only share)
 * then prints "fs: end" and resets.
 *
 * With `loop=1` it instead repeats LOOKUP/OPEN/READ/RELEASE rounds forever
 * after the first one, `round_spins=N` empty loop iterations apart (default
 * 100000: a fraction of a millisecond on bare metal, under a second where
 * the guest runs slowly, as under nested virtualization), printing one
 * line per round:
 *   fs.round=N len=L data=<printable prefix>
 * When a reply carries an error it prints fs.error=<errno> (negative) and
 * fs.error_opcode=<FUSE opcode> and resets: the host sees the error and the
 * vmm ends.
 *
 * Every wait on the used ring is bounded (`fs_spins=N` polls, default
 * 3000000000, seconds on bare metal): a request the device never completes
 * prints "fs: timeout" and resets, so a vmm bug fails a test instead of
 * hanging it. A reply shorter than its header or for another request
 * (unique) is reported and also resets. */
#include "virtio.h"

#define VIRTIO_ID_FS 26

/* FUSE opcodes (linux/fuse.h). */
#define FUSE_LOOKUP 1
#define FUSE_OPEN 14
#define FUSE_READ 15
#define FUSE_RELEASE 18
#define FUSE_INIT 26
#define FUSE_CREATE 35

/* Linux open(2) flags and file modes, as FUSE carries them. */
#define O_RDONLY 0
#define O_RDWR 2
#define O_CREAT 0100
#define S_IFREG 0100000

/* FUSE structures of protocol 7.31 (linux/fuse.h), little-endian. */
struct fuse_in_header {
    u32 len;
    u32 opcode;
    u64 unique;
    u64 nodeid;
    u32 uid;
    u32 gid;
    u32 pid;
    u16 total_extlen;
    u16 padding;
};

struct fuse_out_header {
    u32 len;
    int error;
    u64 unique;
};

struct fuse_init_in {
    u32 major;
    u32 minor;
    u32 max_readahead;
    u32 flags;
};

struct fuse_init_out {
    u32 major;
    u32 minor;
    u32 max_readahead;
    u32 flags;
    u16 max_background;
    u16 congestion_threshold;
    u32 max_write;
    u32 time_gran;
    u16 max_pages;
    u16 map_alignment;
    u32 flags2;
    u32 unused[7];
};

struct fuse_attr {
    u64 ino;
    u64 size;
    u64 blocks;
    u64 atime;
    u64 mtime;
    u64 ctime;
    u32 atimensec;
    u32 mtimensec;
    u32 ctimensec;
    u32 mode;
    u32 nlink;
    u32 uid;
    u32 gid;
    u32 rdev;
    u32 blksize;
    u32 flags;
};

struct fuse_entry_out {
    u64 nodeid;
    u64 generation;
    u64 entry_valid;
    u64 attr_valid;
    u32 entry_valid_nsec;
    u32 attr_valid_nsec;
    struct fuse_attr attr;
};

struct fuse_open_in {
    u32 flags;
    u32 open_flags;
};

struct fuse_open_out {
    u64 fh;
    u32 open_flags;
    u32 padding;
};

struct fuse_read_in {
    u64 fh;
    u64 offset;
    u32 size;
    u32 read_flags;
    u64 lock_owner;
    u32 flags;
    u32 padding;
};

struct fuse_release_in {
    u64 fh;
    u32 flags;
    u32 release_flags;
    u64 lock_owner;
};

struct fuse_create_in {
    u32 flags;
    u32 mode;
    u32 umask;
    u32 open_flags;
};

/* The sizes linux/fuse.h gives these structures. */
_Static_assert(sizeof(struct fuse_in_header) == 40, "fuse_in_header");
_Static_assert(sizeof(struct fuse_out_header) == 16, "fuse_out_header");
_Static_assert(sizeof(struct fuse_init_in) == 16, "fuse_init_in (7.31)");
_Static_assert(sizeof(struct fuse_init_out) == 64, "fuse_init_out");
_Static_assert(sizeof(struct fuse_attr) == 88, "fuse_attr");
_Static_assert(sizeof(struct fuse_entry_out) == 128, "fuse_entry_out");
_Static_assert(sizeof(struct fuse_open_in) == 8, "fuse_open_in");
_Static_assert(sizeof(struct fuse_open_out) == 16, "fuse_open_out");
_Static_assert(sizeof(struct fuse_read_in) == 40, "fuse_read_in");
_Static_assert(sizeof(struct fuse_release_in) == 24, "fuse_release_in");
_Static_assert(sizeof(struct fuse_create_in) == 16, "fuse_create_in");

#define READ_MAX 4096
#define NAME_MAX_LEN 128

static struct vring hiprioq, reqq;
static u64 base;
static u64 wait_spins = 3000000000UL;
static u64 next_unique = 1;

/* The device reads the request from `req` and writes the reply into `reply`. */
static u8 req[sizeof(struct fuse_in_header) + 64 + NAME_MAX_LEN] __attribute__((aligned(16)));
static u8 reply[sizeof(struct fuse_out_header) + READ_MAX] __attribute__((aligned(16)));
#define REPLY_HDR ((volatile struct fuse_out_header *)reply)
#define REPLY_BODY (reply + sizeof(struct fuse_out_header))

static char file_name[NAME_MAX_LEN];

static void put_int(long v) {
    if (v < 0) { putc('-'); put_dec((u64)(-v)); }
    else put_dec((u64)v);
}

static void kv_int(const char *k, long v) { puts(k); putc('='); put_int(v); putc('\n'); }

static u32 str_len(const char *s) {
    u32 n = 0;
    while (s[n]) n++;
    return n;
}

/* Copies the value of `key=` on the command line (up to a space) into
 * `out` (`max` bytes with the NUL); returns whether the key was there. */
static int cmdline_str(const char *cmdline, const char *key, char *out, u32 max) {
    for (const char *p = cmdline; *p; p++) {
        if (p != cmdline && p[-1] != ' ') continue;
        const char *k = key, *q = p;
        while (*k && *q == *k) { k++; q++; }
        if (*k || *q != '=') continue;
        q++;
        u32 n = 0;
        while (*q && *q != ' ' && n + 1 < max) out[n++] = *q++;
        out[n] = 0;
        return 1;
    }
    return 0;
}

/* Prints the printable prefix of `data` (at most 64 bytes, up to the first
 * control character). */
static void put_printable(const u8 *data, u32 len) {
    for (u32 i = 0; i < len && i < 64 && data[i] >= 0x20 && data[i] < 0x7f; i++) putc((char)data[i]);
}

/* Polls the request queue's used ring for up to wait_spins polls; returns
 * the used length, or resets with "fs: timeout". */
static u32 wait_used(void) {
    for (u64 i = 0; i < wait_spins; i++) {
        if (reqq.used.idx != reqq.last_used) {
            barrier();
            u32 len = reqq.used.ring[reqq.last_used % QSZ].len;
            reqq.last_used = (u16)(reqq.last_used + 1);
            return len;
        }
    }
    puts("fs: timeout\n");
    reset();
    return 0;
}

/* Sends one FUSE request on queue 1: the in header, `arg_len` bytes of
 * `arg` and, when `name` is set, that NUL-terminated name; the device may
 * write an out header and `out_len` more bytes. Returns the reply's error
 * (0 or a negative errno); the reply body is at REPLY_BODY. */
static int fuse_call(u32 opcode, u64 nodeid, const void *arg, u32 arg_len, const char *name, u32 out_len) {
    struct fuse_in_header *h = (struct fuse_in_header *)req;
    u32 len = sizeof(*h);
    for (u32 i = 0; i < arg_len; i++) req[len++] = ((const u8 *)arg)[i];
    if (name) {
        u32 n = str_len(name);
        for (u32 i = 0; i <= n; i++) req[len++] = (u8)name[i];
    }
    u64 unique = next_unique++;
    h->len = len;
    h->opcode = opcode;
    h->unique = unique;
    h->nodeid = nodeid;
    h->uid = 0;
    h->gid = 0;
    h->pid = 1;
    h->total_extlen = 0;
    h->padding = 0;
    /* A stale header must not pass for the device's reply. */
    REPLY_HDR->len = 0;
    REPLY_HDR->error = 0;
    REPLY_HDR->unique = 0;

    vq_desc_set(&reqq, 0, (u64)req, len, VQ_F_NEXT, 1);
    vq_desc_set(&reqq, 1, (u64)reply, (u32)sizeof(struct fuse_out_header) + out_len, VQ_F_WRITE, 0);
    vq_offer(&reqq, 0);
    vq_notify(base, 1);
    u32 used = wait_used();
    barrier();
    if (used < sizeof(struct fuse_out_header) || REPLY_HDR->len < sizeof(struct fuse_out_header)) {
        kv_dec("fs.short_reply", used);
        kv_dec("fs.short_reply_opcode", opcode);
        reset();
    }
    if (REPLY_HDR->unique != unique) {
        kv_dec("fs.unique_mismatch", REPLY_HDR->unique);
        kv_dec("fs.unique_expected", unique);
        reset();
    }
    return REPLY_HDR->error;
}

static int fuse_lookup(const char *name, u64 *nodeid, u64 *size) {
    int err = fuse_call(FUSE_LOOKUP, 1, 0, 0, name, sizeof(struct fuse_entry_out));
    if (!err) {
        const struct fuse_entry_out *e = (const struct fuse_entry_out *)REPLY_BODY;
        *nodeid = e->nodeid;
        *size = e->attr.size;
    }
    return err;
}

static int fuse_open(u64 nodeid, u64 *fh) {
    struct fuse_open_in in;
    in.flags = O_RDONLY;
    in.open_flags = 0;
    int err = fuse_call(FUSE_OPEN, nodeid, &in, sizeof(in), 0, sizeof(struct fuse_open_out));
    if (!err) *fh = ((const struct fuse_open_out *)REPLY_BODY)->fh;
    return err;
}

/* Reads up to READ_MAX bytes from offset 0; *len gets the data's length. */
static int fuse_read(u64 nodeid, u64 fh, u32 *len) {
    struct fuse_read_in in;
    in.fh = fh;
    in.offset = 0;
    in.size = READ_MAX;
    in.read_flags = 0;
    in.lock_owner = 0;
    in.flags = O_RDONLY;
    in.padding = 0;
    int err = fuse_call(FUSE_READ, nodeid, &in, sizeof(in), 0, READ_MAX);
    u32 n = REPLY_HDR->len - (u32)sizeof(struct fuse_out_header);
    *len = err ? 0 : (n > READ_MAX ? READ_MAX : n);
    return err;
}

static int fuse_release(u64 nodeid, u64 fh, u32 flags) {
    struct fuse_release_in in;
    in.fh = fh;
    in.flags = flags;
    in.release_flags = 0;
    in.lock_owner = 0;
    return fuse_call(FUSE_RELEASE, nodeid, &in, sizeof(in), 0, 0);
}

/* In loop mode: any error ends the VM, after saying which request got it. */
static void loop_check(int err, u32 opcode) {
    if (!err) return;
    kv_int("fs.error", err);
    kv_dec("fs.error_opcode", opcode);
    reset();
}

/* LOOKUP/OPEN/READ/RELEASE rounds forever, one line each. */
static void rounds(u64 spins) {
    for (u64 round = 1;; round++) {
        for (u64 i = 0; i < spins; i++) barrier();
        u64 nodeid = 0, size = 0, fh = 0;
        u32 len = 0;
        loop_check(fuse_lookup(file_name, &nodeid, &size), FUSE_LOOKUP);
        loop_check(fuse_open(nodeid, &fh), FUSE_OPEN);
        loop_check(fuse_read(nodeid, fh, &len), FUSE_READ);
        /* Print before RELEASE reuses the reply buffer. */
        puts("fs.round=");
        put_dec(round);
        puts(" len=");
        put_dec(len);
        puts(" data=");
        put_printable(REPLY_BODY, len);
        putc('\n');
        loop_check(fuse_release(nodeid, fh, O_RDONLY), FUSE_RELEASE);
    }
}

void guest_main(const u8 *zp) {
    puts("fs: begin\n");
    const char *cl = guest_cmdline(zp);
    u64 loop = 0, spins = 100000;
    cmdline_u64(cl, "loop", &loop);
    cmdline_u64(cl, "round_spins", &spins);
    cmdline_u64(cl, "fs_spins", &wait_spins);
    if (!cmdline_str(cl, "file", file_name, sizeof(file_name))) {
        const char *dflt = "hello.txt";
        for (u32 i = 0; i <= str_len(dflt); i++) file_name[i] = dflt[i];
    }

    base = virtio_find(zp, VIRTIO_ID_FS);
    if (!base) { puts("fs: no device\n"); reset(); }

    /* Config space: tag[36] (NUL padded), then le32 num_request_queues,
     * read as aligned 32-bit words. */
    char tag[37];
    for (u32 w = 0; w < 9; w++) {
        u32 v = mmio_r32(base + VIRTIO_CONFIG + 4 * w);
        for (u32 b = 0; b < 4; b++) tag[4 * w + b] = (char)(v >> (8 * b));
    }
    tag[36] = 0;
    puts("fs.tag=");
    for (u32 i = 0; tag[i]; i++) putc(tag[i] >= 0x20 && tag[i] < 0x7f ? tag[i] : '?');
    putc('\n');
    kv_dec("fs.num_request_queues", mmio_r32(base + VIRTIO_CONFIG + 36));

    /* Only VERSION_1 (virtio_init takes it from the high word). */
    if (virtio_init(base, 0) < 0) { puts("fs: features refused\n"); reset(); }
    kv_dec("fs.queue0_ready", vq_setup(base, 0, &hiprioq, QSZ));
    kv_dec("fs.queue1_ready", vq_setup(base, 1, &reqq, QSZ));
    kv_dec("fs.driver_ok", (virtio_driver_ok(base) & S_DRIVER_OK) != 0);

    struct fuse_init_in init;
    init.major = 7;
    init.minor = 31;
    init.max_readahead = 0;
    init.flags = 0;
    int err = fuse_call(FUSE_INIT, 0, &init, sizeof(init), 0, sizeof(struct fuse_init_out));
    kv_int("fs.init_error", err);
    if (err) reset();
    const struct fuse_init_out *io = (const struct fuse_init_out *)REPLY_BODY;
    kv_dec("fs.init_major", io->major);
    kv_dec("fs.init_minor", io->minor);

    u64 nodeid = 0, size = 0, fh = 0;
    u32 len = 0;
    err = fuse_lookup(file_name, &nodeid, &size);
    kv_int("fs.lookup_error", err);
    if (!err) {
        kv_dec("fs.size", size);
        err = fuse_open(nodeid, &fh);
        kv_int("fs.open_error", err);
    }
    if (!err) {
        err = fuse_read(nodeid, fh, &len);
        kv_int("fs.read_error", err);
        kv_dec("fs.read_len", len);
        puts("fs.data=");
        put_printable(REPLY_BODY, len);
        putc('\n');
        kv_int("fs.release_error", fuse_release(nodeid, fh, O_RDONLY));
    }

    struct fuse_create_in create;
    create.flags = O_CREAT | O_RDWR;
    create.mode = S_IFREG | 0644;
    create.umask = 022;
    create.open_flags = 0;
    err = fuse_call(FUSE_CREATE, 1, &create, sizeof(create), "new.txt",
                    sizeof(struct fuse_entry_out) + sizeof(struct fuse_open_out));
    kv_int("fs.create_error", err);
    if (!err) {
        u64 new_node = ((const struct fuse_entry_out *)REPLY_BODY)->nodeid;
        u64 new_fh = ((const struct fuse_open_out *)(REPLY_BODY + sizeof(struct fuse_entry_out)))->fh;
        kv_int("fs.create_release_error", fuse_release(new_node, new_fh, O_RDWR));
    }

    if (loop) rounds(spins);
    puts("fs: end\n");
    reset();
}
