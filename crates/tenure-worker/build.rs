fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The public API (proto/tenure.proto, at the repository's top level beside the other
    // protocols): the client this library uses, and the service the coordinator implements.
    println!("cargo:rerun-if-changed=../../proto/tenure.proto");
    tonic_prost_build::configure().compile_protos(&["../../proto/tenure.proto"], &["../../proto"])?;
    Ok(())
}
