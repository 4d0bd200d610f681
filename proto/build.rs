//! Compiles `proto/*.proto` with protox (a pure-Rust protobuf compiler), so
//! building this crate never needs a system `protoc`.
//!
//! With the `grpc` feature, tonic service code is generated as well and the
//! encoded file descriptor set is written to `$OUT_DIR/descriptor.bin` for
//! gRPC reflection.

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
    #[cfg(feature = "grpc")]
    {
        use protox::prost::Message as _;
        let out = PathBuf::from(std::env::var("OUT_DIR")?);
        std::fs::write(out.join("descriptor.bin"), descriptors.encode_to_vec())?;
        tonic_prost_build::configure()
            .build_transport(false)
            .compile_fds(descriptors)?;
    }
    #[cfg(not(feature = "grpc"))]
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
