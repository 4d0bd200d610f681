//! A VM's device rate limits (the vmm's token buckets on virtio-net and
//! virtio-blk): set per image at RegisterImage, overridable per session at
//! CreateSession. Kept in the database as text, each limit as the vmm reads
//! it (`SIZE[/MS][+BURST]`), so what an operator wrote is what they read.
//!
//! A session's override replaces the image's limit field by field. Without
//! the admin scope it may only tighten: every overridden limit must be no
//! faster than the image's (a lower or equal sustained rate, and a bucket
//! plus burst no larger), so a tenant cannot buy itself the node's uplink.

use proto::hostagent as pb;
use serde::{Deserialize, Serialize};
use vmm_api::rate_limit::{IoLimit, NetLimits, RateLimit, TokenUnit};

use crate::error::{Error, Result};

/// The limits of one VM's devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoLimits {
    /// virtio-net, per direction.
    pub net: NetLimits,
    /// Every virtio-blk disk.
    pub disk: IoLimit,
}

/// The fields, their API names and units, in a fixed order.
const FIELDS: [(&str, TokenUnit); 6] = [
    ("net_rx_bandwidth", TokenUnit::Bytes),
    ("net_tx_bandwidth", TokenUnit::Bytes),
    ("net_rx_packets", TokenUnit::Ops),
    ("net_tx_packets", TokenUnit::Ops),
    ("disk_bandwidth", TokenUnit::Bytes),
    ("disk_iops", TokenUnit::Ops),
];

/// [`IoLimits`] as stored: the six limits as written (empty: none).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct Stored {
    net_rx_bandwidth: String,
    net_tx_bandwidth: String,
    net_rx_packets: String,
    net_tx_packets: String,
    disk_bandwidth: String,
    disk_iops: String,
}

impl IoLimits {
    fn slots(&self) -> [Option<RateLimit>; 6] {
        [
            self.net.rx.bandwidth,
            self.net.tx.bandwidth,
            self.net.rx.ops,
            self.net.tx.ops,
            self.disk.bandwidth,
            self.disk.ops,
        ]
    }

    fn from_slots(s: [Option<RateLimit>; 6]) -> Self {
        let io = |bandwidth, ops| IoLimit { bandwidth, ops };
        Self {
            net: NetLimits {
                rx: io(s[0], s[2]),
                tx: io(s[1], s[3]),
            },
            disk: io(s[4], s[5]),
        }
    }

    fn parse_texts(texts: [&str; 6]) -> Result<Self> {
        let mut slots = [None; 6];
        for (i, ((field, unit), text)) in FIELDS.iter().zip(texts).enumerate() {
            if !text.trim().is_empty() {
                slots[i] = Some(
                    RateLimit::parse(field, text.trim(), *unit)
                        .map_err(|e| Error::invalid(format!("io_limits: {e}")))?,
                );
            }
        }
        Ok(Self::from_slots(slots))
    }

    fn texts(&self) -> [String; 6] {
        self.slots()
            .map(|s| s.map(|l| l.to_string()).unwrap_or_default())
    }

    /// The limits an API request names (`None`: none given).
    pub fn from_pb(p: Option<&pb::IoLimits>) -> Result<Self> {
        let Some(p) = p else {
            return Ok(Self::default());
        };
        Self::parse_texts([
            &p.net_rx_bandwidth,
            &p.net_tx_bandwidth,
            &p.net_rx_packets,
            &p.net_tx_packets,
            &p.disk_bandwidth,
            &p.disk_iops,
        ])
    }

    /// The limits as the API reports them.
    pub fn to_pb(&self) -> pb::IoLimits {
        let [a, b, c, d, e, f] = self.texts();
        pb::IoLimits {
            net_rx_bandwidth: a,
            net_tx_bandwidth: b,
            net_rx_packets: c,
            net_tx_packets: d,
            disk_bandwidth: e,
            disk_iops: f,
        }
    }

    /// The limits as stored (empty text: none at all).
    pub fn encode(&self) -> String {
        if *self == Self::default() {
            return String::new();
        }
        let [a, b, c, d, e, f] = self.texts();
        let s = Stored {
            net_rx_bandwidth: a,
            net_tx_bandwidth: b,
            net_rx_packets: c,
            net_tx_packets: d,
            disk_bandwidth: e,
            disk_iops: f,
        };
        serde_json::to_string(&s).unwrap_or_default()
    }

    /// Reads stored limits back; text this host-agent did not write is an
    /// error naming it.
    pub fn decode(text: &str) -> Result<Self> {
        if text.is_empty() {
            return Ok(Self::default());
        }
        let s: Stored = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("stored io_limits {text:?}: {e}")))?;
        Self::parse_texts([
            &s.net_rx_bandwidth,
            &s.net_tx_bandwidth,
            &s.net_rx_packets,
            &s.net_tx_packets,
            &s.disk_bandwidth,
            &s.disk_iops,
        ])
    }

    /// `self` with every limit `o` sets replacing its own. Without
    /// `may_loosen`, each of those must be no faster than `self`'s.
    pub fn overridden_by(&self, o: &IoLimits, may_loosen: bool) -> Result<Self> {
        let mut out = self.slots();
        for (i, (mine, theirs)) in self.slots().into_iter().zip(o.slots()).enumerate() {
            let Some(theirs) = theirs else { continue };
            if let (Some(mine), false) = (mine, may_loosen) {
                if !within(&theirs, &mine) {
                    return Err(Error::PermissionDenied(format!(
                        "io_limits.{} {theirs} is looser than the image's {mine}; \
                         loosening it needs the admin scope",
                        FIELDS[i].0
                    )));
                }
            }
            out[i] = Some(theirs);
        }
        Ok(Self::from_slots(out))
    }
}

/// Whether `a` lets no more through than `b`: a sustained rate no higher
/// and a bucket plus burst no larger.
fn within(a: &RateLimit, b: &RateLimit) -> bool {
    // Rates compared as size/refill without floating point.
    let rate_ok = u128::from(a.size) * u128::from(b.refill_ms)
        <= u128::from(b.size) * u128::from(a.refill_ms);
    rate_ok && a.size.saturating_add(a.burst) <= b.size.saturating_add(b.burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(net_tx_bandwidth: &str, disk_iops: &str) -> pb::IoLimits {
        pb::IoLimits {
            net_tx_bandwidth: net_tx_bandwidth.into(),
            disk_iops: disk_iops.into(),
            ..Default::default()
        }
    }

    #[test]
    fn limits_parse_store_and_read_back() {
        let l = IoLimits::from_pb(Some(&limits("10M/100+4M", "500"))).unwrap();
        assert_eq!(
            l.net.tx.bandwidth,
            Some(RateLimit {
                size: 10 << 20,
                burst: 4 << 20,
                refill_ms: 100
            })
        );
        assert_eq!(l.disk.ops, Some(RateLimit::per_second(500)));
        assert_eq!(l.net.rx, IoLimit::default());
        assert_eq!(IoLimits::decode(&l.encode()).unwrap(), l);
        let shown = l.to_pb();
        assert_eq!(IoLimits::from_pb(Some(&shown)).unwrap(), l);
        assert_eq!(shown.net_rx_bandwidth, "");
        // None at all is stored as nothing.
        assert_eq!(IoLimits::default().encode(), "");
        assert_eq!(IoLimits::decode("").unwrap(), IoLimits::default());
        assert_eq!(IoLimits::from_pb(None).unwrap(), IoLimits::default());
    }

    #[test]
    fn bad_limits_name_the_field_and_the_form() {
        let e = IoLimits::from_pb(Some(&limits("lots", "")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("net_tx_bandwidth") && e.contains("BYTES"), "{e}");
        let e = IoLimits::from_pb(Some(&limits("", "1K")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("disk_iops"), "{e}");
        assert!(IoLimits::decode("{not json").is_err());
    }

    #[test]
    fn a_session_may_tighten_the_images_limits_and_only_an_admin_loosen_them() {
        let image = IoLimits::from_pb(Some(&limits("10M", "500"))).unwrap();
        let tighter = IoLimits::from_pb(Some(&limits("1M", ""))).unwrap();
        let got = image.overridden_by(&tighter, false).unwrap();
        assert_eq!(got.net.tx.bandwidth, Some(RateLimit::per_second(1 << 20)));
        assert_eq!(got.disk.ops, image.disk.ops, "not overridden: the image's");
        // Faster, or the same rate with a burst on top: looser.
        for looser in ["20M", "10M+1M", "2M/100"] {
            let o = IoLimits::from_pb(Some(&limits(looser, ""))).unwrap();
            let e = image.overridden_by(&o, false).unwrap_err().to_string();
            assert!(
                e.contains("admin scope") && e.contains("net_tx_bandwidth"),
                "{e}"
            );
            assert_eq!(
                image.overridden_by(&o, true).unwrap().net.tx.bandwidth,
                o.net.tx.bandwidth
            );
        }
        // A limit where the image has none only tightens.
        let rx = IoLimits::from_pb(Some(&pb::IoLimits {
            net_rx_packets: "100".into(),
            ..Default::default()
        }))
        .unwrap();
        assert!(image.overridden_by(&rx, false).is_ok());
    }
}
