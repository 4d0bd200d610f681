//! A guest that faults on its very first instruction: the vmm's crash
//! report says the fault came on the first entry after the vmm wrote the
//! vCPU's state (the phrase test harnesses grep for to blame the vmm).

mod common;

use std::path::Path;

use common::*;

/// Where the kernel is loaded and entered (the loader's high-memory start).
const LOAD_ADDR: u64 = 0x10_0000;
/// ELF64 header and program header sizes.
const EHDR_SIZE: u16 = 64;
const PHDR_SIZE: u16 = 56;

/// A minimal ELF64 vmlinux of one PT_LOAD segment holding `code`, entered
/// at its first byte in 64-bit mode.
fn write_elf(path: &Path, code: &[u8]) {
    let code_offset = u64::from(EHDR_SIZE + PHDR_SIZE);
    let len = code.len() as u64;
    let mut elf = Vec::new();
    elf.extend_from_slice(b"\x7fELF");
    // 64-bit, little-endian, version 1, System V ABI, padding.
    elf.extend_from_slice(&[2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    elf.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    elf.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // e_entry
    elf.extend_from_slice(&u64::from(EHDR_SIZE).to_le_bytes()); // e_phoff
    elf.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    elf.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    elf.extend_from_slice(&EHDR_SIZE.to_le_bytes());
    elf.extend_from_slice(&PHDR_SIZE.to_le_bytes());
    elf.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    elf.extend_from_slice(&[0; 6]); // e_shentsize, e_shnum, e_shstrndx
    assert_eq!(elf.len(), usize::from(EHDR_SIZE));
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // PF_R | PF_X
    elf.extend_from_slice(&code_offset.to_le_bytes());
    elf.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // p_vaddr
    elf.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // p_paddr
    elf.extend_from_slice(&len.to_le_bytes()); // p_filesz
    elf.extend_from_slice(&len.to_le_bytes()); // p_memsz
    elf.extend_from_slice(&0x1000u64.to_le_bytes()); // p_align
    assert_eq!(elf.len() as u64, code_offset);
    elf.extend_from_slice(code);
    std::fs::write(path, elf).unwrap();
}

#[test]
fn a_fault_on_the_first_instruction_is_said_to_come_on_the_first_entry() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("ud2.elf");
    // ud2: the boot IDT (limit 7) holds no 64-bit gate, so neither #UD nor
    // the #GP and #DF after it can be delivered and the vCPU triple-faults
    // before it makes a single exit.
    write_elf(&kernel, &[0x0f, 0x0b]);
    let out = run_vmm(&["run", "--kernel", kernel.to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.contains("vCPU 0 triple-faulted"), "stderr: {err}");
    let state = err
        .lines()
        .find(|l| l.contains("vCPU 0 at the failure:"))
        .unwrap_or_else(|| panic!("no vCPU state in stderr: {err}"));
    assert!(state.contains("; last exits: none;"), "{state}");
    assert!(
        state.contains(
            "exits since the vmm set this vCPU's state: 0 \
             (the failure came on the first entry after the vmm wrote its state)"
        ),
        "{state}"
    );
}
