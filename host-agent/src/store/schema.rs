//! The database's tables, and the migration of a database an older
//! host-agent wrote.

use rusqlite::Connection;

/// Every table, created where missing.
pub(super) const SCHEMA: &str = r#"
PRAGMA journal_mode=WAL;
CREATE TABLE IF NOT EXISTS images(
  id TEXT PRIMARY KEY, kernel TEXT NOT NULL, rootfs TEXT NOT NULL, cmdline TEXT NOT NULL,
  mem_mib INTEGER NOT NULL, vcpus INTEGER NOT NULL, guest_init INTEGER NOT NULL,
  golden_dir TEXT NOT NULL, created_at INTEGER NOT NULL, golden_built_at INTEGER NOT NULL,
  initrd TEXT NOT NULL DEFAULT '', io_limits TEXT NOT NULL DEFAULT '',
  source_session TEXT NOT NULL DEFAULT '', shares TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS sessions(
  id TEXT PRIMARY KEY, image_id TEXT NOT NULL, state INTEGER NOT NULL, execution_id TEXT NOT NULL,
  reason TEXT NOT NULL, detail TEXT NOT NULL, created_at INTEGER NOT NULL, ready_at INTEGER NOT NULL,
  ended_at INTEGER NOT NULL, vmm_pid INTEGER NOT NULL, vmm_start_ticks INTEGER NOT NULL,
  dir TEXT NOT NULL, ttl_s INTEGER NOT NULL, idle_s INTEGER NOT NULL, labels TEXT NOT NULL,
  branch TEXT NOT NULL, head_commit TEXT NOT NULL, last_activity INTEGER NOT NULL,
  repository TEXT NOT NULL, agent TEXT NOT NULL, base_ref TEXT NOT NULL,
  owner TEXT NOT NULL DEFAULT 'legacy', jail_uid INTEGER NOT NULL DEFAULT 0,
  io_limits TEXT NOT NULL DEFAULT '', vm_addresses TEXT NOT NULL DEFAULT '',
  resources TEXT NOT NULL DEFAULT '', base_layer TEXT NOT NULL DEFAULT '',
  persisted INTEGER NOT NULL DEFAULT 0, auto_resume INTEGER NOT NULL DEFAULT 0,
  parent_session TEXT NOT NULL DEFAULT '', shares TEXT NOT NULL DEFAULT '',
  fs_daemons TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS events(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, execution_id TEXT NOT NULL,
  at INTEGER NOT NULL, from_state INTEGER NOT NULL, to_state INTEGER NOT NULL,
  reason TEXT NOT NULL, detail TEXT NOT NULL, owner TEXT NOT NULL DEFAULT 'legacy',
  kind TEXT NOT NULL DEFAULT 'session', schedule_id TEXT NOT NULL DEFAULT '',
  run_id INTEGER NOT NULL DEFAULT 0, trigger_id TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS usage(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, execution_id TEXT NOT NULL,
  interval_start INTEGER NOT NULL, interval_end INTEGER NOT NULL, billed_ms INTEGER NOT NULL,
  vcpu_ns INTEGER NOT NULL, mem_alloc REAL NOT NULL, mem_res REAL NOT NULL, disk INTEGER NOT NULL,
  final INTEGER NOT NULL, raw_cpu_ns INTEGER NOT NULL, raw_disk INTEGER NOT NULL,
  owner TEXT NOT NULL DEFAULT 'legacy',
  net_rx_bytes INTEGER NOT NULL DEFAULT 0, net_rx_packets INTEGER NOT NULL DEFAULT 0,
  net_tx_bytes INTEGER NOT NULL DEFAULT 0, net_tx_packets INTEGER NOT NULL DEFAULT 0,
  net_denied INTEGER NOT NULL DEFAULT 0, dns_denied INTEGER NOT NULL DEFAULT 0,
  snapshot_gib_ms REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS usage_session ON usage(session_id, seq);
CREATE TABLE IF NOT EXISTS audit(
  session_id TEXT NOT NULL, guest_seq INTEGER NOT NULL, json TEXT NOT NULL,
  host_hash TEXT NOT NULL, received_at INTEGER NOT NULL, PRIMARY KEY(session_id, guest_seq));
CREATE INDEX IF NOT EXISTS sessions_created ON sessions(created_at, id);
-- Each labelled session's labels, kept after DeleteSession (as its events
-- are) for Watch's label filter.
CREATE TABLE IF NOT EXISTS session_labels(session_id TEXT PRIMARY KEY, labels TEXT NOT NULL);
-- Snapshot layers (golden snapshots and diffs over them) and who holds
-- each ("image:<id>", "session:<id>", "snapshots:<id>"); a layer is also
-- held by its children (parent).
CREATE TABLE IF NOT EXISTS layers(
  id TEXT PRIMARY KEY, parent TEXT NOT NULL, kind TEXT NOT NULL, dir TEXT NOT NULL,
  bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, owner_session TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS layers_parent ON layers(parent);
CREATE TABLE IF NOT EXISTS layer_holds(
  layer TEXT NOT NULL, holder TEXT NOT NULL, PRIMARY KEY(layer, holder));
CREATE INDEX IF NOT EXISTS layer_holds_holder ON layer_holds(holder);
-- Schedules: the session template as an encoded CreateSessionRequest,
-- the command as a JSON array of strings.
-- fired_through: every fire time up to it (unix ms) is recorded in
-- schedule_runs, or was before the schedule was created or last changed.
CREATE TABLE IF NOT EXISTS schedules(
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, cron TEXT NOT NULL, timezone TEXT NOT NULL,
  template BLOB NOT NULL, run TEXT NOT NULL, overlap INTEGER NOT NULL, catch_up INTEGER NOT NULL,
  enabled INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
  owner_scope TEXT NOT NULL DEFAULT 'sessions', fired_through INTEGER NOT NULL DEFAULT 0);
-- Runs of schedules and triggers; `key` makes a fire time (or delivery)
-- one run. `body` holds a trigger's request body until the run ends.
CREATE TABLE IF NOT EXISTS schedule_runs(
  id INTEGER PRIMARY KEY AUTOINCREMENT, schedule_id TEXT NOT NULL, trigger_id TEXT NOT NULL,
  owner TEXT NOT NULL, fire_at INTEGER NOT NULL, cause TEXT NOT NULL, key TEXT NOT NULL UNIQUE,
  state INTEGER NOT NULL, session_id TEXT NOT NULL, exit_kind INTEGER NOT NULL,
  exit_value INTEGER NOT NULL, exit_reason TEXT NOT NULL, reason TEXT NOT NULL,
  detail TEXT NOT NULL, branch TEXT NOT NULL, head_commit TEXT NOT NULL,
  recorded_at INTEGER NOT NULL, started_at INTEGER NOT NULL, ended_at INTEGER NOT NULL,
  billed_ms INTEGER NOT NULL, attempts INTEGER NOT NULL, fires INTEGER NOT NULL,
  output_tail BLOB NOT NULL, delivery_id TEXT NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS schedule_runs_schedule ON schedule_runs(schedule_id, id);
CREATE INDEX IF NOT EXISTS schedule_runs_trigger ON schedule_runs(trigger_id, id);
CREATE INDEX IF NOT EXISTS schedule_runs_state ON schedule_runs(state);
-- Webhook triggers (the secret is the HMAC key) and every delivery to one.
CREATE TABLE IF NOT EXISTS triggers(
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, owner_scope TEXT NOT NULL, kind INTEGER NOT NULL,
  schedule_id TEXT NOT NULL, template BLOB NOT NULL, run TEXT NOT NULL, session_id TEXT NOT NULL,
  enabled INTEGER NOT NULL, secret TEXT NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS trigger_deliveries(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, trigger_id TEXT NOT NULL, delivery_id TEXT NOT NULL,
  received_at INTEGER NOT NULL, http_status INTEGER NOT NULL, outcome TEXT NOT NULL,
  detail TEXT NOT NULL, run_id INTEGER NOT NULL, remote TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS trigger_deliveries_trigger ON trigger_deliveries(trigger_id, seq);
-- The fleet export's outbox (store/outbox.rs): a row per record committed
-- while outbox_on holds its row, written by the triggers below in the
-- record's own transaction; deleted once JetStream acknowledged it.
CREATE TABLE IF NOT EXISTS outbox(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, ref_seq INTEGER NOT NULL,
  ref_session TEXT NOT NULL DEFAULT '',
  at INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)));
CREATE TABLE IF NOT EXISTS outbox_on(id INTEGER PRIMARY KEY CHECK (id = 1));
CREATE TRIGGER IF NOT EXISTS outbox_events AFTER INSERT ON events
  WHEN EXISTS (SELECT 1 FROM outbox_on) BEGIN
  INSERT INTO outbox(kind, ref_seq) VALUES ('events', NEW.seq);
  INSERT INTO outbox(kind, ref_seq) SELECT 'asks', NEW.seq
    WHERE NEW.reason IN ('ask', 'ask_answered', 'ask_unanswered');
END;
CREATE TRIGGER IF NOT EXISTS outbox_usage AFTER INSERT ON usage
  WHEN EXISTS (SELECT 1 FROM outbox_on) BEGIN
  INSERT INTO outbox(kind, ref_seq) VALUES ('usage', NEW.seq);
END;
CREATE TRIGGER IF NOT EXISTS outbox_audit AFTER INSERT ON audit
  WHEN EXISTS (SELECT 1 FROM outbox_on) BEGIN
  INSERT INTO outbox(kind, ref_seq, ref_session) VALUES ('audit', NEW.guest_seq, NEW.session_id);
END;
CREATE TABLE IF NOT EXISTS idempotency(
  key TEXT PRIMARY KEY, method TEXT NOT NULL, fingerprint TEXT NOT NULL,
  response BLOB NOT NULL, at INTEGER NOT NULL);
"#;

/// The usage table's network counters, in [`crate::accounting::NetIo`]'s order.
pub(super) const NET_USAGE_COLUMNS: [&str; 6] = [
    "net_rx_bytes",
    "net_rx_packets",
    "net_tx_bytes",
    "net_tx_packets",
    "net_denied",
    "dns_denied",
];

/// Whether `table` has `column`.
fn has_column(conn: &Connection, table: &str, column: &str) -> rusqlite::Result<bool> {
    let mut st = conn.prepare("SELECT name FROM pragma_table_info(?1)")?;
    let columns: Vec<String> = st
        .query_map([table], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(columns.iter().any(|c| c == column))
}

/// Brings a database written by an older host-agent up to [`SCHEMA`]:
/// columns added since are added with their defaults. Sessions, events and
/// usage from before owners were recorded belong to
/// [`LEGACY_OWNER`](crate::store::LEGACY_OWNER): only admin clients see them.
pub(super) fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    if !has_column(conn, "images", "initrd")? {
        conn.execute_batch("ALTER TABLE images ADD COLUMN initrd TEXT NOT NULL DEFAULT '';")?;
    }
    for table in ["sessions", "events", "usage"] {
        if !has_column(conn, table, "owner")? {
            // The table name is one of the constants above.
            conn.execute_batch(&format!(
                "ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT '{}';",
                crate::store::LEGACY_OWNER
            ))?;
        }
    }
    if !has_column(conn, "sessions", "jail_uid")? {
        conn.execute_batch("ALTER TABLE sessions ADD COLUMN jail_uid INTEGER NOT NULL DEFAULT 0;")?;
    }
    for column in NET_USAGE_COLUMNS {
        if !has_column(conn, "usage", column)? {
            // The column name is one of the constants below.
            conn.execute_batch(&format!(
                "ALTER TABLE usage ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0;"
            ))?;
        }
    }
    for table in ["images", "sessions"] {
        if !has_column(conn, table, "io_limits")? {
            // The table name is one of the constants above.
            conn.execute_batch(&format!(
                "ALTER TABLE {table} ADD COLUMN io_limits TEXT NOT NULL DEFAULT '';"
            ))?;
        }
    }
    if !has_column(conn, "sessions", "vm_addresses")? {
        conn.execute_batch(
            "ALTER TABLE sessions ADD COLUMN vm_addresses TEXT NOT NULL DEFAULT '';",
        )?;
    }
    if !has_column(conn, "sessions", "resources")? {
        conn.execute_batch("ALTER TABLE sessions ADD COLUMN resources TEXT NOT NULL DEFAULT '';")?;
    }
    // Snapshot layers: what a session's memory descends from, whether it
    // is paused to disk, and where sessions and images came from.
    for (table, column, ty) in [
        ("sessions", "base_layer", "TEXT NOT NULL DEFAULT ''"),
        ("sessions", "persisted", "INTEGER NOT NULL DEFAULT 0"),
        ("sessions", "auto_resume", "INTEGER NOT NULL DEFAULT 0"),
        ("sessions", "parent_session", "TEXT NOT NULL DEFAULT ''"),
        ("images", "source_session", "TEXT NOT NULL DEFAULT ''"),
        ("usage", "snapshot_gib_ms", "REAL NOT NULL DEFAULT 0"),
        // Events of schedules beside sessions' lifecycle.
        ("events", "kind", "TEXT NOT NULL DEFAULT 'session'"),
        ("events", "schedule_id", "TEXT NOT NULL DEFAULT ''"),
        ("events", "run_id", "INTEGER NOT NULL DEFAULT 0"),
        ("events", "trigger_id", "TEXT NOT NULL DEFAULT ''"),
        // virtio-fs shares of images and sessions, and the daemons serving
        // a session's VM.
        ("images", "shares", "TEXT NOT NULL DEFAULT ''"),
        ("sessions", "shares", "TEXT NOT NULL DEFAULT ''"),
        ("sessions", "fs_daemons", "TEXT NOT NULL DEFAULT ''"),
    ] {
        if !has_column(conn, table, column)? {
            // Names and types are the constants just above.
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {ty};"))?;
        }
    }
    // Sessions' labels outlive their rows, for watchers filtering events by
    // label (written with a session's first event since; a session deleted
    // before this table existed has no labels to match).
    conn.execute_batch(
        "INSERT OR IGNORE INTO session_labels SELECT id, labels FROM sessions \
         WHERE json_valid(labels) AND labels <> '{}';",
    )?;
    Ok(())
}
