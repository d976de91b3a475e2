//! The nemesis in the test suite: a short seeded run of the real cluster under every kind of
//! fault must keep every invariant, and a run whose store has the fencing check switched off
//! must be caught by the checker. `tenure nemesis` runs long ones.

mod common;

use std::time::Duration;
use tenure::nemesis::{self, FaultKind, NemesisConfig};

/// The seed comes from `TENURE_NEMESIS_SEED` when set, so a failing run can be replayed.
fn seed() -> u64 {
    std::env::var("TENURE_NEMESIS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261202)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_run_under_every_kind_of_fault_keeps_every_invariant() {
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let config = NemesisConfig::new(seed(), Duration::from_secs(30));
    let outcome = nemesis::run(&config, dir.path()).await.expect("the run completes");
    let h = &outcome.history;
    println!(
        "seed {}: faults {:?}; store accepted {}, refused {}; {} worker operations; recovered after {:?} ms",
        config.seed,
        outcome.faults,
        outcome.writes_accepted,
        outcome.writes_refused,
        h.workers.len(),
        h.recovered_after_ms
    );
    for f in &outcome.history.faults {
        println!("  {:>8.2}s {}", f.start_ns as f64 / 1e9, f.what);
    }
    println!("{}", outcome.report);
    assert!(outcome.report.passed(), "seed {} violated invariants:\n{}", config.seed, outcome.report);
    assert!(outcome.report.verdicts.iter().all(|v| v.skipped.is_none()), "{}", outcome.report);
    assert!(outcome.writes_accepted > 100, "the workload barely ran: {} writes", outcome.writes_accepted);
    assert_eq!(outcome.faults.len(), FaultKind::ALL.len(), "every kind of fault ran: {:?}", outcome.faults);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_without_the_fencing_check_is_caught() {
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut config = NemesisConfig::new(seed(), Duration::from_secs(2));
    config.faults = vec![FaultKind::FreezeWorker];
    config.fencing = false;
    let outcome = nemesis::run(&config, dir.path()).await.expect("the run completes");
    println!("{}", outcome.report);
    assert_eq!(
        outcome.report.failed(),
        vec!["the store never accepts a lower token after a higher one"],
        "{}",
        outcome.report
    );
}
