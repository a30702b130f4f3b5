//! Generates the gRPC code with the `protoc` vendored in a crate, so a fresh
//! machine builds without installing protobuf.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../proto/inferscale.proto";
    println!("cargo:rerun-if-changed={proto}");
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure().compile_with_config(config, &[proto], &["../../proto"])?;
    Ok(())
}
