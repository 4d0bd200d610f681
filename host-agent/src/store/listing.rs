//! Filtered reads: ListSessions' pages of sessions and Watch's events, each
//! filtered in SQL (owner, states, image, labels) so that a page or a batch
//! is counted over the matching rows only.

use std::collections::BTreeMap;

use rusqlite::params;

use super::{labels_json, session_from_row, SessionRow, Store, SESSION_COLS};
use crate::error::Result;

/// Which sessions a listing returns; every filter set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionQuery {
    /// Only this owner's sessions (`None`: everyone's).
    pub owner: Option<String>,
    /// Only sessions in one of these states (empty: every state).
    pub states: Vec<i32>,
    /// Only this image's sessions (empty: every image).
    pub image_id: String,
    /// Only sessions with each of these labels, value for value.
    pub labels: BTreeMap<String, String>,
}

/// Where a page of sessions starts: after the session created at
/// `created_at` with id `id` (sessions are ordered by both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Creation time (Unix ms) of the last session seen.
    pub created_at: i64,
    /// Its id.
    pub id: String,
}

/// Which events a watcher gets; every filter set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// Only this session's events.
    pub session: Option<String>,
    /// Only events of this owner's sessions.
    pub owner: Option<String>,
    /// Only events of sessions with each of these labels, value for value.
    pub labels: BTreeMap<String, String>,
    /// Only events of these kinds (empty: every kind).
    pub kinds: Vec<String>,
}

/// SQL true when every entry of the JSON object `?6` (the filter) is one of
/// the session row's labels. A row whose labels do not parse has none.
const SESSION_HAS_LABELS: &str = "NOT EXISTS (SELECT 1 FROM json_each(?6) AS f \
     WHERE NOT EXISTS (SELECT 1 FROM json_each(CASE WHEN json_valid(sessions.labels) \
     THEN sessions.labels ELSE '{}' END) AS l WHERE l.key = f.key AND l.value = f.value))";

/// SQL true when every entry of the JSON object `?5` (the filter) is one of
/// the labels recorded for the event's session.
pub(super) const EVENT_HAS_LABELS: &str = "NOT EXISTS (SELECT 1 FROM json_each(?5) AS f \
     WHERE NOT EXISTS (SELECT 1 FROM session_labels AS s, json_each(s.labels) AS l \
     WHERE s.session_id = events.session_id AND l.key = f.key AND l.value = f.value))";

impl Store {
    /// Up to `limit` sessions matching `q`, ordered by creation time then
    /// id, starting after `after` (from the first without).
    pub fn list_sessions(
        &self,
        q: &SessionQuery,
        after: Option<&Cursor>,
        limit: u32,
    ) -> Result<Vec<SessionRow>> {
        let states: Vec<String> = q.states.iter().map(i32::to_string).collect();
        let states = format!("[{}]", states.join(","));
        let labels = labels_json(&q.labels);
        let (after_at, after_id) = after.map_or((i64::MIN, ""), |c| (c.created_at, &c.id));
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {SESSION_COLS} FROM sessions \
                 WHERE (?1 IS NULL OR owner = ?1) AND (?2 = '' OR image_id = ?2) \
                 AND (json_array_length(?3) = 0 OR state IN (SELECT value FROM json_each(?3))) \
                 AND (created_at, id) > (?4, ?5) AND {SESSION_HAS_LABELS} \
                 ORDER BY created_at, id LIMIT ?7"
            ))?;
            let rows = st.query_map(
                params![q.owner, q.image_id, states, after_at, after_id, labels, limit],
                session_from_row,
            )?;
            rows.collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EventRow;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Writes session `id` with its first event, as a create does.
    fn session(store: &Store, id: &str, at: i64, state: i32, owner: &str, l: &[(&str, &str)]) {
        let row = SessionRow {
            id: id.into(),
            image_id: if id.starts_with('b') {
                "img-b"
            } else {
                "img-a"
            }
            .into(),
            state,
            created_at: at,
            owner: owner.into(),
            labels: labels(l),
            ..Default::default()
        };
        let ev = EventRow {
            seq: 0,
            session_id: id.into(),
            execution_id: String::new(),
            at,
            from: 0,
            to: state,
            reason: "created".into(),
            detail: String::new(),
            kind: crate::store::EVENT_SESSION.into(),
            ..Default::default()
        };
        store.transition(&row, &ev).unwrap();
    }

    fn ids(rows: &[SessionRow]) -> Vec<&str> {
        rows.iter().map(|r| r.id.as_str()).collect()
    }

    fn fixture() -> (tempfile::TempDir, Store) {
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(&t.path().join("db")).unwrap();
        session(&store, "a1", 10, 4, "alice", &[("team", "x"), ("tier", "")]);
        session(&store, "a2", 20, 5, "alice", &[("team", "y")]);
        // Same creation time as a2: ordered by id.
        session(
            &store,
            "b1",
            20,
            4,
            "bob",
            &[("team", "x"), ("odd\"key.$", "v")],
        );
        session(&store, "b2", 30, 7, "bob", &[]);
        (t, store)
    }

    #[test]
    fn filters_combine_and_labels_match_value_for_value() {
        let (_t, store) = fixture();
        let list = |q: SessionQuery| ids(&store.list_sessions(&q, None, 100).unwrap()).join(",");
        assert_eq!(list(SessionQuery::default()), "a1,a2,b1,b2");
        let team_x = SessionQuery {
            labels: labels(&[("team", "x")]),
            ..Default::default()
        };
        assert_eq!(list(team_x.clone()), "a1,b1");
        assert_eq!(
            list(SessionQuery {
                owner: Some("bob".into()),
                ..team_x.clone()
            }),
            "b1"
        );
        assert_eq!(
            list(SessionQuery {
                states: vec![5, 7],
                ..Default::default()
            }),
            "a2,b2"
        );
        assert_eq!(
            list(SessionQuery {
                image_id: "img-b".into(),
                states: vec![4],
                ..team_x
            }),
            "b1"
        );
        // Every label must match; an empty value matches only an empty value.
        assert_eq!(
            list(SessionQuery {
                labels: labels(&[("team", "x"), ("tier", "")]),
                ..Default::default()
            }),
            "a1"
        );
        assert_eq!(
            list(SessionQuery {
                labels: labels(&[("team", "")]),
                ..Default::default()
            }),
            ""
        );
        // Keys are compared as they are, not as JSON paths.
        assert_eq!(
            list(SessionQuery {
                labels: labels(&[("odd\"key.$", "v")]),
                ..Default::default()
            }),
            "b1"
        );
    }

    #[test]
    fn pages_follow_the_cursor_over_matching_rows_only() {
        let (_t, store) = fixture();
        let q = SessionQuery {
            labels: labels(&[("team", "x")]),
            ..Default::default()
        };
        let first = store.list_sessions(&q, None, 1).unwrap();
        assert_eq!(ids(&first), ["a1"]);
        let cursor = Cursor {
            created_at: first[0].created_at,
            id: first[0].id.clone(),
        };
        // A session created after the first page comes on a later one.
        session(&store, "a3", 40, 4, "alice", &[("team", "x")]);
        let rest = store.list_sessions(&q, Some(&cursor), 10).unwrap();
        assert_eq!(ids(&rest), ["b1", "a3"]);
        // Same time, smaller id: before the cursor; larger: after it.
        let at20 = Cursor {
            created_at: 20,
            id: "a2".into(),
        };
        let all = store
            .list_sessions(&SessionQuery::default(), Some(&at20), 10)
            .unwrap();
        assert_eq!(ids(&all), ["b1", "b2", "a3"]);
    }

    #[test]
    fn labels_of_sessions_from_before_the_labels_table_are_kept_at_open() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("db");
        {
            let store = Store::open(&path).unwrap();
            session(&store, "a1", 10, 4, "alice", &[("team", "x")]);
            session(&store, "a2", 20, 4, "alice", &[]);
            store
                .with(|c| c.execute_batch("DROP TABLE session_labels"))
                .unwrap();
        }
        let store = Store::open(&path).unwrap();
        let filter = EventFilter {
            labels: labels(&[("team", "x")]),
            ..Default::default()
        };
        let seen = store.events_since(0, &filter, 10).unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].session_id, "a1");
    }

    #[test]
    fn events_filtered_by_label_stay_so_after_the_session_row_goes() {
        let (_t, store) = fixture();
        let filter = EventFilter {
            labels: labels(&[("team", "x")]),
            ..Default::default()
        };
        let seen = |f: &EventFilter| -> Vec<String> {
            store
                .events_since(0, f, 100)
                .unwrap()
                .into_iter()
                .map(|e| e.session_id)
                .collect()
        };
        assert_eq!(seen(&filter), ["a1", "b1"]);
        store.delete_session("b1").unwrap();
        assert_eq!(seen(&filter), ["a1", "b1"]);
        let bobs = EventFilter {
            owner: Some("bob".into()),
            ..filter.clone()
        };
        assert_eq!(seen(&bobs), ["b1"]);
        let one = EventFilter {
            session: Some("a1".into()),
            labels: labels(&[("team", "y")]),
            ..Default::default()
        };
        assert!(seen(&one).is_empty());
        assert_eq!(seen(&EventFilter::default()).len(), 4);
    }
}
