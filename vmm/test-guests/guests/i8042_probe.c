/* Runs Linux's i8042 probe (drivers/input/serio/i8042.c) against the vmm's
 * controller by polling its status port, and reports every byte it read:
 * flush, self-test, CTR read/write, keyboard interface test, keyboard
 * enable, the keyboard's reset and identify replies, the AUX loopback and
 * the output port. Then resets through the controller. */
#include "guest.h"

#define I8042_DATA 0x60
#define I8042_STATUS 0x64
#define STR_OBF 0x01
#define STR_IBF 0x02
#define STR_SYSFLAG 0x04
#define STR_KEYLOCK 0x10
#define STR_AUXDATA 0x20
#define CTR_KBDINT 0x01
#define CTR_KBDDIS 0x10
/* A controller that answers does so at once; a silent one costs POLLS exits. */
#define POLLS 2000

static int wait_write(void) {
    for (int i = 0; i < POLLS; i++)
        if (!(inb(I8042_STATUS) & STR_IBF)) return 0;
    return -1;
}

static int wait_read(void) {
    for (int i = 0; i < POLLS; i++)
        if (inb(I8042_STATUS) & STR_OBF) return 0;
    return -1;
}

/* Linux's __i8042_command: the command, `nout` parameter bytes, `nin` replies. */
static int command(u8 cmd, const u8 *out, int nout, u8 *in, int nin) {
    if (wait_write()) return -1;
    outb(I8042_STATUS, cmd);
    for (int i = 0; i < nout; i++) {
        if (wait_write()) return -1;
        outb(I8042_DATA, out[i]);
    }
    for (int i = 0; i < nin; i++) {
        if (wait_read()) return -1;
        in[i] = inb(I8042_DATA);
    }
    return 0;
}

/* A byte for the keyboard itself, then `nin` replies. */
static int kbd_command(u8 byte, u8 *in, int nin) {
    if (wait_write()) return -1;
    outb(I8042_DATA, byte);
    for (int i = 0; i < nin; i++) {
        if (wait_read()) return -1;
        in[i] = inb(I8042_DATA);
    }
    return 0;
}

/* Linux's i8042_flush: read while the output buffer is full, at most 16 bytes. */
static int flush(void) {
    int n = 0;
    while ((inb(I8042_STATUS) & STR_OBF) && n < 16) {
        (void)inb(I8042_DATA);
        n++;
    }
    return n;
}

static void report(const char *key, int err, const u8 *v, int n) {
    puts(key);
    putc('=');
    if (err) {
        puts("timeout");
    } else {
        for (int i = 0; i < n; i++) {
            if (i) putc(' ');
            put_hex(v[i]);
        }
    }
    putc('\n');
}

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    u8 r[4] = {0, 0, 0, 0};
    u8 ctr[2] = {0, 0};
    int err;

    puts("i8042: begin\n");
    puts("flush=");
    put_dec(flush());
    putc('\n');

    err = command(0xaa, 0, 0, r, 1);
    report("selftest", err, r, 1);

    /* i8042_controller_init: read the CTR until two reads agree. */
    err = command(0x20, 0, 0, &ctr[0], 1) || command(0x20, 0, 0, &ctr[1], 1);
    report("ctr", err, ctr, 2);

    u8 status = inb(I8042_STATUS);
    puts("keylock=");
    puts((status & STR_KEYLOCK) ? "off" : "on");
    putc('\n');
    puts("sysflag=");
    put_dec((status & STR_SYSFLAG) ? 1 : 0);
    putc('\n');

    u8 w = (u8)((ctr[0] | CTR_KBDDIS) & ~CTR_KBDINT);
    err = command(0x60, &w, 1, 0, 0) || command(0x20, 0, 0, r, 1);
    report("ctr_init", err, r, 1);
    puts("flush=");
    put_dec(flush());
    putc('\n');

    err = command(0xab, 0, 0, r, 1);
    report("kbd_test", err, r, 1);

    /* i8042_enable_kbd_port */
    w = (u8)((w & ~CTR_KBDDIS) | CTR_KBDINT);
    err = command(0x60, &w, 1, 0, 0) || command(0x20, 0, 0, r, 1);
    report("ctr_enabled", err, r, 1);

    err = kbd_command(0xff, r, 2);
    report("kbd_reset", err, r, 2);
    err = kbd_command(0xf2, r, 3);
    report("kbd_id", err, r, 3);
    err = kbd_command(0xee, r, 1);
    report("kbd_echo", err, r, 1);

    /* i8042_check_aux: the loopback reply comes back marked as AUX data. */
    u8 loop = 0x5a;
    err = command(0xd3, &loop, 1, 0, 0) || wait_read();
    if (!err) {
        status = inb(I8042_STATUS);
        r[0] = inb(I8042_DATA);
    }
    report("aux_loop", err, r, 1);
    puts("aux_loop.auxdata=");
    put_dec((!err && (status & STR_AUXDATA)) ? 1 : 0);
    putc('\n');

    err = command(0xd0, 0, 0, r, 1);
    report("outport", err, r, 1);
    puts("flush=");
    put_dec(flush());
    putc('\n');

    puts("i8042: end\n");
    reset();
}
