//! A zone loses power, small, on the real API server with the
//! manifests as shipped (tests/src/zone.rs; `cargo xtask bench zone` runs
//! the same code with N = 100, 500 and 1,000 and every arm). SKIPPED with
//! the reason when the binaries or kustomize are not on this machine.
use std::time::Duration;

use lastgasp_tests::{
    controlplane,
    render::{kustomize, kustomize_dir, render_kustomize_dir},
    zone::{summary, Arm, Bench},
};

const N: usize = 30;

/// Every node's evidence lands in lastgasp's own priority level (the
/// server's answer says which), none is refused, and the controller fences
/// every node whose record was accepted, from one LIST of Leases per pass,
/// and writes each its ledger entry.
#[test]
fn a_dark_zone_is_queued_not_rejected_and_every_node_fenced() {
    let test = "a_dark_zone_is_queued_not_rejected_and_every_node_fenced";
    let Some(cp) = controlplane::shared(test) else {
        return;
    };
    let Some(k) = kustomize() else {
        println!("SKIPPED {test}: no kustomize (`cargo xtask test` installs it, or set LASTGASP_KUSTOMIZE)");
        return;
    };
    let objs = render_kustomize_dir(&k, &kustomize_dir());
    let mut bench = Bench::start(cp, &objs, 16, true).unwrap();
    let b = bench
        .burst(Arm::PriorityLevel, N, false, Duration::from_secs(60))
        .unwrap();
    println!("{}", summary(&b));
    assert_eq!(b.accepted(), N, "{}", summary(&b));
    assert_eq!((b.refused(429), b.failed()), (0, 0), "{}", summary(&b));
    assert_eq!(b.fenced, N, "{}", summary(&b));
    // The ledger: one NodeShutdown per node, saying it was fenced.
    assert_eq!(b.ledger.map(|l| l.0), Some(N), "{}", summary(&b));
    // The controller's own requests: its passes LIST the Leases, never a
    // read per node; the only GETs are each fence's live re-read of that
    // one node's Lease before it writes, so at most one per fenced node
    // (two if a fence's write was retried).
    let reads: Vec<_> = cp
        .audit("system:serviceaccount:lastgasp:lastgasp-controller")
        .into_iter()
        .filter(|e| e.resource == "leases" && e.namespace == "kube-node-lease")
        .collect();
    assert!(reads.iter().any(|e| e.verb == "list"), "no LIST of Leases");
    let mut gets = std::collections::BTreeMap::<String, usize>::new();
    for e in &reads {
        assert!(e.verb == "list" || e.verb == "get", "{} {}", e.verb, e.name);
        if e.verb == "get" {
            *gets.entry(e.name.clone()).or_default() += 1;
        }
    }
    assert!(
        gets.len() <= N && gets.values().all(|&n| n <= 2),
        "{gets:?}"
    );
    bench.stop().unwrap();
}
