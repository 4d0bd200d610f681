/* Loads an empty IDT and raises an exception: #UD cannot be delivered,
 * nor the #GP/#DF that follow, so the CPU triple-faults (KVM_EXIT_SHUTDOWN). */
#include "guest.h"

void guest_main(const u8 *zero_page) {
    (void)zero_page;
    puts("triplefault: loading an empty IDT\n");
    struct __attribute__((packed)) { u16 limit; u64 base; } idtr = { 0, 0 };
    __asm__ volatile("lidt %0" : : "m"(idtr));
    __asm__ volatile("ud2");
    puts("triplefault: still alive, which is a bug\n");
    for (;;) __asm__ volatile("hlt");
}
