//! Images with a root disk: the golden snapshot keeps the disk the image
//! booted with (the registered file is never written), and every VM gets
//! its own copy of it as its virtio-blk device, so one session's writes reach
//! neither the image nor another session. With jailed vmm processes the copy
//! lies in the jail and belongs to the jail's uid.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::*;

/// The files the process `pid` holds open, as it names them.
fn open_files(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .map(|p| p.display().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vm_gets_its_own_copy_of_the_golden_disk() {
    let t = tempfile::tempdir().unwrap();
    let source = rootfs(t.path());
    let original = std::fs::read(&source).unwrap();
    // Unjailed, so the test can look at the vmm's open files by host path; the
    // jailed case is the next test.
    let agent = Agent::start(&["--no-jail"]);
    let image = disk_image(&agent, &source).await;
    let golden_disk = Path::new(&image.golden_snapshot_dir).join("rootfs.ext4");
    assert_eq!(std::fs::read(&golden_disk).unwrap(), original);

    let a = agent.create("disk", "a").await;
    let b = agent.create("disk", "b").await;
    let mut disks = Vec::new();
    for s in [&a, &b] {
        assert_eq!(s.state, S::Running as i32);
        let disk = agent
            .state_dir()
            .join("sessions")
            .join(&s.session_id)
            .join("disk.ext4");
        assert_eq!(std::fs::read(&disk).unwrap(), original, "{s:?}");
        assert!(
            open_files(s.vmm_pid).contains(&disk.display().to_string()),
            "the vmm of {} does not hold its own disk open",
            s.session_id
        );
        disks.push(disk);
    }
    let inode = |p: &Path| std::fs::metadata(p).unwrap().ino();
    assert_ne!(inode(&disks[0]), inode(&disks[1]));
    assert_ne!(inode(&disks[0]), inode(&golden_disk));
    // A write to one session's disk reaches nothing else.
    std::fs::write(&disks[0], b"changed").unwrap();
    assert_eq!(std::fs::read(&disks[1]).unwrap(), original);
    assert_eq!(std::fs::read(&golden_disk).unwrap(), original);
    assert_eq!(std::fs::read(&source).unwrap(), original);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jailed_vm_gets_its_disk_inside_the_jail() {
    if !jail_supported() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let source = rootfs(t.path());
    // Jailed: host-agent's default.
    let agent = Agent::start(&[]);
    disk_image(&agent, &source).await;
    let s = agent.create("disk", "jailed").await;
    assert_eq!(s.state, S::Running as i32);
    let disk = agent
        .state_dir()
        .join("sessions")
        .join(&s.session_id)
        .join("jail/run/disk.ext4");
    let meta = std::fs::metadata(&disk).unwrap();
    // The VM's own uid from the default range, gid the same.
    assert!(
        (2_000_000_000..=2_000_065_535).contains(&meta.uid()),
        "{}",
        meta.uid()
    );
    assert_eq!(meta.gid(), meta.uid());
    let vmm = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", s.vmm_pid))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse::<u32>()
        .unwrap();
    // Inside its mount namespace the jailed vmm sees the disk at /run.
    assert!(
        open_files(vmm).contains(&"/run/disk.ext4".to_string()),
        "{:?}",
        open_files(vmm)
    );
}
