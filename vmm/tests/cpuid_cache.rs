//! The host CPUID cache (`--cpuid-cache`): the first vmm asks KVM and writes
//! the file, later ones read it, and what the guest sees is the same either
//! way; a cache that does not fit the host is replaced, and a planted
//! change reaches the guest (so the cache really is what later boots use).

mod common;

use std::path::Path;

use common::*;
use kvm_bindings::CpuId;
use vmm::arch::x86_64::cpuid_cache::{self, HostKey};

/// Boots the report guest with `cache` (a path or `none`); returns its
/// CPUID feature lines and where the vmm took the host CPUID from.
fn boot_report(cache: &str) -> (Vec<(String, String)>, String) {
    let g = guest("report");
    let out = run_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--cpuid-cache",
        cache,
        "--log-level",
        "warn,vmm::cpuid=info",
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let features = kv_lines(&stdout(&out))
        .into_iter()
        .filter(|(k, _)| k.starts_with("cpuid."))
        .collect();
    let log = stderr(&out);
    let source = ["Cache", "Kvm"]
        .into_iter()
        .find(|s| log.contains(&format!("source={s}")))
        .unwrap_or_else(|| panic!("no host CPUID source logged: {log}"));
    (features, source.to_string())
}

fn cached(path: &Path) -> CpuId {
    let key = HostKey::read().unwrap();
    cpuid_cache::load(path, &key)
        .unwrap()
        .expect("the cache holds this host's answer")
}

#[test]
fn later_boots_read_the_cache_and_the_guest_sees_the_same_cpuid() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache").join("cpuid");
    let cache = path.to_str().unwrap();

    let (asked, source) = boot_report(cache);
    assert_eq!(source, "Kvm");
    assert!(path.is_file(), "the first boot writes the cache");
    assert!(asked.iter().any(|(k, _)| k == "cpuid.7.ebx"), "{asked:?}");
    let (read, source) = boot_report(cache);
    assert_eq!(source, "Cache");
    assert_eq!(read, asked);
    let (uncached, source) = boot_report("none");
    assert_eq!(source, "Kvm");
    assert_eq!(uncached, asked);

    // A corrupt cache is ignored, and replaced by KVM's answer.
    std::fs::write(&path, b"not a cache").unwrap();
    let (repaired, source) = boot_report(cache);
    assert_eq!((repaired, source.as_str()), (asked.clone(), "Kvm"));
    assert_eq!(boot_report(cache).1, "Cache");

    // What the cache says is what the guest gets: a hypervisor signature
    // planted in the cache reaches the guest's CPUID.
    let mut planted = cached(&path);
    let signature = planted
        .as_mut_slice()
        .iter_mut()
        .find(|e| e.function == 0x4000_0000)
        .expect("KVM reports its signature leaf");
    let words: Vec<u32> = b"CachedCPUID!"
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (signature.ebx, signature.ecx, signature.edx) = (words[0], words[1], words[2]);
    cpuid_cache::store(&path, &HostKey::read().unwrap(), &planted).unwrap();
    let (seen, source) = boot_report(cache);
    assert_eq!(source, "Cache");
    assert_eq!(kv(&seen, "cpuid.hv_signature"), "CachedCPUID!");
}

#[test]
fn an_empty_cache_setting_is_refused() {
    let g = guest("hello");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap(), "--cpuid-cache", ""]);
    assert_eq!(out.status.code(), Some(2), "stderr: {}", stderr(&out));
    assert!(stderr(&out).contains("CPUID cache"), "{}", stderr(&out));
}
