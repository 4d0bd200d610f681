//! Boot GDT entries and their conversion into KVM segment registers.

use kvm_bindings::kvm_segment;

/// Encodes a GDT descriptor from its access/flags word, base and 20-bit limit
/// (the layout of the Linux `GDT_ENTRY` macro).
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = base as u64;
    let limit = limit as u64;
    let flags = flags as u64;
    ((base & 0xff00_0000) << 32)
        | ((flags & 0x0000_f0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
}

fn base(entry: u64) -> u64 {
    ((entry >> 32) & 0xff00_0000) | ((entry >> 16) & 0x00ff_ffff)
}

fn raw_limit(entry: u64) -> u32 {
    (((entry >> 32) & 0x000f_0000) | (entry & 0xffff)) as u32
}

fn bit(entry: u64, n: u32) -> u8 {
    ((entry >> n) & 1) as u8
}

/// Converts GDT descriptor `entry` at table index `index` into a `kvm_segment`.
pub fn kvm_segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let granularity = bit(entry, 55);
    let limit = if granularity == 1 {
        (raw_limit(entry) << 12) | 0xfff
    } else {
        raw_limit(entry)
    };
    let present = bit(entry, 47);
    kvm_segment {
        base: base(entry),
        limit,
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: bit(entry, 54),
        s: bit(entry, 44),
        l: bit(entry, 53),
        g: granularity,
        avl: bit(entry, 52),
        padding: 0,
        unusable: u8::from(present == 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_mode_code_segment_round_trips() {
        let entry = gdt_entry(0xa09b, 0, 0xfffff);
        let seg = kvm_segment_from_gdt(entry, 1);
        assert_eq!(seg.selector, 8);
        assert_eq!(seg.type_, 0xb);
        assert_eq!((seg.present, seg.s, seg.l, seg.db, seg.g), (1, 1, 1, 0, 1));
        assert_eq!(seg.limit, 0xffff_ffff);
        assert_eq!(seg.base, 0);
        assert_eq!(seg.unusable, 0);
    }

    #[test]
    fn base_and_byte_limit_are_decoded() {
        let entry = gdt_entry(0x008b, 0x1234_5678, 0x67);
        let seg = kvm_segment_from_gdt(entry, 3);
        assert_eq!(seg.base, 0x1234_5678);
        assert_eq!(seg.limit, 0x67);
        assert_eq!(seg.g, 0);
        assert_eq!(seg.selector, 24);
    }
}
