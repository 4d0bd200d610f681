use super::*;

fn chain(dir: &tempfile::TempDir, max_bytes: u64) -> AuditChain {
    let store = Arc::new(Store::open(&dir.path().join("db")).unwrap());
    AuditChain::load(AuditSink { store, max_bytes }, "s").unwrap()
}

fn event(seq: u64, json: &str) -> AuditEvent {
    AuditEvent {
        seq,
        json: json.to_string(),
    }
}

#[test]
fn audit_events_must_come_in_sequence() {
    for (bad, due) in [(0, 3), (2, 3), (1, 3), (4, 3), (u64::MAX, 3)] {
        let dir = tempfile::tempdir().unwrap();
        let mut c = chain(&dir, 1 << 20);
        assert_eq!(c.accept("s", event(1, "{}")), None);
        assert_eq!(c.accept("s", event(2, "{}")), None);
        let v = c.accept("s", event(bad, "{}")).expect("refused");
        assert_eq!(v.reason, "audit_out_of_order");
        assert!(
            v.detail
                .contains(&format!("seq {bad} where seq {due} was due")),
            "{v:?}"
        );
        // Later events are not stored either, and stop nothing more.
        assert_eq!(c.accept("s", event(3, "{}")), None);
        let stored = c.sink.store.audit_since("s", 0).unwrap();
        assert_eq!(
            stored.iter().map(|a| a.guest_seq).collect::<Vec<_>>(),
            [1, 2]
        );
    }
}

#[test]
fn audit_over_the_volume_is_refused_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = chain(&dir, 10);
    assert_eq!(c.accept("s", event(1, "12345")), None);
    let v = c.accept("s", event(2, "123456")).expect("over the volume");
    assert_eq!(v.reason, "audit_limit");
    assert_eq!(c.accept("s", event(3, "1")), None);
    let stored = c.sink.store.audit_since("s", 0).unwrap();
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[0].json, "12345");
    assert!(
        stored[1].json.contains("audit.limit_exceeded"),
        "{stored:?}"
    );
    // The chain holds across a reconnect: the volume counts what is stored.
    let again = AuditChain::load(c.sink.clone(), "s").unwrap();
    assert_eq!(again.last_seq, 2);
    assert!(again.stored_bytes > 10);
}
