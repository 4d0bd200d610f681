//! A virtio-fs share (`--fs TAG:SOCKET[,queues=N]`): the tag the guest
//! mounts it by and the vhost-user socket of the virtiofsd serving it,
//! written and parsed by the same code the vmm uses.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::rate_limit::SpecError;

/// Longest tag: the virtio-fs configuration space holds 36 bytes.
pub const MAX_TAG_LEN: usize = 36;

/// Most request queues `queues=N` may ask for (besides the high-priority
/// queue), as the vmm accepts.
pub const MAX_QUEUES: u16 = 16;

/// The fields `--fs` takes after `TAG:SOCKET`.
const FS_FIELDS: &str = "queues=N (1..=16) after TAG:SOCKET (SOCKET without commas)";

/// What a tag must be, for error messages.
const TAG_FORM: &str = "1 to 36 bytes of letters, digits, '_', '.' or '-'";

/// A virtio-fs device backed by a vhost-user daemon (virtiofsd).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsSpec {
    /// The tag the guest mounts (`mount -t virtiofs TAG PATH`); see
    /// [`check_tag`].
    pub tag: String,
    /// The vhost-user socket the daemon listens on; the vmm connects to it
    /// as the frontend when it starts.
    pub socket: PathBuf,
    /// Request queues (`None`: the vmm's default, 1).
    pub queues: Option<u16>,
}

impl FsSpec {
    /// A share `tag` served on `socket`, with the vmm's default queues; the
    /// tag is checked ([`check_tag`]).
    pub fn new(tag: impl Into<String>, socket: impl Into<PathBuf>) -> Result<Self, SpecError> {
        let tag = tag.into();
        check_tag(&tag)?;
        Ok(Self {
            tag,
            socket: socket.into(),
            queues: None,
        })
    }

    /// The `--fs` value.
    pub(super) fn arg(&self) -> String {
        self.to_string()
    }
}

/// Checks a virtio-fs tag: 1 to [`MAX_TAG_LEN`] bytes of `[A-Za-z0-9_.-]`
/// (so it fits the device's configuration space and never needs quoting
/// on a command line or in a mount table).
pub fn check_tag(tag: &str) -> Result<(), SpecError> {
    let ok = (1..=MAX_TAG_LEN).contains(&tag.len())
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(SpecError::Invalid {
            field: "tag".into(),
            value: tag.into(),
            expected: TAG_FORM,
        })
    }
}

/// The `--fs` option's text.
impl fmt::Display for FsSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.tag, self.socket.display())?;
        if let Some(q) = self.queues {
            write!(f, ",queues={q}")?;
        }
        Ok(())
    }
}

/// Parses `TAG:SOCKET[,queues=N]`.
impl FromStr for FsSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let mut parts = s.split(',');
        let first = parts.next().unwrap_or_default();
        let (tag, socket) = first.split_once(':').ok_or_else(|| SpecError::Invalid {
            field: "fs".into(),
            value: s.into(),
            expected: "TAG:SOCKET[,queues=N]",
        })?;
        check_tag(tag)?;
        if socket.is_empty() {
            return Err(SpecError::Invalid {
                field: "socket".into(),
                value: s.into(),
                expected: "TAG:SOCKET[,queues=N] with a non-empty SOCKET path",
            });
        }
        let mut spec = FsSpec::new(tag, socket)?;
        for part in parts {
            match part.split_once('=') {
                Some(("queues", v)) => {
                    if spec.queues.is_some() {
                        return Err(SpecError::Repeated {
                            field: "queues".into(),
                        });
                    }
                    let n = v
                        .parse::<u16>()
                        .ok()
                        .filter(|n| (1..=MAX_QUEUES).contains(n))
                        .ok_or_else(|| SpecError::Invalid {
                            field: "queues".into(),
                            value: v.into(),
                            expected: "a count of 1 to 16",
                        })?;
                    spec.queues = Some(n);
                }
                _ => {
                    return Err(SpecError::Unknown {
                        field: part.into(),
                        known: FS_FIELDS,
                    })
                }
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_options_parse_and_print_back() {
        let f: FsSpec = "cache:/run/fs/0.sock,queues=2".parse().unwrap();
        assert_eq!(f.tag, "cache");
        assert_eq!(f.socket, PathBuf::from("/run/fs/0.sock"));
        assert_eq!(f.queues, Some(2));
        assert_eq!(f.to_string(), "cache:/run/fs/0.sock,queues=2");
        assert_eq!(f.to_string().parse::<FsSpec>(), Ok(f));
        let plain = FsSpec::new("a.b_c-1", "/s").unwrap();
        assert_eq!(plain.to_string(), "a.b_c-1:/s");
        assert_eq!("a.b_c-1:/s".parse::<FsSpec>(), Ok(plain));
        // The socket may hold colons; only the first separates the tag.
        let colon: FsSpec = "t:/a:b".parse().unwrap();
        assert_eq!(colon.socket, PathBuf::from("/a:b"));
        let longest = "x".repeat(MAX_TAG_LEN);
        assert!(FsSpec::new(longest.as_str(), "/s").is_ok());
    }

    #[test]
    fn bad_fs_options_say_which_field_and_what_form() {
        let err = |s: &str| s.parse::<FsSpec>().unwrap_err().to_string();
        assert!(err("nosocket").starts_with("invalid fs \"nosocket\""));
        assert!(err(":/s").starts_with("invalid tag \"\""));
        assert!(err("a b:/s").starts_with("invalid tag \"a b\""));
        assert!(err("a/b:/s").starts_with("invalid tag"));
        assert!(err(&format!("{}:/s", "x".repeat(37))).starts_with("invalid tag"));
        assert!(err("t:").starts_with("invalid socket"));
        assert!(err("t:/s,queues=0").starts_with("invalid queues \"0\""));
        assert!(err("t:/s,queues=17").starts_with("invalid queues \"17\""));
        assert!(err("t:/s,queues=x").starts_with("invalid queues"));
        assert!(err("t:/s,ro").starts_with("unknown field \"ro\""));
        assert_eq!(
            err("t:/s,queues=1,queues=2"),
            "field queues is given more than once"
        );
        for bad in ["", "é", "a:b", "a,b", "a=b", "-", "x"] {
            let ok = bad == "-" || bad == "x";
            assert_eq!(check_tag(bad).is_ok(), ok, "{bad:?}");
        }
    }
}
