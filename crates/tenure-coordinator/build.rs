fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The peer transport (proto/peer.proto): Raft between coordinator nodes, not the public API,
    // which the worker crate compiles.
    println!("cargo:rerun-if-changed=../../proto/peer.proto");
    tonic_prost_build::configure().compile_protos(&["../../proto/peer.proto"], &["../../proto"])?;
    Ok(())
}
