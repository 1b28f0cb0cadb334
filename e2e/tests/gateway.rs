//! The build-cache gateway under faults (`tidepool_e2e::gateway`): a
//! `tidepool gateway` process in front of a cluster of real processes,
//! driven over the HTTP cache protocol by clients that store new blobs and
//! read stored ones, and over the REAPI by clients that store actions and
//! fetch them as Bazel does, while a node is killed (-9), frozen and cut off, and
//! while the gateway itself is killed (-9) and restarted. Every
//! acknowledged blob must be readable whole during and after the faults,
//! no read may return other bytes, and no failed upload may leave part of
//! a blob stored. Replay a seed with `E2E_SEED=<seed>`.

use std::time::{Duration, Instant};

use tidepool_e2e::cluster::{Cluster, Options};
use tidepool_e2e::gateway::{CacheLoad, CacheLoadOptions, GatewayProcess};

/// A fault: what it was, when it started and when the cluster had settled.
struct Window {
    name: &'static str,
    from: Instant,
    to: Instant,
    failures_before: u64,
    failures_after: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_serves_through_node_and_gateway_faults() {
    let mut cluster = Cluster::start(Options::default()).await;
    let mut gateway = GatewayProcess::start(&cluster).await;
    let load = CacheLoad::start(
        &gateway,
        CacheLoadOptions {
            seed: tidepool_testkit::seed_from_env("E2E_SEED"),
            ..CacheLoadOptions::default()
        },
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut windows = Vec::new();
    for name in [
        "kill -9 a leader",
        "freeze a leader",
        "isolate a leader",
        "kill -9 the gateway",
    ] {
        let from = Instant::now();
        let failures_before = load.failures();
        let victim = cluster.busiest_leader().await;
        match name {
            "kill -9 a leader" => {
                cluster.kill_node(victim);
                tokio::time::sleep(Duration::from_secs(3)).await;
                cluster.start_node(victim);
            }
            "freeze a leader" => {
                cluster.freeze_node(victim);
                tokio::time::sleep(Duration::from_secs(3)).await;
                cluster.thaw_node(victim);
            }
            "isolate a leader" => {
                let isolated = victim as u64 + 1;
                let rest: Vec<u64> = (1..=3).filter(|n| *n != isolated).collect();
                cluster.partition(&[&[isolated], &rest]);
                tokio::time::sleep(Duration::from_secs(3)).await;
                cluster.heal();
            }
            _ => {
                gateway.kill();
                tokio::time::sleep(Duration::from_secs(1)).await;
                gateway.restart().await;
            }
        }
        cluster.wait_settled(Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        windows.push(Window {
            name,
            from,
            to: Instant::now(),
            failures_before,
            failures_after: load.failures(),
        });
    }
    let report = load.stop().await.verify().await;
    println!(
        "gateway under faults: {} PUTs acknowledged ({} MiB), {} reads answered whole",
        report.puts_acknowledged,
        report.bytes_acknowledged >> 20,
        report.reads_ok
    );
    println!(
        "REAPI: {} actions stored, {} fetched whole (result and outputs)",
        report.actions_stored, report.actions_fetched
    );
    println!("failed PUTs: {:?}", report.puts_failed);
    println!("failed reads: {:?}", report.reads_failed);
    println!(
        "failed PUTs found stored whole at the end: {}",
        report.failed_but_stored
    );
    println!("| fault | failed requests | longest stretch without an acknowledged PUT |");
    println!("|---|---|---|");
    for w in &windows {
        println!(
            "| {} | {} | {:.2} s |",
            w.name,
            w.failures_after - w.failures_before,
            report.longest_put_gap(w.from, w.to).as_secs_f64()
        );
    }

    report.assert_intact();
    assert!(report.puts_acknowledged > 100, "the load ran");
    assert!(
        report.actions_stored > 20 && report.actions_fetched > 20,
        "the builds ran"
    );
    // The node faults leave a majority of every shard's replicas; the SDK
    // under the gateway retries through them, so its clients see no error.
    // Only the gateway's own death breaks their connections.
    for w in &windows[..3] {
        assert_eq!(
            w.failures_after, w.failures_before,
            "{}: requests failed through a node fault (failed PUTs {:?}, reads {:?})",
            w.name, report.puts_failed, report.reads_failed
        );
    }
    let gateway_errors = gateway.error_lines();
    assert!(
        gateway_errors.is_empty(),
        "gateway errors:\n{}",
        gateway_errors.join("\n")
    );
    let unexpected = cluster.unexpected_log_lines(&[]);
    assert!(
        unexpected.is_empty(),
        "unexpected log lines:\n{}",
        unexpected.join("\n")
    );
}
