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

/// A guest end whose Hello is `hello` (None: it never answers), kept open
/// in `kept` for the test's length.
async fn guest_end(
    hello: Option<Out>,
    kept: &Arc<Mutex<Vec<UnixStream>>>,
    wait: Duration,
) -> Result<GuestConn> {
    let (host, mut guest) = UnixStream::pair().unwrap();
    if let Some(kind) = hello {
        let frame = encode_frame(&GuestMessage { kind: Some(kind) }, DEFAULT_MAX_FRAME).unwrap();
        guest.write_all(&frame).await.unwrap();
    }
    kept.lock().unwrap().push(guest);
    GuestConn::open(host, "s", None, wait).await
}

fn good_hello() -> Out {
    Out::Hello(proto::guest::Hello {
        protocol_version: proto::guest::PROTOCOL_VERSION,
        software: "fake".into(),
    })
}

#[tokio::test]
async fn a_connection_whose_hello_never_comes_is_given_up_for_a_new_one() {
    // A real guest's fork: its first connection was reset on the guest's
    // side, which tells the host nothing, and host-agent waited for a Hello
    // until the fork failed.
    let kept = Arc::new(Mutex::new(Vec::new()));
    let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let waits = Arc::new(Mutex::new(Vec::new()));
    let conn = open_retrying(
        Duration::from_secs(20),
        Duration::from_millis(200),
        |_, wait| {
            let n = tries.fetch_add(1, Ordering::SeqCst);
            waits.lock().unwrap().push(wait);
            let kept = kept.clone();
            async move {
                let hello = (n >= 2).then(good_hello);
                guest_end(hello, &kept, wait).await
            }
        },
    )
    .await
    .expect("the third connection answers");
    assert!(!conn.is_closed());
    assert_eq!(tries.load(Ordering::SeqCst), 3);
    assert!(
        waits
            .lock()
            .unwrap()
            .iter()
            .all(|w| *w == Duration::from_millis(200)),
        "each connection waits one attempt's time"
    );
}

#[tokio::test]
async fn a_guest_that_never_says_hello_fails_at_the_timeout_and_a_bad_hello_at_once() {
    let kept = Arc::new(Mutex::new(Vec::new()));
    let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = std::time::Instant::now();
    let r = open_retrying(
        Duration::from_millis(700),
        Duration::from_millis(200),
        |left, wait| {
            tries.fetch_add(1, Ordering::SeqCst);
            assert!(wait <= left && left <= Duration::from_millis(700));
            let kept = kept.clone();
            async move { guest_end(None, &kept, wait).await }
        },
    )
    .await;
    assert!(matches!(r, Err(Error::Timeout(_))), "{:?}", r.err());
    assert!(tries.load(Ordering::SeqCst) >= 2);
    assert!(started.elapsed() >= Duration::from_millis(700));
    // A guest of another protocol is not asked again.
    let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = open_retrying(
        Duration::from_secs(20),
        Duration::from_millis(200),
        |_, wait| {
            tries.fetch_add(1, Ordering::SeqCst);
            let kept = kept.clone();
            async move {
                let wrong = Out::Hello(proto::guest::Hello {
                    protocol_version: proto::guest::PROTOCOL_VERSION + 1,
                    software: "other".into(),
                });
                guest_end(Some(wrong), &kept, wait).await
            }
        },
    )
    .await;
    assert!(matches!(r, Err(Error::Guest(_))), "{:?}", r.err());
    assert_eq!(tries.load(Ordering::SeqCst), 1);
}
