//! The whole stack (openraft, tonic, RocksDB, the worker library) under turmoil's simulated
//! network and clock: many seeds through the checker, the same history from the same seed, a
//! store without fencing caught, and the regression the sweep found.
//!
//! Seeds run as `tenure simulate-stack` child processes, one process per seed, which is what
//! makes a seed replay exactly (see `crates/tenure-testkit/src/stack_simulation/`). `TENURE_STACK_SEEDS` sets how many
//! seeds the sweep runs and `TENURE_SIM_SEED` the first; thousands are one command:
//! `cargo run --release -- simulate-stack --seeds 2000`.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;
use tenure::stack_simulation::{run, scratch_dir, SimConfig, SimFault, SimOutcome, SimSummary};

/// Simulated seconds of faults per seed in the suite: as long as `tenure simulate-stack`'s own
/// default, so faults follow one another and interact (100 seeds of 8 s rather than 200 of 4 s:
/// the same fault time, fewer setups).
const FAULT_SECS: u64 = 8;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Runs `tenure simulate-stack` with `args` and reads its JSON lines.
fn simulate_stack(args: &[&str]) -> Vec<SimSummary> {
    let output = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["simulate-stack", "--json", "--fault-secs", &FAULT_SECS.to_string()])
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .expect("tenure runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summaries: Vec<SimSummary> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a summary ({e}): {l}")))
        .collect();
    assert!(!summaries.is_empty(), "no summary; stderr:\n{}", String::from_utf8_lossy(&output.stderr));
    summaries
}

#[test]
fn every_seed_keeps_every_invariant() {
    let first = env_u64("TENURE_SIM_SEED", 1000);
    let count = env_u64("TENURE_STACK_SEEDS", 100);
    let summaries =
        simulate_stack(&["--seed", &first.to_string(), "--seeds", &count.to_string(), "--threads", "2"]);
    assert_eq!(summaries.len() as u64, count, "one summary per seed");
    let failures: Vec<String> = summaries
        .iter()
        .filter(|s| !s.passed)
        .map(|s| {
            format!(
                "seed {} failed (replay: tenure simulate-stack --seed {} --seeds 1 --fault-secs {FAULT_SECS}), \
                 faults {:?}:\n{}",
                s.seed, s.seed, s.faults, s.report
            )
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Each seed proves it did something, not only the sweep in total: a seed that injected no
    // fault, committed almost nothing or barely wrote is no evidence. (Refused writes cannot be
    // required per seed: most seeds draw no fault that makes a late write.)
    let idle: Vec<String> = summaries
        .iter()
        .filter(|s| {
            s.faults.is_empty()
                || s.committed_decisions < 10
                || s.worker_operations < 100
                || s.writes_accepted < 100
        })
        .map(|s| {
            format!(
                "seed {}: {} faults, {} committed decisions, {} worker operations, {} writes accepted",
                s.seed,
                s.faults.len(),
                s.committed_decisions,
                s.worker_operations,
                s.writes_accepted
            )
        })
        .collect();
    assert!(idle.is_empty(), "seeds that did too little to count:\n{}", idle.join("\n"));
    let kinds: BTreeSet<&str> = summaries
        .iter()
        .flat_map(|s| s.faults.iter().map(|f| f.split(' ').next().unwrap_or_default()))
        .collect();
    let operations: usize = summaries.iter().map(|s| s.worker_operations).sum();
    println!("{count} seeds, {operations} worker operations, fault kinds: {kinds:?}");
    assert!(operations > 0);
    if count >= 100 {
        assert_eq!(kinds.len(), SimFault::ALL.len(), "every fault kind was injected somewhere: {kinds:?}");
    }
}

#[test]
fn a_seed_replays_the_same_history() {
    // Seeds whose runs include crashes of nodes and workers, each run twice in fresh processes:
    // the fingerprint covers every recorded event and its simulated time.
    for seed in [4, 16, 22] {
        let first = simulate_stack(&["--seed", &seed.to_string(), "--seeds", "1"]);
        let second = simulate_stack(&["--seed", &seed.to_string(), "--seeds", "1"]);
        assert!(first[0].worker_operations > 0 && !first[0].faults.is_empty(), "the run did something");
        assert_eq!(first, second, "seed {seed} replayed differently");
    }
}

fn run_here(config: &SimConfig) -> SimOutcome {
    let dir = scratch_dir().expect("scratch directory");
    run(config, dir.path()).unwrap_or_else(|e| panic!("seed {} could not run: {e}", config.seed))
}

fn short(seed: u64) -> SimConfig {
    let mut config = SimConfig::new(seed);
    config.fault_time = Duration::from_secs(FAULT_SECS);
    config
}

#[test]
fn a_store_without_fencing_is_caught() {
    let mut config = short(11);
    config.fencing = false;
    config.faults = vec![SimFault::FreezeWorker];
    config.fault_time = Duration::from_secs(8);
    let outcome = run_here(&config);
    assert!(
        outcome.report.failed().contains(&"the store never accepts a lower token after a higher one"),
        "late writes of frozen workers must get in without fencing, and be caught: faults {:?}\n{}",
        outcome.faults,
        outcome.report
    );
}

/// Found by the sweep (seed 31 of `simulate-stack`): links between nodes that lost data in
/// flight left every peer connection stalled, and the cluster never elected a leader again after
/// the network healed, because a peer channel kept every call on its dead connection. Peer
/// connections are now pinged and replaced when a ping goes unanswered.
#[test]
fn nodes_find_each_other_again_after_links_lost_data() {
    for seed in [31, 32] {
        let mut config = short(seed);
        config.faults = vec![SimFault::LossyLinks];
        let outcome = run_here(&config);
        assert!(outcome.faults.len() >= 2, "seed {seed}: {:?}", outcome.faults);
        let recovered = outcome.history.recovered_after_ms;
        assert!(
            recovered.is_some_and(|ms| ms <= outcome.history.liveness_bound_ms),
            "seed {seed}: recovered after {recovered:?} ms (bound {} ms)\n{}",
            outcome.history.liveness_bound_ms,
            outcome.report
        );
        assert!(outcome.report.passed(), "seed {seed}:\n{}", outcome.report);
    }
}

/// An operator cuts the lease TTL through the operator API while workers hold leases under the
/// longer one, often with the leader killed under the shorter TTL, then sets it back: every change
/// is made, and no belief outlives its grant.
#[test]
fn lease_ttl_changes_through_the_operator_api_keep_every_invariant() {
    let summaries = simulate_stack(&["--seed", "0", "--seeds", "6", "--faults", "set-lease-ttl"]);
    let failures: Vec<String> =
        summaries.iter().filter(|s| !s.passed).map(|s| format!("seed {}:\n{}", s.seed, s.report)).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let faults: Vec<&String> = summaries.iter().flat_map(|s| &s.faults).collect();
    assert!(faults.len() >= 12, "{faults:?}");
    for fault in &faults {
        // The cut and the way back: both answered by a leader.
        assert_eq!(fault.matches("(made, was ").count(), 2, "{fault}");
    }
    assert!(faults.iter().any(|f| f.contains("killed meanwhile")), "{faults:?}");
}
