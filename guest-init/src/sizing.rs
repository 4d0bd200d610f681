//! A session's size inside the VM (StartSession's `vcpus`, `mem_mib` and
//! `root_disk_bytes`): the VM is a restore of a snapshot of fixed size, and a
//! smaller session is confined within it.
//!
//! * vCPUs past the session's are taken offline (`/sys/devices/system/cpu`),
//!   so its commands see as many CPUs as it was given (host-agent caps the
//!   VM's CPU time to match).
//! * Memory is the turns' cgroup limit ([`crate::turn::Turns::limit_memory`]).
//! * A root disk larger than the snapshot's (the vmm restores it grown and
//!   raises a configuration change) is waited for, and the root ext4
//!   filesystem grown online to fill it.
//!
//! The CPUs and the disk are the machine's: only guest-init as PID 1 changes
//! them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Why a session could not be given its size.
#[derive(Debug, thiserror::Error)]
pub enum SizingError {
    /// A vCPU could not be taken offline.
    #[error("cannot take cpu{cpu} offline ({path}): {source}")]
    Offline {
        /// The CPU's number.
        cpu: u32,
        /// Its `online` file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The root filesystem's device was not found in mountinfo.
    #[error("cannot find the root filesystem's block device: {0}")]
    NoRootDevice(String),
    /// The disk did not show the size the host gave it in time.
    #[error(
        "the root disk {device} is {seen} bytes after {waited_ms} ms, not the {want} bytes the \
         host gave it (does the vmm restore grown disks?)"
    )]
    DiskNotGrown {
        /// The block device's name (`vda`).
        device: String,
        /// Its size as last seen.
        seen: u64,
        /// The size asked for.
        want: u64,
        /// How long it was waited for.
        waited_ms: u64,
    },
    /// The filesystem could not be grown.
    #[error("cannot grow the root filesystem to {bytes} bytes: {source}")]
    Resize {
        /// The size asked for.
        bytes: u64,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Takes vCPUs `keep` and above offline under `cpu_dir` (normally
/// /sys/devices/system/cpu); returns how many went offline. CPUs without an
/// `online` file (cpu0 on most kernels) stay; so do ones offline already.
pub fn offline_cpus(cpu_dir: &Path, keep: u32) -> Result<u32, SizingError> {
    let mut cpus: Vec<u32> = std::fs::read_dir(cpu_dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("cpu")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    cpus.sort_unstable();
    let mut taken = 0;
    for cpu in cpus.into_iter().filter(|&c| c >= keep) {
        let path = cpu_dir.join(format!("cpu{cpu}")).join("online");
        match std::fs::read_to_string(&path) {
            Ok(s) if s.trim() == "0" => continue,
            Ok(_) => {}
            Err(_) => continue,
        }
        std::fs::write(&path, "0").map_err(|source| SizingError::Offline {
            cpu,
            path: path.clone(),
            source,
        })?;
        taken += 1;
    }
    Ok(taken)
}

/// The block device (its name under /sys/class/block, e.g. `vda`) of the
/// filesystem mounted at `/`, from `/proc/self/mountinfo`'s text.
pub fn root_device(mountinfo: &str) -> Result<String, SizingError> {
    // Fields: id parent major:minor root mount-point options ... - fstype source ...
    // The last mount at / is the one in force.
    let source = mountinfo
        .lines()
        .rev()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (pre.split_whitespace().nth(4)? == "/").then(|| post.split_whitespace().nth(1))?
        })
        .ok_or_else(|| SizingError::NoRootDevice("no mount at / in mountinfo".into()))?;
    source
        .strip_prefix("/dev/")
        .filter(|d| !d.is_empty() && !d.contains('/'))
        .map(str::to_string)
        .ok_or_else(|| SizingError::NoRootDevice(format!("/ is mounted from {source:?}")))
}

/// Size in bytes of block device `device` under `class_block` (normally
/// /sys/class/block), which counts in 512-byte sectors.
fn device_bytes(class_block: &Path, device: &str) -> u64 {
    std::fs::read_to_string(class_block.join(device).join("size"))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(0, |s| s.saturating_mul(512))
}

/// Waits until `device` is at least `want` bytes (the driver takes the
/// vmm's configuration change on a work queue, so the new size shows a
/// little after the guest resumes); returns its size.
pub fn wait_for_disk(
    class_block: &Path,
    device: &str,
    want: u64,
    timeout: Duration,
) -> Result<u64, SizingError> {
    let t0 = Instant::now();
    loop {
        let seen = device_bytes(class_block, device);
        if seen >= want {
            return Ok(seen);
        }
        if t0.elapsed() >= timeout {
            return Err(SizingError::DiskNotGrown {
                device: device.into(),
                seen,
                want,
                waited_ms: t0.elapsed().as_millis() as u64,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// EXT4_IOC_RESIZE_FS: `_IOW('f', 16, __u64)`.
const EXT4_IOC_RESIZE_FS: libc::c_ulong = 0x4008_6610;

/// Grows the ext4 filesystem mounted at `mount` to `bytes` (rounded down to
/// its block size), online. Growing to its current size does nothing.
pub fn grow_ext4(mount: &Path, bytes: u64) -> Result<(), SizingError> {
    let fail = |source| SizingError::Resize { bytes, source };
    let dir = std::fs::File::open(mount).map_err(fail)?;
    // SAFETY: an all-zero statfs is a valid value for fstatfs to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    use std::os::fd::AsRawFd;
    // SAFETY: `dir` is an open descriptor and `st` a writable statfs.
    if unsafe { libc::fstatfs(dir.as_raw_fd(), &mut st) } != 0 {
        return Err(fail(std::io::Error::last_os_error()));
    }
    let block = st.f_bsize as u64;
    if block == 0 {
        return Err(fail(std::io::Error::other(
            "the filesystem reports block size 0",
        )));
    }
    let blocks: u64 = bytes / block;
    // SAFETY: the ioctl reads one u64 (the new block count) from the
    // pointer, which is valid for the call.
    if unsafe { libc::ioctl(dir.as_raw_fd(), EXT4_IOC_RESIZE_FS as _, &blocks) } != 0 {
        return Err(fail(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Gives the root disk its new size: waits for the device to show `bytes`
/// (at most `timeout`), then grows the root filesystem. Returns the device.
pub fn grow_root(bytes: u64, timeout: Duration) -> Result<String, SizingError> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| SizingError::NoRootDevice(e.to_string()))?;
    let device = root_device(&mountinfo)?;
    let seen = wait_for_disk(Path::new("/sys/class/block"), &device, bytes, timeout)?;
    grow_ext4(Path::new("/"), seen)?;
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_cpus(dir: &Path, online: &[(u32, Option<&str>)]) {
        for (cpu, state) in online {
            let d = dir.join(format!("cpu{cpu}"));
            std::fs::create_dir_all(&d).unwrap();
            if let Some(s) = state {
                std::fs::write(d.join("online"), s).unwrap();
            }
        }
        // Entries that are not CPUs are left alone.
        std::fs::create_dir_all(dir.join("cpufreq")).unwrap();
        std::fs::write(dir.join("online"), "0-3\n").unwrap();
    }

    #[test]
    fn vcpus_past_the_sessions_go_offline_and_the_rest_stay() {
        let t = tempfile::tempdir().unwrap();
        fake_cpus(
            t.path(),
            &[
                (0, None),
                (1, Some("1\n")),
                (2, Some("1\n")),
                (3, Some("0\n")),
                (10, Some("1\n")),
            ],
        );
        assert_eq!(offline_cpus(t.path(), 2).unwrap(), 2, "cpu2 and cpu10");
        let state =
            |c: u32| std::fs::read_to_string(t.path().join(format!("cpu{c}/online"))).unwrap();
        assert_eq!(state(1), "1\n");
        assert_eq!(state(2), "0");
        assert_eq!(state(3), "0\n", "offline already: not written");
        assert_eq!(state(10), "0", "numbered past 9: compared as a number");
        assert_eq!(offline_cpus(t.path(), 2).unwrap(), 0, "nothing left to do");
        assert_eq!(
            std::fs::read_to_string(t.path().join("online")).unwrap(),
            "0-3\n"
        );
    }

    #[test]
    fn the_root_device_comes_from_the_mount_at_slash() {
        let mi = "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                  23 22 0:5 / /dev rw - devtmpfs devtmpfs rw\n\
                  24 22 0:21 / /proc rw - proc proc rw\n";
        assert_eq!(root_device(mi).unwrap(), "vda");
        // The last mount at / is the one in force (an initramfs's rootfs first).
        let stacked = "1 1 0:2 / / rw - rootfs rootfs rw\n30 1 254:0 / / rw - ext4 /dev/vdb rw\n";
        assert_eq!(root_device(stacked).unwrap(), "vdb");
        for bad in [
            "",
            "1 1 0:2 / / rw - rootfs rootfs rw\n",
            "1 1 0:2 / / rw - ext4 /dev/mapper/x rw\n",
        ] {
            assert!(
                matches!(root_device(bad), Err(SizingError::NoRootDevice(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_disk_is_waited_for_until_it_shows_its_size() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("vda")).unwrap();
        std::fs::write(t.path().join("vda/size"), "2048\n").unwrap();
        assert_eq!(
            wait_for_disk(t.path(), "vda", 1 << 20, Duration::ZERO).unwrap(),
            1 << 20
        );
        let e = wait_for_disk(t.path(), "vda", 2 << 20, Duration::from_millis(20)).unwrap_err();
        assert!(
            matches!(e, SizingError::DiskNotGrown { seen, want, .. } if seen == 1 << 20 && want == 2 << 20),
            "{e}"
        );
        // Grown while waited for.
        let size = t.path().join("vda/size");
        let grower = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            std::fs::write(size, "4096\n").unwrap();
        });
        assert_eq!(
            wait_for_disk(t.path(), "vda", 2 << 20, Duration::from_secs(30)).unwrap(),
            2 << 20
        );
        grower.join().unwrap();
    }
}
