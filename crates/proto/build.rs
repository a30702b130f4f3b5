//! Generates the gRPC code with the `protoc` vendored in a crate, so a fresh
//! machine builds without installing protobuf.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let ours = "../../proto/inferscale.proto";
    let etcd = "../../proto/etcd.proto";
    println!("cargo:rerun-if-changed={ours}");
    println!("cargo:rerun-if-changed={etcd}");
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure().compile_with_config(config, &[ours], &["../../proto"])?;
    // etcd is a server we talk to, never one we implement.
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure().build_server(false).compile_with_config(config, &[etcd], &["../../proto"])?;
    Ok(())
}
