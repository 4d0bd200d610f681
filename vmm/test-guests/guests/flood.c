/* Writes to the serial port as fast as it can, forever: a hostile guest for
 * checking that host memory stays bounded when nobody reads the console. */
#include "guest.h"

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    for (;;) {
        for (int i = 0; i < 63; i++) outb(COM1, 'x');
        outb(COM1, '\n');
    }
}
