//! Compiles `proto/*.proto` with protox (a pure-Rust protobuf compiler), so
//! building this crate never needs a system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from("proto");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "proto") {
            println!("cargo:rerun-if-changed={}", path.display());
            files.push(path);
        }
    }
    files.sort();
    println!("cargo:rerun-if-changed={}", dir.display());
    let descriptors = protox::compile(&files, [&dir])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
