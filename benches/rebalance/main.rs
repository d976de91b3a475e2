//! What users of a coordinator care about, measured on a 3-node cluster in this process (real
//! gRPC on loopback, RocksDB on disk, every write synced): the cost of one Raft commit, planned
//! move latency, join and leave rebalances, crash failover, leader loss and heartbeat
//! throughput. Every latency is also printed as a multiple of the commit, measured in the same
//! run, so the ratios hold on a noisy machine.
//!
//! `cargo bench` runs everything; `cargo bench -- --quick` (or `TENURE_BENCH_QUICK=1`) runs the
//! small sizes only, in a couple of minutes. The table is printed and written to
//! `<target dir>/tenure-bench/results.md`.

mod etcd;
mod failover;
mod fleet;
mod heartbeats;
mod moves;
mod postgres;
mod report;
mod scale;
mod storm;
mod versus;

#[global_allocator]
static ALLOCATOR: scale::Counting = scale::Counting;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::fence::MemoryFence;
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::LocalCluster;
use tenure::ownership::Command;
use tenure::proto;
use tenure::worker::{Client, Worker, WorkerConfig, WorkerEvent};

use fleet::*;
use heartbeats::*;
use moves::*;
use report::*;
use versus::*;

/// Join and leave ratios of one baseline against tenure, every moved partition owned.
fn compare(table: &mut Table, baseline: &str, p: u32, tenure: (&Sample, &Sample), other: (&Sample, &Sample)) {
    let join = format!("P={p} join 4->5, every moved partition owned");
    ratio(table, baseline, &join, tenure.0.max(), other.0.max());
    let leave = format!("P={p} leave 5->4, every moved partition owned");
    ratio(table, baseline, &leave, tenure.1.max(), other.1.max());
}

async fn run(quick: bool, only: Option<&str>) -> Result<(String, String)> {
    let want = |section: &str| only.is_none_or(|o| o == section);
    let dir = tempfile::tempdir()?;
    let base = cluster(dir.path(), 1024, Duration::from_secs(5)).await?;
    let floor = commit_floor(&base, if quick { 200 } else { 1000 }).await?;
    base.shutdown().await;
    let mut table = Table { floor: floor.pct(0.5), rows: Vec::new() };
    table.latency("one Raft commit (no-op write) p50", floor.pct(0.5));
    table.latency("one Raft commit (no-op write) p99", floor.pct(0.99));
    eprintln!("commit floor measured");

    let baselines_wanted = want("join-leave") || want("crash") || want("renewal-cpu");
    let etcd = if !baselines_wanted {
        None
    } else {
        match etcd::EtcdCluster::start().await {
            Ok(etcd) => Some(etcd),
            Err(e) => {
                eprintln!("etcd baseline skipped: {e:#}");
                table.figure("etcd baseline", "skipped (etcd not available)");
                None
            }
        }
    };
    let mut curves: Vec<(String, Sample)> = Vec::new();
    if want("planned") {
        let moves = planned_moves(&mut table, if quick { 25 } else { 100 }).await?;
        curves.push(("tenure, planned move, P=16".into(), moves));
        eprintln!("planned moves measured");
    }
    let sizes: &[u32] = if !want("join-leave") {
        &[]
    } else if quick {
        &[1024]
    } else {
        &[1024, 65536]
    };
    for &p in sizes {
        let (join, leave) = join_and_leave(&mut table, p).await?;
        eprintln!("P={p} join/leave measured");
        if p == 1024 {
            curves.push((format!("tenure, join 4->5, P={p}"), join.clone()));
        }
        if let Some(etcd) = &etcd {
            let (ejoin, eleave) = baseline_join_and_leave(&mut table, etcd, p).await?;
            compare(&mut table, "etcd", p, (&join, &leave), (&ejoin, &eleave));
            eprintln!("etcd P={p} join/leave measured");
            if p == 1024 {
                curves.push((format!("etcd, join 4->5, P={p}"), ejoin));
            }
        }
        match postgres::Postgres::start(p).await {
            Ok(pg) => {
                let (pjoin, pleave) = baseline_join_and_leave(&mut table, &pg, p).await?;
                compare(&mut table, "PostgreSQL", p, (&join, &leave), (&pjoin, &pleave));
                pg.stop().await?;
                eprintln!("PostgreSQL P={p} join/leave measured");
                if p == 1024 {
                    curves.push((format!("PostgreSQL, join 4->5, P={p}"), pjoin));
                }
            }
            Err(e) => eprintln!("PostgreSQL baseline skipped: {e:#}"),
        }
    }
    let ttls: &[u64] = if !want("crash") {
        &[]
    } else if quick {
        &[1]
    } else {
        &[1, 5]
    };
    for &ttl in ttls {
        let crash = crash_failover(&mut table, Duration::from_secs(ttl)).await?;
        let what = format!("crash at TTL {ttl} s, last partition owned again");
        if ttl == 1 {
            curves.push((format!("tenure, crash, TTL {ttl} s"), crash.clone()));
        }
        if let Some(etcd) = &etcd {
            let ecrash = baseline_crash(&mut table, etcd, Duration::from_secs(ttl)).await?;
            ratio(&mut table, "etcd", &what, crash.max(), ecrash.max());
            if ttl == 1 {
                curves.push((format!("etcd, crash, lease TTL {ttl} s"), ecrash));
            }
        }
        match postgres::Postgres::start(256).await {
            Ok(pg) => {
                let pcrash = baseline_crash(&mut table, &pg, Duration::from_secs(ttl)).await?;
                ratio(&mut table, "PostgreSQL", &what, crash.max(), pcrash.max());
                pg.stop().await?;
                if ttl == 1 {
                    curves.push((format!("PostgreSQL, crash, lease TTL {ttl} s"), pcrash));
                }
            }
            Err(e) => eprintln!("PostgreSQL baseline skipped: {e:#}"),
        }
        eprintln!("crash failover at TTL {ttl} s measured");
    }
    if want("leader") {
        leader_loss(&mut table, if quick { 5 } else { 20 }).await?;
        eprintln!("leader loss measured");
    }
    if want("failover") {
        for ttl in [2, 1] {
            failover::leader_failure(&mut table, Duration::from_secs(ttl), if quick { 3 } else { 10 })
                .await?;
            eprintln!("leader failure under a worker at TTL {ttl} s measured");
            match failover::etcd_leader_failure(
                &mut table,
                Duration::from_secs(ttl),
                if quick { 3 } else { 10 },
            )
            .await
            {
                Ok(()) => eprintln!("etcd leader failure under a worker at TTL {ttl} s measured"),
                Err(e) => eprintln!("etcd leader failure at TTL {ttl} s skipped: {e:#}"),
            }
        }
    }
    let loads: &[(u32, usize)] = if !want("heartbeats") {
        &[]
    } else if quick {
        &[(1024, 500)]
    } else {
        &[(1024, 1000), (65536, 1000), (1024, 5000), (1024, 10_000)]
    };
    for &(p, sessions) in loads {
        heartbeat_throughput(&mut table, p, sessions, Duration::from_secs(5)).await?;
        eprintln!("heartbeats at P={p} with {sessions} sessions measured");
    }
    if want("renewal-cpu") {
        let window = Duration::from_secs(if quick { 5 } else { 10 });
        let tenure_us = renewal_cpu(&mut table, 1000, window, etcd.as_ref()).await?;
        eprintln!("leader CPU per renewal measured");
        for p in if quick { &[1024][..] } else { &[1024, 65536][..] } {
            postgres_renewal_cpu(&mut table, *p, 1000, window, tenure_us).await?;
            eprintln!("PostgreSQL CPU per renewal at P={p} measured");
        }
    }
    if want("storm") {
        // `TENURE_BENCH_STORM_SESSIONS` sizes the storm for a profile between the two sizes.
        let sized = std::env::var("TENURE_BENCH_STORM_SESSIONS").ok().and_then(|s| s.parse().ok());
        let (p, sessions) = (65536, sized.unwrap_or(if quick { 1000 } else { 10_000 }));
        storm::join_storm(&mut table, p, sessions).await?;
        eprintln!("join storm of {sessions} sessions at P={p} measured");
    }
    if want("scale") {
        let sizes: &[(u32, usize)] =
            if quick { &[(1_000_000, 1000)] } else { &[(1_000_000, 1000), (1_000_000, 10_000)] };
        scale::bootstrap(&mut table, 1_000_000)?;
        for &(p, workers) in sizes {
            scale::state_machine_scale(&mut table, p, workers)?;
            eprintln!("state machine at P={p} with {workers} workers measured");
        }
    }
    Ok((table.render(), cdf_svg(&curves)))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("benchmarks run with `cargo bench` (quick: `cargo bench -- --quick`)");
        return Ok(());
    }
    let quick = args.iter().any(|a| a == "--quick") || std::env::var_os("TENURE_BENCH_QUICK").is_some();
    // `--only <section>`: planned, join-leave, crash, leader, failover, heartbeats, renewal-cpu,
    // storm, scale.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (table, svg) = runtime.block_on(run(quick, only.as_deref()))?;
    println!("\n{table}");
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let out = std::path::Path::new(&target).join("tenure-bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("results.md"), &table)?;
    std::fs::write(out.join("latency.svg"), &svg)?;
    println!("written to {} and latency.svg", out.join("results.md").display());
    Ok(())
}
