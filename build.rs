fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Only the gRPC-speaking halves need generated code (and protoc): the worker library the
    // public API, the coordinator also the peer transport, the test kit the harness's store.
    println!("cargo:rerun-if-changed=proto");
    let mut protos = Vec::new();
    if std::env::var_os("CARGO_FEATURE_WORKER").is_some() {
        protos.push("proto/tenure.proto");
    }
    if std::env::var_os("CARGO_FEATURE_COORDINATOR").is_some() {
        protos.push("proto/peer.proto");
    }
    if std::env::var_os("CARGO_FEATURE_HARNESS").is_some() {
        protos.push("proto/harness.proto");
    }
    if !protos.is_empty() {
        tonic_prost_build::configure().compile_protos(&protos, &["proto"])?;
    }
    Ok(())
}
