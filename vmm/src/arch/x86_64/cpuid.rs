//! CPUID for each vCPU: KVM_GET_SUPPORTED_CPUID, normalised so the guest sees
//! its own APIC id and topology, knows it runs under a hypervisor, and does
//! not see host details that do not concern it.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

const LEAF_FEATURES: u32 = 0x1;
const LEAF_SERIAL_NUMBER: u32 = 0x3;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_THERMAL_POWER: u32 = 0x6;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;

const ECX_HYPERVISOR_BIT: u32 = 1 << 31;
const EDX_HTT_BIT: u32 = 1 << 28;
/// Topology level types in leaf 0xB/0x1F ECX[15:8].
const LEVEL_TYPE_SMT: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;

/// Normalises `cpuid` in place for vCPU `index` of `count` vCPUs.
pub fn normalize(cpuid: &mut CpuId, index: u8, count: u8) {
    for entry in cpuid.as_mut_slice() {
        normalize_entry(entry, index, count);
    }
}

fn normalize_entry(entry: &mut kvm_cpuid_entry2, index: u8, count: u8) {
    let index = u32::from(index);
    let count = u32::from(count);
    match entry.function {
        LEAF_FEATURES => {
            // EBX[31:24] initial APIC id, EBX[23:16] logical processors per package.
            entry.ebx = (entry.ebx & 0x0000_ffff) | (index << 24) | (count << 16);
            entry.ecx |= ECX_HYPERVISOR_BIT;
            if count > 1 {
                entry.edx |= EDX_HTT_BIT;
            } else {
                entry.edx &= !EDX_HTT_BIT;
            }
        }
        LEAF_CACHE_PARAMS => {
            // EAX[31:26]: cores per package minus one; EAX[25:14]: threads sharing the cache
            // minus one. One core per vCPU, no SMT.
            entry.eax &= 0x0000_3fff;
            if entry.eax & 0x1f != 0 {
                entry.eax |= (count - 1) << 26;
            }
        }
        LEAF_SERIAL_NUMBER | LEAF_THERMAL_POWER => {
            entry.eax = 0;
            entry.ebx = 0;
            entry.ecx = 0;
            entry.edx = 0;
        }
        LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY => {
            let (eax, ebx, level_type) = match entry.index {
                0 => (0, 1, LEVEL_TYPE_SMT),
                1 => (core_id_shift(count), count, LEVEL_TYPE_CORE),
                _ => (0, 0, 0),
            };
            entry.eax = eax;
            entry.ebx = ebx;
            entry.ecx = (level_type << 8) | (entry.index & 0xff);
            entry.edx = index;
        }
        _ => {}
    }
}

/// Bits needed to number `count` cores (the x2APIC id shift of the core level).
fn core_id_shift(count: u32) -> u32 {
    u32::BITS - count.saturating_sub(1).leading_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0x0000_0800,
            ecx: 0x1,
            edx: 0x1,
            ..Default::default()
        }
    }

    #[test]
    fn leaf_one_carries_apic_id_count_and_hypervisor_bit() {
        let mut e = entry(1, 0);
        normalize_entry(&mut e, 3, 4);
        assert_eq!(e.ebx >> 24, 3);
        assert_eq!((e.ebx >> 16) & 0xff, 4);
        assert_eq!(e.ebx & 0xffff, 0x0800);
        assert_ne!(e.ecx & ECX_HYPERVISOR_BIT, 0);
        assert_ne!(e.edx & EDX_HTT_BIT, 0);
    }

    #[test]
    fn leaf_one_keeps_the_mtrr_feature_bit() {
        const EDX_MTRR_BIT: u32 = 1 << 12;
        for count in [1, 2] {
            let mut e = entry(1, 0);
            e.edx |= EDX_MTRR_BIT;
            normalize_entry(&mut e, 0, count);
            assert_ne!(e.edx & EDX_MTRR_BIT, 0, "{count} vCPUs");
        }
    }

    #[test]
    fn topology_leaf_reports_x2apic_id_and_core_count() {
        let mut core = entry(0xb, 1);
        normalize_entry(&mut core, 2, 3);
        assert_eq!(core.edx, 2);
        assert_eq!(core.ebx, 3);
        assert_eq!(core.eax, 2);
        assert_eq!((core.ecx >> 8) & 0xff, LEVEL_TYPE_CORE);
    }

    #[test]
    fn host_detail_leaves_are_cleared() {
        let mut e = entry(LEAF_THERMAL_POWER, 0);
        e.eax = 0x77;
        normalize_entry(&mut e, 0, 1);
        assert_eq!((e.eax, e.ebx, e.ecx, e.edx), (0, 0, 0, 0));
    }

    #[test]
    fn core_shift_fits_the_count() {
        assert_eq!(core_id_shift(1), 0);
        assert_eq!(core_id_shift(2), 1);
        assert_eq!(core_id_shift(3), 2);
        assert_eq!(core_id_shift(8), 3);
    }
}
