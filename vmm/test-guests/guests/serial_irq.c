/* The UART's THR-empty interrupt, taken through the IOAPIC. Prints a line
 * with the UART's interrupts off (writes the vmm may route through KVM's
 * coalesced ring), enables the THR-empty interrupt, then writes one byte to
 * THR and waits for the interrupt without making any other exit: a write
 * left in the ring would raise it only at the next exit, so the wait would
 * time out. Prints how many interrupts arrived (2 expected: one when the
 * interrupt was enabled with THR empty, one for the write). */
#include "guest.h"
#include "virtio.h"

#define IOAPIC 0xfec00000UL
#define LAPIC 0xfee00000UL
#define LAPIC_EOI 0xb0
#define LAPIC_SVR 0xf0
#define UART_VECTOR 0x34
#define SPURIOUS_VECTOR 0xff
#define UART_IER 1
#define UART_IIR 2
#define IER_THR_EMPTY 0x02
/* TSC ticks to wait for an interrupt before giving up: about a second
 * (a count of spins would not do: guest kernel code may be emulated, at
 * speeds that differ by orders of magnitude between hosts). */
#define WAIT_TICKS 3000000000UL

struct interrupt_frame;

static volatile u32 irqs;

__attribute__((interrupt)) static void uart_isr(struct interrupt_frame *frame) {
    (void)frame;
    (void)inb(COM1 + UART_IIR); /* acknowledges the THR-empty interrupt */
    irqs++;
    mmio_w32(LAPIC + LAPIC_EOI, 0);
}

__attribute__((interrupt)) static void spurious_isr(struct interrupt_frame *frame) {
    (void)frame;
}

struct __attribute__((packed)) gate {
    u16 offset_low, selector;
    u8 ist, type;
    u16 offset_mid;
    u32 offset_high, zero;
};

static struct gate idt[256] __attribute__((aligned(16)));

static void set_gate(int vector, void (*handler)(struct interrupt_frame *)) {
    u64 at = (u64)handler;
    u16 cs;
    __asm__ volatile("mov %%cs, %0" : "=r"(cs));
    idt[vector] = (struct gate){
        .offset_low = (u16)at,
        .selector = cs,
        .type = 0x8e, /* present, DPL 0, 64-bit interrupt gate */
        .offset_mid = (u16)(at >> 16),
        .offset_high = (u32)(at >> 32),
    };
}

static void ioapic_write(u32 reg, u32 value) {
    mmio_w32(IOAPIC, reg);
    mmio_w32(IOAPIC + 0x10, value);
}

static u64 rdtsc(void) {
    u32 lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return ((u64)hi << 32) | lo;
}

/* Spins until `n` interrupts have arrived or WAIT_TICKS have passed. */
static u32 wait_for(u32 n) {
    u64 start = rdtsc();
    while (irqs < n && rdtsc() - start < WAIT_TICKS) __asm__ volatile("" ::: "memory");
    return irqs;
}

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    puts("serial_irq: polled line\n");

    map_mmio_hole();
    outb(0x21, 0xff); /* both PICs masked: the IOAPIC alone delivers */
    outb(0xa1, 0xff);
    set_gate(UART_VECTOR, uart_isr);
    set_gate(SPURIOUS_VECTOR, spurious_isr);
    struct __attribute__((packed)) { u16 limit; u64 base; } idtr = { sizeof(idt) - 1, (u64)idt };
    __asm__ volatile("lidt %0" : : "m"(idtr));
    mmio_w32(LAPIC + LAPIC_SVR, 0x100 | SPURIOUS_VECTOR);
    /* IOAPIC pin 4 (COM1): edge, active high, fixed, to APIC 0. */
    ioapic_write(0x10 + 2 * 4 + 1, 0);
    ioapic_write(0x10 + 2 * 4, UART_VECTOR);
    __asm__ volatile("sti");

    outb(COM1 + UART_IER, IER_THR_EMPTY);
    u32 enabled = wait_for(1);
    outb(COM1, '.'); /* no exit after this until the interrupt */
    u32 written = wait_for(2);
    outb(COM1 + UART_IER, 0);
    __asm__ volatile("cli");

    puts("\nserial_irq: on_enable=");
    put_dec(enabled);
    puts(" after_write=");
    put_dec(written);
    putc('\n');
    reset();
}
