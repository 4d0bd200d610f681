//! Helpers shared by the images integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

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

/// The output directory `images` printed on stdout.
pub fn printed_dir(out: &Output) -> PathBuf {
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// True when running as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs a command and returns (success, stdout + stderr).
pub fn sh(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}
