//! The checked-in config fragment and the check that every option in it
//! survived `olddefconfig`.
//!
//! A fragment line is `CONFIG_NAME=VALUE` (`y`, a number or a quoted
//! string) or `# CONFIG_NAME is not set`; other `#` lines and blank lines
//! are comments. Each such line is a requirement on the final `.config`.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, IoContext, Result};

/// One required option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    /// `CONFIG_...`.
    pub name: String,
    /// The value it must have; `None` means it must be unset.
    pub value: Option<String>,
}

/// Reads and parses a fragment file.
pub fn load_fragment(path: &Path) -> Result<Vec<Requirement>> {
    let text = std::fs::read_to_string(path).at(path, "read the kernel config fragment")?;
    parse_fragment(&text).map_err(|(line, message)| Error::BadFragment {
        path: path.to_path_buf(),
        line,
        message,
    })
}

/// Parses fragment text; an error is (1-based line, message).
pub fn parse_fragment(text: &str) -> std::result::Result<Vec<Requirement>, (usize, String)> {
    let mut out: Vec<Requirement> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let req = if let Some(rest) = line.strip_prefix("# CONFIG_") {
            match rest.strip_suffix(" is not set") {
                Some(name) => Requirement {
                    name: format!("CONFIG_{name}"),
                    value: None,
                },
                None => continue,
            }
        } else if line.is_empty() || line.starts_with('#') {
            continue;
        } else if let Some((name, value)) = line.split_once('=') {
            if !name.starts_with("CONFIG_") || value.is_empty() {
                return Err((i + 1, format!("expected CONFIG_NAME=VALUE, found `{line}`")));
            }
            Requirement {
                name: name.to_string(),
                value: Some(value.to_string()),
            }
        } else {
            return Err((
                i + 1,
                format!("expected CONFIG_NAME=VALUE or `# CONFIG_NAME is not set`, found `{line}`"),
            ));
        };
        if !valid_name(&req.name) {
            return Err((i + 1, format!("`{}` is not a valid option name", req.name)));
        }
        if out.iter().any(|r| r.name == req.name) {
            return Err((i + 1, format!("{} is listed twice", req.name)));
        }
        out.push(req);
    }
    Ok(out)
}

fn valid_name(name: &str) -> bool {
    name.len() > "CONFIG_".len()
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// The values set in a `.config` (unset options are absent).
pub fn parse_dotconfig(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| l.starts_with("CONFIG_"))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The requirements `dotconfig` does not meet, described for the user:
/// `CONFIG_X (wanted y, got m)`, `CONFIG_Y (wanted y, got not set)`.
pub fn unmet(requirements: &[Requirement], dotconfig: &str) -> Vec<String> {
    let have = parse_dotconfig(dotconfig);
    requirements
        .iter()
        .filter_map(|r| {
            let got = have.get(&r.name);
            if got == r.value.as_ref() {
                return None;
            }
            let show = |v: Option<&String>| v.map_or("not set".to_string(), |v| v.clone());
            Some(format!(
                "{} (wanted {}, got {})",
                r.name,
                show(r.value.as_ref()),
                show(got)
            ))
        })
        .collect()
}

/// Checks `dotconfig_path` against the fragment at `fragment_path`.
pub fn verify(fragment_path: &Path, dotconfig_path: &Path) -> Result<usize> {
    let reqs = load_fragment(fragment_path)?;
    let text = std::fs::read_to_string(dotconfig_path).at(dotconfig_path, "read .config")?;
    let missing = unmet(&reqs, &text);
    if missing.is_empty() {
        Ok(reqs.len())
    } else {
        Err(Error::ConfigOptionsLost {
            missing,
            fragment: fragment_path.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRAGMENT: &str =
        "# comment\nCONFIG_A=y\n\n# CONFIG_MODULES is not set\nCONFIG_NR_CPUS=32\n";

    #[test]
    fn parses_set_and_unset_requirements() {
        let r = parse_fragment(FRAGMENT).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].value.as_deref(), Some("y"));
        assert_eq!(r[1].name, "CONFIG_MODULES");
        assert_eq!(r[1].value, None);
    }

    #[test]
    fn refuses_malformed_and_duplicate_lines() {
        assert_eq!(parse_fragment("CONFIG_A=y\nnonsense\n").unwrap_err().0, 2);
        assert_eq!(parse_fragment("CONFIG_A=y\nCONFIG_A=m\n").unwrap_err().0, 2);
        assert_eq!(parse_fragment("CONFIG_a=y\n").unwrap_err().0, 1);
        assert_eq!(parse_fragment("CONFIG_A=\n").unwrap_err().0, 1);
    }

    #[test]
    fn names_every_option_that_did_not_survive() {
        let reqs = parse_fragment(FRAGMENT).unwrap();
        let ok = "CONFIG_A=y\n# CONFIG_MODULES is not set\nCONFIG_NR_CPUS=32\n";
        assert!(unmet(&reqs, ok).is_empty());
        let bad = "CONFIG_A=m\nCONFIG_MODULES=y\n";
        assert_eq!(
            unmet(&reqs, bad),
            [
                "CONFIG_A (wanted y, got m)",
                "CONFIG_MODULES (wanted not set, got y)",
                "CONFIG_NR_CPUS (wanted 32, got not set)",
            ]
        );
    }

    #[test]
    fn the_checked_in_fragment_parses_and_covers_the_issue() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernel/microvm.config");
        let reqs = load_fragment(&path).unwrap();
        for name in [
            "CONFIG_64BIT",
            "CONFIG_PVH",
            "CONFIG_KVM_GUEST",
            "CONFIG_PARAVIRT_CLOCK",
            "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES",
            "CONFIG_VIRTIO_BLK",
            "CONFIG_VIRTIO_NET",
            "CONFIG_VIRTIO_VSOCKETS",
            "CONFIG_HW_RANDOM_VIRTIO",
            "CONFIG_EXT4_FS",
            "CONFIG_FUSE_FS",
            "CONFIG_VIRTIO_FS",
            "CONFIG_SERIAL_8250_CONSOLE",
            "CONFIG_SERIO_I8042",
            "CONFIG_CGROUPS",
            "CONFIG_NF_TABLES",
            "CONFIG_VMGENID",
        ] {
            let r = reqs
                .iter()
                .find(|r| r.name == name)
                .unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(r.value.as_deref(), Some("y"), "{name}");
        }
        let modules = reqs.iter().find(|r| r.name == "CONFIG_MODULES").unwrap();
        assert_eq!(modules.value, None);
    }
}
