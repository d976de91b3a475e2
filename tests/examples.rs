//! The examples are part of the promise: each is run here as its own process and must print the
//! outcome it claims. The examples check their own outcome too and exit non-zero when it is not
//! what they claim; this test also reads what they printed.

use std::path::PathBuf;
use std::process::Command;

fn postgres() -> String {
    std::env::var("TENURE_TEST_POSTGRES").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".into()
    })
}

/// `cargo test` builds the examples next to the test binaries: target/<profile>/examples/<name>.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    let path = profile_dir.join("examples").join(name);
    assert!(path.exists(), "{} was not built; run the tests with --all-targets", path.display());
    path
}

/// Runs an example to its end, or kills it after `limit`: a hung example fails the test instead
/// of hanging the suite.
fn run_for(name: &str, args: &[&str], limit: std::time::Duration) -> String {
    let child = Command::new(example(name))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("example starts");
    let pid = child.id();
    let (done, waited) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    let output = match waited.recv_timeout(limit) {
        Ok(output) => output.expect("example runs"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{name} did not finish within {limit:?}");
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{name} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn gc_pause_stale_write_wins_without_fencing_and_is_rejected_with_it() {
    let out = run_for("gc_pause", &[], std::time::Duration::from_secs(120));
    assert!(out.contains("final value: batch-1-late"), "{out}");
    assert!(out.contains("final value: batch-2"), "{out}");
    assert!(out.contains("REJECT A token="), "{out}");
}

/// Duplicates per row of the invoices table: (lease checks, fencing, unique key) -> duplicates.
fn duplicates(out: &str) -> Vec<((String, String, String), u64)> {
    out.lines()
        .filter(|l| l.matches('|').count() == 3 && !l.starts_with("lease"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').collect();
            let layers: Vec<String> = cells[0].split_whitespace().map(str::to_owned).collect();
            let figures: Vec<u64> = cells[1].split_whitespace().map(|n| n.parse().expect("number")).collect();
            ((layers[0].clone(), layers[1].clone(), layers[2].clone()), figures[1])
        })
        .collect()
}

#[test]
fn invoices_duplicates_with_a_plain_lock_and_none_with_all_three_layers() {
    let out = run_for("invoices", &["--postgres", &postgres()], std::time::Duration::from_secs(600));
    let rows = duplicates(&out);
    assert_eq!(rows.len(), 8, "{out}");
    let of = |l: &str, f: &str, u: &str| {
        rows.iter().find(|(k, _)| *k == (l.into(), f.into(), u.into())).map(|(_, d)| *d).expect("row")
    };
    assert!(of("off", "off", "off") > 0, "{out}");
    // Lease checks alone cannot stop the write that was already past its check.
    assert!(of("on", "off", "off") >= 1, "{out}");
    for (layers, dups) in &rows {
        if layers.1 == "on" || layers.2 == "on" {
            assert_eq!(*dups, 0, "{layers:?}\n{out}");
        }
    }
}

#[test]
fn tenure_run_gives_a_shell_job_a_token_and_the_fence_refuses_a_frozen_child() {
    let tenure = env!("CARGO_BIN_EXE_tenure");
    let out = run_for(
        "tenure_run",
        &["--tenure", tenure, "--postgres", &postgres()],
        std::time::Duration::from_secs(120),
    );
    assert!(out.contains("[alpha] REFUSED partition=0 token="), "{out}");
    assert!(out.contains("fence held: partition 0"), "{out}");
    // Both runners stopped their children on SIGTERM and left cleanly.
    assert_eq!(out.matches("STOPPED sessions=").count(), 2, "{out}");
}

#[test]
fn an_object_store_fence_built_on_conditional_writes_passes_the_fence_kit() {
    let out = run_for("object_store_fence", &[], std::time::Duration::from_secs(60));
    assert!(out.contains("9 cases passed on the object-store fence"), "{out}");
    assert!(out.contains("pass fences_data_and_checkpoints_survive_a_restart"), "{out}");
}
