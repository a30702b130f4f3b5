//! Generates the gRPC code with the `protoc` vendored in a crate, so a fresh
//! machine builds without installing protobuf.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let ours = "../../proto/inferscale.proto";
    println!("cargo:rerun-if-changed={ours}");
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure().compile_with_config(config, &[ours], &["../../proto"])?;
    Ok(())
}
