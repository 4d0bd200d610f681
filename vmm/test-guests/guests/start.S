/* Entry for every test guest. The vmm enters here in 64-bit long mode with
 * the first GiB identity-mapped, interrupts off and RSI = zero page.
 * We switch to our own stack and call guest_main(zero_page). */
    .section .text.start, "ax"
    .globl _start
    .code64
_start:
    lea stack_top(%rip), %rsp
    mov %rsi, %rdi
    call guest_main
1:  hlt
    jmp 1b

    .section .bss
    .balign 16
stack_bottom:
    .skip 16384
stack_top:
