//! vCPU register setup for the first instruction: general registers, segment
//! and control registers (64-bit long mode or PVH 32-bit protected mode), the
//! FPU, and the local APIC's LINT0/LINT1 wiring.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_regs, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use super::gdt::{gdt_entry, kvm_segment_from_gdt};
use super::layout::{
    BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, PVH_INFO_START, ZERO_PAGE_START,
};
use super::loader::BootEntry;
use super::paging::write_identity_map;
use crate::memory::GuestMemoryMmap;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;
const RFLAGS_RESERVED_BIT: u64 = 0x2;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// General registers for the entry: RSI = zero page (64-bit) or RBX = start info (PVH).
pub fn boot_regs(entry: BootEntry) -> kvm_regs {
    let mut regs = kvm_regs {
        rflags: RFLAGS_RESERVED_BIT,
        rip: entry.addr().0,
        ..Default::default()
    };
    match entry {
        BootEntry::Linux64(_) => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = ZERO_PAGE_START;
        }
        BootEntry::Pvh(_) => regs.rbx = PVH_INFO_START,
    }
    regs
}

/// The boot GDT for `entry`: null, code, data, TSS.
pub fn boot_gdt(entry: BootEntry) -> [u64; 4] {
    match entry {
        BootEntry::Linux64(_) => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xa09b, 0, 0xfffff),
            gdt_entry(0xc093, 0, 0xfffff),
            gdt_entry(0x808b, 0, 0xfffff),
        ],
        BootEntry::Pvh(_) => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xc09b, 0, 0xffff_ffff),
            gdt_entry(0xc093, 0, 0xffff_ffff),
            gdt_entry(0x008b, 0, 0x67),
        ],
    }
}

/// Writes the GDT, IDT and (for 64-bit entry) page tables into guest memory and
/// fills `sregs` for `entry`.
pub fn setup_sregs(
    mem: &GuestMemoryMmap,
    entry: BootEntry,
    sregs: &mut kvm_sregs,
) -> Result<(), vm_memory::GuestMemoryError> {
    let gdt = boot_gdt(entry);
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + (i as u64) * 8))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))?;

    let code = kvm_segment_from_gdt(gdt[1], 1);
    let data = kvm_segment_from_gdt(gdt[2], 2);
    let tss = kvm_segment_from_gdt(gdt[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    match entry {
        BootEntry::Linux64(_) => {
            sregs.cr3 = write_identity_map(mem)?;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
        BootEntry::Pvh(_) => {
            sregs.cr0 = (sregs.cr0 & !X86_CR0_PG) | X86_CR0_PE;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
    Ok(())
}

/// The FPU state Linux expects at entry (x87 control word and MXCSR defaults).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

fn read_lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let b = &lapic.regs[offset..offset + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn write_lapic_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().iter().enumerate() {
        lapic.regs[offset + i] = *byte as _;
    }
}

fn set_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// Wires LINT0 to ExtINT (the PIC) and LINT1 to NMI, as the MP table says.
pub fn setup_lint(lapic: &mut kvm_lapic_state) {
    let lvt0 = read_lapic_reg(lapic, APIC_LVT0);
    write_lapic_reg(lapic, APIC_LVT0, set_delivery_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = read_lapic_reg(lapic, APIC_LVT1);
    write_lapic_reg(lapic, APIC_LVT1, set_delivery_mode(lvt1, APIC_MODE_NMI));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux64_sregs_enter_long_mode() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let mut sregs = kvm_sregs::default();
        setup_sregs(&mem, BootEntry::Linux64(GuestAddress(0x100000)), &mut sregs).unwrap();
        assert_eq!(sregs.cs.l, 1);
        assert_eq!(sregs.cs.selector, 8);
        assert_ne!(sregs.cr0 & X86_CR0_PG, 0);
        assert_ne!(sregs.efer & EFER_LMA, 0);
        assert_eq!(sregs.cr3, super::super::layout::PML4_START);
        let gdt1: u64 = mem.read_obj(GuestAddress(BOOT_GDT_START + 8)).unwrap();
        assert_eq!(gdt1, gdt_entry(0xa09b, 0, 0xfffff));
    }

    #[test]
    fn pvh_sregs_are_protected_mode_without_paging() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let mut sregs = kvm_sregs {
            cr0: 0x6000_0010,
            ..Default::default()
        };
        setup_sregs(&mem, BootEntry::Pvh(GuestAddress(0x1000000)), &mut sregs).unwrap();
        assert_eq!(sregs.cr0 & X86_CR0_PG, 0);
        assert_ne!(sregs.cr0 & X86_CR0_PE, 0);
        assert_eq!(sregs.cs.db, 1);
        assert_eq!(sregs.cs.l, 0);
        assert_eq!(sregs.efer, 0);
        let regs = boot_regs(BootEntry::Pvh(GuestAddress(0x1000000)));
        assert_eq!(regs.rbx, PVH_INFO_START);
    }

    #[test]
    fn lint_pins_get_extint_and_nmi() {
        let mut lapic = kvm_lapic_state::default();
        write_lapic_reg(&mut lapic, APIC_LVT0, 0x0001_0000);
        setup_lint(&mut lapic);
        assert_eq!(read_lapic_reg(&lapic, APIC_LVT0), 0x0001_0700);
        assert_eq!((read_lapic_reg(&lapic, APIC_LVT1) >> 8) & 7, APIC_MODE_NMI);
    }
}
