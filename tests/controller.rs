//! The controller's pass against the API double: its writes side by side,
//! each judged again on a live read, only while it leads; the operator's
//! controls (observe, pause, opt-out, ceiling); a new leader finishing what
//! the old one left. The rule itself is unit-tested in
//! `agent/src/controller/rule.rs`; on the real control plane in
//! `tests/controlplane.rs`.
use std::time::{Duration, SystemTime};

use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Node, Pod},
    events::v1::Event,
};
use lastgasp::controller::{
    Controller, ControllerConfig, FencePolicy, OPT_OUT_LABEL, OPT_OUT_VALUE, OUT_OF_SERVICE_KEY,
    PAUSE_ANNOTATION,
};
use lastgasp_apidouble::{ApiDouble, Fault};
use lastgasp_tests::support::{
    direct_poweroff, kernel_poweroff, logind_signal, put_lease, put_record, record_of,
};
use serde_json::json;

const LONG_AGO: Duration = Duration::from_secs(60);

/// Nodes `names`, each of boot `<name>-boot`, Ready=Unknown, with one pod
/// whose kubelet is down (pods stay Terminating until deleted with grace 0).
async fn cluster(names: &[&str]) -> ApiDouble {
    let double = ApiDouble::start().await.unwrap();
    for name in names {
        double
            .create_value(
                lastgasp_tests::nodes::node(name)
                    .ready("Unknown")
                    .boot(&format!("{name}-boot"))
                    .json(),
            )
            .unwrap();
        double
            .create_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("app-{name}"), "namespace": "default"},
                "spec": {"nodeName": name, "containers": [{"name": "c", "image": "busybox"}]},
                "status": {"phase": "Running"}
            }))
            .unwrap();
        double.kubelet().set_node_running(name, false);
        put_lease(&double, name, SystemTime::now() - LONG_AGO);
    }
    double
}

/// `name` powered off a minute ago: the kernel's proof, its kubelet silent since.
fn powered_off(double: &ApiDouble, name: &str) {
    let mut sig = kernel_poweroff();
    sig.at = SystemTime::now() - LONG_AGO;
    let rec = record_of(&format!("{name}-boot"), &sig);
    put_record(double, name, &rec, sig.at);
}

async fn controller(double: &ApiDouble, cfg: ControllerConfig) -> Controller {
    let c = double.client_without_retry().await;
    let ctl = Controller::start(c.clone(), c, cfg).await.unwrap();
    settle().await;
    ctl
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(150)).await;
}

fn fenced(double: &ApiDouble, name: &str) -> bool {
    double
        .get::<Node>("", name)
        .unwrap()
        .spec
        .and_then(|s| s.taints)
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_KEY))
}

fn pod_left(double: &ApiDouble, name: &str) -> bool {
    double
        .get::<Pod>("default", &format!("app-{name}"))
        .is_some()
}

fn events(double: &ApiDouble, reason: &str) -> Vec<String> {
    double
        .list::<Event>("default")
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter_map(|e| e.regarding.and_then(|r| r.name))
        .collect()
}

fn node_writes(double: &ApiDouble) -> usize {
    double
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH" && r.path.starts_with("/api/v1/nodes/"))
        .count()
}

/// A zone that went dark is fenced in one pass: the writes side by side
/// (at most `concurrency` in flight), each after a live read of the Node
/// and its kubelet's Lease; the taint is stored before the pods the taint
/// evicts are deleted with grace 0.
#[tokio::test]
async fn a_dark_zone_is_fenced_side_by_side() {
    let zone: Vec<String> = (0..24).map(|i| format!("z{i}")).collect();
    let names: Vec<&str> = zone.iter().map(String::as_str).collect();
    let double = cluster(&names).await;
    for n in &names {
        powered_off(&double, n);
    }
    double.inject(
        Fault::latency(Duration::from_millis(100))
            .method("PATCH")
            .path_prefix("/api/v1/nodes/z")
            .always(),
    );
    let cfg = ControllerConfig {
        concurrency: 8,
        ..ControllerConfig::new("a")
    };
    let mut c = controller(&double, cfg).await;
    double.clear_requests();
    assert!(c.tick().await.unwrap());
    for n in &names {
        assert!(fenced(&double, n), "{n}");
        assert!(!pod_left(&double, n), "{n}'s pod is deleted");
    }
    let reqs: Vec<_> = double.requests().into_iter().filter(|r| !r.watch).collect();
    let lists = reqs
        .iter()
        .filter(|r| {
            r.method == "GET"
                && r.path == "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        })
        .count();
    assert_eq!(lists, 1, "one LIST of the Leases");
    for n in &names {
        let live_node = reqs
            .iter()
            .filter(|r| r.method == "GET" && r.path == format!("/api/v1/nodes/{n}"))
            .count();
        let live_lease = reqs
            .iter()
            .filter(|r| {
                r.method == "GET"
                    && r.path
                        == format!(
                            "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{n}"
                        )
            })
            .count();
        assert_eq!(
            (live_node, live_lease),
            (1, 1),
            "{n}: one live read of each"
        );
        let taint = reqs
            .iter()
            .find(|r| r.method == "PATCH" && r.path == format!("/api/v1/nodes/{n}"))
            .unwrap();
        let delete = reqs
            .iter()
            .find(|r| r.method == "DELETE" && r.path.ends_with(&format!("/pods/app-{n}")))
            .unwrap();
        assert!(
            taint.seq < delete.seq && taint.instant + taint.elapsed <= delete.instant,
            "{n}: the taint is stored before the delete"
        );
        assert_eq!(
            delete
                .body
                .as_ref()
                .map(|b| b["gracePeriodSeconds"].clone()),
            Some(json!(0)),
            "{n}"
        );
    }
    let taints: Vec<_> = reqs
        .iter()
        .filter(|r| r.method == "PATCH" && r.path.starts_with("/api/v1/nodes/z"))
        .filter(|r| !r.path.ends_with("/status"))
        .collect();
    assert_eq!(taints.len(), zone.len());
    // And each fenced node's PoweredOffAndFenced condition.
    let conditions = reqs
        .iter()
        .filter(|r| {
            r.method == "PATCH"
                && r.path.starts_with("/api/v1/nodes/z")
                && r.path.ends_with("/status")
        })
        .count();
    assert_eq!(conditions, zone.len());
    let in_flight = taints
        .iter()
        .map(|a| {
            taints
                .iter()
                .filter(|b| b.instant <= a.instant && a.instant < b.instant + b.elapsed)
                .count()
        })
        .max()
        .unwrap();
    assert!(
        (2..=8).contains(&in_flight),
        "{in_flight} taint writes in flight at once"
    );
    assert_eq!(
        c.actions
            .iter()
            .filter(|(_, v)| v.kind() == "Fence")
            .count(),
        zone.len()
    );
    // The next pass writes nothing more.
    settle().await;
    let before = node_writes(&double);
    c.tick().await.unwrap();
    assert_eq!(node_writes(&double), before);
}

/// What the cache says is checked live: a kubelet that wrote its Lease
/// after the proof (the cache has not seen it) means no fence.
#[tokio::test]
async fn a_fence_is_judged_again_on_a_live_read() {
    let double = cluster(&["n1"]).await;
    powered_off(&double, "n1");
    // The LIST answers from before the kubelet's write; the live GET after.
    let stale = double.inject(
        Fault::latency(Duration::from_millis(300))
            .method("GET")
            .path_prefix("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1"),
    );
    let mut c = controller(&double, ControllerConfig::new("a")).await;
    let writer = {
        let double = &double;
        async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            put_lease(double, "n1", SystemTime::now());
        }
    };
    let (r, ()) = tokio::join!(c.tick(), writer);
    r.unwrap();
    double.remove_fault(stale);
    assert!(
        !fenced(&double, "n1"),
        "the live Lease contradicts the proof"
    );
    assert!(pod_left(&double, "n1"));
    settle().await;
    c.tick().await.unwrap();
    assert!(!fenced(&double, "n1"));
    assert_eq!(events(&double, "ShutdownRecordContradicted"), ["n1"]);
}

/// Only the proof fences: a graceful shutdown announced, with the kubelet
/// long silent, gets nothing; its last word (PID 1's reboot(2)) fences.
#[tokio::test]
async fn an_announced_shutdown_waits_for_its_last_word() {
    let double = cluster(&["n1"]).await;
    let mut sig = logind_signal();
    sig.at = SystemTime::now() - LONG_AGO;
    let graceful = record_of("n1-boot", &sig);
    put_record(&double, "n1", &graceful, sig.at);
    let mut c = controller(&double, ControllerConfig::new("a")).await;
    c.tick().await.unwrap();
    assert!(!fenced(&double, "n1"), "no proof, no fence");
    powered_off(&double, "n1");
    settle().await;
    c.tick().await.unwrap();
    assert!(fenced(&double, "n1"));
}

/// `--policy observe`: an Event and a metric say what would be fenced;
/// nothing is written to the Node or its pods.
#[tokio::test]
async fn observe_says_and_writes_nothing() {
    let double = cluster(&["n1"]).await;
    powered_off(&double, "n1");
    let cfg = ControllerConfig {
        policy: FencePolicy::Observe,
        ..ControllerConfig::new("a")
    };
    let mut c = controller(&double, cfg).await;
    double.clear_requests();
    for _ in 0..3 {
        c.tick().await.unwrap();
        settle().await;
    }
    assert!(!fenced(&double, "n1"));
    assert!(pod_left(&double, "n1"));
    assert_eq!(node_writes(&double), 0);
    assert!(!double.requests().iter().any(|r| r.method == "DELETE"));
    assert_eq!(events(&double, "OutOfServiceWouldFence"), ["n1"], "once");
    assert!(c
        .metrics
        .encode()
        .contains("lastgasp_controller_actions_total{action=\"would-fence\"} 1"));
}

/// The pause switch on the controller's own Lease holds every fence back
/// (a Warning says so) until it is removed; no redeploy.
#[tokio::test]
async fn the_pause_switch_holds_fences_back() {
    let double = cluster(&["n1"]).await;
    powered_off(&double, "n1");
    let mut c = controller(&double, ControllerConfig::new("a")).await;
    double
        .create_value(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system"}}),
        )
        .ok();
    // The first pass creates the Lease: pause it before anything is fenced.
    let pause = |on: bool| {
        double
            .modify::<Lease, _>("kube-system", "lastgasp-controller", |l| {
                let ann = l.metadata.annotations.get_or_insert_with(Default::default);
                if on {
                    ann.insert(PAUSE_ANNOTATION.into(), "true".into());
                } else {
                    ann.remove(PAUSE_ANNOTATION);
                }
            })
            .unwrap();
    };
    double.inject(
        Fault::status(503)
            .method("GET")
            .path_prefix("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases")
            .times(1),
    );
    c.tick().await.unwrap();
    assert!(!fenced(&double, "n1"), "the Leases could not be read");
    pause(true);
    for _ in 0..2 {
        c.tick().await.unwrap();
    }
    assert!(!fenced(&double, "n1"));
    assert!(pod_left(&double, "n1"));
    settle().await;
    assert_eq!(events(&double, "OutOfServicePaused"), ["n1"]);
    assert!(c.metrics.encode().contains("lastgasp_controller_paused 1"));
    pause(false);
    c.tick().await.unwrap();
    assert!(fenced(&double, "n1"));
    assert!(!pod_left(&double, "n1"));
}

/// The uninstall's pause (its lift's) holds the controllers it paused, and
/// is lifted by a reinstall's: one whose Deployment was created after it,
/// by the server's stamps. An operator's pause stays.
#[tokio::test]
async fn a_reinstall_lifts_the_uninstalls_pause_and_only_it() {
    use k8s_openapi::api::apps::v1::Deployment;
    use lastgasp::controller::{lift, PAUSED_BY_ANNOTATION};
    let double = cluster(&["n1"]).await;
    powered_off(&double, "n1");
    double
        .create_value(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system"}}),
        )
        .ok();
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "lastgasp-controller", "namespace": "kube-system"},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "c"}},
            "template": {"metadata": {"labels": {"app": "c"}},
                "spec": {"containers": [{"name": "c", "image": "lastgasp"}]}}}});
    double.create_value(deployment.clone()).unwrap();
    let cfg = ControllerConfig {
        deployment: Some("lastgasp-controller".into()),
        policy: FencePolicy::Observe,
        ..ControllerConfig::new("a")
    };
    let mut old = controller(&double, cfg.clone()).await;
    old.tick().await.unwrap();
    // Stamps are whole seconds: the pause a second after the install.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    lift::pause(double.client().await, "kube-system", "lastgasp-controller")
        .await
        .unwrap();
    let paused = || {
        let l: Lease = double.get("kube-system", "lastgasp-controller").unwrap();
        l.metadata
            .annotations
            .unwrap_or_default()
            .contains_key(PAUSE_ANNOTATION)
    };
    old.tick().await.unwrap();
    assert!(
        paused(),
        "the uninstalled release's own controller stays paused"
    );
    assert!(old
        .metrics
        .encode()
        .contains("lastgasp_controller_paused 1"));
    // Reinstalled: a new Deployment, created after the pause.
    kube::Api::<Deployment>::namespaced(double.client().await, "kube-system")
        .delete("lastgasp-controller", &Default::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    double.create_value(deployment).unwrap();
    let mut new = controller(&double, cfg.clone()).await;
    new.tick().await.unwrap();
    assert!(!paused(), "a reinstall lifts the uninstall's pause");
    assert!(new
        .metrics
        .encode()
        .contains("lastgasp_controller_paused 0"));
    // An operator's pause (no paused-by) stays, whatever the Deployment.
    double
        .modify::<Lease, _>("kube-system", "lastgasp-controller", |l| {
            let ann = l.metadata.annotations.get_or_insert_with(Default::default);
            ann.insert(PAUSE_ANNOTATION.into(), "true".into());
            ann.remove(PAUSED_BY_ANNOTATION);
        })
        .unwrap();
    new.tick().await.unwrap();
    assert!(paused(), "an operator's pause stays");
}

/// A node labelled `lastgasp.dev/fencing=disabled` is never fenced; the
/// ceiling holds back fences past `--max-fenced` with a Warning.
#[tokio::test]
async fn opt_out_and_the_ceiling() {
    let double = cluster(&["n1", "n2", "n3"]).await;
    for n in ["n1", "n2", "n3"] {
        powered_off(&double, n);
    }
    double
        .modify::<Node, _>("", "n1", |n| {
            n.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert(OPT_OUT_LABEL.into(), OPT_OUT_VALUE.into());
        })
        .unwrap();
    let cfg = ControllerConfig {
        max_fenced: 1,
        concurrency: 1,
        ..ControllerConfig::new("a")
    };
    let mut c = controller(&double, cfg).await;
    c.tick().await.unwrap();
    c.tick().await.unwrap();
    settle().await;
    assert!(!fenced(&double, "n1"), "opted out");
    let fenced_now: Vec<&str> = ["n2", "n3"]
        .into_iter()
        .filter(|n| fenced(&double, n))
        .collect();
    assert_eq!(fenced_now.len(), 1, "{fenced_now:?}: the ceiling is 1");
    assert_eq!(events(&double, "OutOfServiceOptedOut"), ["n1"]);
    assert_eq!(events(&double, "OutOfServiceCeiling").len(), 1);
    let m = c.metrics.encode();
    assert!(m.contains("action=\"held-ceiling\"} 1"), "{m}");
    assert!(m.contains("action=\"held-opted-out\"} 1"), "{m}");
}

/// A replica whose hold on the Lease is no longer recent writes nothing:
/// the live reads took longer than two thirds of the Lease.
#[tokio::test]
async fn no_write_without_a_recent_lease() {
    let double = cluster(&["n1"]).await;
    powered_off(&double, "n1");
    let cfg = ControllerConfig {
        lease_duration: Duration::from_secs(1),
        ..ControllerConfig::new("a")
    };
    let mut c = controller(&double, cfg).await;
    let slow = double.inject(
        Fault::latency(Duration::from_millis(900))
            .method("GET")
            .path_prefix("/api/v1/nodes/n1")
            .always(),
    );
    assert!(c.tick().await.unwrap(), "it leads");
    assert!(!fenced(&double, "n1"), "its term ran out while it read");
    assert!(c
        .metrics
        .encode()
        .contains("lastgasp_controller_pass_errors_total{stage=\"action\"} 1"));
    double.remove_fault(slow);
    c.tick().await.unwrap();
    assert!(fenced(&double, "n1"));
}

/// A write that fails on one node does not stop the pass; a leader that
/// fenced a node but could not delete its pods stops, and the next leader
/// deletes them without fencing again.
#[tokio::test]
async fn failures_and_a_new_leader() {
    let double = cluster(&["n1", "n2"]).await;
    for n in ["n1", "n2"] {
        powered_off(&double, n);
    }
    let patch = double.inject(
        Fault::status(500)
            .method("PATCH")
            .path_prefix("/api/v1/nodes/n1")
            .always(),
    );
    let deletes = double.inject(
        Fault::status(500)
            .method("DELETE")
            .path_prefix("/api/v1/namespaces/default/pods/")
            .always(),
    );
    let short = |id: &str| ControllerConfig {
        lease_duration: Duration::from_secs(2),
        ..ControllerConfig::new(id)
    };
    let mut a = controller(&double, short("a")).await;
    assert!(a.tick().await.unwrap());
    assert!(!fenced(&double, "n1"), "n1's patch failed");
    assert!(fenced(&double, "n2"), "n2 fenced despite n1's error");
    assert!(pod_left(&double, "n2"), "its delete failed");
    drop(a);
    double.remove_fault(patch);
    double.remove_fault(deletes);
    let mut b = controller(&double, short("b")).await;
    assert!(!b.tick().await.unwrap(), "a's lease is not expired yet");
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert!(b.tick().await.unwrap(), "b takes the expired lease");
    assert!(!pod_left(&double, "n2"), "b deleted the pods a left");
    assert!(fenced(&double, "n1"), "and fenced n1");
    let kinds: Vec<_> = b
        .actions
        .iter()
        .map(|(n, v)| (n.as_str(), v.kind()))
        .collect();
    assert_eq!(kinds, [("n1", "Fence")], "n2 not fenced again");
}

/// A direct tool's proof (`poweroff -f`) fences once the kubelet's Lease is
/// silent; a node back on a new boot is untainted after a live read.
#[tokio::test]
async fn a_direct_tool_then_back_on_a_new_boot() {
    let double = cluster(&["n1"]).await;
    // The kubelet wrote its Lease 10 s ago: the tool's record came after,
    // 9 s ago (past the direct tool's quiet time, 8 s).
    let now = SystemTime::now();
    put_lease(&double, "n1", now - Duration::from_secs(10));
    let mut tool = direct_poweroff();
    tool.at = now - Duration::from_secs(9);
    put_record(&double, "n1", &record_of("n1-boot", &tool), tool.at);
    let mut c = controller(&double, ControllerConfig::new("a")).await;
    c.tick().await.unwrap();
    assert!(!fenced(&double, "n1"), "the kubelet is not silent yet");
    put_lease(&double, "n1", SystemTime::now() - Duration::from_secs(20));
    settle().await;
    c.tick().await.unwrap();
    assert!(fenced(&double, "n1"));
    double
        .modify::<Node, _>("", "n1", |n| {
            let st = n.status.as_mut().unwrap();
            st.node_info.as_mut().unwrap().boot_id = "n1-boot-2".into();
            st.conditions.as_mut().unwrap()[0].status = "True".into();
        })
        .unwrap();
    settle().await;
    c.tick().await.unwrap();
    assert!(!fenced(&double, "n1"), "untainted on the new boot");
    assert_eq!(events(&double, "OutOfServiceTaintRemoved"), ["n1"]);
}
