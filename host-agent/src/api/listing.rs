//! Labels and listing: the checks of a label map (CreateSession's labels,
//! ListSessions' and Watch's label filters) and ListSessions' pages, with
//! their opaque page tokens.

use std::collections::{BTreeMap, HashMap};

use prost::Message;
use proto::hostagent as pb;
use sha2::{Digest, Sha256};

use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::images::valid_id;
use crate::store::{Cursor, SessionQuery, SessionRow, Store};

/// Most labels a session has, or a filter names.
pub const MAX_LABELS: usize = 16;
/// Longest label key, in bytes (keys are at least one byte).
pub const MAX_LABEL_KEY: usize = 64;
/// Longest label value, in bytes (values may be empty).
pub const MAX_LABEL_VALUE: usize = 256;

/// Sessions per page when the request leaves page_size 0.
pub const DEFAULT_PAGE_SIZE: u32 = 100;
/// Most sessions per page.
pub const MAX_PAGE_SIZE: u32 = 1000;
/// A page ends before its sessions take more than this, well under gRPC's
/// usual 4 MiB limit on a message.
const MAX_PAGE_BYTES: usize = 3 << 20;
/// Most entries of ListSessionsRequest.states.
const MAX_STATES: usize = 16;

/// Token layout version (first byte).
const TOKEN_VERSION: u8 = 1;
/// Bytes of the query digest in a token.
const DIGEST_LEN: usize = 8;
/// Version, digest and creation time: the bytes before the session id.
const TOKEN_HEAD: usize = 1 + DIGEST_LEN + 8;
/// Longest session id a token may hold.
const MAX_TOKEN_ID: usize = 64;

/// Checks a label map (field `field`: `labels` of a request): at most 16
/// entries, keys 1..=64 bytes, values at most 256 bytes. Returns it ordered.
pub fn check_labels(
    field: &str,
    labels: &HashMap<String, String>,
) -> Result<BTreeMap<String, String>> {
    if labels.len() > MAX_LABELS {
        return Err(Error::invalid(format!(
            "{field}: {} labels; at most {MAX_LABELS}",
            labels.len()
        )));
    }
    for (k, v) in labels {
        if k.is_empty() || k.len() > MAX_LABEL_KEY {
            return Err(Error::invalid(format!(
                "{field}: key {k:?} is {} bytes; keys are 1..={MAX_LABEL_KEY} bytes",
                k.len()
            )));
        }
        if v.len() > MAX_LABEL_VALUE {
            return Err(Error::invalid(format!(
                "{field}[{k:?}]: the value is {} bytes; at most {MAX_LABEL_VALUE}",
                v.len()
            )));
        }
    }
    Ok(labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// The states filter: each a SessionState other than UNSPECIFIED; returned
/// sorted, without repeats.
fn check_states(states: &[i32]) -> Result<Vec<i32>> {
    if states.len() > MAX_STATES {
        return Err(Error::invalid(format!(
            "states: {} entries; at most {MAX_STATES}",
            states.len()
        )));
    }
    let mut out = Vec::with_capacity(states.len());
    for (i, &s) in states.iter().enumerate() {
        match pb::SessionState::try_from(s) {
            Ok(pb::SessionState::Unspecified) => {
                return Err(Error::invalid(format!(
                    "states[{i}]: SESSION_STATE_UNSPECIFIED matches no session; leave states \
                     empty for every state"
                )))
            }
            Ok(_) => out.push(s),
            Err(_) => {
                return Err(Error::invalid(format!(
                    "states[{i}]: {s} is not a SessionState (1..=8)"
                )))
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// What identifies a query across its pages: its filters, the caller's
/// owner filter included (a token is not valid for another query).
fn query_digest(q: &SessionQuery) -> [u8; DIGEST_LEN] {
    let mut h = Sha256::new();
    // Length-prefixed fields, so that no two queries write the same bytes.
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_be_bytes());
        h.update(b);
    };
    field(&[u8::from(q.owner.is_some())]);
    field(q.owner.as_deref().unwrap_or_default().as_bytes());
    field(q.image_id.as_bytes());
    field(&(q.states.len() as u64).to_be_bytes());
    for s in &q.states {
        field(&s.to_be_bytes());
    }
    field(&(q.labels.len() as u64).to_be_bytes());
    for (k, v) in &q.labels {
        field(k.as_bytes());
        field(v.as_bytes());
    }
    let d = h.finalize();
    let mut out = [0u8; DIGEST_LEN];
    out.copy_from_slice(&d[..DIGEST_LEN]);
    out
}

/// The page token after `last`, for query `q`: hex of version, the query's
/// digest, `last`'s creation time and id.
fn encode_token(q: &SessionQuery, last: &SessionRow) -> String {
    let mut b = Vec::with_capacity(TOKEN_HEAD + last.id.len());
    b.push(TOKEN_VERSION);
    b.extend_from_slice(&query_digest(q));
    b.extend_from_slice(&last.created_at.to_be_bytes());
    b.extend_from_slice(last.id.as_bytes());
    hex::encode(b)
}

/// Where the page after `token` starts (`None` for the first page).
fn decode_token(q: &SessionQuery, token: &str) -> Result<Option<Cursor>> {
    if token.is_empty() {
        return Ok(None);
    }
    let not_ours = || {
        Error::invalid(
            "page_token is not a next_page_token of ListSessions; pass it as it came, or none \
             for the first page",
        )
    };
    if token.len() > 2 * (TOKEN_HEAD + MAX_TOKEN_ID) {
        return Err(not_ours());
    }
    let b = hex::decode(token).map_err(|_| not_ours())?;
    if b.len() <= TOKEN_HEAD || b[0] != TOKEN_VERSION {
        return Err(not_ours());
    }
    if b[1..1 + DIGEST_LEN] != query_digest(q) {
        return Err(Error::invalid(
            "page_token was returned for other filters (labels, states, image_id) or to another \
             client; pass the filters of the first page, or start again without page_token",
        ));
    }
    let mut at = [0u8; 8];
    at.copy_from_slice(&b[1 + DIGEST_LEN..TOKEN_HEAD]);
    let id = String::from_utf8(b[TOKEN_HEAD..].to_vec()).map_err(|_| not_ours())?;
    Ok(Some(Cursor {
        created_at: i64::from_be_bytes(at),
        id,
    }))
}

/// One page of ListSessions for `caller`; `to_pb` makes each row's message.
pub fn list_page(
    store: &Store,
    caller: &Caller,
    r: pb::ListSessionsRequest,
    to_pb: impl Fn(&SessionRow) -> pb::Session,
) -> Result<pb::ListSessionsResponse> {
    if !r.image_id.is_empty() {
        valid_id(&r.image_id)?;
    }
    if r.page_size > MAX_PAGE_SIZE {
        return Err(Error::invalid(format!(
            "page_size {} is out of range 0..={MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})",
            r.page_size
        )));
    }
    let q = SessionQuery {
        owner: caller.owner_filter().map(str::to_string),
        states: check_states(&r.states)?,
        image_id: r.image_id,
        labels: check_labels("labels", &r.labels)?,
    };
    let after = decode_token(&q, &r.page_token)?;
    let size = match r.page_size {
        0 => DEFAULT_PAGE_SIZE,
        n => n,
    };
    // One more than the page: whether another page follows.
    let rows = store.list_sessions(&q, after.as_ref(), size + 1)?;
    let mut more = rows.len() > size as usize;
    let mut sessions = Vec::new();
    let mut last = None;
    let mut bytes = 0usize;
    for row in rows.iter().take(size as usize) {
        let s = to_pb(row);
        // The message, its tag and its length.
        let len = s.encoded_len() + 1 + prost::length_delimiter_len(s.encoded_len());
        if !sessions.is_empty() && bytes + len > MAX_PAGE_BYTES {
            more = true;
            break;
        }
        bytes += len;
        sessions.push(s);
        last = Some(row);
    }
    let next_page_token = match (more, last) {
        (true, Some(row)) => encode_token(&q, row),
        _ => String::new(),
    };
    Ok(pb::ListSessionsResponse {
        sessions,
        next_page_token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(at: i64, id: &str) -> SessionRow {
        SessionRow {
            id: id.into(),
            created_at: at,
            ..Default::default()
        }
    }

    #[test]
    fn a_token_reads_back_for_its_query_only() {
        let q = SessionQuery {
            owner: Some("alice".into()),
            states: vec![4],
            ..Default::default()
        };
        let t = encode_token(&q, &row(-5, "s-1"));
        assert_eq!(
            decode_token(&q, &t).unwrap(),
            Some(Cursor {
                created_at: -5,
                id: "s-1".into()
            })
        );
        assert_eq!(decode_token(&q, "").unwrap(), None);
        let others = [
            SessionQuery {
                owner: Some("bob".into()),
                ..q.clone()
            },
            SessionQuery {
                owner: None,
                ..q.clone()
            },
            SessionQuery {
                states: vec![4, 5],
                ..q.clone()
            },
            SessionQuery {
                image_id: "i".into(),
                ..q.clone()
            },
            SessionQuery {
                labels: [("a".to_string(), String::new())].into(),
                ..q.clone()
            },
        ];
        for other in others {
            let e = decode_token(&other, &t).unwrap_err().to_string();
            assert!(
                e.contains("page_token") && e.contains("other filters"),
                "{e}"
            );
        }
    }

    #[test]
    fn malformed_tokens_are_refused_naming_page_token() {
        let q = SessionQuery::default();
        let good = encode_token(&q, &row(1, "s"));
        let mut wrong_version = good.clone();
        wrong_version.replace_range(0..2, "02");
        let head_only = good[..2 * TOKEN_HEAD].to_string();
        let not_utf8 = format!("{head_only}ff");
        for bad in [
            "x",
            "zz",
            "abc",
            &wrong_version,
            &head_only,
            &not_utf8,
            &"ab".repeat(200),
        ] {
            let e = decode_token(&q, bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
            assert!(e.to_string().contains("page_token"), "{bad}: {e}");
        }
    }

    #[test]
    fn states_and_labels_are_checked_naming_their_field() {
        assert_eq!(check_states(&[7, 4, 7]).unwrap(), [4, 7]);
        for (bad, says) in [
            (vec![0], "states[0]: SESSION_STATE_UNSPECIFIED"),
            (vec![4, 99], "states[1]: 99"),
            (vec![4; 17], "states: 17 entries"),
        ] {
            let e = check_states(&bad).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let l = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
        assert_eq!(check_labels("labels", &l("k", "")).unwrap().len(), 1);
        for (bad, says) in [
            (l("", "v"), "labels: key \"\""),
            (l(&"k".repeat(65), "v"), "keys are 1..=64"),
            (l("k", &"v".repeat(257)), "labels[\"k\"]: the value is 257"),
            (
                (0..17).map(|i| (i.to_string(), String::new())).collect(),
                "labels: 17 labels",
            ),
        ] {
            let e = check_labels("labels", &bad).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
