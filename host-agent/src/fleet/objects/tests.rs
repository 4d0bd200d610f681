//! Push and pull against the local-file backend, a real `nats-server` and a
//! local S3-compatible server (the last two skipped when not installed).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use super::cloud::CloudObjects;
use super::*;
use crate::error::Error;

const MIB: u64 = 1 << 20;

/// Deterministic, incompressible-looking bytes.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The three files of the round trip, under `dir`.
struct Image {
    files: Vec<PushFile>,
    /// name, mode
    modes: Vec<(&'static str, u32)>,
}

fn write_file(dir: &Path, name: &str, mode: u32, f: impl FnOnce(&std::fs::File)) -> PushFile {
    let path = dir.join(name.replace('/', "_"));
    let file = std::fs::File::create(&path).unwrap();
    f(&file);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    PushFile {
        name: name.to_string(),
        path,
    }
}

/// `kernel`: over 2 chunks with a tail; `empty`: 0 bytes; `golden/memory`:
/// 20 MiB, sparse, with data in two places.
fn make_image(dir: &Path, seed: u64) -> Image {
    let kernel = write_file(dir, "kernel", 0o644, |f| {
        (&*f)
            .write_all(&noise(2 * CHUNK_BYTES + 12_345, seed))
            .unwrap()
    });
    let empty = write_file(dir, "empty", 0o600, |_| {});
    let memory = write_file(dir, "golden/memory", 0o640, |f| {
        use std::os::unix::fs::FileExt;
        f.set_len(20 * MIB).unwrap();
        f.write_all_at(&noise(1000, seed + 1), 100).unwrap();
        f.write_all_at(&noise(5000, seed + 2), 9 * MIB).unwrap();
    });
    Image {
        files: vec![kernel, empty, memory],
        modes: vec![
            ("kernel", 0o644),
            ("empty", 0o600),
            ("golden/memory", 0o640),
        ],
    }
}

fn local_store(dir: &Path) -> CloudObjects {
    CloudObjects::from_url(&format!("file://{}", dir.display())).unwrap()
}

/// The chunk hashes of `file` in `key`'s manifest.
async fn chunks_of(store: &dyn ObjectStore, key: &str, file: &str) -> Vec<String> {
    let raw = store
        .get(&format!("manifests/{key}.json"))
        .await
        .unwrap()
        .unwrap();
    let m: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    m["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == file)
        .unwrap()["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_string())
        .collect()
}

fn assert_nothing_at(dest: &Path) {
    assert!(!dest.exists(), "{} exists", dest.display());
    let partial = PathBuf::from(format!("{}.partial", dest.display()));
    assert!(!partial.exists(), "{} exists", partial.display());
}

/// Push, pull, compare, push again; then a damaged chunk. Used against
/// every backend.
async fn round_trip(store: &dyn ObjectStore) {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let img = make_image(src.path(), 7);
    let meta = json!({"vcpus": 2, "cmdline": "console=ttyS0"});

    assert!(!pushed(store, "img-a").await.unwrap());
    let s = push(store, "img-a", meta.clone(), &img.files)
        .await
        .unwrap();
    assert!(pushed(store, "img-a").await.unwrap());
    assert_eq!(s.files, 3);
    assert_eq!(s.bytes, (2 * CHUNK_BYTES + 12_345) as u64 + 20 * MIB);
    assert_eq!(s.chunks, 3 + 5);
    // memory: chunk 0 and 2 hold data, 1, 3 and 4 are the same zero chunk.
    assert_eq!(s.chunks_uploaded, 3 + 3, "{s:?}");

    let dest = out.path().join("a");
    let pulled = pull(store, "img-a", &dest).await.unwrap();
    assert_eq!(pulled.meta, meta);
    assert_eq!(pulled.stats.files, 3);
    assert_eq!(pulled.stats.bytes, s.bytes);
    assert_eq!(pulled.stats.chunks, 8);
    assert_eq!(pulled.stats.chunks_fetched, 3 + 2, "{:?}", pulled.stats);
    for (f, (name, mode)) in img.files.iter().zip(&img.modes) {
        let got = dest.join(name);
        assert_eq!(
            std::fs::read(&got).unwrap(),
            std::fs::read(&f.path).unwrap(),
            "{name}"
        );
        let md = std::fs::metadata(&got).unwrap();
        assert_eq!(md.permissions().mode() & 0o7777, *mode, "{name}");
    }
    let md = std::fs::metadata(dest.join("golden/memory")).unwrap();
    assert_eq!(md.len(), 20 * MIB);
    assert!(
        md.blocks() * 512 <= 9 * MIB,
        "golden/memory takes {} blocks of 512 bytes for {} bytes: holes were written",
        md.blocks(),
        md.len()
    );
    assert!(!out.path().join("a.partial").exists());

    // Pulling onto an existing destination is refused.
    let again = pull(store, "img-a", &dest).await.unwrap_err();
    assert!(matches!(again, Error::AlreadyExists(_)), "{again}");

    // Same files again: nothing to upload.
    let s2 = push(store, "img-a", meta.clone(), &img.files)
        .await
        .unwrap();
    assert_eq!(s2.chunks_uploaded, 0, "{s2:?}");
    assert_eq!(s2.bytes_uploaded, 0);

    // Another image sharing the kernel: only its own file's chunks go up.
    let other = write_file(src.path(), "rootfs", 0o600, |f| {
        (&*f).write_all(&noise(CHUNK_BYTES + 1, 99)).unwrap()
    });
    let s3 = push(
        store,
        "img-b",
        json!(null),
        &[img.files[0].clone(), other.clone()],
    )
    .await
    .unwrap();
    assert_eq!(s3.chunks, 3 + 2);
    assert_eq!(s3.chunks_uploaded, 2, "{s3:?}");
    assert_eq!(s3.bytes_uploaded, CHUNK_BYTES as u64 + 1);
    let dest_b = out.path().join("b");
    pull(store, "img-b", &dest_b).await.unwrap();
    assert_eq!(
        std::fs::read(dest_b.join("rootfs")).unwrap(),
        std::fs::read(&other.path).unwrap()
    );

    // A chunk overwritten with other bytes.
    let chunks = chunks_of(store, "img-a", "golden/memory").await;
    store
        .put(
            &format!("chunks/{}", chunks[2]),
            Bytes::from(noise(CHUNK_BYTES, 5)),
        )
        .await
        .unwrap();
    let dest_c = out.path().join("c");
    let err = pull(store, "img-a", &dest_c).await.unwrap_err();
    let msg = err.to_string();
    eprintln!("damaged chunk: {msg}");
    assert!(matches!(err, Error::Corrupt(_)), "{msg}");
    assert!(msg.contains("golden/memory"), "{msg}");
    assert!(msg.contains("chunk 2"), "{msg}");
    assert!(msg.contains(&chunks[2]), "{msg}");
    assert_nothing_at(&dest_c);
}

#[tokio::test]
async fn local_round_trip_dedupe_and_damage() {
    let root = tempfile::tempdir().unwrap();
    let store = local_store(&root.path().join("store"));
    round_trip(&store).await;
}

#[tokio::test]
async fn local_missing_chunk_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let store_dir = root.path().join("store");
    let store = local_store(&store_dir);
    let img = make_image(root.path(), 3);
    push(&store, "k", json!({}), &img.files).await.unwrap();
    let chunks = chunks_of(&store, "k", "kernel").await;
    std::fs::remove_file(store_dir.join("chunks").join(&chunks[1])).unwrap();
    let dest = root.path().join("out");
    let err = pull(&store, "k", &dest).await.unwrap_err();
    let msg = err.to_string();
    eprintln!("missing chunk: {msg}");
    assert!(matches!(err, Error::Corrupt(_)), "{msg}");
    assert!(msg.contains("chunk 1 of kernel"), "{msg}");
    assert!(msg.contains("missing"), "{msg}");
    assert_nothing_at(&dest);
}

#[tokio::test]
async fn local_truncated_manifest_is_corrupt() {
    let root = tempfile::tempdir().unwrap();
    let store = local_store(&root.path().join("store"));
    let img = make_image(root.path(), 4);
    push(&store, "k", json!({}), &img.files).await.unwrap();
    let raw = store.get("manifests/k.json").await.unwrap().unwrap();
    store
        .put("manifests/k.json", raw.slice(..raw.len() / 2))
        .await
        .unwrap();
    let dest = root.path().join("out");
    let err = pull(&store, "k", &dest).await.unwrap_err();
    eprintln!("truncated manifest: {err}");
    assert!(matches!(err, Error::Corrupt(_)), "{err}");
    assert!(err.to_string().contains("manifests/k.json"), "{err}");
    assert_nothing_at(&dest);
}

#[tokio::test]
async fn local_hostile_manifests_are_refused_before_writing() {
    let root = tempfile::tempdir().unwrap();
    let store = local_store(&root.path().join("store"));
    let zero = "0".repeat(64);
    let cases = [
        ("../x", 0, vec![]),
        ("/etc/passwd", 0, vec![]),
        ("a/../../x", 0, vec![]),
        ("a//b", 0, vec![]),
        ("./a", 0, vec![]),
        ("ok", 10, vec![]),                          // size without chunks
        ("ok", 0, vec![zero.clone()]),               // chunk without size
        ("ok", 10, vec!["ABC".to_string()]),         // not a hash
        ("ok", 10, vec![zero.to_uppercase() + "x"]), // not a hash
    ];
    for (i, (name, size, chunks)) in cases.into_iter().enumerate() {
        let m = json!({
            "format": 1, "key": "evil", "meta": null, "chunk_bytes": CHUNK_BYTES,
            "files": [{"name": name, "size": size, "mode": 0o644, "chunks": chunks}],
        });
        store
            .put("manifests/evil.json", Bytes::from(m.to_string()))
            .await
            .unwrap();
        let dest = root.path().join(format!("out{i}"));
        let err = pull(&store, "evil", &dest).await.unwrap_err();
        eprintln!("hostile manifest: {err}");
        assert!(matches!(err, Error::Corrupt(_)), "{name}: {err}");
        assert_nothing_at(&dest);
    }
    assert!(!root.path().join("x").exists());

    // Other bad shapes: unknown field, wrong key, duplicate names, format 2,
    // chunk size out of range.
    let bad = [
        json!({"format": 1, "key": "evil", "meta": null, "chunk_bytes": CHUNK_BYTES, "files": [], "extra": 1}),
        json!({"format": 1, "key": "other", "meta": null, "chunk_bytes": CHUNK_BYTES, "files": []}),
        json!({"format": 2, "key": "evil", "meta": null, "chunk_bytes": CHUNK_BYTES, "files": []}),
        json!({"format": 1, "key": "evil", "meta": null, "chunk_bytes": 1024, "files": []}),
        json!({"format": 1, "key": "evil", "meta": null, "chunk_bytes": CHUNK_BYTES, "files": [
            {"name": "a", "size": 0, "mode": 0o644, "chunks": []},
            {"name": "a", "size": 0, "mode": 0o644, "chunks": []}]}),
        json!({"format": 1, "key": "evil", "meta": null, "chunk_bytes": CHUNK_BYTES, "files": [
            {"name": "a", "size": 0, "mode": 0o644, "chunks": []},
            {"name": "a/b", "size": 0, "mode": 0o644, "chunks": []}]}),
    ];
    for (i, m) in bad.iter().enumerate() {
        store
            .put("manifests/evil.json", Bytes::from(m.to_string()))
            .await
            .unwrap();
        let dest = root.path().join(format!("bad{i}"));
        let err = pull(&store, "evil", &dest).await.unwrap_err();
        assert!(matches!(err, Error::Corrupt(_)), "{m}: {err}");
        assert_nothing_at(&dest);
    }
}

#[tokio::test]
async fn local_missing_manifest_is_not_found() {
    let root = tempfile::tempdir().unwrap();
    let store_dir = root.path().join("store");
    let store = local_store(&store_dir);
    let img = make_image(root.path(), 5);
    push(&store, "k", json!({}), &img.files).await.unwrap();
    std::fs::remove_file(store_dir.join("manifests/k.json")).unwrap();
    assert!(!pushed(&store, "k").await.unwrap());
    let dest = root.path().join("out");
    let err = pull(&store, "k", &dest).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound { kind: "pushed image", id } if id == "k"),
        "{err}"
    );
    assert_nothing_at(&dest);
}

#[tokio::test]
async fn leftover_partial_is_replaced() {
    let root = tempfile::tempdir().unwrap();
    let store = local_store(&root.path().join("store"));
    let img = make_image(root.path(), 6);
    push(&store, "k", json!(1), &img.files).await.unwrap();
    let dest = root.path().join("out");
    std::fs::create_dir_all(root.path().join("out.partial/golden")).unwrap();
    std::fs::write(root.path().join("out.partial/kernel"), b"stale").unwrap();
    pull(&store, "k", &dest).await.unwrap();
    assert_eq!(
        std::fs::read(dest.join("kernel")).unwrap(),
        std::fs::read(&img.files[0].path).unwrap()
    );
    assert!(!root.path().join("out.partial").exists());
}

#[tokio::test]
async fn bad_names_and_urls_are_invalid() {
    let root = tempfile::tempdir().unwrap();
    let store = local_store(root.path());
    let f = PushFile {
        name: "../x".into(),
        path: root.path().join("nope"),
    };
    let err = push(&store, "k", json!(null), &[f]).await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = push(&store, "../k", json!(null), &[]).await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    for url in [
        "gs://b/p",
        "az://c/p",
        "ftp://x/y",
        "file://relative",
        "nourl",
    ] {
        let err = CloudObjects::from_url(url).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{url}: {err}");
    }
    let err = CloudObjects::from_url("gs://b").unwrap_err().to_string();
    assert!(err.contains("fs and aws"), "{err}");
}

#[tokio::test]
async fn jetstream_round_trip() {
    if !test_harness::nats::NatsServer::available() {
        return;
    }
    let server = test_harness::nats::NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let store = jetstream::JetStreamObjects::open(&js).await.unwrap();
    // Opening an existing bucket works too.
    jetstream::JetStreamObjects::open(&js).await.unwrap();
    assert!(store.describe().contains(jetstream::BUCKET));
    assert_eq!(store.get("chunks/none").await.unwrap(), None);
    assert!(!store.exists("chunks/none").await.unwrap());
    round_trip(&store).await;
}

/// moto's S3 server on a loopback port, killed when dropped.
struct Moto {
    child: std::process::Child,
    port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `moto_server` from `$AGENTVM_MOTO_SERVER` or `PATH`.
fn moto_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("AGENTVM_MOTO_SERVER") {
        let p = PathBuf::from(p);
        if p.exists() {
            return Some(p);
        }
    }
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("moto_server"))
            .find(|c| c.exists())
    })
}

fn start_moto(bin: &Path) -> Moto {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = test_harness::process::command(bin)
        .args(["-H", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let moto = Moto { child, port };
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let start = Instant::now();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "moto_server did not listen on {addr} within 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    moto
}

/// An unsigned `<method> <target>` to moto (which takes them), expecting
/// 200; returns the whole reply.
fn http(port: u16, method: &str, target: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200"),
        "{method} {target}: {reply}"
    );
    reply
}

/// Runs against moto (`pip install 'moto[server]'`), a local S3-compatible
/// server, started on a loopback port with an in-memory backend: the S3
/// client of the `object_store` crate with a key prefix, explicit endpoint
/// and credentials (options, not the process-wide environment). Skipped when
/// no `moto_server` is in `PATH` or at `$AGENTVM_MOTO_SERVER`.
#[tokio::test]
async fn s3_round_trip_against_moto() {
    let Some(bin) = moto_binary() else {
        eprintln!(
            "SKIP: no moto_server in PATH or at $AGENTVM_MOTO_SERVER (pip install 'moto[server]')"
        );
        return;
    };
    let moto = tokio::task::spawn_blocking(move || start_moto(&bin))
        .await
        .unwrap();
    let port = moto.port;
    tokio::task::spawn_blocking(move || http(port, "PUT", "/agentvm-test"))
        .await
        .unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let store = CloudObjects::from_url_with(
        "s3://agentvm-test/fleet/images",
        &[
            ("AWS_ENDPOINT", endpoint.as_str()),
            ("aws_allow_http", "true"),
            ("aws_access_key_id", "test"),
            ("aws_secret_access_key", "test"),
            ("aws_region", "us-east-1"),
        ],
    )
    .unwrap();
    assert_eq!(store.get("chunks/none").await.unwrap(), None);
    round_trip(&store).await;
    // The objects really are in moto's bucket, under the URL's prefix.
    let listing = tokio::task::spawn_blocking(move || {
        http(
            port,
            "GET",
            "/agentvm-test?list-type=2&prefix=fleet/images/manifests/",
        )
    })
    .await
    .unwrap();
    assert!(
        listing.contains("<Key>fleet/images/manifests/img-a.json</Key>"),
        "{listing}"
    );
    drop(moto);
}
