//! The controller against the real control plane (kube-apiserver,
//! kube-controller-manager and kube-scheduler v1.32.13 with default flags)
//! and the node simulator. SKIPPED with the reason when the binaries are not
//! on this machine.
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{Api, ResourceExt};
use lastgasp::controller::{FENCED_BOOT_ANNOTATION, OUT_OF_SERVICE_KEY, TAINTED_BY_ANNOTATION};
use lastgasp_tests::{
    controlplane, nodesim,
    recovery::{self, Scenario, APP},
    support::rt,
};

fn out_of_service(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_KEY))
}

/// A node with a current power-off record whose kubelet goes silent is
/// fenced (taint, then its pods deleted with grace 0): the StatefulSet's pod
/// runs on another node and the volume leaves node A, long before the node
/// lifecycle controller's 50 s. When A comes back on a new boot, the taint
/// goes.
#[test]
fn a_silent_node_with_a_record_is_fenced_and_its_stateful_pod_moves() {
    let Some(cp) =
        controlplane::shared("a_silent_node_with_a_record_is_fenced_and_its_stateful_pod_moves")
    else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let scn = Scenario::start(c.clone(), "fence").await.unwrap();
        let ctl = recovery::spawn_controller(
            c.clone(),
            recovery::controller_config("fence"),
        )
        .await
        .unwrap();
        let boot = scn.sim.boot_id(scn.a()).unwrap();
        let took = recovery::last_gasp(&c, scn.a(), &boot, recovery::reboot_syscall()).await.unwrap();
        let off = scn.sim.power_off(scn.a());
        let (running, detached) = scn.watch_recovery(off, Duration::from_secs(45)).await.unwrap();
        println!("last gasp {took:?}; Running elsewhere after {running:?}, node A's attachment gone after {detached:?}");
        let running = running.unwrap_or_else(|| panic!("the app did not run elsewhere within 45 s\nkcm: {}", cp.log_tail("kube-controller-manager", 20)));
        assert!(detached.is_some(), "node A's VolumeAttachment is still there after 45 s");
        // Not by the lifecycle controller: it takes 50 s to mark the node Unknown.
        assert!(running < Duration::from_secs(40), "{running:?}");
        let nodes: Api<Node> = Api::all(c.clone());
        let a = nodes.get(scn.a()).await.unwrap();
        assert!(out_of_service(&a), "node A carries the out-of-service taint");
        assert_eq!(a.annotations().get(FENCED_BOOT_ANNOTATION), Some(&boot));
        // A comes back on a new boot: Ready, and the taint goes.
        let new_boot = scn.sim.add_node(scn.a()).await.unwrap();
        assert_ne!(new_boot, boot);
        let t0 = Instant::now();
        loop {
            let a = nodes.get(scn.a()).await.unwrap();
            if !out_of_service(&a) {
                assert!(!a.annotations().contains_key(TAINTED_BY_ANNOTATION));
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "the taint stayed after A came back");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        ctl.abort();
        scn.remove_nodes().await;
    });
}

/// A record is a claim: a node that keeps renewing its Lease after its
/// record is never fenced, not while it lives, and not when it goes silent
/// later (the record was contradicted). The controller writes nothing.
#[test]
fn a_node_that_renews_after_its_record_is_never_fenced() {
    let Some(cp) = controlplane::shared("a_node_that_renews_after_its_record_is_never_fenced")
    else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let scn = Scenario::start(c.clone(), "alive").await.unwrap();
        let ctl = recovery::spawn_controller(c.clone(), recovery::controller_config("alive"))
            .await
            .unwrap();
        let pods: Api<Pod> = Api::namespaced(c.clone(), &scn.ns);
        let uid = pods.get(&format!("{APP}-0")).await.unwrap().uid();
        let boot = scn.sim.boot_id(scn.a()).unwrap();
        let nodes: Api<Node> = Api::all(c.clone());
        recovery::last_gasp(&c, scn.a(), &boot, recovery::reboot_syscall())
            .await
            .unwrap();
        // Alive for 25 s (two renewals at least), then silent for 25 s.
        let t0 = SystemTime::now();
        while t0.elapsed().unwrap() < Duration::from_secs(50) {
            if t0.elapsed().unwrap() > Duration::from_secs(25) && scn.sim.boot_id(scn.a()).is_some()
            {
                scn.sim.power_off(scn.a());
                println!("node A silent from now on");
            }
            let a = nodes.get(scn.a()).await.unwrap();
            assert!(
                !out_of_service(&a),
                "node A was fenced after {:?}",
                t0.elapsed()
            );
            assert!(!a.annotations().contains_key(TAINTED_BY_ANNOTATION));
            assert!(!a.annotations().contains_key(FENCED_BOOT_ANNOTATION));
            let p = pods.get(&format!("{APP}-0")).await.unwrap();
            assert_eq!(p.uid(), uid, "the pod was deleted");
            assert!(
                p.metadata.deletion_timestamp.is_none(),
                "the pod was marked for deletion"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        ctl.abort();
        scn.remove_nodes().await;
    });
}

#[test]
fn the_simulated_nodes_run_a_stateful_pod() {
    let Some(cp) = controlplane::shared("the_simulated_nodes_run_a_stateful_pod") else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let t0 = Instant::now();
        let scn = Scenario::start(c.clone(), "smoke").await.unwrap();
        assert!(nodesim::attached_to(&c, "smoke", APP, scn.a())
            .await
            .unwrap());
        println!("{APP}-0 Running on {} after {:?}", scn.a(), t0.elapsed());
        scn.remove_nodes().await;
    });
}
