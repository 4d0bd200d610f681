//! The manifest written beside every output: what went in (pinned inputs,
//! package versions, hashes) and what came out (file sizes and hashes).
//!
//! The input hash is SHA-256 over the kind and the sorted `key=value`
//! inputs, so any change to an input (a package version, the kernel config,
//! guest-init's hash, a size) selects a different cache entry.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};
use crate::hash;

/// File name of the manifest inside an output directory.
pub const FILE_NAME: &str = "manifest.json";
/// Version of the manifest format.
pub const FORMAT: u32 = 1;

/// What a recipe was given, pinned: every value that changes the output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inputs(pub BTreeMap<String, String>);

impl Inputs {
    /// Records one input.
    pub fn set(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.0.insert(key.to_string(), value.into());
        self
    }

    /// The input hash for `kind`.
    pub fn hash(&self, kind: &str) -> String {
        let mut s = format!("images-manifest-v{FORMAT}\nkind={kind}\n");
        for (k, v) in &self.0 {
            s.push_str(k);
            s.push('=');
            s.push_str(v);
            s.push('\n');
        }
        hash::bytes_sha256(s.as_bytes())
    }
}

/// One output file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    /// Path relative to the output directory.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Hex SHA-256 of the content.
    pub sha256: String,
}

/// The manifest of one output directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// `kernel`, `kernel-config`, `rootfs-base`, `rootfs` or `golden`.
    pub kind: String,
    /// [`Inputs::hash`] of `inputs`.
    pub input_hash: String,
    /// The pinned inputs.
    pub inputs: Inputs,
    /// Debian packages and their versions (the kernel's source package; every
    /// package installed in the root filesystem).
    pub packages: BTreeMap<String, String>,
    /// The output files.
    pub outputs: Vec<Output>,
    /// When it was built, seconds since the Unix epoch.
    pub built_unix: u64,
    /// How long the build took.
    pub build_seconds: f64,
}

impl Manifest {
    /// Reads and parses a manifest file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).at(path, "read a manifest")?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| Error::Manifest {
            path: path.to_path_buf(),
            message: format!("not a valid manifest: {e}"),
        })?;
        if m.format != FORMAT {
            return Err(Error::Manifest {
                path: path.to_path_buf(),
                message: format!(
                    "format {} is not the {FORMAT} this tool writes; rebuild",
                    m.format
                ),
            });
        }
        Ok(m)
    }

    /// Writes the manifest atomically (temporary file, fsync, rename).
    pub fn store(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::Manifest {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let tmp = path.with_extension("json.tmp");
        let step = "write the manifest";
        let mut f = std::fs::File::create(&tmp).at(&tmp, step)?;
        f.write_all(text.as_bytes()).at(&tmp, step)?;
        f.write_all(b"\n").at(&tmp, step)?;
        f.sync_all().at(&tmp, step)?;
        std::fs::rename(&tmp, path).at(path, step)?;
        Ok(())
    }

    /// The output named `path`, if recorded.
    pub fn output(&self, path: &str) -> Option<&Output> {
        self.outputs.iter().find(|o| o.path == path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_hash_depends_on_every_input_and_the_kind() {
        let mut a = Inputs::default();
        a.set("config_sha256", "aa")
            .set("source", "linux-source-6.12");
        let mut b = a.clone();
        assert_eq!(a.hash("kernel"), b.hash("kernel"));
        assert_ne!(a.hash("kernel"), a.hash("rootfs"));
        b.set("config_sha256", "ab");
        assert_ne!(a.hash("kernel"), b.hash("kernel"));
    }

    #[test]
    fn round_trips_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE_NAME);
        let mut inputs = Inputs::default();
        inputs.set("k", "v");
        let m = Manifest {
            format: FORMAT,
            kind: "kernel".into(),
            input_hash: inputs.hash("kernel"),
            inputs,
            packages: BTreeMap::from([("git".into(), "1:2.39.5-0+deb12u2".into())]),
            outputs: vec![Output {
                path: "vmlinux".into(),
                size: 3,
                sha256: "x".into(),
            }],
            built_unix: 1,
            build_seconds: 0.5,
        };
        m.store(&p).unwrap();
        assert_eq!(Manifest::load(&p).unwrap(), m);
        std::fs::write(&p, "{not json").unwrap();
        let e = Manifest::load(&p).unwrap_err();
        assert!(e.to_string().contains("not a valid manifest"), "{e}");
    }
}
