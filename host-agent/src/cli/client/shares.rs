//! `--share TAG=HOST_PATH[,ro][,mount=PATH]` of `images register` and
//! `sessions create`.

use proto::hostagent as pb;

/// What `--share` takes.
const FORM: &str = "TAG=HOST_PATH[,ro][,mount=GUEST_PATH] (HOST_PATH without commas)";

/// The shares `entries` name, in order. Their contents are checked by
/// host-agent.
pub fn parse(entries: &[String]) -> Result<Vec<pb::Share>, String> {
    entries.iter().map(|e| parse_one(e)).collect()
}

fn parse_one(e: &str) -> Result<pb::Share, String> {
    let mut parts = e.split(',');
    let first = parts.next().unwrap_or_default();
    let (tag, host) = first
        .split_once('=')
        .filter(|(t, h)| !t.is_empty() && !h.is_empty())
        .ok_or_else(|| format!("--share {e:?}: expected {FORM}"))?;
    let mut share = pb::Share {
        tag: tag.into(),
        host_path: host.into(),
        ..Default::default()
    };
    let (mut ro, mut mount) = (false, false);
    for part in parts {
        match part.split_once('=') {
            None if part == "ro" && !ro => {
                ro = true;
                share.read_only = true;
            }
            Some(("mount", p)) if !mount => {
                mount = true;
                share.mount_path = p.into();
            }
            _ => {
                return Err(format!(
                "--share {e:?}: {part:?} is not one of ro, mount=PATH (each once); expected {FORM}"
            ))
            }
        }
    }
    Ok(share)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse_with_their_options() {
        let s = parse(&[
            "cargo=/srv/cache/cargo,ro".into(),
            "data=/srv/data,mount=/data".into(),
        ])
        .unwrap();
        assert_eq!(
            (s[0].tag.as_str(), s[0].host_path.as_str(), s[0].read_only),
            ("cargo", "/srv/cache/cargo", true)
        );
        assert_eq!(s[0].mount_path, "");
        assert_eq!((s[1].read_only, s[1].mount_path.as_str()), (false, "/data"));
        for bad in [
            "cargo",
            "=/x",
            "t=",
            "t=/x,rw",
            "t=/x,ro,ro",
            "t=/x,mount=/a,mount=/b",
        ] {
            assert!(parse(&[bad.into()]).is_err(), "{bad}");
        }
    }
}
