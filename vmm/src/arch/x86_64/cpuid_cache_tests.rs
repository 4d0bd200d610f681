use std::os::unix::fs::PermissionsExt;

use super::*;

fn entry(function: u32, eax: u32) -> kvm_cpuid_entry2 {
    kvm_cpuid_entry2 {
        function,
        eax,
        ebx: function ^ 0x5a5a,
        ecx: 3,
        edx: 4,
        ..Default::default()
    }
}

fn sample_cpuid() -> CpuId {
    CpuId::from_entries(&[entry(0, 0xd), entry(1, 0x806f8), entry(7, 0)]).unwrap()
}

fn sample_key() -> HostKey {
    HostKey {
        boot_id: "4a0d2a63-3a36-4d0c-9d1e-0c5b1f7f3c11".into(),
        modules: vec![Some(8508), None, None, Some(9103)],
        leaves: vec![[1, 0, 0x800, 0xfffa3203, 0x1f8bfbff]; 3],
        xcomp_guest_perm: Some(0x2e7),
    }
}

fn cache_path() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub").join("cpuid");
    (dir, path)
}

fn entries(cpuid: &CpuId) -> Vec<kvm_cpuid_entry2> {
    cpuid.as_slice().to_vec()
}

#[test]
fn stored_cpuid_loads_back_for_the_same_key() {
    let (_dir, path) = cache_path();
    store(&path, &sample_key(), &sample_cpuid()).unwrap();
    let loaded = load(&path, &sample_key()).unwrap().expect("a cache hit");
    assert_eq!(entries(&loaded), entries(&sample_cpuid()));
}

#[test]
fn store_makes_a_private_directory_and_file_and_leaves_no_temporary() {
    let (_dir, path) = cache_path();
    store(&path, &sample_key(), &sample_cpuid()).unwrap();
    let dir_mode = fs::metadata(path.parent().unwrap()).unwrap().mode() & 0o777;
    let file_mode = fs::metadata(&path).unwrap().mode() & 0o777;
    assert_eq!((dir_mode, file_mode), (0o700, 0o600));
    let names: Vec<_> = fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![OsString::from("cpuid")]);
    // A second store replaces the file.
    let other = CpuId::from_entries(&[entry(0, 1)]).unwrap();
    store(&path, &sample_key(), &other).unwrap();
    let loaded = load(&path, &sample_key()).unwrap().unwrap();
    assert_eq!(entries(&loaded), entries(&other));
}

#[test]
fn every_part_of_the_key_invalidates_the_cache() {
    let (_dir, path) = cache_path();
    store(&path, &sample_key(), &sample_cpuid()).unwrap();
    let changes: [fn(&mut HostKey); 4] = [
        |k| k.boot_id = "11111111-2222-3333-4444-555555555555".into(),
        |k| k.modules[0] = Some(9999),
        |k| k.leaves[1][3] ^= 1 << 11,
        |k| k.xcomp_guest_perm = Some(0x60000 | 0x2e7),
    ];
    for (i, change) in changes.iter().enumerate() {
        let mut key = sample_key();
        change(&mut key);
        assert!(load(&path, &key).unwrap().is_none(), "change {i} still hit");
    }
}

#[test]
fn a_missing_file_is_a_plain_miss() {
    let (_dir, path) = cache_path();
    assert!(load(&path, &sample_key()).unwrap().is_none());
}

#[test]
fn malformed_files_are_refused() {
    let (_dir, path) = cache_path();
    store(&path, &sample_key(), &sample_cpuid()).unwrap();
    let good = fs::read(&path).unwrap();
    let too_many = encode(&CacheFile {
        key: sample_key(),
        entries: vec![entry(0, 0); KVM_MAX_CPUID_ENTRIES + 1],
    })
    .unwrap();
    let no_entries = encode(&CacheFile {
        key: sample_key(),
        entries: Vec::new(),
    })
    .unwrap();
    let mut short_key = sample_key();
    short_key.leaves.pop();
    let other_shape = encode(&CacheFile {
        key: short_key,
        entries: vec![entry(0, 0)],
    })
    .unwrap();
    let mut wrong_version = good.clone();
    wrong_version[7] = b'1';
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("wrong version", wrong_version),
        ("truncated", good[..good.len() - 3].to_vec()),
        ("trailing bytes", [good.as_slice(), &[0]].concat()),
        ("too many entries", too_many),
        ("no entries", no_entries),
        ("another key shape", other_shape),
    ];
    for (what, bytes) in cases {
        fs::write(&path, &bytes).unwrap();
        let err = load(&path, &sample_key()).expect_err(what);
        assert!(matches!(err, CacheError::Malformed { .. }), "{what}: {err}");
    }
    let huge = vec![0u8; MAX_FILE_BYTES as usize + 1];
    fs::write(&path, huge).unwrap();
    let err = load(&path, &sample_key()).unwrap_err();
    assert!(err.to_string().contains("more than"), "{err}");
}

#[test]
fn files_others_could_have_written_are_not_trusted() {
    let (dir, path) = cache_path();
    store(&path, &sample_key(), &sample_cpuid()).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o620)).unwrap();
    let err = load(&path, &sample_key()).unwrap_err();
    assert!(matches!(err, CacheError::Untrusted { .. }), "{err}");
    assert!(err.to_string().contains("writable by group"), "{err}");

    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let err = load(&link, &sample_key()).unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");

    let err = load(dir.path(), &sample_key()).unwrap_err();
    assert!(
        matches!(err, CacheError::Untrusted { .. } | CacheError::Read { .. }),
        "{err}"
    );
}

#[test]
fn store_reports_an_unwritable_place() {
    let (dir, _) = cache_path();
    let blocker = dir.path().join("file");
    fs::write(&blocker, b"x").unwrap();
    let err = store(&blocker.join("cpuid"), &sample_key(), &sample_cpuid()).unwrap_err();
    assert!(matches!(err, CacheError::Write { .. }), "{err}");
}

#[test]
fn this_hosts_key_reads_the_same_twice() {
    let key = HostKey::read().unwrap();
    assert_eq!(key.boot_id.len(), 36);
    assert_eq!(key.modules.len(), MODULES.len());
    assert_eq!(key.leaves.len(), KEY_LEAVES.len());
    assert_eq!(HostKey::read().unwrap(), key);
}

#[test]
fn supported_cpuid_asks_kvm_once_then_reads_the_cache() {
    let kvm = match Kvm::new() {
        Ok(kvm) => kvm,
        Err(e) => {
            println!("SKIPPED: cannot open /dev/kvm: {e}");
            return;
        }
    };
    let (_dir, path) = cache_path();
    let (first, source) = supported_cpuid(&kvm, Some(&path)).unwrap();
    assert_eq!(source, Source::Kvm);
    assert!(path.is_file());
    let (second, source) = supported_cpuid(&kvm, Some(&path)).unwrap();
    assert_eq!(source, Source::Cache);
    assert_eq!(entries(&second), entries(&first));
    let (direct, source) = supported_cpuid(&kvm, None).unwrap();
    assert_eq!(source, Source::Kvm);
    assert_eq!(entries(&direct), entries(&first));

    // A corrupt file is replaced by KVM's answer.
    fs::write(&path, b"garbage").unwrap();
    let (_, source) = supported_cpuid(&kvm, Some(&path)).unwrap();
    assert_eq!(source, Source::Kvm);
    assert_eq!(supported_cpuid(&kvm, Some(&path)).unwrap().1, Source::Cache);
}
