//! The layer tree under random creates, forks, persists, snapshots and
//! deletes: after every step nothing that is needed is gone and nothing
//! unneeded is left, on disk and in the records.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use super::*;
use crate::store::{ImageRow, Store};

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A snapshot directory as a vmm leaves it, in `run`.
fn vmm_writes(run: &Path, name: &str) -> std::path::PathBuf {
    let dir = run.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("manifest"),
        br#"{"kind":"diff","parent":"/golden"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("state"), b"state").unwrap();
    std::fs::write(dir.join("memory"), vec![7u8; 4096]).unwrap();
    dir
}

fn golden_dir(images: &Path, image: &str, n: u32) -> String {
    let dir = images.join(image).join(format!("golden-{n}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("manifest"), br#"{"kind":"full","parent":null}"#).unwrap();
    std::fs::write(dir.join("memory"), vec![1u8; 4096]).unwrap();
    std::fs::write(dir.join("state"), b"s").unwrap();
    dir.display().to_string()
}

/// A diff of `kind` over session `s`'s base, written as `name`, which
/// becomes its base (as the session code does).
fn diff_over_base(
    layers: &Layers,
    run: &Path,
    name: &str,
    layer_kind: &str,
    m: &Model,
    s: &str,
) -> LayerRow {
    let base = layers.get(&m.base[s]).unwrap();
    let holder = session_holder(s);
    let written = vmm_writes(run, name);
    layers
        .adopt(
            &written,
            NewLayer {
                kind: layer_kind,
                parent: Some(&base),
                owner_session: s,
                holders: &[&holder],
                release: &[(&holder, &base.id)],
            },
        )
        .unwrap()
}

/// A `pause` layer of session `s` over `parent`, written as `name`.
fn pause_of_s(layers: &Layers, run: &Path, name: &str, parent: &LayerRow) -> LayerRow {
    let written = vmm_writes(run, name);
    layers
        .adopt(
            &written,
            NewLayer {
                kind: kind::PAUSE,
                parent: Some(parent),
                owner_session: "s",
                holders: &["session:s"],
                release: &[],
            },
        )
        .unwrap()
}

/// The model: what each session and image needs.
#[derive(Default)]
struct Model {
    /// Session -> its base layer.
    base: BTreeMap<String, String>,
    /// Session -> its SnapshotSession layers.
    snaps: BTreeMap<String, BTreeSet<String>>,
    /// Image -> its golden layer.
    golden: BTreeMap<String, String>,
}

/// Every layer some holder needs, with their ancestors.
fn needed(layers: &Layers, m: &Model) -> BTreeSet<String> {
    let mut roots: Vec<String> = m.base.values().cloned().collect();
    roots.extend(m.snaps.values().flatten().cloned());
    roots.extend(m.golden.values().cloned());
    let mut out = BTreeSet::new();
    for r in roots {
        for l in layers.chain(&r).expect("a needed layer's chain is whole") {
            out.insert(l.id);
        }
    }
    out
}

fn check(layers: &Layers, m: &Model, step: usize) {
    let want = needed(layers, m);
    let have: BTreeSet<String> = layers
        .store
        .layers()
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(
        have, want,
        "step {step}: recorded layers are exactly the needed ones"
    );
    let mut on_disk: BTreeSet<String> = std::fs::read_dir(layers.root())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    for l in layers.store.layers().unwrap() {
        assert!(
            Path::new(&l.dir).join("manifest").is_file(),
            "step {step}: layer {} ({}) has its files",
            l.id,
            l.kind
        );
        on_disk.remove(&l.id);
    }
    assert!(
        on_disk.is_empty(),
        "step {step}: nothing unneeded on disk: {on_disk:?}"
    );
}

fn run(seed: u64) {
    let t = tempfile::tempdir().unwrap();
    let state = t.path();
    let store = Arc::new(Store::open(&state.join("db")).unwrap());
    let layers = Layers::open(state, store.clone()).unwrap();
    let images_dir = state.join("images");
    let run_dir = state.join("run");
    let mut rng = Rng(seed);
    let mut m = Model::default();
    let mut golden_n = 0;
    let mut session_n = 0;
    for step in 0..200 {
        let sessions: Vec<String> = m.base.keys().cloned().collect();
        match rng.below(8) {
            // Build (or rebuild) an image's golden snapshot.
            0 => {
                let image = format!("img{}", rng.below(2));
                golden_n += 1;
                let row = ImageRow {
                    id: image.clone(),
                    golden_dir: golden_dir(&images_dir, &image, golden_n),
                    golden_built_at: golden_n as i64,
                    ..Default::default()
                };
                let new = layers.golden(&row).unwrap().unwrap();
                if let Some(old) = m.golden.insert(image.clone(), new.id) {
                    layers.release(Some(&old), &image_holder(&image)).unwrap();
                }
            }
            // A session from an image's golden snapshot.
            1 if !m.golden.is_empty() => {
                let images: Vec<&String> = m.golden.keys().collect();
                let image = images[rng.below(images.len())].clone();
                let g = m.golden[&image].clone();
                session_n += 1;
                let s = format!("s{session_n}");
                layers.hold(&g, &session_holder(&s)).unwrap();
                m.base.insert(s, g);
            }
            // Persist (a diff over the base becomes the base).
            2 | 3 if !sessions.is_empty() => {
                let s = sessions[rng.below(sessions.len())].clone();
                let new =
                    diff_over_base(&layers, &run_dir, &format!("p{step}"), kind::PAUSE, &m, &s);
                m.base.insert(s, new.id);
            }
            // Fork into 1..=3 sessions.
            4 if !sessions.is_empty() => {
                let s = sessions[rng.below(sessions.len())].clone();
                let fork =
                    diff_over_base(&layers, &run_dir, &format!("f{step}"), kind::FORK, &m, &s);
                m.base.insert(s, fork.id.clone());
                for _ in 0..=rng.below(3) {
                    session_n += 1;
                    let child = format!("s{session_n}");
                    layers.hold(&fork.id, &session_holder(&child)).unwrap();
                    m.base.insert(child, fork.id.clone());
                }
            }
            // A SnapshotSession snapshot (full), which becomes the base too.
            5 if !sessions.is_empty() => {
                let s = sessions[rng.below(sessions.len())].clone();
                let holder = session_holder(&s);
                let snaps = snapshots_holder(&s);
                let old = m.base[&s].clone();
                let written = vmm_writes(&run_dir, &format!("n{step}"));
                let snap = layers
                    .adopt(
                        &written,
                        NewLayer {
                            kind: kind::SNAPSHOT,
                            parent: None,
                            owner_session: &s,
                            holders: &[&holder, &snaps],
                            release: &[(&holder, &old)],
                        },
                    )
                    .unwrap();
                layers.collect(false).unwrap();
                m.base.insert(s.clone(), snap.id.clone());
                m.snaps.entry(s).or_default().insert(snap.id);
            }
            // Delete a session.
            6 if !sessions.is_empty() => {
                let s = sessions[rng.below(sessions.len())].clone();
                layers.release(None, &session_holder(&s)).unwrap();
                layers.release(None, &snapshots_holder(&s)).unwrap();
                m.base.remove(&s);
                m.snaps.remove(&s);
            }
            // Delete an image.
            7 if !m.golden.is_empty() => {
                let images: Vec<String> = m.golden.keys().cloned().collect();
                let image = images[rng.below(images.len())].clone();
                layers.release(None, &image_holder(&image)).unwrap();
                m.golden.remove(&image);
            }
            _ => {}
        }
        check(&layers, &m, step);
        // A dry run agrees that nothing is left to collect.
        assert!(layers.collect(true).unwrap().is_empty(), "step {step}");
    }
    // Everything let go: nothing stays.
    for s in m.base.keys().cloned().collect::<Vec<_>>() {
        layers.release(None, &session_holder(&s)).unwrap();
        layers.release(None, &snapshots_holder(&s)).unwrap();
    }
    for image in m.golden.keys() {
        layers.release(None, &image_holder(image)).unwrap();
    }
    assert!(store.layers().unwrap().is_empty());
    assert_eq!(std::fs::read_dir(layers.root()).unwrap().count(), 0);
    assert!(
        !images_dir.exists() || std::fs::read_dir(&images_dir).unwrap().count() == 0,
        "golden snapshots (and their emptied image directories) went with their layers"
    );
}

#[test]
fn two_hundred_random_steps_keep_exactly_the_needed_layers() {
    for seed in [0x9E37_79B9_7F4A_7C15, 42, 7_777_777] {
        run(seed);
    }
}

#[test]
fn a_dry_run_lists_what_would_go_and_deletes_nothing() {
    let t = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&t.path().join("db")).unwrap());
    let layers = Layers::open(t.path(), store.clone()).unwrap();
    let image = ImageRow {
        id: "i".into(),
        golden_dir: golden_dir(&t.path().join("images"), "i", 1),
        ..Default::default()
    };
    let g = layers.golden(&image).unwrap().unwrap();
    let d = pause_of_s(&layers, &t.path().join("run"), "x", &g);
    store.release_layer(None, "session:s").unwrap();
    store.release_layer(None, "image:i").unwrap();
    let would: Vec<String> = layers
        .collect(true)
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(would, [d.id.clone(), g.id.clone()], "child before parent");
    assert_eq!(
        store.layers().unwrap().len(),
        2,
        "a dry run deletes nothing"
    );
    let gone: Vec<String> = layers
        .collect(false)
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(gone, would);
    assert!(!Path::new(&image.golden_dir).exists());
    // A collected layer cannot be held again: the hold is refused, and no
    // hold is left on a layer that is not there.
    let e = layers.hold(&d.id, "session:late").unwrap_err().to_string();
    assert!(e.contains(&d.id) && e.contains("gone"), "{e}");
    assert!(store.layer_holds().unwrap().is_empty());
}

#[test]
fn at_start_a_directory_no_layer_names_is_removed_and_a_lost_layer_is_named() {
    let t = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&t.path().join("db")).unwrap());
    let layers = Layers::open(t.path(), store.clone()).unwrap();
    let image = ImageRow {
        id: "i".into(),
        golden_dir: golden_dir(&t.path().join("images"), "i", 1),
        ..Default::default()
    };
    // A crash between the move into the store and the record.
    vmm_writes(layers.root(), "crashed-before-record");
    layers.check_at_start(std::slice::from_ref(&image)).unwrap();
    let g = store.layer_by_dir(&image.golden_dir).unwrap().unwrap();
    assert_eq!(store.held_by("image:i").unwrap(), vec![g.id.clone()]);
    let names: Vec<String> = std::fs::read_dir(layers.root())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names,
        vec![g.id.clone()],
        "only the golden snapshot's link stays"
    );
    // A layer whose files went: its chain says which.
    let d = pause_of_s(&layers, &t.path().join("run"), "y", &g);
    std::fs::remove_dir_all(&image.golden_dir).unwrap();
    let err = layers.chain(&d.id).unwrap_err().to_string();
    assert!(err.contains(&g.id) && err.contains("missing"), "{err}");
}

#[test]
fn a_chain_moved_from_another_node_is_taken_in_under_its_ids_over_the_golden_id_given() {
    let t = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&t.path().join("db")).unwrap());
    let layers = Layers::open(t.path(), store.clone()).unwrap();
    let image = ImageRow {
        id: "i".into(),
        golden_dir: golden_dir(&t.path().join("images"), "i", 1),
        ..Default::default()
    };
    // The pulled image's golden snapshot keeps the pushing node's layer id.
    assert!(layers.golden_as(&image, "../x").is_err());
    assert!(layers.golden_as(&image, "p1").is_err(), "not a golden id");
    let g = layers.golden_as(&image, "g-from-a").unwrap().unwrap();
    assert_eq!(g.id, "g-from-a");
    assert_eq!(layers.golden(&image).unwrap().unwrap().id, "g-from-a");
    assert!(layers.root().join("g-from-a").is_symlink());

    let pulled = t.path().join("pulled");
    let p1 = vmm_writes(&pulled, "p1");
    let p2 = vmm_writes(&pulled, "p2");
    let moved = |parent0: &'static str| {
        vec![
            MovedLayer {
                id: "p1",
                kind: kind::PAUSE,
                parent: parent0,
                owner_session: "s",
                created_at: 1,
                files: &p1,
            },
            MovedLayer {
                id: "p2",
                kind: kind::PAUSE,
                parent: "p1",
                owner_session: "s",
                created_at: 2,
                files: &p2,
            },
        ]
    };
    // A base this node lacks: nothing is recorded, the files stay put.
    let e = layers.take_in(&moved("g-other"), "session:s").unwrap_err();
    assert!(e.to_string().contains("g-other"), "{e}");
    assert!(store.layer("p1").unwrap().is_none() && p1.is_dir());

    let rows = layers.take_in(&moved("g-from-a"), "session:s").unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(store.held_by("session:s").unwrap(), vec!["p2".to_string()]);
    let chain: Vec<String> = layers
        .chain("p2")
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(chain, ["g-from-a", "p1", "p2"]);
    // Each manifest names its parent layer by id, as the vmm resolves it.
    for (id, parent) in [("p1", "g-from-a"), ("p2", "p1")] {
        let m: serde_json::Value = serde_json::from_slice(
            &std::fs::read(layers.root().join(id).join("manifest")).unwrap(),
        )
        .unwrap();
        assert_eq!(m["parent"], parent);
    }
    // Nothing is collected while the session holds the top.
    layers.collect(false).unwrap();
    assert_eq!(store.layers().unwrap().len(), 3);
    layers.release(None, "session:s").unwrap();
    assert_eq!(
        store.layers().unwrap().len(),
        1,
        "the golden snapshot stays"
    );
}
