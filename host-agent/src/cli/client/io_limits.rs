//! `--io-limit FIELD=RATE` of `images register` and `sessions create`.

use proto::hostagent as pb;

/// The fields `--io-limit` names, as the API's `IoLimits` has them.
const FIELDS: &str = "net_rx_bandwidth, net_tx_bandwidth, net_rx_packets, net_tx_packets, \
     disk_bandwidth, disk_iops";

/// The limits `entries` (`FIELD=RATE` each) set; `None` for none. The
/// rates themselves are checked by host-agent.
pub fn parse(entries: &[String]) -> Result<Option<pb::IoLimits>, String> {
    if entries.is_empty() {
        return Ok(None);
    }
    let mut l = pb::IoLimits::default();
    for e in entries {
        let (field, rate) = e
            .split_once('=')
            .ok_or_else(|| format!("--io-limit {e:?}: expected FIELD=RATE ({FIELDS})"))?;
        let slot = match field.trim() {
            "net_rx_bandwidth" => &mut l.net_rx_bandwidth,
            "net_tx_bandwidth" => &mut l.net_tx_bandwidth,
            "net_rx_packets" => &mut l.net_rx_packets,
            "net_tx_packets" => &mut l.net_tx_packets,
            "disk_bandwidth" => &mut l.disk_bandwidth,
            "disk_iops" => &mut l.disk_iops,
            other => return Err(format!("--io-limit: unknown field {other:?} ({FIELDS})")),
        };
        if !slot.is_empty() {
            return Err(format!("--io-limit: {field} given twice"));
        }
        *slot = rate.trim().to_string();
    }
    Ok(Some(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_rates() {
        let l = parse(&["net_tx_bandwidth=10M".into(), "disk_iops=500/100".into()])
            .unwrap()
            .unwrap();
        assert_eq!(l.net_tx_bandwidth, "10M");
        assert_eq!(l.disk_iops, "500/100");
        assert_eq!(parse(&[]).unwrap(), None);
        assert!(parse(&["speed=1".into()]).unwrap_err().contains("unknown"));
        assert!(parse(&["disk_iops".into()])
            .unwrap_err()
            .contains("FIELD=RATE"));
        let twice = ["disk_iops=1".to_string(), "disk_iops=2".to_string()];
        assert!(parse(&twice).unwrap_err().contains("twice"));
    }
}
