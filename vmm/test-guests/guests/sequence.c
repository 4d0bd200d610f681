/* Writes the line "abcdefghijklmnopqrstuvwxyz\n" to the serial port over
 * and over, one OUT instruction per byte and without polling the line
 * status: nearly every vCPU exit is a port write, so a pause lands right
 * after one (it enables the THR-empty interrupt first, see below). Each byte follows the one before, so output replayed or lost
 * across a snapshot and restore shows as a break in the sequence. */
#include "guest.h"

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    /* The THR-empty interrupt on (never taken: interrupts stay off here):
     * the vmm then takes the data port out of KVM's coalesced ring, so each
     * OUT is an exit again, as the pause tests need. */
    outb(COM1 + 1, 0x02);
    for (;;) {
        for (u8 c = 'a'; c <= 'z'; c++) outb(COM1, c);
        outb(COM1, '\n');
    }
}
