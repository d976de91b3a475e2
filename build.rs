fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Only the gRPC-speaking halves need generated code (and protoc).
    if std::env::var_os("CARGO_FEATURE_WORKER").is_some() {
        println!("cargo:rerun-if-changed=proto/tenure.proto");
        tonic_prost_build::configure().compile_protos(&["proto/tenure.proto"], &["proto"])?;
    }
    Ok(())
}
