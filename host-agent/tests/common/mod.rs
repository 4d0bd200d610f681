//! host-agent's test helpers. The shared harness (`tests/harness`) has the
//! host-agent process ([`Agent`]), the vmm binary, the counter guest,
//! process killing, the root and jail checks and git; they are re-exported
//! here. What stays is host-agent's own: the usage-chain check and a
//! scripted stand-in for guest-init ([`fake_guest`]).
// Each test file uses a part of this module.
#![allow(dead_code, unused_imports)]

pub mod capture;
pub mod counts;
pub mod fake_guest;
pub mod netns;
pub mod networked;

use std::path::{Path, PathBuf};

use proto::hostagent as pb;

pub use test_harness::agent::{Agent, S};
pub use test_harness::bin::vmm_path;
pub use test_harness::git::{git, repo_with_main};
pub use test_harness::guests::counter_kernel;
pub use test_harness::host::{is_root, jail_supported};
pub use test_harness::process::{kill_processes_under, sigkill};

/// PauseSession of `id` to disk.
pub fn persist_req(id: &str) -> pb::PauseSessionRequest {
    pb::PauseSessionRequest {
        session_id: id.into(),
        idempotency_key: String::new(),
        persist: true,
    }
}

/// A call on session `id` without an idempotency key.
pub fn call(id: &str) -> pb::SessionCall {
    pb::SessionCall {
        session_id: id.into(),
        idempotency_key: String::new(),
    }
}

/// Checks usage records of one session: seqs increase, intervals are
/// contiguous, cumulative counters never decrease.
pub fn check_usage_chain(recs: &[pb::UsageRecord]) {
    for w in recs.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        assert!(b.seq > a.seq, "seq increases");
        assert_eq!(
            b.interval_start, a.interval_end,
            "intervals are contiguous: {a:?} {b:?}"
        );
        assert!(b.interval_end >= b.interval_start);
        assert!(b.billed_seconds >= a.billed_seconds);
        assert!(b.vcpu_seconds >= a.vcpu_seconds);
        assert!(b.memory_allocated_gib_seconds >= a.memory_allocated_gib_seconds);
        assert!(b.memory_resident_gib_seconds >= a.memory_resident_gib_seconds);
        assert!(b.disk_bytes_written >= a.disk_bytes_written);
        assert!(!a.r#final, "only the last record is final");
    }
}

/// Registers test guest `guest` as image `id` with `cmdline`, `mem_mib` of
/// memory and, if given, a root disk, and builds its golden snapshot.
pub async fn test_guest_image(
    agent: &Agent,
    id: &str,
    guest: &str,
    cmdline: &str,
    mem_mib: u32,
    rootfs: Option<&Path>,
) {
    let mut im = agent.images().await;
    im.register_image(pb::RegisterImageRequest {
        image_id: id.into(),
        kernel_path: test_harness::guests::path(guest).display().to_string(),
        rootfs_path: rootfs.map(|p| p.display().to_string()).unwrap_or_default(),
        cmdline: cmdline.into(),
        mem_mib,
        vcpus: 1,
        ..Default::default()
    })
    .await
    .expect("register the image");
    im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
        image_id: id.into(),
        settle_ms: 50,
        ..Default::default()
    })
    .await
    .expect("build its golden snapshot");
}

/// Writes `data` over the start of the file at `path` (a VM's disk),
/// leaving its length.
pub fn write_at_start(path: &Path, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, 0).unwrap();
}

/// A 4 MiB "root disk" with data at both ends and a hole between.
pub fn rootfs(dir: &Path) -> PathBuf {
    let path = dir.join("rootfs.img");
    let mut data = vec![0u8; 4 << 20];
    data[..12].copy_from_slice(b"image rootfs");
    let end = data.len();
    data[end - 4..].copy_from_slice(b"tail");
    std::fs::write(&path, &data).unwrap();
    path
}

pub async fn disk_image(agent: &Agent, rootfs: &Path) -> pb::Image {
    let mut im = agent.images().await;
    im.register_image(pb::RegisterImageRequest {
        image_id: "disk".into(),
        kernel_path: counter_kernel(),
        rootfs_path: rootfs.display().to_string(),
        cmdline: "interval=100000000".into(),
        mem_mib: 32,
        vcpus: 1,
        ..Default::default()
    })
    .await
    .expect("register an image with a rootfs");
    im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
        image_id: "disk".into(),
        settle_ms: 50,
        ..Default::default()
    })
    .await
    .expect("golden snapshot with the disk attached")
    .into_inner()
}
