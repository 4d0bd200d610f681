//! When a schedule fires: a cron expression evaluated in an IANA time zone
//! (`croner` parses and steps it; `chrono-tz` holds the zones). Fire times
//! are instants (unix ms); the expression is read in the zone's wall clock,
//! with croner's daylight-saving rules: a fixed time that a spring-forward
//! gap skips runs at the first time after the gap that day, one that a
//! fall-back overlap repeats runs once (at its first occurrence), and
//! wildcard or step fields run at every matching wall-clock time, skipped in
//! a gap and repeated in an overlap.

use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds};
use croner::Cron;

use crate::error::{Error, Result};

/// Longest cron expression taken.
pub const MAX_CRON_LEN: usize = 256;

/// A parsed cron expression and the zone it is read in.
#[derive(Debug, Clone)]
pub struct Cadence {
    cron: Cron,
    tz: Tz,
}

impl Cadence {
    /// Parses `cron` (five fields, or six with seconds first) and
    /// `timezone` (an IANA name; empty is UTC). Errors name the field and
    /// what is wrong, for INVALID_ARGUMENT.
    pub fn parse(cron: &str, timezone: &str) -> Result<Cadence> {
        if cron.len() > MAX_CRON_LEN {
            return Err(Error::invalid(format!(
                "cron is {} bytes, more than {MAX_CRON_LEN}",
                cron.len()
            )));
        }
        let parsed = CronParser::builder()
            .seconds(Seconds::Optional)
            .build()
            .parse(cron)
            .map_err(|e| {
                Error::invalid(format!(
                    "cron {cron:?} is not a cron expression (five fields, \
                     or six with seconds first): {e}"
                ))
            })?;
        let tz = if timezone.is_empty() {
            Tz::UTC
        } else {
            Tz::from_str(timezone).map_err(|_| {
                Error::invalid(format!(
                    "timezone {timezone:?} is not an IANA time zone name (such as \
                     \"Europe/Berlin\" or \"UTC\")"
                ))
            })?
        };
        Ok(Cadence { cron: parsed, tz })
    }

    /// The first fire time strictly after `after_ms` (unix ms), or None when
    /// no time matches any more (croner searches up to the year 5000).
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        let start: DateTime<Utc> = DateTime::from_timestamp_millis(after_ms)?;
        let local = self.tz.from_utc_datetime(&start.naive_utc());
        self.cron
            .find_next_occurrence(&local, false)
            .ok()
            .map(|t| t.with_timezone(&Utc).timestamp_millis())
    }

    /// The fire times in `(after_ms, until_ms]`, at most `max` of them.
    pub fn between(&self, after_ms: i64, until_ms: i64, max: usize) -> Vec<i64> {
        let mut out = Vec::new();
        let mut t = after_ms;
        while out.len() < max {
            match self.next_after(t) {
                Some(n) if n <= until_ms => {
                    out.push(n);
                    t = n;
                }
                _ => break,
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDate;

    /// Unix ms of a wall-clock time in `tz` (the earlier one in an overlap).
    fn at(tz: Tz, y: i32, mo: u32, d: u32, h: u32, mi: u32) -> i64 {
        let naive = NaiveDate::from_ymd_opt(y, mo, d)
            .unwrap()
            .and_hms_opt(h, mi, 0)
            .unwrap();
        tz.from_local_datetime(&naive)
            .earliest()
            .unwrap()
            .timestamp_millis()
    }

    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> i64 {
        at(Tz::UTC, y, mo, d, h, mi)
    }

    #[test]
    fn five_and_six_field_expressions_and_the_zone() {
        let c = Cadence::parse("0 9 * * MON", "Europe/Berlin").unwrap();
        // Monday 2027-01-04 09:00 in Berlin is 08:00 UTC (winter, +01:00).
        assert_eq!(
            c.next_after(utc(2027, 1, 1, 0, 0)),
            Some(utc(2027, 1, 4, 8, 0))
        );
        // In summer (+02:00) the same wall-clock time is 07:00 UTC.
        assert_eq!(
            c.next_after(utc(2027, 7, 1, 0, 0)),
            Some(utc(2027, 7, 5, 7, 0))
        );
        let every_second = Cadence::parse("* * * * * *", "").unwrap();
        let t = utc(2027, 1, 1, 0, 0);
        assert_eq!(every_second.next_after(t), Some(t + 1000));
        assert_eq!(
            every_second.between(t, t + 5000, 100),
            vec![t + 1000, t + 2000, t + 3000, t + 4000, t + 5000]
        );
        assert_eq!(every_second.between(t, t + 5000, 2).len(), 2);
    }

    #[test]
    fn bad_expressions_and_zones_are_named() {
        for bad in ["", "* * *", "61 * * * *", "* * * * * * * *", "every day"] {
            let e = Cadence::parse(bad, "").unwrap_err().to_string();
            assert!(
                e.contains("cron") && e.contains(&format!("{bad:?}")),
                "{bad}: {e}"
            );
        }
        let e = Cadence::parse("* * * * *", "Mars/Olympus_Mons")
            .unwrap_err()
            .to_string();
        assert!(e.contains("timezone \"Mars/Olympus_Mons\""), "{e}");
        let long = "*".repeat(MAX_CRON_LEN + 1);
        assert!(Cadence::parse(&long, "").is_err());
    }

    #[test]
    fn daylight_saving_gap_and_overlap() {
        let ny: Tz = "America/New_York".parse().unwrap();
        // 2027-03-14: 02:00 jumps to 03:00 in New York. A job at 02:30 runs
        // at the first time after the gap that day, 03:00 EDT (07:00 UTC).
        let fixed = Cadence::parse("30 2 * * *", "America/New_York").unwrap();
        let before = at(ny, 2027, 3, 14, 0, 0);
        assert_eq!(fixed.next_after(before), Some(utc(2027, 3, 14, 7, 0)));
        // And the day after at 02:30 EDT again (06:30 UTC).
        assert_eq!(
            fixed.next_after(utc(2027, 3, 14, 7, 0)),
            Some(utc(2027, 3, 15, 6, 30))
        );
        // 2027-11-07: 02:00 falls back to 01:00. A job at 01:30 runs once,
        // at the first 01:30 (EDT, 05:30 UTC), not again at 01:30 EST.
        let twice = Cadence::parse("30 1 * * *", "America/New_York").unwrap();
        let first = twice.next_after(at(ny, 2027, 11, 7, 0, 0)).unwrap();
        assert_eq!(first, utc(2027, 11, 7, 5, 30));
        assert_eq!(twice.next_after(first), Some(utc(2027, 11, 8, 6, 30)));
        // A wildcard job runs at each matching wall-clock time: every 30
        // minutes over the repeated hour is four fires from 01:00 EDT on.
        let half_hourly = Cadence::parse("*/30 * * * *", "America/New_York").unwrap();
        let fires = half_hourly.between(utc(2027, 11, 7, 4, 59), utc(2027, 11, 7, 6, 59), 10);
        assert_eq!(
            fires,
            vec![
                utc(2027, 11, 7, 5, 0),
                utc(2027, 11, 7, 5, 30),
                utc(2027, 11, 7, 6, 0),
                utc(2027, 11, 7, 6, 30)
            ]
        );
    }
}
