//! Fixed guest-physical addresses of the boot structures the VMM writes.

/// GDT used for boot.
pub const BOOT_GDT_START: u64 = 0x500;
/// Empty IDT used for boot (the guest installs its own).
pub const BOOT_IDT_START: u64 = 0x520;
/// PVH `hvm_start_info`.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH memory map table.
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Linux zero page (`boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the 64-bit entry.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4 of the boot identity map.
pub const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table of the boot identity map.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory of the boot identity map (512 x 2 MiB = the first GiB).
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Largest command line (including the NUL) for kernels that do not say (Linux's COMMAND_LINE_SIZE).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area, where the MP table goes; RAM below it is usable.
pub const EBDA_START: u64 = 0x9fc00;
/// The ACPI area: the legacy BIOS range 0xe0000..0x100000 (128 KiB) inside the
/// reserved e820 range above the EBDA. It holds the RSDP (where Linux also
/// finds it by scanning 16-byte boundaries), the VM generation ID and the
/// tables; nothing else is placed there.
pub const ACPI_AREA_START: u64 = 0xe_0000;
/// End (exclusive) of the ACPI area.
pub const ACPI_AREA_END: u64 = 0x10_0000;
/// The RSDP, at the start of the ACPI area (16-byte aligned, as the scan needs).
pub const ACPI_RSDP_START: u64 = ACPI_AREA_START;
/// The 16-byte VM generation ID (8-byte aligned, as the VMGenID spec asks).
pub const ACPI_VMGENID_START: u64 = ACPI_AREA_START + 0x40;
/// The first ACPI table (DSDT); the others follow it, 8-byte aligned.
pub const ACPI_TABLES_START: u64 = ACPI_AREA_START + 0x80;
/// Start of high memory: kernels load here or above.
pub const HIMEM_START: u64 = 0x10_0000;
/// KVM's TSS (three pages) inside the MMIO hole.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// KVM's identity-map page inside the MMIO hole, just below the TSS.
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;
/// The IOAPIC's MMIO base.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// The local APIC's MMIO base.
pub const APIC_START: u64 = 0xfee0_0000;
/// Where the initrd may end at most (Linux's initrd_addr_max default for 64-bit loaders is higher,
/// but staying under the MMIO hole keeps it in low RAM).
pub const INITRD_ALIGN: u64 = 0x1000;
/// MMIO address of the first virtio device; each next one is a window higher.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// GSI of the first virtio device; each next one uses the next free GSI.
pub const VIRTIO_FIRST_GSI: u32 = 5;
/// Highest GSI the IOAPIC has (24 pins).
pub const VIRTIO_LAST_GSI: u32 = 23;
/// Most virtio devices a VM can have: one GSI each, from
/// `VIRTIO_FIRST_GSI` to `VIRTIO_LAST_GSI` except the i8042's AUX line.
pub const MAX_DEVICES: usize = (VIRTIO_LAST_GSI - VIRTIO_FIRST_GSI) as usize;
