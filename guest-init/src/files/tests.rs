//! The operations on a temporary workspace (as the current user).

use super::ops;
use super::path::Workspace;
use super::watch::{stop_pipe, Watcher};
use super::write::Writer;
use proto::guest::{file_change::Kind as Change, file_error::Code, file_write::Mode};

fn ws() -> (tempfile::TempDir, Workspace) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ws")).unwrap();
    let w = Workspace::open(&dir.path().join("ws")).unwrap();
    (dir, w)
}

#[test]
fn a_failed_or_dropped_write_leaves_no_file_and_create_never_replaces() {
    let (dir, w) = ws();
    let root = dir.path().join("ws");
    let rel = w.check("path", b"f").unwrap();
    let mut wr = Writer::open(&w, &rel, Mode::Truncate, 0).unwrap();
    wr.write(b"half").unwrap();
    assert!(!root.join("f").exists(), "nothing at the path until done");
    drop(wr);
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0, "temp removed");

    let mut wr = Writer::open(&w, &rel, Mode::Create, 0o600).unwrap();
    wr.write(b"one").unwrap();
    // Something else creates the path meanwhile: CREATE does not replace it.
    std::fs::write(root.join("f"), b"other").unwrap();
    assert_eq!(wr.finish(&w).unwrap_err().code, Code::AlreadyExists);
    assert_eq!(std::fs::read(root.join("f")).unwrap(), b"other");
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 1, "temp removed");

    let mut wr = Writer::open(&w, &rel, Mode::Truncate, 0o600).unwrap();
    wr.write(b"two").unwrap();
    let (n, info) = wr.finish(&w).unwrap();
    assert_eq!((n, info.size, info.permissions), (3, 3, 0o600));
    let mut wr = Writer::open(&w, &rel, Mode::Append, 0).unwrap();
    wr.write(b"+").unwrap();
    wr.finish(&w).unwrap();
    assert_eq!(std::fs::read(root.join("f")).unwrap(), b"two+");
    let bad = Writer::open(&w, &rel, Mode::Truncate, 0o4755)
        .err()
        .unwrap();
    assert_eq!(
        (bad.code, bad.field),
        (Code::InvalidArgument, "permissions")
    );
}

#[test]
fn list_remove_rename_and_mkdir() {
    let (dir, w) = ws();
    let root = dir.path().join("ws");
    let p = |s: &[u8]| w.check("path", s).unwrap();
    ops::make_dir(&w, &p(b"a/b/c"), true, 0o755).unwrap();
    assert_eq!(
        ops::make_dir(&w, &p(b"a"), false, 0o755).unwrap_err().code,
        Code::AlreadyExists
    );
    ops::make_dir(&w, &p(b"a"), true, 0o755).unwrap();
    std::fs::write(root.join("a/b/f"), b"x").unwrap();
    std::os::unix::fs::symlink("/", root.join("a/root-link")).unwrap();
    let (one, cut) = ops::list(&w, &p(b"a"), 1).unwrap();
    let names: Vec<_> = one.iter().map(|i| i.path.as_str()).collect();
    assert_eq!((names, cut), (vec!["a/b", "a/root-link"], false));
    let (all, _) = ops::list(&w, &p(b"."), 10).unwrap();
    let names: Vec<_> = all.iter().map(|i| i.path.as_str()).collect();
    assert_eq!(
        names,
        vec!["a", "a/b", "a/b/c", "a/b/f", "a/root-link"],
        "links are not entered"
    );
    assert_eq!(ops::list(&w, &p(b"."), 65).unwrap_err().field, "depth");
    ops::rename(&w, &p(b"a/b/f"), &p(b"g"), false).unwrap();
    assert_eq!(
        ops::remove(&w, &p(b"a"), false).unwrap_err().field,
        "recursive"
    );
    assert_eq!(ops::remove(&w, &p(b"a"), true).unwrap(), 4);
    assert_eq!(
        ops::remove(&w, &p(b"."), true).unwrap_err().code,
        Code::FailedPrecondition
    );
    assert!(root.join("g").exists() && !root.join("a").exists());
}

#[test]
fn a_watch_reports_changes_below_it_and_stops_when_told() {
    let (dir, w) = ws();
    let root = dir.path().join("ws");
    let watcher = Watcher::new(&w, &w.check("path", b".").unwrap(), true).unwrap();
    let (stop_rd, stop_wr) = stop_pipe().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || watcher.run(&stop_rd, |c| tx.send(c).is_ok()));
    let next = || rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    std::fs::create_dir(root.join("d")).unwrap();
    let c = next();
    assert_eq!(
        (c.kind, c.path.as_str(), c.is_dir),
        (Change::Created as i32, "d", true)
    );
    std::fs::write(root.join("d/f"), b"x").unwrap();
    let c = next();
    assert_eq!((c.kind, c.path.as_str()), (Change::Created as i32, "d/f"));
    assert_eq!(next().kind, Change::Modified as i32);
    std::fs::rename(root.join("d/f"), root.join("g")).unwrap();
    let c = next();
    assert_eq!(
        (c.kind, c.path.as_str(), c.to.as_str()),
        (Change::Renamed as i32, "d/f", "g")
    );
    drop(stop_wr);
    t.join().unwrap();
}
