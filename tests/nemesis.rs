//! The nemesis in the test suite: a short seeded run of three `tenure serve` processes and three
//! worker processes (two of them on the partition runner) under every kind of fault (kill -9
//! and SIGSTOP included) must keep every invariant; so must a run with nodes and workers in this process; and a run whose store has
//! the fencing check switched off must be caught by the checker; so must a rolling upgrade
//! across two versions of the placement rules. `tenure nemesis` runs long ones.

mod common;

use std::time::Duration;
use tenure::history::WorkerOp;
use tenure::nemesis::{self, FaultKind, NemesisConfig};

/// One run at a time: each starts a cluster and several workers with 1 s leases, and the
/// liveness verdict should measure the system, not two runs starving each other of CPU.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The seed comes from `TENURE_NEMESIS_SEED` when set, so a failing run can be replayed.
fn seed() -> u64 {
    std::env::var("TENURE_NEMESIS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261203)
}

fn print_outcome(config: &NemesisConfig, outcome: &nemesis::Outcome) {
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
    for f in &h.faults {
        println!("  {:>8.2}s {}", f.start_ns as f64 / 1e9, f.what);
    }
    println!("{}", outcome.report);
}

/// The end of every process log the run left in `dir` (nodes and worker processes write theirs
/// there), so a failed run says what its processes said before the directory is deleted.
fn print_log_tails(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for path in entries.filter_map(Result::ok).map(|e| e.path()) {
        if path.is_dir() {
            print_log_tails(&path);
        } else if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            // A panic's message comes before its backtrace, which would fill the tail.
            for (i, _) in lines.iter().enumerate().filter(|(_, l)| l.contains("panicked at")) {
                println!("--- {} panicked:", path.display());
                for line in &lines[i..(i + 3).min(lines.len())] {
                    println!("{line}");
                }
            }
            println!("--- last lines of {}:", path.display());
            for line in &lines[lines.len().saturating_sub(20)..] {
                println!("{line}");
            }
        }
    }
}

/// Runs `config` and requires what every run here must show: every invariant held, none
/// skipped, and enough done for the verdicts to mean something.
async fn run_keeping_every_invariant(config: &NemesisConfig, dir: &std::path::Path) -> nemesis::Outcome {
    let outcome = nemesis::run(config, dir).await.expect("the run completes");
    print_outcome(config, &outcome);
    if !outcome.report.passed() || !outcome.shortfalls(config.fencing).is_empty() {
        print_log_tails(dir);
    }
    assert!(outcome.report.passed(), "seed {} violated invariants:\n{}", config.seed, outcome.report);
    assert!(outcome.report.verdicts.iter().all(|v| v.skipped.is_none()), "{}", outcome.report);
    assert_eq!(outcome.shortfalls(config.fencing), Vec::<String>::new(), "the run did too little");
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_processes_under_every_kind_of_fault_keep_every_invariant() {
    common::init_tracing();
    let _turn = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = NemesisConfig::new(seed(), Duration::from_secs(40));
    config.serve_binary = Some(env!("CARGO_BIN_EXE_tenure").into());
    // Two of the three worker processes (w2, w3) run the partition runner, so the faults land
    // on it as often as on the event loop underneath.
    config.runners = 2;
    let outcome = run_keeping_every_invariant(&config, dir.path()).await;
    assert_eq!(outcome.faults.len(), FaultKind::ALL.len(), "every kind of fault ran: {:?}", outcome.faults);
    // Fencing was exercised by real SIGSTOPs: a frozen worker process's late writes were refused
    // (the default seed freezes one on the event loop; a frozen runner aborts its tasks as it
    // wakes, usually before their late writes go out).
    if std::env::var_os("TENURE_NEMESIS_SEED").is_none() {
        assert!(outcome.froze_an_event_loop_worker(), "the default seed must freeze an event-loop worker");
    }
    if outcome.froze_an_event_loop_worker() {
        assert!(outcome.refused_from_frozen_workers() > 0, "no write refused from a frozen worker process");
    }
    // The coordinator's record was read back from every node's log on disk.
    let nodes: std::collections::BTreeSet<u64> = outcome.history.coordinator.iter().map(|c| c.node).collect();
    assert_eq!(nodes, (1..=config.nodes).collect(), "decisions replayed from every node's log");
    // The workers ran as processes of their own and reported what they did.
    let workers: std::collections::BTreeSet<&str> =
        outcome.history.workers.iter().map(|r| r.worker.as_str()).collect();
    assert_eq!(workers.len(), config.workers, "records from every worker process: {workers:?}");
    // The runners' handlers raised fences, wrote, and ended: returned after a stop (a revoke's
    // drain or a leave) and aborted on a loss.
    assert_eq!(outcome.runner_slots, ["w2", "w3"]);
    for runner in ["w2", "w3"] {
        let ops: Vec<WorkerOp> =
            outcome.history.workers.iter().filter(|r| r.worker == runner).map(|r| r.op).collect();
        for op in [WorkerOp::Acquired, WorkerOp::Wrote, WorkerOp::Released] {
            assert!(ops.contains(&op), "runner {runner} recorded no {op:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_process_nodes_under_faults_keep_every_invariant() {
    common::init_tracing();
    let _turn = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let config = NemesisConfig::new(seed(), Duration::from_secs(20));
    let outcome = run_keeping_every_invariant(&config, dir.path()).await;
    assert!(outcome.history.faults.len() >= 4, "too few faults: {:?}", outcome.faults);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_without_the_fencing_check_is_caught() {
    common::init_tracing();
    let _turn = ONE_AT_A_TIME.lock().await;
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

/// A rolling upgrade, one node at a time, from one version of the placement rules to the next,
/// among leader kills and workers that leave and come back: leaders of both versions decide,
/// and the checker still finds every replica applying the same decisions at the same index
/// (each node's log is read back from disk) and every other invariant kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_upgrade_of_the_placement_rules_keeps_every_invariant() {
    common::init_tracing();
    let _turn = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = NemesisConfig::new(seed(), Duration::from_secs(16));
    config.faults =
        vec![FaultKind::UpgradeNode, FaultKind::KillLeader, FaultKind::LeaveWorker, FaultKind::DropWorker];
    let outcome = run_keeping_every_invariant(&config, dir.path()).await;
    // Every node was upgraded once: the last step leaves the whole cluster on the new rules.
    let upgrades: Vec<&str> = outcome
        .history
        .faults
        .iter()
        .map(|f| f.what.as_str())
        .filter(|w| w.starts_with("upgrade-node"))
        .collect();
    assert!(upgrades.len() >= config.nodes as usize, "too few upgrade steps: {upgrades:?}");
    assert!(
        upgrades[config.nodes as usize - 1].ends_with("(cluster: [1, 1, 1])"),
        "the upgrade did not roll through every node: {upgrades:?}"
    );
}
