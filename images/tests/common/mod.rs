//! The images integration tests' own helpers: the shared download cache and
//! running the `images` binary. The workspace root, the root check and
//! running a command come from the shared harness (`tests/harness`) and are
//! re-exported here.
// Each test file uses a part of this module.
#![allow(dead_code, unused_imports)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub use test_harness::bin::workspace_root as workspace;
pub use test_harness::host::is_root;
pub use test_harness::process::sh;

/// The cache shared by the tests (and by `images` run by hand from the
/// workspace root): downloads, the unpacked kernel tree and the Debian base
/// are fetched once per machine, not once per test.
pub fn shared_cache() -> PathBuf {
    std::env::var_os("IMAGES_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/images"))
}

/// Runs the `images` binary with `args`, echoing its stderr, and returns
/// the output and how long it took.
pub fn images(args: &[&str]) -> (Output, Duration) {
    images_env(args, &[])
}

/// [`images`] with extra environment variables for the command.
pub fn images_env(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_images"))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(workspace())
        .output()
        .expect("run images");
    let took = start.elapsed();
    eprintln!(
        "--- images {} ({:.1}s, {}) ---\n{}",
        args.join(" "),
        took.as_secs_f64(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    (out, took)
}

/// The inode, size and modification time of a file: equal before and after
/// a command only if nothing replaced or wrote it. The tests check a cache
/// hit with this, never with a time limit (speed is perf's business).
pub fn file_identity(path: &std::path::Path) -> (u64, u64, std::time::SystemTime) {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).unwrap();
    (meta.ino(), meta.len(), meta.modified().unwrap())
}

/// The output directory `images` printed on stdout.
pub fn printed_dir(out: &Output) -> PathBuf {
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}
