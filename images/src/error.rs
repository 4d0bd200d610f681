//! The one error type of the recipes, with messages that say what to do.

use std::path::PathBuf;

/// A tool a step needs and the Debian package that provides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingTool {
    /// Program name (or header file, for a library).
    pub tool: String,
    /// Debian package to install.
    pub package: String,
}

/// Everything that can stop a recipe.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// One or more tools a step needs are not installed.
    #[error("{step} needs tools that are not installed: {}; install them with: apt-get install {}",
        .missing.iter().map(|m| format!("{} (package {})", m.tool, m.package)).collect::<Vec<_>>().join(", "),
        packages(.missing))]
    MissingTools {
        /// The step that needs them.
        step: String,
        /// What is missing.
        missing: Vec<MissingTool>,
    },
    /// Not enough free space for a step, found before starting it.
    #[error("not enough free disk space in {}: {available_mib} MiB free, {needed_mib} MiB needed to {step}; free some space or pass another --cache-dir", path.display())]
    NotEnoughSpace {
        /// Where the space is needed.
        path: PathBuf,
        /// Free MiB there.
        available_mib: u64,
        /// MiB the step needs.
        needed_mib: u64,
        /// The step.
        step: String,
    },
    /// The disk filled up during a step.
    #[error("the disk holding {} is full (while trying to {step}); free some space or pass another --cache-dir", path.display())]
    DiskFull {
        /// A path on the full file system.
        path: PathBuf,
        /// The step.
        step: String,
    },
    /// A step must run as root.
    #[error("{step} must run as root (it {why}); rerun with sudo")]
    NotRoot {
        /// The step.
        step: String,
        /// Why root is needed.
        why: String,
    },
    /// An I/O error on a path.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A program could not be started.
    #[error("{step}: cannot run {program}: {source}")]
    Spawn {
        /// The step.
        step: String,
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A program ran and failed.
    #[error("{step}: `{command}` failed ({status}); its last output:\n{tail}")]
    CommandFailed {
        /// The step.
        step: String,
        /// The command line.
        command: String,
        /// Exit status in words.
        status: String,
        /// The last lines it printed.
        tail: String,
    },
    /// A Debian package could not be resolved or fetched.
    #[error("package {package}: {message}")]
    Package {
        /// The package.
        package: String,
        /// What went wrong and what to do.
        message: String,
    },
    /// Required kernel options were dropped by olddefconfig.
    #[error("kernel config: {} required option(s) did not survive olddefconfig (a dependency is missing from {}): {}",
        .missing.len(), fragment.display(), .missing.join("; "))]
    ConfigOptionsLost {
        /// `CONFIG_X (wanted y, got not set)` for each.
        missing: Vec<String>,
        /// The checked-in fragment.
        fragment: PathBuf,
    },
    /// The config fragment itself is malformed.
    #[error("{}:{line}: {message}", path.display())]
    BadFragment {
        /// The fragment file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A built artefact is not what it should be.
    #[error("{}: {message}", path.display())]
    BadArtifact {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The root filesystem content does not fit the requested size.
    #[error("the root filesystem content needs about {needed_mib} MiB but --size-mib is {size_mib}; pass --size-mib {needed_mib} or more")]
    RootfsTooSmall {
        /// MiB the tree needs (with ext4 overhead).
        needed_mib: u64,
        /// The size asked for.
        size_mib: u64,
    },
    /// A manifest could not be read or written.
    #[error("manifest {}: {message}", path.display())]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An output directory exists and was not made by this tool.
    #[error("refusing to replace {}: it exists, is not empty and holds no images manifest; remove it or pick another directory", path.display())]
    ForeignDirectory {
        /// The directory.
        path: PathBuf,
    },
    /// The golden-snapshot boot failed.
    #[error("golden snapshot: {message}")]
    Golden {
        /// What happened, with the console tail where it helps.
        message: String,
    },
}

fn packages(missing: &[MissingTool]) -> String {
    let mut p: Vec<&str> = missing.iter().map(|m| m.package.as_str()).collect();
    p.sort_unstable();
    p.dedup();
    p.join(" ")
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error on `path` during `step`; a full disk becomes [`Error::DiskFull`].
    pub fn io(path: impl Into<PathBuf>, step: &str, source: std::io::Error) -> Self {
        let path = path.into();
        if source.raw_os_error() == Some(libc::ENOSPC) {
            return Error::DiskFull {
                path,
                step: step.to_string(),
            };
        }
        Error::Io { path, source }
    }
}

/// Adds a path (and the step, for a full disk) to an `io::Result`.
pub trait IoContext<T> {
    /// See [`Error::io`].
    fn at(self, path: impl Into<PathBuf>, step: &str) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl Into<PathBuf>, step: &str) -> Result<T> {
        self.map_err(|e| Error::io(path, step, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tools_name_the_packages_once() {
        let e = Error::MissingTools {
            step: "build the kernel".into(),
            missing: vec![
                MissingTool {
                    tool: "flex".into(),
                    package: "flex".into(),
                },
                MissingTool {
                    tool: "gelf.h".into(),
                    package: "libelf-dev".into(),
                },
                MissingTool {
                    tool: "flex-again".into(),
                    package: "flex".into(),
                },
            ],
        };
        let s = e.to_string();
        assert!(s.ends_with("apt-get install flex libelf-dev"), "{s}");
        assert!(s.contains("gelf.h (package libelf-dev)"), "{s}");
    }

    #[test]
    fn enospc_becomes_disk_full() {
        let e = Error::io(
            "/x",
            "write the image",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert!(matches!(e, Error::DiskFull { .. }));
        assert!(e.to_string().contains("is full"), "{e}");
        let e = Error::io(
            "/x",
            "read",
            std::io::Error::from_raw_os_error(libc::EACCES),
        );
        assert!(matches!(e, Error::Io { .. }));
    }
}
