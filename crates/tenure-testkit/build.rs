fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The harness's fenced store (proto/harness.proto), served to a run's worker processes.
    println!("cargo:rerun-if-changed=../../proto/harness.proto");
    tonic_prost_build::configure().compile_protos(&["../../proto/harness.proto"], &["../../proto"])?;
    Ok(())
}
