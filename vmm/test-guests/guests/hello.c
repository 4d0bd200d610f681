/* Prints one line on the serial port and resets through the i8042. */
#include "guest.h"

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    puts("Hello from the hello test guest!\n");
    reset();
}
