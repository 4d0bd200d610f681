use super::*;
use std::collections::BTreeMap;

#[test]
fn a_database_from_before_the_initrd_column_opens_and_keeps_its_images() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("db");
    {
        let c = Connection::open(&path).unwrap();
        c.execute_batch(
            "CREATE TABLE images(id TEXT PRIMARY KEY, kernel TEXT NOT NULL, \
             rootfs TEXT NOT NULL, cmdline TEXT NOT NULL, mem_mib INTEGER NOT NULL, \
             vcpus INTEGER NOT NULL, guest_init INTEGER NOT NULL, golden_dir TEXT NOT NULL, \
             created_at INTEGER NOT NULL, golden_built_at INTEGER NOT NULL);
             INSERT INTO images VALUES ('old','/k','','c',64,1,0,'/g',1,2);",
        )
        .unwrap();
    }
    let store = Store::open(&path).unwrap();
    let old = store.image("old").unwrap().unwrap();
    assert_eq!((old.kernel.as_str(), old.initrd.as_str()), ("/k", ""));
    let new = ImageRow {
        id: "new".into(),
        kernel: "/k".into(),
        initrd: "/i".into(),
        ..Default::default()
    };
    store.insert_image(&new).unwrap();
    assert_eq!(store.image("new").unwrap().unwrap(), new);
    // Opening again changes nothing.
    drop(store);
    let store = Store::open(&path).unwrap();
    assert_eq!(store.images().unwrap().len(), 2);
}

/// The sessions, events and usage tables as host-agent wrote them
/// before sessions had owners.
const SCHEMA_BEFORE_OWNERS: &str = r#"
CREATE TABLE sessions(
  id TEXT PRIMARY KEY, image_id TEXT NOT NULL, state INTEGER NOT NULL, execution_id TEXT NOT NULL,
  reason TEXT NOT NULL, detail TEXT NOT NULL, created_at INTEGER NOT NULL, ready_at INTEGER NOT NULL,
  ended_at INTEGER NOT NULL, vmm_pid INTEGER NOT NULL, vmm_start_ticks INTEGER NOT NULL,
  dir TEXT NOT NULL, ttl_s INTEGER NOT NULL, idle_s INTEGER NOT NULL, labels TEXT NOT NULL,
  branch TEXT NOT NULL, head_commit TEXT NOT NULL, last_activity INTEGER NOT NULL,
  repository TEXT NOT NULL, agent TEXT NOT NULL, base_ref TEXT NOT NULL);
CREATE TABLE events(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, execution_id TEXT NOT NULL,
  at INTEGER NOT NULL, from_state INTEGER NOT NULL, to_state INTEGER NOT NULL,
  reason TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE usage(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, execution_id TEXT NOT NULL,
  interval_start INTEGER NOT NULL, interval_end INTEGER NOT NULL, billed_ms INTEGER NOT NULL,
  vcpu_ns INTEGER NOT NULL, mem_alloc REAL NOT NULL, mem_res REAL NOT NULL, disk INTEGER NOT NULL,
  final INTEGER NOT NULL, raw_cpu_ns INTEGER NOT NULL, raw_disk INTEGER NOT NULL);
INSERT INTO sessions VALUES ('old','img',4,'e1','','',1,2,0,0,0,'/d',0,0,'{}','','',3,'','','');
INSERT INTO events(session_id, execution_id, at, from_state, to_state, reason, detail)
  VALUES ('old','e1',1,1,4,'created','');
INSERT INTO usage(session_id, execution_id, interval_start, interval_end, billed_ms, vcpu_ns,
  mem_alloc, mem_res, disk, final, raw_cpu_ns, raw_disk) VALUES ('old','e1',1,2,3,4,0,0,0,0,0,0);
"#;

/// The events of `owner`'s sessions.
fn owned_by(owner: &str) -> EventFilter {
    EventFilter {
        owner: Some(owner.into()),
        ..Default::default()
    }
}

#[test]
fn a_database_from_before_owners_opens_with_its_rows_owned_by_legacy() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("db");
    Connection::open(&path)
        .unwrap()
        .execute_batch(SCHEMA_BEFORE_OWNERS)
        .unwrap();
    let store = Store::open(&path).unwrap();
    let old = store.session("old").unwrap().unwrap();
    assert_eq!(
        (old.owner.as_str(), old.execution_id.as_str()),
        ("legacy", "e1")
    );
    // Owner filters: legacy rows are legacy's (admins pass no filter).
    assert_eq!(
        store
            .events_since(0, &EventFilter::default(), 10)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        store
            .events_since(0, &owned_by("legacy"), 10)
            .unwrap()
            .len(),
        1
    );
    assert!(store
        .events_since(0, &owned_by("alice"), 10)
        .unwrap()
        .is_empty());
    assert_eq!(store.usage_since(None, None, 0, 0, 10).unwrap().len(), 1);
    assert!(store
        .usage_since(None, Some("alice"), 0, 0, 10)
        .unwrap()
        .is_empty());

    // New rows carry their owner, into events and usage too.
    let new = SessionRow {
        id: "new".into(),
        execution_id: "e2".into(),
        labels: BTreeMap::new(),
        owner: "alice".into(),
        ..Default::default()
    };
    let ev = EventRow {
        seq: 0,
        session_id: "new".into(),
        execution_id: "e2".into(),
        at: 5,
        from: 0,
        to: 1,
        reason: "created".into(),
        detail: String::new(),
        kind: crate::store::EVENT_SESSION.into(),
        ..Default::default()
    };
    store.transition(&new, &ev).unwrap();
    store
        .insert_usage(&UsageRow {
            session_id: "new".into(),
            interval_end: 9,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(store.session("new").unwrap().unwrap().owner, "alice");
    let hers = store.events_since(0, &owned_by("alice"), 10).unwrap();
    assert_eq!(hers.len(), 1);
    assert_eq!(hers[0].session_id, "new");
    let hers = store.usage_since(None, Some("alice"), 0, 0, 10).unwrap();
    assert_eq!(hers.len(), 1);
    assert_eq!(hers[0].session_id, "new");
    // Opening again changes nothing.
    drop(store);
    let store = Store::open(&path).unwrap();
    assert_eq!(store.sessions().unwrap().len(), 2);
    assert_eq!(store.session("old").unwrap().unwrap().owner, "legacy");
}

#[test]
fn a_sessions_jail_uid_is_kept_and_old_databases_gain_the_column() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("db");
    {
        let c = Connection::open(&path).unwrap();
        c.execute_batch(
            "CREATE TABLE sessions(
              id TEXT PRIMARY KEY, image_id TEXT NOT NULL, state INTEGER NOT NULL,
              execution_id TEXT NOT NULL, reason TEXT NOT NULL, detail TEXT NOT NULL,
              created_at INTEGER NOT NULL, ready_at INTEGER NOT NULL,
              ended_at INTEGER NOT NULL, vmm_pid INTEGER NOT NULL,
              vmm_start_ticks INTEGER NOT NULL, dir TEXT NOT NULL, ttl_s INTEGER NOT NULL,
              idle_s INTEGER NOT NULL, labels TEXT NOT NULL, branch TEXT NOT NULL,
              head_commit TEXT NOT NULL, last_activity INTEGER NOT NULL,
              repository TEXT NOT NULL, agent TEXT NOT NULL, base_ref TEXT NOT NULL);
             INSERT INTO sessions VALUES ('old','i',5,'e','','',1,0,0,0,0,'/d',0,0,'{}',
              '','',0,'','','');",
        )
        .unwrap();
    }
    let store = Store::open(&path).unwrap();
    assert_eq!(store.session("old").unwrap().unwrap().jail_uid, 0);
    assert_eq!(store.session("old").unwrap().unwrap().vm_addresses, "");
    assert_eq!(store.session("old").unwrap().unwrap().resources, "");
    let row = SessionRow {
        id: "new".into(),
        jail_uid: 2_000_000_007,
        vm_addresses: "10.200.0.2,fd00:200::2".into(),
        resources: r#"{"vcpus":1}"#.into(),
        ..Default::default()
    };
    store.put_session(&row).unwrap();
    drop(store);
    let store = Store::open(&path).unwrap();
    let new = store.session("new").unwrap().unwrap();
    assert_eq!(new.jail_uid, 2_000_000_007);
    assert_eq!(new.vm_addresses, "10.200.0.2,fd00:200::2");
    assert_eq!(new.resources, r#"{"vcpus":1}"#);
}

#[test]
fn shares_are_kept_and_old_databases_gain_their_columns() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("db");
    {
        // The images and sessions tables as host-agent wrote them just
        // before shares.
        let c = Connection::open(&path).unwrap();
        let before = SCHEMA
            .replace(
                ", shares TEXT NOT NULL DEFAULT '',\n  fs_daemons TEXT NOT NULL DEFAULT ''",
                "",
            )
            .replace(", shares TEXT NOT NULL DEFAULT ''", "");
        c.execute_batch(&before).unwrap();
        assert!(!has_column_for_test(&c, "sessions", "fs_daemons"));
        c.execute_batch(
            "INSERT INTO images(id, kernel, rootfs, cmdline, mem_mib, vcpus, guest_init, \
             golden_dir, created_at, golden_built_at) VALUES ('old','/k','','',64,1,1,'',1,0);",
        )
        .unwrap();
    }
    let store = Store::open(&path).unwrap();
    assert_eq!(store.image("old").unwrap().unwrap().shares, "");
    let shares =
        r#"[{"tag":"cargo","host_path":"/srv/cargo","read_only":true,"mount_path":"/mnt/cargo"}]"#;
    let img = ImageRow {
        id: "new".into(),
        kernel: "/k".into(),
        shares: shares.into(),
        ..Default::default()
    };
    store.insert_image(&img).unwrap();
    let row = SessionRow {
        id: "s".into(),
        shares: shares.into(),
        fs_daemons: "42:1000".into(),
        ..Default::default()
    };
    store.put_session(&row).unwrap();
    drop(store);
    let store = Store::open(&path).unwrap();
    assert_eq!(store.image("new").unwrap().unwrap(), img);
    let back = store.session("s").unwrap().unwrap();
    assert_eq!(
        (back.shares.as_str(), back.fs_daemons.as_str()),
        (shares, "42:1000")
    );
}

/// Whether `table` has `column` (the migration's own check, for the test).
fn has_column_for_test(c: &Connection, table: &str, column: &str) -> bool {
    c.prepare(&format!("SELECT {column} FROM {table}")).is_ok()
}

#[test]
fn the_last_audit_record_is_the_highest_seq_of_its_session() {
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(&t.path().join("db")).unwrap();
    assert!(store.last_audit("s1").unwrap().is_none());
    for (session, seq) in [("s1", 2), ("s1", 7), ("s1", 5), ("s2", 9)] {
        store
            .insert_audit(&AuditRow {
                session_id: session.into(),
                guest_seq: seq,
                json: format!("{{\"seq\":{seq}}}"),
                host_hash: format!("h{seq}"),
                received_at: 0,
            })
            .unwrap();
    }
    let last = store.last_audit("s1").unwrap().unwrap();
    assert_eq!((last.guest_seq, last.host_hash.as_str()), (7, "h7"));
    assert_eq!(store.audit_since("s1", 0).unwrap().len(), 3);
    // Pages: at least one record each, `more` until the last.
    let (page, more) = store.audit_page("s1", 0, 1).unwrap();
    assert_eq!((page.len(), more), (1, true));
    let (page, more) = store.audit_page("s1", page[0].guest_seq, 1 << 20).unwrap();
    assert_eq!((page.len(), more), (2, false));
    let (page, more) = store.audit_page("s1", 99, 1 << 20).unwrap();
    assert!(page.is_empty() && !more);
}
