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
mod fleet;
mod heartbeats;
mod moves;
mod report;
mod scale;
mod storm;
mod versus_etcd;

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
use versus_etcd::*;

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

    let etcd_wanted = want("join-leave") || want("crash") || want("renewal-cpu");
    let etcd = if !etcd_wanted {
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
        if let Some(etcd) = &etcd {
            let (ejoin, eleave) = etcd_join_and_leave(&mut table, etcd, p).await?;
            ratio(
                &mut table,
                &format!("P={p} join 4->5, every moved partition owned"),
                join.max(),
                ejoin.max(),
            );
            ratio(
                &mut table,
                &format!("P={p} leave 5->4, every moved partition owned"),
                leave.max(),
                eleave.max(),
            );
            eprintln!("etcd P={p} join/leave measured");
            if p == 1024 {
                curves.push((format!("etcd, join 4->5, P={p}"), ejoin));
            }
        }
        if p == 1024 {
            curves.push((format!("tenure, join 4->5, P={p}"), join));
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
        if let Some(etcd) = &etcd {
            let ecrash = etcd_crash(&mut table, etcd, ttl as i64).await?;
            ratio(
                &mut table,
                &format!("crash at TTL {ttl} s, last partition owned again"),
                crash.max(),
                ecrash.max(),
            );
            if ttl == 1 {
                curves.push((format!("etcd, crash, lease TTL {ttl} s"), ecrash));
            }
        }
        if ttl == 1 {
            curves.push((format!("tenure, crash, TTL {ttl} s"), crash));
        }
        eprintln!("crash failover at TTL {ttl} s measured");
    }
    if want("leader") {
        leader_loss(&mut table, if quick { 5 } else { 20 }).await?;
        eprintln!("leader loss measured");
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
        renewal_cpu(&mut table, 1000, Duration::from_secs(if quick { 5 } else { 10 }), etcd.as_ref()).await?;
        eprintln!("leader CPU per renewal measured");
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
    // `--only <section>`: planned, join-leave, crash, leader, heartbeats, renewal-cpu, storm, scale.
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
