//! The controller against the real control plane (kube-apiserver,
//! kube-controller-manager and kube-scheduler v1.32.13 with default flags)
//! and the node simulator. SKIPPED with the reason when the binaries are not
//! on this machine.
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{Api, ResourceExt};
use lastgasp::{
    act::kube::NodeClient,
    apiserver::Use,
    controller::{
        ControllerConfig, FENCED_BOOT_ANNOTATION, OUT_OF_SERVICE_KEY, TAINTED_BY_ANNOTATION,
    },
    record::Closing,
};
use lastgasp_tests::{
    controlplane, nodesim,
    recovery::{self, Scenario, APP},
    support::{self, rt},
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
        let took = recovery::last_gasp(&c, scn.a(), &boot, lastgasp_tests::support::kernel_poweroff()).await.unwrap();
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

/// A pod bound to `node` in `ns` (the simulated kubelet runs it).
async fn pod_on(client: &kube::Client, ns: &str, name: &str, node: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
    }))
    .unwrap();
    pods.create(&kube::api::PostParams::default(), &p)
        .await
        .unwrap();
}

/// No write to a live node. Five nodes whose records are current but whose
/// kubelets renew after them, then stall (no renewal, no status: to the
/// cluster, a kubelet that stopped while the node and its pods run on);
/// meanwhile the controller is killed and started again with the same
/// identity (a liveness kill, an OOM, a rollout), and a second replica
/// stands by. Whatever they remember, nothing is fenced and no pod is
/// touched:
/// - A: the kernel's proof, retracted at once: the reboot(2) returned (the
///   agent closes the record as failed);
/// - B: a direct tool's proof (`poweroff -f`), contradicted likewise;
/// - C: a graceful shutdown announced (no proof);
/// - D: the kernel's proof with its time ten minutes ahead (forged, or a
///   node's clock gone wrong);
/// - E: the kernel's proof of an episode closed as cancelled.
#[test]
fn a_live_node_is_never_fenced_across_restarts_and_kubelet_stalls() {
    let Some(cp) =
        controlplane::shared("a_live_node_is_never_fenced_across_restarts_and_kubelet_stalls")
    else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let sim = nodesim::Sim::start(c.clone()).await.unwrap();
        let names = ["live-a", "live-b", "live-c", "live-d", "live-e", "live-f"];
        for n in names {
            sim.add_node(n).await.unwrap();
        }
        nodesim::schedulable(&c, &names, Duration::from_secs(60))
            .await
            .unwrap();
        let ns = "live";
        nodesim::namespace(&c, ns).await.unwrap();
        let watched = &names[..5];
        for n in watched {
            pod_on(&c, ns, &format!("app-{n}"), n).await;
        }
        let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
        let mut uids = Vec::new();
        for n in watched {
            uids.push(pods.get(&format!("app-{n}")).await.unwrap().uid());
        }
        let boot = |n: &str| sim.boot_id(n).unwrap();
        let (a, b, cc, d, e) = (names[0], names[1], names[2], names[3], names[4]);
        recovery::last_gasp(&c, b, &boot(b), support::direct_poweroff())
            .await
            .unwrap();
        let nc = |n: &str| {
            let c = c.clone();
            let n = n.to_string();
            async move { NodeClient::start(c, &n).await.unwrap() }
        };
        let failed = support::record_of(&boot(a), &support::kernel_poweroff());
        let a_client = nc(a).await;
        a_client.set_record(&failed).await.unwrap();
        a_client
            .close_record(
                &failed.key(),
                Closing::Failed,
                "reboot(2) returned -1 EINVAL",
            )
            .await;
        nc(cc)
            .await
            .set_record(&support::record_of(&boot(cc), &support::logind_signal()))
            .await
            .unwrap();
        let mut ahead = support::kernel_poweroff();
        ahead.at = SystemTime::now() + Duration::from_secs(600);
        recovery::last_gasp(&c, d, &boot(d), ahead).await.unwrap();
        let cancelled = support::record_of(&boot(e), &support::kernel_poweroff());
        let e_client = nc(e).await;
        e_client.set_record(&cancelled).await.unwrap();
        e_client
            .close_record(&cancelled.key(), Closing::Cancelled, "test")
            .await;

        let cfg = recovery::controller_config("live");
        let first = recovery::spawn_controller(c.clone(), cfg.clone())
            .await
            .unwrap();
        let standby = recovery::spawn_controller(
            c.clone(),
            ControllerConfig {
                identity: "live-standby".into(),
                ..cfg.clone()
            },
        )
        .await
        .unwrap();
        let nodes: Api<Node> = Api::all(c.clone());
        let t0 = Instant::now();
        let mut restarted = None;
        while t0.elapsed() < Duration::from_secs(70) {
            // Alive and renewing for 25 s, then the kubelets stall.
            if t0.elapsed() > Duration::from_secs(25) && restarted.is_none() {
                for n in watched {
                    sim.power_off(n);
                }
                first.abort();
                restarted = Some(
                    recovery::spawn_controller(c.clone(), cfg.clone())
                        .await
                        .unwrap(),
                );
                println!(
                    "kubelets stalled, the controller restarted, at {:?}",
                    t0.elapsed()
                );
            }
            for (n, uid) in watched.iter().zip(&uids) {
                let node = nodes.get(n).await.unwrap();
                assert!(
                    !out_of_service(&node),
                    "{n} was fenced after {:?}",
                    t0.elapsed()
                );
                assert!(
                    !node.annotations().contains_key(TAINTED_BY_ANNOTATION),
                    "{n}"
                );
                let p = pods.get(&format!("app-{n}")).await.unwrap();
                assert_eq!(p.uid().as_ref(), uid.as_ref(), "{n}'s pod was deleted");
                assert!(
                    p.metadata.deletion_timestamp.is_none(),
                    "{n}'s pod was marked for deletion"
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        standby.abort();
        if let Some(t) = restarted {
            t.abort();
        }
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(c.clone());
        let contradicted: Vec<String> = events
            .list(&Default::default())
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ShutdownRecordContradicted"))
            .filter_map(|e| e.regarding.and_then(|r| r.name))
            .collect();
        assert!(contradicted.iter().any(|x| x == b), "{b}: {contradicted:?}");
        for n in names {
            sim.power_off(n);
            let _ = nodes.delete(n, &Default::default()).await;
        }
    });
}

/// A graceful shutdown whose kubelet renews through a drain longer than its
/// Lease interval is fenced on the agent's last word (PID 1's reboot(2),
/// the kernel's end), after the node is down and not before: the renewals
/// during the drain contradict nothing. Until the last word, nothing.
#[test]
fn a_long_drain_then_the_power_off_is_fenced_after_death() {
    let Some(cp) = controlplane::shared("a_long_drain_then_the_power_off_is_fenced_after_death")
    else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let scn = Scenario::start(c.clone(), "drain").await.unwrap();
        let ctl = recovery::spawn_controller(c.clone(), recovery::controller_config("drain"))
            .await
            .unwrap();
        let a = scn.a().to_string();
        let boot = scn.sim.boot_id(&a).unwrap();
        let nodes: Api<Node> = Api::all(c.clone());
        // The graceful episode: logind's PrepareForShutdown; the drain runs
        // for 15 s while the kubelet renews.
        let mut logind = support::logind_signal();
        logind.at = SystemTime::now();
        recovery::episode_record(&c, &a, &boot, &[logind.clone()]).await.unwrap();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(15) {
            assert!(!out_of_service(&nodes.get(&a).await.unwrap()), "fenced during the drain");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // The end: PID 1 runs systemd-shutdown, then its reboot(2): the
        // agent's last word, then the kernel powers the node off.
        let mut end = support::kernel_poweroff();
        end.at = SystemTime::now();
        recovery::episode_record(&c, &a, &boot, &[logind, end]).await.unwrap();
        let off = scn.sim.power_off(&a);
        let (running, detached) = scn
            .watch_recovery(off, Duration::from_secs(45))
            .await
            .unwrap();
        let n = nodes.get(&a).await.unwrap();
        assert!(out_of_service(&n), "fenced on the last word");
        let fenced = n
            .spec
            .unwrap()
            .taints
            .unwrap()
            .into_iter()
            .find(|t| t.key == OUT_OF_SERVICE_KEY)
            .and_then(|t| t.time_added)
            .map(|t| SystemTime::from(t.0))
            .unwrap();
        println!(
            "power-off, then fenced {:?} later; Running elsewhere {running:?}, detached {detached:?}",
            fenced.duration_since(off).ok()
        );
        assert!(fenced >= off, "the fence came before the power-off");
        assert!(running.is_some(), "the app runs elsewhere within 45 s");
        ctl.abort();
        scn.remove_nodes().await;
    });
}

/// A new leader finishes a fence an earlier one left half done: the first
/// replica may taint but not delete pods (its RBAC lacks the delete); once
/// it is gone, the second takes the Lease and deletes the node's pods, from
/// what the API server holds alone, without fencing again.
#[test]
fn a_second_replica_takes_over_a_fence_left_half_done() {
    let Some(cp) = controlplane::shared("a_second_replica_takes_over_a_fence_left_half_done")
    else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let scn = Scenario::start(c.clone(), "handover").await.unwrap();
        let limited = limited_controller_client(cp, &c).await;
        let cfg = recovery::controller_config("handover");
        let first = recovery::spawn_controller(
            limited,
            ControllerConfig { identity: "handover-1".into(), ..cfg.clone() },
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let second = recovery::spawn_controller(
            c.clone(),
            ControllerConfig { identity: "handover-2".into(), ..cfg.clone() },
        )
        .await
        .unwrap();
        let a = scn.a().to_string();
        let boot = scn.sim.boot_id(&a).unwrap();
        recovery::last_gasp(&c, &a, &boot, support::kernel_poweroff()).await.unwrap();
        let off = scn.sim.power_off(&a);
        let nodes: Api<Node> = Api::all(c.clone());
        let t0 = Instant::now();
        while !out_of_service(&nodes.get(&a).await.unwrap()) {
            assert!(t0.elapsed() < Duration::from_secs(20), "the first replica fenced nothing");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The pod is marked by the taint, and stays (the first replica cannot delete it).
        tokio::time::sleep(Duration::from_secs(3)).await;
        let pods: Api<Pod> = Api::namespaced(c.clone(), &scn.ns);
        let pod = pods.get(&format!("{APP}-0")).await.unwrap();
        assert_eq!(pod.spec.as_ref().and_then(|s| s.node_name.as_deref()), Some(a.as_str()));
        assert!(pod.metadata.deletion_timestamp.is_some(), "the taint evicts it");
        first.abort();
        let (running, _) = scn.watch_recovery(off, Duration::from_secs(60)).await.unwrap();
        println!("the second replica finished the fence: Running elsewhere {running:?} after the power-off");
        assert!(running.is_some(), "the second replica deleted the pod");
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(c.clone());
        let added: Vec<_> = events
            .list(&Default::default())
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("OutOfServiceTaintAdded")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(a.as_str()))
            .collect();
        assert_eq!(added.len(), 1, "fenced once: {added:?}");
        second.abort();
        scn.remove_nodes().await;
    });
}

/// A client of a ServiceAccount with the controller's grants but pod
/// deletes.
async fn limited_controller_client(
    cp: &controlplane::ControlPlane,
    admin: &kube::Client,
) -> kube::Client {
    nodesim::namespace(admin, lastgasp_tests::zone::NS)
        .await
        .unwrap();
    let objs = serde_json::json!([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "limited-controller", "namespace": lastgasp_tests::zone::NS}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "limited-controller"},
         "rules": [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "create", "update"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "limited-controller"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "limited-controller"},
         "subjects": [{"kind": "ServiceAccount", "name": "limited-controller", "namespace": lastgasp_tests::zone::NS}]}
    ]);
    lastgasp_tests::render::apply(admin, objs.as_array().unwrap(), false)
        .await
        .unwrap();
    let token = lastgasp_tests::zone::token(admin, "limited-controller", None)
        .await
        .unwrap();
    cp.agent_client(&token, Use::Watch)
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
