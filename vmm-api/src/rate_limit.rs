//! Rate limits of the vmm's virtio-net and virtio-blk devices, as the
//! `--net` and `--disk` options spell them, and the errors of parsing those
//! options. The vmm parses its own options with these types, so what a
//! client builds is exactly what the vmm reads.
//!
//! A limit is a token bucket: `SIZE[/MS][+BURST]`. `SIZE` tokens are added
//! every `MS` milliseconds (default 1000), continuously in proportion to
//! time, and `SIZE` is also what the bucket holds; `BURST` is a one-time
//! allowance of extra tokens available from the start and never refilled.
//! For bandwidth a token is a byte and `SIZE` and `BURST` take a `K`, `M` or
//! `G` suffix (powers of 1024); for operations (packets, requests) a token is
//! one operation and the numbers are plain.

use std::fmt;

/// Errors in a `--net` or `--disk` option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A field's value is not of the expected form.
    #[error("invalid {field} {value:?}: expected {expected}")]
    Invalid {
        /// The field (`tap`, `mac`, `rx_bw`, `path`...).
        field: String,
        /// The text given.
        value: String,
        /// The accepted form.
        expected: &'static str,
    },
    /// A `name=value` field the option does not have.
    #[error("unknown field {field:?}: expected {known}")]
    Unknown {
        /// The field as given.
        field: String,
        /// The fields the option takes.
        known: &'static str,
    },
    /// A field given twice.
    #[error("field {field} is given more than once")]
    Repeated {
        /// The field.
        field: String,
    },
}

/// What a bucket's tokens are: this decides the units a limit is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenUnit {
    /// Bytes: sizes take K, M or G suffixes.
    Bytes,
    /// Operations (packets, requests): plain counts.
    Ops,
}

/// The accepted form of a bandwidth limit.
pub const BYTES_FORM: &str = "BYTES[/MS][+BURST] (BYTES and BURST a byte count above zero with an \
     optional K, M or G suffix, MS the refill period in milliseconds above zero, default 1000), \
     e.g. 10M or 1M/100+4M";
/// The accepted form of an operations limit.
pub const OPS_FORM: &str = "COUNT[/MS][+BURST] (COUNT and BURST plain numbers, COUNT above \
     zero, MS the refill period in milliseconds above zero, default 1000), e.g. 1000 or 100/100+500";

/// One token bucket: `size` tokens every `refill_ms` milliseconds, at most
/// `size` held, plus a one-time `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RateLimit {
    /// Tokens added per refill period, and the bucket's capacity (above zero).
    pub size: u64,
    /// Extra tokens available once, from the start (0: none).
    pub burst: u64,
    /// The refill period in milliseconds (above zero).
    pub refill_ms: u64,
}

impl RateLimit {
    /// `size` tokens per second, no burst.
    pub fn per_second(size: u64) -> RateLimit {
        RateLimit {
            size,
            burst: 0,
            refill_ms: 1000,
        }
    }

    /// The sustained rate in tokens per second.
    pub fn per_sec(&self) -> f64 {
        self.size as f64 * 1000.0 / self.refill_ms as f64
    }

    /// Parses `SIZE[/MS][+BURST]` of field `field`, in `unit`s.
    pub fn parse(field: &str, text: &str, unit: TokenUnit) -> Result<RateLimit, SpecError> {
        let invalid = || SpecError::Invalid {
            field: field.to_string(),
            value: text.to_string(),
            expected: match unit {
                TokenUnit::Bytes => BYTES_FORM,
                TokenUnit::Ops => OPS_FORM,
            },
        };
        let (rest, burst) = match text.split_once('+') {
            Some((rest, burst)) => (rest, parse_amount(burst, unit).ok_or_else(invalid)?),
            None => (text, 0),
        };
        let (size, refill_ms) = match rest.split_once('/') {
            Some((size, ms)) => (size, ms.parse::<u64>().ok().ok_or_else(invalid)?),
            None => (rest, 1000),
        };
        let size = parse_amount(size, unit).ok_or_else(invalid)?;
        if size == 0 || refill_ms == 0 {
            return Err(invalid());
        }
        Ok(RateLimit {
            size,
            burst,
            refill_ms,
        })
    }
}

/// `SIZE[/MS][+BURST]` with plain numbers: what [`RateLimit::parse`] reads
/// back in either unit.
impl fmt::Display for RateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.size)?;
        if self.refill_ms != 1000 {
            write!(f, "/{}", self.refill_ms)?;
        }
        if self.burst != 0 {
            write!(f, "+{}", self.burst)?;
        }
        Ok(())
    }
}

/// A plain number, or for bytes a number with a K, M or G suffix.
fn parse_amount(text: &str, unit: TokenUnit) -> Option<u64> {
    let (digits, scale) = match (unit, text.as_bytes().last()) {
        (TokenUnit::Bytes, Some(b'K' | b'k')) => (&text[..text.len() - 1], 1u64 << 10),
        (TokenUnit::Bytes, Some(b'M' | b'm')) => (&text[..text.len() - 1], 1 << 20),
        (TokenUnit::Bytes, Some(b'G' | b'g')) => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    // `u64::from_str` accepts a leading '+', which would read oddly here.
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// The limits of one device or one direction: bandwidth in bytes, and
/// operations (packets for virtio-net, requests for virtio-blk). An
/// operation passes only when both buckets have its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct IoLimit {
    /// Bytes.
    pub bandwidth: Option<RateLimit>,
    /// Operations.
    pub ops: Option<RateLimit>,
}

impl IoLimit {
    /// Whether neither bucket is set.
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth.is_none() && self.ops.is_none()
    }
}

/// The limits of a virtio-net device, per direction (as the guest sees it:
/// `rx` is host to guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct NetLimits {
    /// Frames the guest receives.
    pub rx: IoLimit,
    /// Frames the guest sends.
    pub tx: IoLimit,
}

/// Sets `slot` from `field=text` once; a second time is an error.
pub(crate) fn set_once(
    slot: &mut Option<RateLimit>,
    field: &str,
    text: &str,
    unit: TokenUnit,
) -> Result<(), SpecError> {
    if slot.is_some() {
        return Err(SpecError::Repeated {
            field: field.to_string(),
        });
    }
    *slot = Some(RateLimit::parse(field, text, unit)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_with_units_periods_and_bursts() {
        let p = |t| RateLimit::parse("rx_bw", t, TokenUnit::Bytes);
        assert_eq!(p("1000"), Ok(RateLimit::per_second(1000)));
        assert_eq!(p("10M").unwrap().size, 10 << 20);
        assert_eq!(p("4k").unwrap().size, 4096);
        assert_eq!(p("1G").unwrap().size, 1 << 30);
        assert_eq!(
            p("1M/100+4M"),
            Ok(RateLimit {
                size: 1 << 20,
                burst: 4 << 20,
                refill_ms: 100
            })
        );
        assert_eq!(p("512+1K").unwrap().burst, 1024);
        assert_eq!(p("512/10").unwrap().refill_ms, 10);
        let o = |t| RateLimit::parse("iops", t, TokenUnit::Ops);
        assert_eq!(
            o("100/100+500"),
            Ok(RateLimit {
                size: 100,
                burst: 500,
                refill_ms: 100
            })
        );
        assert!((o("100/100").unwrap().per_sec() - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn bad_limits_name_the_field_and_the_form() {
        for bad in [
            "",
            "0",
            "10X",
            "-5",
            "+5",
            "1M/0",
            "1M/",
            "/100",
            "1M+",
            "1M+x",
            "1M/1.5",
            "1.5M",
            "99999999999999999999",
            "17179869184G",
        ] {
            let e = RateLimit::parse("tx_bw", bad, TokenUnit::Bytes).unwrap_err();
            let text = e.to_string();
            assert!(text.starts_with("invalid tx_bw "), "{bad:?}: {text}");
            assert!(text.contains("BYTES[/MS][+BURST]"), "{text}");
        }
        // Operations take no size suffix.
        let e = RateLimit::parse("rx_ops", "1K", TokenUnit::Ops).unwrap_err();
        assert!(e.to_string().contains("COUNT[/MS][+BURST]"), "{e}");
    }

    #[test]
    fn limits_display_as_they_parse() {
        for l in [
            RateLimit::per_second(7),
            RateLimit {
                size: 1 << 20,
                burst: 3,
                refill_ms: 250,
            },
            RateLimit {
                size: 9,
                burst: 0,
                refill_ms: 1,
            },
        ] {
            for unit in [TokenUnit::Bytes, TokenUnit::Ops] {
                assert_eq!(RateLimit::parse("f", &l.to_string(), unit), Ok(l));
            }
        }
    }
}
