//! KVM_GET_SUPPORTED_CPUID, remembered across vmm processes.
//!
//! Every cold boot needs the host's supported CPUID, and the ioctl is the
//! most expensive single step of a boot on a nested host: KVM executes
//! CPUID for every leaf, and in a VM each CPUID traps to the hypervisor
//! below (about 0.4 ms of the vmm's 3.2 ms of CPU per tiny-guest boot on the
//! development machine, perf/README.md). One vmm process per VM pays it
//! every time, so the answer is kept in a small file (by default on /run, a
//! tmpfs) and reused while the host is provably the same host:
//!
//! * the boot (`/proc/sys/kernel/random/boot_id`);
//! * the loaded KVM modules: the inode of `/sys/module/NAME` for kvm,
//!   kvm_intel, kvm_amd and kvm_pvm. sysfs hands out inode numbers
//!   cyclically, so a module reloaded with other parameters (nested on or
//!   off, say) has a new inode;
//! * the host CPU as this process sees it: leaves 1, 7 and 0x8000_0001
//!   (feature flags a late microcode load can change, TSX for one);
//! * this process's permission for dynamic guest xstate (AMX), which KVM
//!   filters leaf 0xD by.
//!
//! Any difference, or any part of the key that cannot be read (a jail
//! without /proc or /sys), and the vmm asks KVM instead. A file that is not
//! a regular file owned by this user or root, is writable by others, or does
//! not parse is ignored with a warning and replaced. Writes go to a private
//! temporary file renamed into place, so concurrent vmms never read half a
//! file.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;
use serde::{Deserialize, Serialize};

/// Where `vmm run` keeps the cache unless told otherwise.
pub const DEFAULT_PATH: &str = "/run/agentvm/kvm-supported-cpuid";

/// First bytes of a cache file; the digit is the format version.
const MAGIC: [u8; 8] = *b"AVMCPUI2";
/// A cache file is a few KiB; anything larger is not one.
const MAX_FILE_BYTES: u64 = 64 * 1024;
/// The KVM modules whose reload changes what KVM supports.
const MODULES: [&str; 4] = ["kvm", "kvm_intel", "kvm_amd", "kvm_pvm"];
/// CPUID leaves (leaf, subleaf) whose feature flags key the cache.
const KEY_LEAVES: [(u32, u32); 3] = [(1, 0), (7, 0), (0x8000_0001, 0)];
/// arch_prctl code reading the process's guest xstate permission.
const ARCH_GET_XCOMP_GUEST_PERM: libc::c_int = 0x1024;

/// What identifies the host whose KVM answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostKey {
    /// The kernel's boot id.
    boot_id: String,
    /// Inode of /sys/module/NAME for each of [`MODULES`], None where absent.
    modules: Vec<Option<u64>>,
    /// (leaf, subleaf, ebx, ecx, edx) of each of [`KEY_LEAVES`]; EAX and
    /// leaf 1's EBX (this CPU's APIC id) are left out.
    leaves: Vec<[u32; 5]>,
    /// This process's guest xstate permission, None where the kernel has none.
    xcomp_guest_perm: Option<u64>,
}

/// The file's contents after [`MAGIC`]: the entries as kvm-bindings
/// serializes them (as in a snapshot's vCPU state).
#[derive(Debug, Serialize, Deserialize)]
struct CacheFile {
    key: HostKey,
    entries: Vec<kvm_cpuid_entry2>,
}

/// Why a cache file was not used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The cache file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The file is not one this vmm may trust.
    #[error("ignoring {path}: {reason}")]
    Untrusted {
        /// The cache file.
        path: PathBuf,
        /// Why it is not trusted.
        reason: String,
    },
    /// The file is not a cache file of this format.
    #[error("ignoring {path}: not a CPUID cache of this vmm's format ({reason})")]
    Malformed {
        /// The cache file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The cache file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// Where the supported CPUID came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The cache file, written by an earlier vmm on this host.
    Cache,
    /// KVM_GET_SUPPORTED_CPUID.
    Kvm,
}

/// The host's supported CPUID: from the cache at `cache` when it holds this
/// host's answer, else from KVM (then written to `cache` for the next vmm).
/// With `cache == None` this is KVM_GET_SUPPORTED_CPUID and nothing else.
pub fn supported_cpuid(
    kvm: &Kvm,
    cache: Option<&Path>,
) -> Result<(CpuId, Source), kvm_ioctls::Error> {
    let Some(path) = cache else {
        return Ok((ask_kvm(kvm)?, Source::Kvm));
    };
    let key = match HostKey::read() {
        Ok(key) => key,
        Err(e) => {
            tracing::debug!(error = %e, "host identity unreadable: CPUID cache not used");
            return Ok((ask_kvm(kvm)?, Source::Kvm));
        }
    };
    match load(path, &key) {
        Ok(Some(cpuid)) => return Ok((cpuid, Source::Cache)),
        Ok(None) => {}
        Err(e @ CacheError::Read { .. }) => tracing::debug!(error = %e, "no CPUID cache"),
        Err(e) => tracing::warn!(error = %e, "CPUID cache not used"),
    }
    let cpuid = ask_kvm(kvm)?;
    if let Err(e) = store(path, &key, &cpuid) {
        // A read-only /run or a jail is not an error: the next vmm asks KVM too.
        tracing::debug!(error = %e, "CPUID cache not written");
    }
    Ok((cpuid, Source::Kvm))
}

fn ask_kvm(kvm: &Kvm) -> Result<CpuId, kvm_ioctls::Error> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
}

impl HostKey {
    /// Reads this host's identity (see the module doc).
    pub fn read() -> io::Result<Self> {
        let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id")?
            .trim()
            .to_string();
        if boot_id.len() != 36 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected boot id {boot_id:?}"),
            ));
        }
        let mut modules = Vec::with_capacity(MODULES.len());
        for name in MODULES {
            match fs::metadata(Path::new("/sys/module").join(name)) {
                Ok(meta) => modules.push(Some(meta.ino())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => modules.push(None),
                Err(e) => return Err(e),
            }
        }
        let leaves = KEY_LEAVES
            .iter()
            .map(|&(leaf, sub)| {
                let r = std::arch::x86_64::__cpuid_count(leaf, sub);
                let ebx = if leaf == 1 {
                    r.ebx & 0x00ff_ffff
                } else {
                    r.ebx
                };
                [leaf, sub, ebx, r.ecx, r.edx]
            })
            .collect();
        Ok(HostKey {
            boot_id,
            modules,
            leaves,
            xcomp_guest_perm: xcomp_guest_perm(),
        })
    }
}

/// This process's permitted guest xstate features, None where the kernel
/// does not know the request (before Linux 5.17).
fn xcomp_guest_perm() -> Option<u64> {
    let mut perm: u64 = 0;
    // SAFETY: ARCH_GET_XCOMP_GUEST_PERM writes one u64 at the address given,
    // which points at `perm`, alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_GUEST_PERM,
            &mut perm as *mut u64,
        )
    };
    (rc == 0).then_some(perm)
}

/// The cached CPUID at `path` if it was written for `key`; None when the
/// file is absent or was written for another host state.
pub fn load(path: &Path, key: &HostKey) -> Result<Option<CpuId>, CacheError> {
    let read = |source| CacheError::Read {
        path: path.into(),
        source,
    };
    let untrusted = |reason: String| CacheError::Untrusted {
        path: path.into(),
        reason,
    };
    let malformed = |reason: String| CacheError::Malformed {
        path: path.into(),
        reason,
    };
    let mut file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(untrusted("a symbolic link".into()))
        }
        Err(e) => return Err(read(e)),
    };
    let meta = file.metadata().map_err(read)?;
    if !meta.is_file() {
        return Err(untrusted("not a regular file".into()));
    }
    let euid = effective_uid();
    if meta.uid() != euid && meta.uid() != 0 {
        return Err(untrusted(format!(
            "owned by uid {}, not by this user ({euid}) or root",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(untrusted(format!(
            "writable by group or others (mode {:o})",
            meta.mode() & 0o777
        )));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(malformed(format!(
            "{} bytes, more than {MAX_FILE_BYTES}",
            meta.len()
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut file)
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    let cached = decode(&bytes).map_err(malformed)?;
    if cached.key != *key {
        tracing::debug!(path = %path.display(), "CPUID cache written for another boot, module load or CPU state");
        return Ok(None);
    }
    CpuId::from_entries(&cached.entries)
        .map(Some)
        .map_err(|e| malformed(format!("{e:?}")))
}

/// Writes `cpuid`, KVM's answer on the host `key` describes, to `path`.
pub fn store(path: &Path, key: &HostKey, cpuid: &CpuId) -> Result<(), CacheError> {
    let write = |source| CacheError::Write {
        path: path.into(),
        source,
    };
    let bytes = encode(&CacheFile {
        key: key.clone(),
        entries: cpuid.as_slice().to_vec(),
    })
    .map_err(|e| write(io::Error::other(e)))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // Succeeds when the directory exists; a new one is private.
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(write)?;
    let mut tmp_name: OsString = path.file_name().unwrap_or_default().to_owned();
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = write_new(&tmp, &bytes).and_then(|()| fs::rename(&tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(write)
}

/// Creates `path` (which must not exist) readable by its owner only, holding `bytes`.
fn write_new(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file: File = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    file.write_all(bytes)
}

fn encode(file: &CacheFile) -> Result<Vec<u8>, postcard::Error> {
    let mut bytes = MAGIC.to_vec();
    bytes.extend(postcard::to_allocvec(file)?);
    Ok(bytes)
}

fn decode(bytes: &[u8]) -> Result<CacheFile, String> {
    let body = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| "wrong magic or version".to_string())?;
    let (file, rest): (CacheFile, &[u8]) =
        postcard::take_from_bytes(body).map_err(|e| e.to_string())?;
    if !rest.is_empty() {
        return Err(format!("{} bytes after the end", rest.len()));
    }
    if file.entries.is_empty() || file.entries.len() > KVM_MAX_CPUID_ENTRIES {
        return Err(format!(
            "{} entries, not 1..={KVM_MAX_CPUID_ENTRIES}",
            file.entries.len()
        ));
    }
    if file.key.modules.len() != MODULES.len() || file.key.leaves.len() != KEY_LEAVES.len() {
        return Err("a key of another shape".into());
    }
    Ok(file)
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
#[path = "cpuid_cache_tests.rs"]
mod tests;
