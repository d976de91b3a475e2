fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The public API (proto/tenure.proto, at the repository's top level beside the other
    // protocols): the client this library uses, and the service the coordinator implements.
    println!("cargo:rerun-if-changed=../../proto/tenure.proto");
    // The descriptors too: a coordinator serves them over gRPC reflection, so `grpcurl` can list
    // and call the API without the .proto files.
    let descriptors = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("tenure_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(descriptors)
        .compile_protos(&["../../proto/tenure.proto"], &["../../proto"])?;
    Ok(())
}
