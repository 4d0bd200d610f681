//! Model-specific registers set on every vCPU before its first instruction,
//! and the MTRRs a snapshot saves on top of KVM's own list.

use kvm_bindings::{kvm_msr_entry, Msrs};

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MSR_MTRRdefType: the MTRR enable bits and the default memory type.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRdefType bit 11: MTRRs enabled (fixed-range MTRRs, bit 10, stay off).
const MTRR_ENABLE: u64 = 1 << 11;
/// Memory type 6: write-back.
const MTRR_TYPE_WRITE_BACK: u64 = 6;
/// First variable-range MTRR (IA32_MTRR_PHYSBASE0); KVM has 8 base/mask pairs.
const MSR_MTRR_PHYS_BASE0: u32 = 0x200;
const KVM_VARIABLE_MTRRS: u32 = 8;
/// The fixed-range MTRRs: 64K, two 16K and eight 4K registers.
const MSR_MTRR_FIX_64K: u32 = 0x250;
const MSR_MTRR_FIX_16K: [u32; 2] = [0x258, 0x259];
const MSR_MTRR_FIX_4K_FIRST: u32 = 0x268;
const MSR_MTRR_FIX_4K_LAST: u32 = 0x26f;

/// The boot MSR values: syscall/sysenter state cleared, TSC at zero, fast
/// strings on, and MTRRs enabled with write-back as the default type (as
/// firmware leaves them; Linux skips PAT setup when MTRRs are off).
pub fn boot_msr_entries() -> Vec<kvm_msr_entry> {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_TYPE_WRITE_BACK),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

/// The boot MSRs as the FAM wrapper KVM_SET_MSRS takes.
pub fn boot_msrs() -> Result<Msrs, vmm_sys_util::fam::Error> {
    Msrs::from_entries(&boot_msr_entries())
}

/// Every MTRR a guest can program (variable ranges, fixed ranges, default
/// type). KVM emulates them but leaves them out of KVM_GET_MSR_INDEX_LIST,
/// so a snapshot adds them to the MSRs it saves.
pub fn mtrr_msrs() -> Vec<u32> {
    let variable = MSR_MTRR_PHYS_BASE0..MSR_MTRR_PHYS_BASE0 + 2 * KVM_VARIABLE_MTRRS;
    let fixed_4k = MSR_MTRR_FIX_4K_FIRST..=MSR_MTRR_FIX_4K_LAST;
    variable
        .chain([MSR_MTRR_FIX_64K])
        .chain(MSR_MTRR_FIX_16K)
        .chain(fixed_4k)
        .chain([MSR_MTRR_DEF_TYPE])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_msrs_enable_mtrrs_with_write_back_default() {
        let entries = boot_msr_entries();
        let mtrr: Vec<u64> = entries
            .iter()
            .filter(|e| e.index == 0x2ff)
            .map(|e| e.data)
            .collect();
        assert_eq!(mtrr, [0x806]);
        assert_eq!(boot_msrs().unwrap().as_slice().len(), entries.len());
    }

    #[test]
    fn mtrr_list_covers_variable_fixed_and_default_registers() {
        let list = mtrr_msrs();
        assert_eq!(list.len(), 16 + 11 + 1);
        assert_eq!(list.first(), Some(&0x200));
        assert!(list.contains(&0x20f));
        for fixed in [0x250, 0x258, 0x259, 0x268, 0x26f] {
            assert!(list.contains(&fixed), "{fixed:#x}");
        }
        assert_eq!(list.last(), Some(&0x2ff));
    }
}
