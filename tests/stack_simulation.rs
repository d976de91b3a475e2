//! The whole stack (openraft, tonic, RocksDB, the worker library) under turmoil: seeded faults,
//! a checked history, and the same history again from the same seed.

use tenure::stack_simulation::{run, SimConfig};

fn data_dir() -> tempfile::TempDir {
    // RocksDB syncs every write; on tmpfs that costs nothing, and the simulation waits for it.
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(dir) = tempfile::tempdir_in(shm) {
            return dir;
        }
    }
    tempfile::tempdir().expect("temp dir")
}

#[test]
fn one_seed() {
    let seed: u64 = std::env::var("TENURE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let dir = data_dir();
    let started = std::time::Instant::now();
    let outcome = run(&SimConfig::new(seed), dir.path()).expect("the run completes");
    println!(
        "seed {seed}: {:?} simulated in {:?}; {} faults: {:?}; {} writes accepted, {} refused; recovered after {:?} ms; fingerprint {:x}",
        outcome.simulated,
        started.elapsed(),
        outcome.faults.len(),
        outcome.faults,
        outcome.writes_accepted,
        outcome.writes_refused,
        outcome.history.recovered_after_ms,
        outcome.fingerprint()
    );
    println!("{}", outcome.report);
    assert!(outcome.report.passed(), "seed {seed} failed:\n{}", outcome.report);
}
