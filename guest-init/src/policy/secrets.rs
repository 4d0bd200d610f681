//! Secret scoping and redaction.
//!
//! A command's environment holds a secret only when the agent's grant in the
//! manifest *and* the session's allowlist both name it. Secret values are
//! replaced by `[REDACTED:<name>]` wherever guest-init writes text: audit
//! events, logs, errors and the commands' streamed output.

use std::collections::{BTreeMap, BTreeSet};

/// Secrets a session may deliver, with values.
#[derive(Clone, Default)]
pub struct Secrets {
    delivered: BTreeMap<String, String>,
    redactor: Redactor,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: values must never reach a log.
        f.debug_struct("Secrets")
            .field("names", &self.delivered.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Secrets {
    /// Scopes `values` to names in both `grant` and `allowlist`. Every value
    /// given is redacted, delivered or not.
    pub fn scope(
        grant: &[String],
        allowlist: &[String],
        values: &BTreeMap<String, String>,
    ) -> Self {
        let grant: BTreeSet<&String> = grant.iter().collect();
        let allow: BTreeSet<&String> = allowlist.iter().collect();
        let delivered = values
            .iter()
            .filter(|(name, _)| grant.contains(name) && allow.contains(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        Self {
            delivered,
            redactor: Redactor::new(values),
        }
    }

    /// Name/value pairs to put in a command's environment.
    pub fn env(&self) -> &BTreeMap<String, String> {
        &self.delivered
    }

    /// Names delivered, for audit events.
    pub fn names(&self) -> Vec<String> {
        self.delivered.keys().cloned().collect()
    }

    /// The redactor for every secret value of the session.
    pub fn redactor(&self) -> &Redactor {
        &self.redactor
    }
}

/// Replaces secret values in text.
#[derive(Clone, Default)]
pub struct Redactor {
    /// (value, marker), longest value first so overlapping values redact fully.
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Redactor {
    /// A redactor for these name -> value pairs (empty values are ignored).
    pub fn new(values: &BTreeMap<String, String>) -> Self {
        let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = values
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(n, v)| {
                (
                    v.as_bytes().to_vec(),
                    format!("[REDACTED:{n}]").into_bytes(),
                )
            })
            .collect();
        pairs.sort_by_key(|p| std::cmp::Reverse(p.0.len()));
        Self { pairs }
    }

    /// `text` with every secret value replaced.
    pub fn redact(&self, text: &str) -> String {
        String::from_utf8_lossy(&self.redact_bytes(text.as_bytes())).into_owned()
    }

    /// `data` with every secret value replaced.
    pub fn redact_bytes(&self, data: &[u8]) -> Vec<u8> {
        if self.pairs.is_empty() {
            return data.to_vec();
        }
        let mut out = Vec::with_capacity(data.len());
        let mut i = 0;
        'outer: while i < data.len() {
            for (value, marker) in &self.pairs {
                if data[i..].starts_with(value) {
                    out.extend_from_slice(marker);
                    i += value.len();
                    continue 'outer;
                }
            }
            out.push(data[i]);
            i += 1;
        }
        out
    }

    /// Length of the longest suffix of `data` that could begin a secret value.
    fn pending_prefix(&self, data: &[u8]) -> usize {
        let longest = self.pairs.first().map_or(0, |p| p.0.len());
        let start = data.len().saturating_sub(longest.saturating_sub(1));
        (start..data.len())
            .find(|&i| self.pairs.iter().any(|(v, _)| v.starts_with(&data[i..])))
            .map_or(0, |i| data.len() - i)
    }

    /// A redactor for one output stream, which also catches values split
    /// across chunks.
    pub fn stream(&self) -> StreamRedactor {
        StreamRedactor {
            redactor: self.clone(),
            carry: Vec::new(),
        }
    }
}

/// Redacts a byte stream chunk by chunk; see [`Redactor::stream`].
pub struct StreamRedactor {
    redactor: Redactor,
    carry: Vec<u8>,
}

impl StreamRedactor {
    /// Redacts `chunk`, holding back a tail that might start a secret.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut data = std::mem::take(&mut self.carry);
        data.extend_from_slice(chunk);
        let mut out = self.redactor.redact_bytes(&data);
        let hold = self.redactor.pending_prefix(&out);
        self.carry = out.split_off(out.len() - hold);
        out
    }

    /// The held-back tail at end of stream (never a whole secret).
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.carry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> BTreeMap<String, String> {
        [
            ("TOKEN", "s3cr3t-value"),
            ("OTHER", "hunter2"),
            ("EMPTY", ""),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
    }

    #[test]
    fn scoping_needs_grant_and_allowlist() {
        let s = Secrets::scope(
            &["TOKEN".into(), "OTHER".into()],
            &["TOKEN".into(), "MISSING".into()],
            &values(),
        );
        assert_eq!(s.names(), ["TOKEN"]);
        assert!(!format!("{s:?}").contains("s3cr3t"));
    }

    #[test]
    fn redaction() {
        let r = Redactor::new(&values());
        assert_eq!(
            r.redact("a s3cr3t-value b hunter2"),
            "a [REDACTED:TOKEN] b [REDACTED:OTHER]"
        );
        assert_eq!(r.redact("nothing"), "nothing");
    }

    #[test]
    fn stream_redaction_across_chunks() {
        let r = Redactor::new(&values());
        let mut s = r.stream();
        let mut out = Vec::new();
        for chunk in ["xx s3c", "r3t-va", "lue yy hun", "ter2", " end s3"] {
            out.extend(s.push(chunk.as_bytes()));
        }
        out.extend(s.finish());
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "xx [REDACTED:TOKEN] yy [REDACTED:OTHER] end s3"
        );
    }
}
