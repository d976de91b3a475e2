//! The status page in a real browser: three `tenure serve` processes with their pages on, three
//! workers, and headless Chromium driven through its WebDriver. What a person would see is
//! checked against the cluster's own table: one region of the ring per range of partitions,
//! each with the owner the table gives it; the leader the page names is the leader; a worker
//! that leaves hands its ranges to the others on the page, followed live, without a reload.
//!
//! It needs Debian's `chromium` and `chromium-driver` (`scripts/setup` installs them) and says
//! plainly that it was skipped on a machine without them. `TENURE_UPDATE_SCREENSHOT=1` saves
//! the screenshot it takes to `docs/status-page.png`, the picture in the README.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;
use tenure::nemesis::{ProcessCluster, ServeSettings};
use tenure::worker::{Assignment, Runner};
use tokio::time::Instant;

const PARTITIONS: u32 = 12;

/// One region as the page draws it.
#[derive(Debug)]
struct Region {
    first: u32,
    last: u32,
    owner: u64,
}

/// What the page shows: its regions and the leader it names.
#[derive(Debug)]
struct Shown {
    regions: Vec<Region>,
    leader: u64,
}

const READ_PAGE: &str = r#"
    const regions = Array.from(document.querySelectorAll('#ring .region')).map(e => ({
        first: Number(e.dataset.first), last: Number(e.dataset.last), owner: Number(e.dataset.owner) }));
    return { regions, leader: Number(document.getElementById('leader').dataset.id) };
"#;

/// How many `applied` events the page has taken from its stream.
async fn applied_events(browser: &fantoccini::Client) -> u64 {
    let value = browser.execute("return Number(document.body.dataset.applied || 0);", vec![]).await;
    value.ok().and_then(|v| v.as_u64()).unwrap_or(0)
}

async fn shown(browser: &fantoccini::Client) -> Option<Shown> {
    let value = browser.execute(READ_PAGE, vec![]).await.ok()?;
    let regions = value["regions"]
        .as_array()?
        .iter()
        .map(|r| {
            Some(Region {
                first: r["first"].as_u64()? as u32,
                last: r["last"].as_u64()? as u32,
                owner: r["owner"].as_u64()?,
            })
        })
        .collect::<Option<Vec<Region>>>()?;
    Some(Shown { regions, leader: value["leader"].as_u64()? })
}

/// Each partition's owner as the page's regions say; `None` if the regions do not cover the
/// table exactly once.
fn owners_on_page(shown: &Shown) -> Option<BTreeMap<u32, u64>> {
    let mut owners = BTreeMap::new();
    for r in &shown.regions {
        for p in r.first..=r.last {
            if owners.insert(p, r.owner).is_some() {
                return None;
            }
        }
    }
    (owners.len() == PARTITIONS as usize).then_some(owners)
}

fn owners_in_table(status: &tenure::proto::StatusResponse) -> BTreeMap<u32, u64> {
    status.partitions.iter().map(|r| (r.partition, r.owner)).collect()
}

/// The `tenure serve` processes' settings, with their status pages on.
fn with_status_pages(insecure: bool) -> ServeSettings {
    ServeSettings {
        binary: env!("CARGO_BIN_EXE_tenure").into(),
        partition_count: PARTITIONS,
        lease_ttl: Duration::from_millis(2000),
        election_timeout: Duration::from_millis(300),
        snapshot_after_logs: 1000,
        insecure,
        status_pages: true,
    }
}

/// A chromedriver on a free loopback port, killed with the test.
async fn chromedriver() -> Option<(tokio::process::Child, String)> {
    let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
    let child = tokio::process::Command::new(driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    let url = format!("http://127.0.0.1:{port}");
    let until = Instant::now() + PATIENCE;
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if Instant::now() > until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Some((child, url))
}

async fn headless_chromium(driver: &str) -> fantoccini::Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1320,900", "--hide-scrollbars"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    fantoccini::ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(driver)
        .await
        .expect("chromium starts under its webdriver")
}

/// Waits until the page shows exactly the table's owners and the cluster's leader.
async fn page_matches_table(browser: &fantoccini::Client, c: &ProcessCluster, what: &str) -> Shown {
    eventually(what, || async {
        let status = c.status().await?;
        let shown = shown(browser).await?;
        let leader = c.leader().await?;
        (owners_on_page(&shown)? == owners_in_table(&status) && shown.leader == leader).then_some(shown)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_table_the_leader_and_a_leave_as_it_happens() {
    init_tracing();
    let Some((_driver, driver_url)) = chromedriver().await else {
        println!(
            "SKIPPED: no chromedriver (install Debian's chromium and chromium-driver; scripts/setup does)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let settings = with_status_pages(true);
    let c = ProcessCluster::start(3, dir.path(), settings).await.expect("three serve processes");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    // Workers on the runner, whose tasks idle until told to stop: revokes are answered.
    let mut workers: Vec<_> =
        ["indexer-a", "indexer-b", "indexer-<i>c</i>"].map(|name| idle_runner(&c, name)).into();
    eventually("three workers own four partitions each", || async {
        let status = c.status().await?;
        let balanced = status.sessions.len() == 3 && status.sessions.iter().all(|s| s.owned == 4);
        (balanced && status.revoking == 0 && status.unowned == 0).then_some(())
    })
    .await;

    // A follower's page: every node serves one, from what it has applied.
    let leader = c.leader().await.expect("a leader");
    let follower = c.ids().into_iter().find(|id| *id != leader).expect("a follower");
    let page: SocketAddr = c.status_page(follower).expect("status pages are on");
    let browser = headless_chromium(&driver_url).await;
    browser.goto(&format!("http://{page}/")).await.expect("the page loads");
    let before = page_matches_table(&browser, &c, "the page shows the table and the leader").await;
    // A worker's name is shown as text, never as markup.
    let names = browser
        .execute(
            "const t = document.querySelector('#sessions tbody'); return [t.textContent, t.querySelectorAll('i').length];",
            vec![],
        )
        .await
        .expect("the sessions table");
    assert!(names[0].as_str().is_some_and(|t| t.contains("indexer-<i>c</i>")), "{names}");
    assert_eq!(names[1].as_u64(), Some(0), "a name became markup: {names}");
    let leaving = workers[0].0.now().session.expect("the first worker serves a session");
    let applied_before = applied_events(&browser).await;
    assert!(before.regions.iter().any(|r| r.owner == leaving.0), "{before:?}");
    assert!(before.regions.len() <= PARTITIONS as usize, "{before:?}");

    // The first worker leaves: the page, without a reload, hands its ranges to the others.
    let left = Instant::now();
    let (_, stop) = workers.remove(0);
    stop.cancel();
    let gone = eventually("the leaver's ranges change hands on the page", || async {
        let shown = shown(&browser).await?;
        let owners = owners_on_page(&shown)?;
        owners.values().all(|o| *o != 0 && *o != leaving.0).then(|| left.elapsed())
    })
    .await;
    println!("the page showed the leave handed over {} ms after the leave call", gone.as_millis());
    let after = page_matches_table(&browser, &c, "the page shows the table after the leave").await;
    assert!(after.regions.iter().all(|r| r.owner != leaving.0), "{after:?}");
    // Still the same page, and the handover reached it as events it was streamed.
    let url = browser.current_url().await.expect("a url");
    assert_eq!(url.as_str(), format!("http://{page}/"));
    let applied_after = applied_events(&browser).await;
    assert!(
        applied_after > applied_before,
        "no applied event reached the page: {applied_before} -> {applied_after}"
    );

    // The leader's page knows more (each node's replication, lease time left, the renewal
    // rate): that is the picture the README shows, with one range picked.
    let page = c.status_page(leader).expect("status pages are on");
    browser.goto(&format!("http://{page}/")).await.expect("the leader's page loads");
    page_matches_table(&browser, &c, "the leader's page shows the table").await;
    eventually("the leader's page shows a renewal rate", || async {
        let rate = browser.find(fantoccini::Locator::Css("#renewal-rate")).await.ok()?.text().await.ok()?;
        rate.ends_with("/s").then_some(())
    })
    .await;
    // A click where a person would click: on the range's own arc (WebDriver's click aims at
    // the middle of the element's box, which for a wide arc is the ring's hole).
    browser
        .execute(
            "document.querySelector('#ring .region').dispatchEvent(new MouseEvent('click', {bubbles: true}));",
            vec![],
        )
        .await
        .expect("a region is picked");
    let detail =
        browser.find(fantoccini::Locator::Css("#detail")).await.expect("details").text().await.expect("text");
    assert!(detail.contains("owner") && detail.contains("token"), "{detail}");
    let screenshot = browser.screenshot().await.expect("a screenshot");
    assert!(screenshot.starts_with(b"\x89PNG"), "the screenshot is a PNG");
    let saved = match std::env::var_os("TENURE_UPDATE_SCREENSHOT") {
        Some(_) => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/status-page.png"),
        None => dir.path().join("status-page.png"),
    };
    std::fs::write(&saved, &screenshot).expect("the screenshot is saved");
    println!("screenshot: {} ({} bytes)", saved.display(), screenshot.len());
    browser.close().await.expect("the browser closes");
}

/// One HTTPS GET of `path` from `addr` presenting `client` (certificate and key PEM), trusting
/// `ca`; the response's first line and body, or why there was none.
async fn https_get(
    addr: SocketAddr,
    ca: &str,
    client: Option<(&str, &str)>,
    path: &str,
) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::{
        self, pki_types::pem::PemObject, pki_types::CertificateDer, pki_types::PrivateKeyDer,
    };
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(cert.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => {
            let certs = CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<Vec<_>, _>>();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| e.to_string())?;
            builder
                .with_client_auth_cert(certs.map_err(|e| e.to_string())?, key)
                .map_err(|e| e.to_string())?
        }
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from(addr.ip().to_string()).map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let mut tls = connector.connect(name, tcp).await.map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(PATIENCE, tls.read_to_end(&mut answer))
        .await
        .map_err(|_| "no answer in time")?;
    read.map_err(|e| e.to_string())?;
    match String::from_utf8_lossy(&answer).into_owned() {
        empty if empty.is_empty() => Err("closed without an answer".into()),
        text => Ok(text),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tls_on_the_status_page_answers_operators_only() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let settings = with_status_pages(false);
    let c = ProcessCluster::start(1, dir.path(), settings).await.expect("a serve process");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    let addr = c.status_page(1).expect("status pages are on");
    let ca = c.ca().expect("the run's CA");
    let issue = |p: tenure::tls::Principal| ca.issue(&p, &[], Default::default()).expect("issued");
    let operator = issue(tenure::tls::Principal::Operator("ops".into()));
    let worker = issue(tenure::tls::Principal::Worker("indexer-a".into()));

    let answer = eventually("the page answers an operator", || async {
        https_get(addr, &ca.ca_pem(), Some((&operator.cert_pem, &operator.key_pem)), "/status.json")
            .await
            .ok()
    })
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"partition_count\":12"), "{answer}");
    let page = https_get(addr, &ca.ca_pem(), Some((&operator.cert_pem, &operator.key_pem)), "/").await;
    assert!(page.as_deref().is_ok_and(|p| p.contains("<svg id=\"ring\"")), "{page:?}");

    // A worker's certificate, from the same CA, gets nothing; nor does a client without one.
    let as_worker =
        https_get(addr, &ca.ca_pem(), Some((&worker.cert_pem, &worker.key_pem)), "/status.json").await;
    assert!(as_worker.as_ref().is_err_and(|e| !e.contains("200")), "{as_worker:?}");
    let anonymous = https_get(addr, &ca.ca_pem(), None, "/status.json").await;
    assert!(anonymous.is_err(), "{anonymous:?}");
    // And the node still serves the operator afterwards.
    let again =
        https_get(addr, &ca.ca_pem(), Some((&operator.cert_pem, &operator.key_pem)), "/status.json").await;
    assert!(again.is_ok_and(|a| a.starts_with("HTTP/1.1 200")));
}

/// Workers on the runner whose tasks idle until told to stop, each with its stop switch.
fn idle_runner(
    c: &ProcessCluster,
    name: &str,
) -> (tenure::worker::RunnerStatus, tokio_util::sync::CancellationToken) {
    let runner = Runner::new(c.worker_config(name));
    let status = runner.status();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(runner.run(
        |a: Assignment| async move {
            a.stopped().await;
            Ok::<(), std::convert::Infallible>(())
        },
        stop.clone().cancelled_owned(),
    ));
    (status, stop)
}

/// A table too large to draw partition by partition: the page shows the node's aggregation, at
/// most 2,048 ranges covering it, each with the owner of most of its partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_table_is_drawn_as_a_bounded_number_of_ranges_with_their_majority_owners() {
    init_tracing();
    let Some((_driver, driver_url)) = chromedriver().await else {
        println!(
            "SKIPPED: no chromedriver (install Debian's chromium and chromium-driver; scripts/setup does)"
        );
        return;
    };
    const LARGE: u32 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let mut settings = with_status_pages(true);
    settings.partition_count = LARGE;
    settings.lease_ttl = Duration::from_secs(5);
    let c = ProcessCluster::start(1, dir.path(), settings).await.expect("a serve process");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    let _workers = [idle_runner(&c, "indexer-a"), idle_runner(&c, "indexer-b")];
    // Counts only while waiting; the whole table once, when it has settled.
    let counts = tenure::proto::StatusRequest { omit_partitions: true, ..Default::default() };
    eventually("two workers share the table", || async {
        let status = c.client().read_status(counts.clone(), None).await.ok()?;
        let shared = status.sessions.len() == 2 && status.sessions.iter().all(|s| s.owned > 0);
        (shared && status.revoking == 0 && status.unowned == 0).then_some(())
    })
    .await;
    let owners = owners_in_table(&eventually("the whole table", || c.status()).await);

    let browser = headless_chromium(&driver_url).await;
    browser.goto(&format!("http://{}/", c.status_page(1).expect("on"))).await.expect("the page loads");
    let shown = eventually("the page draws the whole table", || async {
        let shown = shown(&browser).await?;
        (shown.regions.first()?.first == 0 && shown.regions.last()?.last == LARGE - 1).then_some(shown)
    })
    .await;
    assert!(shown.regions.len() <= 2048, "{} shapes", shown.regions.len());
    for pair in shown.regions.windows(2) {
        assert_eq!(pair[0].last + 1, pair[1].first, "ranges are contiguous");
    }
    for r in &shown.regions {
        let mut count: BTreeMap<u64, usize> = BTreeMap::new();
        for p in r.first..=r.last {
            *count.entry(owners[&p]).or_default() += 1;
        }
        // The most partitions; on a tie, the smaller session id.
        let most = count.iter().max_by_key(|(id, n)| (**n, std::cmp::Reverse(**id))).map(|(id, _)| *id);
        assert_eq!(Some(r.owner), most, "p{}-p{}: {count:?}", r.first, r.last);
    }
    browser.close().await.expect("the browser closes");
}
