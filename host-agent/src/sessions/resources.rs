//! A session's size within its image's VM (`SessionResources`): what
//! CreateSession may ask for, what it means, and how it is stored.
//!
//! A session's VM is a restore of the image's golden snapshot, so it has the
//! snapshot's vCPUs and memory; nothing here changes them. A smaller session
//! is confined inside that VM: fewer vCPUs are taken offline by guest-init
//! (and the VM's CPU time is capped in its jail's cgroup), less memory is a
//! guest memory cgroup around the session's commands, and only that much is
//! committed on the node. A larger disk is the one thing that grows.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::ImageRow;

/// Largest root disk a session may ask for, MiB (1 TiB).
pub const MAX_DISK_MIB: u64 = 1 << 20;

/// Period of the CPU cap written to the jail's cpu.max, microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

/// A session's size, every field filled (see `SessionResources` in
/// hostagent.proto).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Resources {
    /// vCPUs the session's commands see.
    pub vcpus: u32,
    /// Memory committed to the session, MiB.
    pub mem_mib: u32,
    /// CPU cap of the VM in thousandths of a CPU (0: none).
    pub cpu_millis: u32,
    /// Root disk size, MiB (0: the image has no root disk).
    pub disk_mib: u64,
}

/// A size in bytes as whole MiB, rounded up.
fn mib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

impl Resources {
    /// The image's own size: what a session that asks for nothing gets.
    /// `disk_bytes` is the size of the image's root disk (0: none).
    pub fn of_image(image: &ImageRow, disk_bytes: u64) -> Resources {
        Resources {
            vcpus: image.vcpus,
            mem_mib: image.mem_mib,
            cpu_millis: 0,
            disk_mib: mib_ceil(disk_bytes),
        }
    }

    /// Checks a request against `image` (whose root disk is `disk_bytes`
    /// long) and fills in its zero fields; `jailed` says whether the node
    /// runs vmms in jails (a CPU cap needs one). Errors name the field.
    pub fn requested(
        r: Option<&proto::hostagent::SessionResources>,
        image: &ImageRow,
        disk_bytes: u64,
        jailed: bool,
    ) -> Result<Resources> {
        let base = Resources::of_image(image, disk_bytes);
        let Some(r) = r else {
            return Ok(base);
        };
        let vcpus = if r.vcpus == 0 { base.vcpus } else { r.vcpus };
        if vcpus > base.vcpus {
            return Err(Error::invalid(format!(
                "resources.vcpus {vcpus} is more than image {:?} has ({}): a session runs \
                 in a restore of the image's golden snapshot, whose vCPUs are fixed",
                image.id, base.vcpus
            )));
        }
        let mem_mib = if r.mem_mib == 0 {
            base.mem_mib
        } else {
            r.mem_mib
        };
        if mem_mib > base.mem_mib {
            return Err(Error::invalid(format!(
                "resources.mem_mib {mem_mib} is more than image {:?} has ({} MiB): the golden \
                 snapshot's memory is the most a session can have; register a larger image",
                image.id, base.mem_mib
            )));
        }
        if mem_mib < base.mem_mib && !image.guest_init {
            return Err(Error::invalid(format!(
                "resources.mem_mib {mem_mib}: image {:?} runs no guest-init, which is what \
                 confines a smaller session inside the image's {} MiB; leave it 0",
                image.id, base.mem_mib
            )));
        }
        // The smallest useful memory cgroup: below it a shell cannot start.
        if mem_mib < 32 {
            return Err(Error::invalid(format!(
                "resources.mem_mib {mem_mib} is below the minimum of 32 MiB"
            )));
        }
        let max_millis = vcpus.saturating_mul(1000);
        if r.cpu_millis != 0 && !(10..=max_millis).contains(&r.cpu_millis) {
            return Err(Error::invalid(format!(
                "resources.cpu_millis {} is out of range 10..={max_millis} (1000 per vCPU)",
                r.cpu_millis
            )));
        }
        // Fewer vCPUs than the VM has cap its CPU time too (where a jail
        // can), unless the request says how much.
        let cpu_millis = match r.cpu_millis {
            0 if vcpus < base.vcpus && jailed => max_millis,
            m => m,
        };
        if cpu_millis != 0 && !jailed {
            return Err(Error::FailedPrecondition(format!(
                "resources.cpu_millis {cpu_millis}: a CPU cap is enforced in the vmm's jail, \
                 and this node runs vmms unjailed (no_jail); leave it 0"
            )));
        }
        let disk_mib = if r.disk_mib == 0 {
            base.disk_mib
        } else {
            r.disk_mib
        };
        if r.disk_mib != 0 {
            if image.rootfs.is_empty() {
                return Err(Error::invalid(format!(
                    "resources.disk_mib: image {:?} has no root disk to size",
                    image.id
                )));
            }
            if disk_mib < base.disk_mib || disk_mib > MAX_DISK_MIB {
                return Err(Error::invalid(format!(
                    "resources.disk_mib {disk_mib} is out of range {}..={MAX_DISK_MIB} (the \
                     image's root disk is {} MiB; a disk cannot shrink)",
                    base.disk_mib, base.disk_mib
                )));
            }
        }
        Ok(Resources {
            vcpus,
            mem_mib,
            cpu_millis,
            disk_mib,
        })
    }

    /// The jail's cpu.max, `(quota_us, period_us)`, when capped.
    pub fn cpu_max(&self) -> Option<(u64, u64)> {
        (self.cpu_millis > 0).then(|| {
            (
                u64::from(self.cpu_millis) * CPU_PERIOD_US / 1000,
                CPU_PERIOD_US,
            )
        })
    }

    /// Whether a session of this size can take a warm VM of `image` (whose
    /// root disk is `disk_bytes` long): only one of the image's own size.
    pub fn is_image_default(&self, image: &ImageRow, disk_bytes: u64) -> bool {
        *self == Resources::of_image(image, disk_bytes)
    }

    /// As stored in the session's row (`""` for a row from before sizes
    /// were recorded).
    pub fn encode(&self) -> String {
        // Four integers: serialisation cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A stored size; `None` for an empty or unreadable one (the caller
    /// falls back to the image's).
    pub fn decode(stored: &str) -> Option<Resources> {
        if stored.is_empty() {
            return None;
        }
        serde_json::from_str(stored)
            .map_err(|e| tracing::error!(error = %e, "a session's stored size does not read back"))
            .ok()
    }

    /// As the API reports it.
    pub fn to_pb(self) -> proto::hostagent::SessionResources {
        proto::hostagent::SessionResources {
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            cpu_millis: self.cpu_millis,
            disk_mib: self.disk_mib,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::hostagent::SessionResources as Pb;

    fn image(guest_init: bool) -> ImageRow {
        ImageRow {
            id: "img".into(),
            vcpus: 4,
            mem_mib: 1024,
            rootfs: "/r.ext4".into(),
            guest_init,
            ..Default::default()
        }
    }
    const DISK: u64 = 300 << 20;

    fn req(vcpus: u32, mem_mib: u32, cpu_millis: u32, disk_mib: u64) -> Pb {
        Pb {
            vcpus,
            mem_mib,
            cpu_millis,
            disk_mib,
        }
    }

    #[test]
    fn nothing_asked_is_the_images_size() {
        let img = image(true);
        let r = Resources::requested(None, &img, DISK, false).unwrap();
        assert_eq!(r, Resources::of_image(&img, DISK));
        assert_eq!(
            (r.vcpus, r.mem_mib, r.cpu_millis, r.disk_mib),
            (4, 1024, 0, 300)
        );
        assert!(r.is_image_default(&img, DISK));
        assert_eq!(r.cpu_max(), None);
        let zeros = Resources::requested(Some(&Pb::default()), &img, DISK, false).unwrap();
        assert_eq!(zeros, r);
    }

    #[test]
    fn fewer_vcpus_cap_the_cpu_unless_a_cap_is_given() {
        let img = image(true);
        let r = Resources::requested(Some(&req(2, 0, 0, 0)), &img, DISK, true).unwrap();
        assert_eq!((r.vcpus, r.cpu_millis), (2, 2000));
        assert_eq!(r.cpu_max(), Some((200_000, 100_000)));
        assert!(!r.is_image_default(&img, DISK));
        let r = Resources::requested(Some(&req(2, 0, 500, 0)), &img, DISK, true).unwrap();
        assert_eq!(r.cpu_max(), Some((50_000, 100_000)));
    }

    #[test]
    fn out_of_range_requests_name_their_field() {
        let img = image(true);
        for (bad, field) in [
            (req(5, 0, 0, 0), "resources.vcpus"),
            (req(0, 2048, 0, 0), "resources.mem_mib"),
            (req(0, 16, 0, 0), "resources.mem_mib"),
            (req(0, 0, 5, 0), "resources.cpu_millis"),
            (req(2, 0, 2001, 0), "resources.cpu_millis"),
            (req(0, 0, 0, 299), "resources.disk_mib"),
            (req(0, 0, 0, MAX_DISK_MIB + 1), "resources.disk_mib"),
        ] {
            let e = Resources::requested(Some(&bad), &img, DISK, true).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains(field), "{bad:?}: {e}");
        }
    }

    #[test]
    fn what_needs_a_jail_or_guest_init_or_a_disk_is_refused_without() {
        let e =
            Resources::requested(Some(&req(2, 0, 1000, 0)), &image(true), DISK, false).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
        // Unjailed, fewer vCPUs are only taken offline in the guest.
        let r = Resources::requested(Some(&req(2, 0, 0, 0)), &image(true), DISK, false).unwrap();
        assert_eq!((r.vcpus, r.cpu_max()), (2, None));
        let e =
            Resources::requested(Some(&req(0, 512, 0, 0)), &image(false), DISK, true).unwrap_err();
        assert!(e.to_string().contains("guest-init"), "{e}");
        let no_disk = ImageRow {
            rootfs: String::new(),
            ..image(true)
        };
        let e = Resources::requested(Some(&req(0, 0, 0, 400)), &no_disk, 0, true).unwrap_err();
        assert!(e.to_string().contains("no root disk"), "{e}");
    }

    #[test]
    fn a_size_reads_back_as_stored() {
        let r = Resources {
            vcpus: 2,
            mem_mib: 512,
            cpu_millis: 1500,
            disk_mib: 4096,
        };
        assert_eq!(Resources::decode(&r.encode()), Some(r));
        assert_eq!(Resources::decode(""), None);
        assert_eq!(Resources::decode("{not json"), None);
    }
}
