//! Webhook triggers: what one is (checked from the API's `Trigger`), the
//! check of a delivery (HMAC-SHA256 over `<timestamp>.<delivery id>.<body>`
//! in GitHub's `X-Hub-Signature-256: sha256=<hex>` form, a timestamp within
//! [`TIMESTAMP_WINDOW_S`], a delivery id accepted once), and a delivery
//! turned into a run. The signature covers the timestamp and delivery id so
//! a captured request cannot be sent again under new ones.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use proto::hostagent as pb;
use sha2::Sha256;

use super::runner::{CAUSE_TRIGGER, CAUSE_WAKE_UP};
use super::scheduler::{schedule_lane, Overlap, Scheduler};
use super::{check_run, check_template};
use crate::error::{Error, Result};
use crate::sessions::now_ms;
use crate::store::{DeliveryRow, RunRow, TriggerRow, ACCEPTED};

/// Longest trigger id (a run's key, `trigger:<id>:<delivery>`, stays
/// within 128 bytes).
pub const MAX_TRIGGER_ID_LEN: usize = 64;
/// Longest delivery id.
pub const MAX_DELIVERY_ID_LEN: usize = 48;
/// How far a delivery's timestamp may be from the node's clock, seconds.
pub const TIMESTAMP_WINDOW_S: i64 = 300;
/// Largest request body taken.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// The header with the unix time the sender signed.
pub const TIMESTAMP_HEADER: &str = "x-agentvm-timestamp";
/// The header with the delivery's id.
pub const DELIVERY_HEADER: &str = "x-agentvm-delivery";
/// The signature header (GitHub's name and `sha256=<hex>` form).
pub const SIGNATURE_HEADER: &str = "x-hub-signature-256";

/// Checks a trigger id: 1..=[`MAX_TRIGGER_ID_LEN`] of `[A-Za-z0-9._-]`.
pub fn check_trigger_id(id: &str) -> Result<()> {
    crate::images::check_name("trigger_id", id, MAX_TRIGGER_ID_LEN)
}

/// The HMAC-SHA256 of `<timestamp>.<delivery>.<body>` under `secret`, as
/// the signature header carries it (`sha256=<hex>`). Senders compute the
/// same (see the README's example).
pub fn signature(secret: &str, timestamp: &str, delivery: &str, body: &[u8]) -> String {
    let mac = mac(secret, timestamp, delivery, body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

fn mac(secret: &str, timestamp: &str, delivery: &str, body: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length: new_from_slice cannot fail for it.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(delivery.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// Why a delivery is refused: its HTTP status, outcome and detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status answered.
    pub status: u16,
    /// The outcome kept ("bad_request", "bad_signature", ...).
    pub outcome: &'static str,
    /// What was wrong, for the sender and the operator.
    pub detail: String,
}

fn refuse(status: u16, outcome: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        status,
        outcome,
        detail: detail.into(),
    }
}

/// A delivery's headers, as the request had them.
#[derive(Debug, Clone, Default)]
pub struct Headers {
    /// [`TIMESTAMP_HEADER`].
    pub timestamp: Option<String>,
    /// [`DELIVERY_HEADER`].
    pub delivery: Option<String>,
    /// [`SIGNATURE_HEADER`].
    pub signature: Option<String>,
}

/// Checks a delivery's headers and signature against `secret` at `now_s`
/// (unix seconds): the headers present and well formed (400), the
/// signature right (401), the timestamp within the window (401). Returns
/// the delivery id.
pub fn verify(secret: &str, h: &Headers, body: &[u8], now_s: i64) -> Result<String, Refusal> {
    let (Some(ts), Some(delivery), Some(sig)) = (&h.timestamp, &h.delivery, &h.signature) else {
        return Err(refuse(
            400,
            "bad_request",
            format!(
                "the headers {TIMESTAMP_HEADER}, {DELIVERY_HEADER} and {SIGNATURE_HEADER} are required"
            ),
        ));
    };
    let Ok(at) = ts.parse::<i64>() else {
        return Err(refuse(
            400,
            "bad_request",
            format!("{TIMESTAMP_HEADER} {ts:?} is not a unix time in seconds"),
        ));
    };
    if delivery.is_empty()
        || delivery.len() > MAX_DELIVERY_ID_LEN
        || !delivery
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(refuse(
            400,
            "bad_request",
            format!("{DELIVERY_HEADER} must be 1..={MAX_DELIVERY_ID_LEN} of [A-Za-z0-9._-]"),
        ));
    }
    let Some(given) = sig
        .strip_prefix("sha256=")
        .and_then(|h| hex::decode(h).ok())
    else {
        return Err(refuse(
            401,
            "bad_signature",
            format!("{SIGNATURE_HEADER} is not sha256=<hex>"),
        ));
    };
    // verify_slice compares in constant time.
    if mac(secret, ts, delivery, body)
        .verify_slice(&given)
        .is_err()
    {
        return Err(refuse(
            401,
            "bad_signature",
            "the signature does not match the body, timestamp and delivery id under this \
             trigger's secret",
        ));
    }
    if (now_s - at).abs() > TIMESTAMP_WINDOW_S {
        return Err(refuse(
            401,
            "stale_timestamp",
            format!(
                "{TIMESTAMP_HEADER} {at} is {} s from the node's clock; at most \
                 {TIMESTAMP_WINDOW_S} s are taken",
                (now_s - at).abs()
            ),
        ));
    }
    Ok(delivery.clone())
}

/// A new trigger secret: 32 random bytes, hex.
pub fn new_secret() -> Result<String> {
    let mut buf = [0u8; 32];
    getrandom::fill(&mut buf)
        .map_err(|e| Error::Schedule(format!("no random bytes for a trigger secret: {e}")))?;
    Ok(hex::encode(buf))
}

impl TriggerRow {
    /// The trigger `t` asks for, owned by `owner`, checked field by field.
    /// `check_session` checks a template as CreateSession would;
    /// `schedule_of` and `session_of` find the caller's schedule and
    /// session (NOT_FOUND otherwise).
    pub fn from_request(
        t: pb::Trigger,
        owner: &crate::auth::Caller,
        now: i64,
        check_session: impl FnOnce(&pb::CreateSessionRequest) -> Result<()>,
        schedule_of: impl FnOnce(&str) -> Result<()>,
        session_of: impl FnOnce(&str) -> Result<bool>,
    ) -> Result<TriggerRow> {
        let id = if t.trigger_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            check_trigger_id(&t.trigger_id)?;
            t.trigger_id
        };
        if !t.secret.is_empty() {
            return Err(Error::invalid(
                "secret: host-agent generates a trigger's secret (CreateTrigger returns it once)",
            ));
        }
        check_run(&t.run)?;
        let kind = match pb::TriggerKind::try_from(t.kind) {
            Ok(pb::TriggerKind::Unspecified | pb::TriggerKind::Run) => pb::TriggerKind::Run,
            Ok(pb::TriggerKind::WakeUp) => pb::TriggerKind::WakeUp,
            Err(_) => {
                return Err(Error::invalid(format!(
                    "kind {} is not one of RUN, WAKE_UP",
                    t.kind
                )))
            }
        };
        let mut row = TriggerRow {
            id,
            owner: owner.name.clone(),
            owner_scope: owner.scope.name().to_string(),
            kind: kind as i32,
            enabled: t.enabled,
            secret: new_secret()?,
            created_at: now,
            ..Default::default()
        };
        match kind {
            pb::TriggerKind::WakeUp => {
                if !t.schedule_id.is_empty() || t.session.is_some() {
                    return Err(Error::invalid(
                        "schedule_id, session: a WAKE_UP trigger resumes session_id; it takes \
                         no schedule or template",
                    ));
                }
                if t.session_id.is_empty() {
                    return Err(Error::invalid(
                        "session_id: a WAKE_UP trigger names the session it resumes",
                    ));
                }
                if t.run.is_empty() {
                    return Err(Error::invalid(
                        "run: a WAKE_UP trigger needs the command it runs in the session",
                    ));
                }
                if !session_of(&t.session_id)? {
                    return Err(Error::invalid(format!(
                        "session_id: session {} runs an image without guest-init; nothing can \
                         run a command in it",
                        t.session_id
                    )));
                }
                row.session_id = t.session_id;
                row.run = t.run;
            }
            _ => {
                if !t.session_id.is_empty() {
                    return Err(Error::invalid(
                        "session_id: only a WAKE_UP trigger names a session",
                    ));
                }
                if t.schedule_id.is_empty() {
                    row.template = Some(check_template(t.session, check_session)?);
                    row.run = t.run;
                } else {
                    if t.session.is_some() || !t.run.is_empty() {
                        return Err(Error::invalid(
                            "session, run: a trigger of a schedule runs the schedule's template \
                             and command; leave them empty",
                        ));
                    }
                    super::check_id(&t.schedule_id)?;
                    schedule_of(&t.schedule_id)?;
                    row.schedule_id = t.schedule_id;
                }
            }
        }
        Ok(row)
    }

    /// The trigger as the API reports it (the secret only when `with_secret`).
    pub fn to_pb(&self, with_secret: bool) -> pb::Trigger {
        pb::Trigger {
            trigger_id: self.id.clone(),
            kind: self.kind,
            schedule_id: self.schedule_id.clone(),
            session: self.template.clone(),
            run: self.run.clone(),
            session_id: self.session_id.clone(),
            enabled: self.enabled,
            secret: if with_secret {
                self.secret.clone()
            } else {
                String::new()
            },
            owner: self.owner.clone(),
            created_at: self.created_at,
            path: format!("/triggers/{}", self.id),
        }
    }
}

/// What a delivery came to: the HTTP status, and the run (accepted) or
/// the refusal.
pub type Delivered = std::result::Result<RunRow, Refusal>;

impl Scheduler {
    /// Takes a request to `/triggers/<trigger_id>`: checks it, keeps it
    /// (accepted or refused, with `remote`), and, accepted, records its
    /// run and starts it as its lane allows.
    pub fn deliver(
        self: &Arc<Self>,
        trigger_id: &str,
        headers: &Headers,
        body: Result<Vec<u8>, Refusal>,
        remote: &str,
    ) -> Delivered {
        let now = now_ms();
        let delivery_id = headers
            .delivery
            .as_deref()
            .map(|d| crate::execs::record::cut(d.to_string(), MAX_DELIVERY_ID_LEN))
            .unwrap_or_default();
        let keep = |status: u16, outcome: &str, detail: &str, run_id: u64| DeliveryRow {
            trigger_id: crate::execs::record::cut(trigger_id.to_string(), MAX_TRIGGER_ID_LEN),
            delivery_id: delivery_id.clone(),
            received_at: now,
            http_status: status,
            outcome: outcome.to_string(),
            detail: detail.to_string(),
            run_id,
            remote: remote.to_string(),
        };
        let result = self.check_delivery(trigger_id, headers, body, now);
        match result {
            Err(r) => {
                tracing::warn!(trigger = %trigger_id, delivery = %delivery_id, remote, status = r.status, outcome = r.outcome, detail = %r.detail, "webhook delivery refused");
                // A trigger that does not exist keeps nothing: anyone may
                // send those, and they name nothing of the node's.
                if r.status != 404 {
                    if let Err(e) = self
                        .mgr
                        .store
                        .record_delivery(&keep(r.status, r.outcome, &r.detail, 0))
                    {
                        tracing::error!(error = %e, "keeping a refused delivery");
                    }
                }
                Err(r)
            }
            Ok(run) => {
                if let Err(e) = self
                    .mgr
                    .store
                    .record_delivery(&keep(202, ACCEPTED, "", run.id))
                {
                    tracing::error!(error = %e, "keeping an accepted delivery");
                }
                tracing::info!(trigger = %trigger_id, delivery = %delivery_id, remote, run = run.id, "webhook delivery accepted");
                Ok(run)
            }
        }
    }

    fn check_delivery(
        self: &Arc<Self>,
        trigger_id: &str,
        headers: &Headers,
        body: Result<Vec<u8>, Refusal>,
        now: i64,
    ) -> Delivered {
        let store = &self.mgr.store;
        let failed = |e: Error| refuse(503, "failed", format!("the node could not record it: {e}"));
        let trigger = check_trigger_id(trigger_id)
            .ok()
            .map(|_| store.trigger(trigger_id))
            .transpose()
            .map_err(failed)?
            .flatten()
            .ok_or_else(|| refuse(404, "unknown_trigger", "no such trigger on this node"))?;
        let body = body?;
        let delivery = verify(&trigger.secret, headers, &body, now / 1000)?;
        if !trigger.enabled {
            return Err(refuse(423, "disabled", "the trigger is disabled"));
        }
        let wake_up = trigger.kind == pb::TriggerKind::WakeUp as i32;
        let run = RunRow {
            schedule_id: trigger.schedule_id.clone(),
            trigger_id: trigger.id.clone(),
            owner: trigger.owner.clone(),
            fire_at: now,
            cause: if wake_up {
                CAUSE_WAKE_UP
            } else {
                CAUSE_TRIGGER
            }
            .into(),
            key: format!("trigger:{}:{delivery}", trigger.id),
            recorded_at: now,
            fires: 1,
            delivery_id: delivery.clone(),
            body,
            ..Default::default()
        };
        let (lane, overlap) = if wake_up {
            (format!("session:{}", trigger.session_id), Overlap::Queue)
        } else if !trigger.schedule_id.is_empty() {
            let overlap = store
                .schedule(&trigger.schedule_id)
                .map_err(failed)?
                .map_or(Overlap::Skip, |s| Overlap::of(s.overlap));
            (schedule_lane(&trigger.schedule_id), overlap)
        } else {
            (format!("trigger:{}", trigger.id), Overlap::Allow)
        };
        // A delivery id seen before is a run key taken: nothing is recorded.
        let (run, new) = self.admit(&lane, overlap, run, None).map_err(failed)?;
        if !new {
            return Err(refuse(
                409,
                "replayed",
                format!("delivery {delivery:?} was accepted before"),
            ));
        }
        Ok(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed(secret: &str, ts: i64, delivery: &str, body: &[u8]) -> Headers {
        Headers {
            timestamp: Some(ts.to_string()),
            delivery: Some(delivery.into()),
            signature: Some(signature(secret, &ts.to_string(), delivery, body)),
        }
    }

    #[test]
    fn a_signed_fresh_delivery_is_taken() {
        let h = signed("s3cret", 1_000, "d-1", b"{\"week\":48}");
        assert_eq!(
            verify("s3cret", &h, b"{\"week\":48}", 1_000).unwrap(),
            "d-1"
        );
        // Within the window either way.
        assert!(verify("s3cret", &h, b"{\"week\":48}", 1_000 + TIMESTAMP_WINDOW_S).is_ok());
        assert!(verify("s3cret", &h, b"{\"week\":48}", 1_000 - TIMESTAMP_WINDOW_S).is_ok());
    }

    #[test]
    fn each_bad_delivery_is_refused_with_its_status() {
        let body = b"payload";
        let good = signed("k", 5_000, "d", body);
        let cases: Vec<(Headers, &[u8], i64, u16, &str)> = vec![
            // Another body, another secret's signature, no signature.
            (good.clone(), b"payload!", 5_000, 401, "bad_signature"),
            (
                signed("other", 5_000, "d", body),
                body,
                5_000,
                401,
                "bad_signature",
            ),
            (
                Headers {
                    signature: Some("sha1=abc".into()),
                    ..good.clone()
                },
                body,
                5_000,
                401,
                "bad_signature",
            ),
            // The timestamp or delivery id changed under the old signature.
            (
                Headers {
                    timestamp: Some("5001".into()),
                    ..good.clone()
                },
                body,
                5_000,
                401,
                "bad_signature",
            ),
            (
                Headers {
                    delivery: Some("e".into()),
                    ..good.clone()
                },
                body,
                5_000,
                401,
                "bad_signature",
            ),
            // Signed, but old (or from the future).
            (
                good.clone(),
                body,
                5_000 + TIMESTAMP_WINDOW_S + 1,
                401,
                "stale_timestamp",
            ),
            (
                good.clone(),
                body,
                5_000 - TIMESTAMP_WINDOW_S - 1,
                401,
                "stale_timestamp",
            ),
            // Missing or malformed headers.
            (Headers::default(), body, 5_000, 400, "bad_request"),
            (
                Headers {
                    timestamp: Some("yesterday".into()),
                    ..good.clone()
                },
                body,
                5_000,
                400,
                "bad_request",
            ),
            (
                signed("k", 5_000, "a/b", body),
                body,
                5_000,
                400,
                "bad_request",
            ),
            (
                signed("k", 5_000, &"d".repeat(MAX_DELIVERY_ID_LEN + 1), body),
                body,
                5_000,
                400,
                "bad_request",
            ),
        ];
        for (i, (h, b, now, status, outcome)) in cases.into_iter().enumerate() {
            let r = verify("k", &h, b, now).unwrap_err();
            assert_eq!((r.status, r.outcome), (status, outcome), "case {i}: {r:?}");
            assert!(!r.detail.is_empty());
        }
    }

    #[test]
    fn the_signature_is_the_documented_hmac() {
        // HMAC-SHA256("key", "1.d.body"), as `openssl dgst -sha256 -hmac key` prints it.
        let s = signature("key", "1", "d", b"body");
        let expected = {
            let mut m = Hmac::<Sha256>::new_from_slice(b"key").unwrap();
            m.update(b"1.d.body");
            hex::encode(m.finalize().into_bytes())
        };
        assert_eq!(s, format!("sha256={expected}"));
        assert_eq!(new_secret().unwrap().len(), 64);
        assert_ne!(new_secret().unwrap(), new_secret().unwrap());
    }
}
