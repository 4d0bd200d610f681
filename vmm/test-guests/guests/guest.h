/* Freestanding helpers shared by the test guests: port I/O, the COM1
 * console (polled), i8042 reset, CPUID and the Linux zero page fields the
 * guests read. Only plain integer instructions, port I/O and loops: this is
 * what an emulated KVM (PVM native mode) can run. */
#ifndef GUEST_H
#define GUEST_H

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long u64;

#define COM1 0x3f8

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }

static inline void putc(char c) {
    while ((inb(COM1 + 5) & 0x20) == 0) { }
    outb(COM1, (u8)c);
}

static inline void puts(const char *s) { while (*s) putc(*s++); }

static inline void put_hex(u64 v) {
    static const char digits[] = "0123456789abcdef";
    char buf[19];
    int i = 18;
    buf[i] = 0;
    do { buf[--i] = digits[v & 0xf]; v >>= 4; } while (v && i > 2);
    buf[--i] = 'x';
    buf[--i] = '0';
    puts(&buf[i]);
}

static inline void put_dec(u64 v) {
    char buf[21];
    int i = 20;
    buf[i] = 0;
    do { buf[--i] = (char)('0' + v % 10); v /= 10; } while (v && i > 0);
    puts(&buf[i]);
}

/* Ask the i8042 to reset the machine; the vmm ends the VM cleanly. */
static inline void reset(void) {
    outb(0x64, 0xfe);
    for (;;) __asm__ volatile("hlt");
}

static inline void cpuid(u32 leaf, u32 sub, u32 *a, u32 *b, u32 *c, u32 *d) {
    __asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(sub));
}

/* Zero-page (struct boot_params) offsets, from Linux's bootparam.h. */
#define BP_E820_ENTRIES 0x1e8
#define BP_BOOT_FLAG 0x1fe
#define BP_HEADER 0x202
#define BP_TYPE_OF_LOADER 0x210
#define BP_CMD_LINE_PTR 0x228
#define BP_CMDLINE_SIZE 0x238
#define BP_E820_TABLE 0x2d0

static inline u8 bp8(const u8 *bp, u32 off) { return bp[off]; }
static inline u16 bp16(const u8 *bp, u32 off) { return (u16)(bp[off] | (bp[off + 1] << 8)); }
static inline u32 bp32(const u8 *bp, u32 off) { return (u32)bp16(bp, off) | ((u32)bp16(bp, off + 2) << 16); }
static inline u64 bp64(const u8 *bp, u32 off) { return (u64)bp32(bp, off) | ((u64)bp32(bp, off + 4) << 32); }

/* Finds "key=" in the command line and parses the decimal value after it. */
static inline int cmdline_u64(const char *cmdline, const char *key, u64 *out) {
    for (const char *p = cmdline; *p; p++) {
        if (p != cmdline && p[-1] != ' ') continue;
        const char *k = key, *q = p;
        while (*k && *q == *k) { k++; q++; }
        if (*k || *q != '=') continue;
        q++;
        u64 v = 0;
        int any = 0;
        while (*q >= '0' && *q <= '9') { v = v * 10 + (u64)(*q - '0'); q++; any = 1; }
        if (!any) return 0;
        *out = v;
        return 1;
    }
    return 0;
}

#endif
