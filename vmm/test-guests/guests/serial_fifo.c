/* Resets the UART's receive FIFO through the FIFO control register once
 * host input has arrived, reports whether data was still ready after the
 * reset, then reads the next line the host sends and prints it back. */
#include "guest.h"

#define UART_FCR 2
#define UART_LSR 5
#define LSR_DATA_READY 0x01
/* Enable the FIFOs and clear both (Linux's serial8250_clear_fifos). */
#define FCR_ENABLE_CLEAR_BOTH 0x07

static int data_ready(void) { return inb(COM1 + UART_LSR) & LSR_DATA_READY; }

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    puts("fifo: waiting\n");
    while (!data_ready()) { }
    outb(COM1 + UART_FCR, FCR_ENABLE_CLEAR_BOTH);
    puts("fifo: data_ready_after_reset=");
    put_dec(data_ready() ? 1 : 0);
    putc('\n');
    puts("fifo: reset done\n");

    char line[64];
    int n = 0;
    for (;;) {
        while (!data_ready()) { }
        char c = (char)inb(COM1);
        if (c == '\n') break;
        if (n < (int)sizeof(line) - 1) line[n++] = c;
    }
    line[n] = 0;
    puts("fifo: got=");
    puts(line);
    putc('\n');
    reset();
}
