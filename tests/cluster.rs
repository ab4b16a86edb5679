//! The graceful path and the last gasp, end to end against the Kubernetes API
//! double (real HTTP/JSON, kube-rs unchanged). No root needed.
use std::{
    collections::BTreeMap,
    time::{Duration, SystemTime},
};

use k8s_openapi::api::{
    core::v1::{Node, Pod},
    events::v1::Event,
};
use lastgasp::{
    act::{
        kube::{
            graceful::{self, GracefulOptions, Removal},
            lastgasp::LastGasp,
            NodeClient, CONDITION, RECORD_ANNOTATION, TAINT_KEY,
        },
        metrics::Metrics,
    },
    decide::{Action, Decider, Episode},
    grace::Bucket,
    signal::{Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};
use lastgasp_apidouble::{ApiDouble, Fault};
use serde_json::json;

const NODE: &str = "n1";

fn node() -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "spec": {"taints": [{"key": "example.com/other", "value": "x", "effect": "PreferNoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}
    })
}

fn pod(name: &str, priority: Option<i32>, tgps: Option<i64>, extra: serde_json::Value) -> serde_json::Value {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    });
    if let Some(pr) = priority {
        p["spec"]["priority"] = json!(pr);
    }
    if let Some(t) = tgps {
        p["spec"]["terminationGracePeriodSeconds"] = json!(t);
    }
    merge(&mut p, extra);
    p
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn logind_signal() -> ShutdownSignal {
    ShutdownSignal {
        source: Source::Logind,
        kind: Kind::Poweroff,
        forced: false,
        bypasses_logind: false,
        scope: Scope::Node,
        effect: Effect::Now,
        actor: None,
        at: SystemTime::now(),
        boot_ns: 0,
        deadline: Some(SystemTime::now() + Duration::from_secs(30)),
        detail: Detail::Dbus { member: "PrepareForShutdown".into(), unit: None },
    }
}

fn graceful_episode() -> (ShutdownSignal, Episode) {
    let s = logind_signal();
    let d = Decider::new().decide(&s);
    assert!(matches!(d.action, Action::Graceful { .. }));
    (s, d.episode.unwrap())
}

struct Setup {
    double: ApiDouble,
    nc: NodeClient,
    dir: std::path::PathBuf,
}

async fn setup(name: &str, pods: Vec<serde_json::Value>) -> Setup {
    let double = ApiDouble::start().await.unwrap();
    double.create_value(node()).unwrap();
    for p in pods {
        double.create_value(p).unwrap();
    }
    double.kubelet().set_default_termination(Duration::from_millis(100));
    let nc = NodeClient::start(double.client_without_retry().await, NODE).await.unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Setup { double, nc, dir }
}

fn opts(s: &Setup, buckets: Vec<Bucket>, removal: Removal) -> GracefulOptions {
    GracefulOptions {
        buckets,
        removal,
        own_pod: Some(("default".into(), "lastgasp-agent".into())),
        state_file: s.dir.join("graceful_node_shutdown_state"),
    }
}

/// Pod DELETE requests in order: (name, gracePeriodSeconds).
fn deletions(double: &ApiDouble) -> Vec<(String, i64)> {
    double
        .requests()
        .iter()
        .filter(|r| r.method == "DELETE" && r.path.contains("/pods/"))
        .map(|r| {
            let name = r.path.rsplit('/').next().unwrap().to_string();
            let grace = r
                .body
                .as_ref()
                .and_then(|b| b["gracePeriodSeconds"].as_i64())
                .or_else(|| r.query.split('&').find_map(|kv| kv.strip_prefix("gracePeriodSeconds=")?.parse().ok()))
                .unwrap_or(-1);
            (name, grace)
        })
        .collect()
}

fn condition(n: &Node) -> Option<(String, String)> {
    n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == CONDITION).map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

fn taint_keys(n: &Node) -> Vec<String> {
    n.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default().into_iter().map(|t| t.key).collect()
}

#[tokio::test]
async fn graceful_run_terminates_by_priority_with_kubelet_grace_semantics() {
    let s = setup(
        "graceful",
        vec![
            pod("low-a", None, None, json!({})),
            pod("low-b", Some(0), Some(1), json!({})),
            pod("mid", Some(1000), None, json!({})),
            pod("high", Some(100000), None, json!({})),
            pod("static", Some(2000001000), None, json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "abc"}}})),
            pod("done", Some(0), None, json!({"status": {"phase": "Succeeded"}})),
            pod("lastgasp-agent", Some(2000001000), None, json!({})),
        ],
    )
    .await;
    let buckets = vec![
        Bucket { priority: 0, seconds: 3 },
        Bucket { priority: 1000, seconds: 3 },
        Bucket { priority: 10000, seconds: 30 },
        Bucket { priority: 100000, seconds: 3 },
        Bucket { priority: 2000000000, seconds: 2 },
    ];
    let (sig, ep) = graceful_episode();
    let metrics = Metrics::default();
    let o = opts(&s, buckets, Removal::Delete);
    let report = graceful::run(&s.nc, &o, &ep, &json!({"episode": ep, "signal": sig}), &metrics).await.unwrap();

    // Order and grace periods: bucket by bucket, lowest first; the pod's own
    // shorter grace wins; our own pod last; mirror and finished pods untouched.
    let dels = deletions(&s.double);
    let names: Vec<&str> = dels.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 5, "{dels:?}");
    assert!(names[..2].contains(&"low-a") && names[..2].contains(&"low-b"), "{names:?}");
    assert_eq!(&names[2..], &["mid", "high", "lastgasp-agent"]);
    let grace: BTreeMap<_, _> = dels.into_iter().collect();
    assert_eq!(grace["low-a"], 3);
    assert_eq!(grace["low-b"], 1, "its own terminationGracePeriodSeconds is shorter");
    assert_eq!(grace["mid"], 3);
    assert_eq!(grace["high"], 3);
    let skipped: Vec<_> = report.pods.iter().filter(|p| p.how.starts_with("skipped")).map(|p| (p.name.as_str(), p.how.as_str())).collect();
    assert_eq!(skipped.len(), 2);
    assert!(skipped.contains(&("static", "skipped-mirror")) && skipped.contains(&("done", "skipped-finished")));

    // The empty 10000 bucket (30 s) was skipped, not waited for.
    let ran: Vec<i32> = report.buckets.iter().map(|b| b.priority).collect();
    assert_eq!(ran, vec![0, 1000, 100000]);
    assert!(report.buckets.iter().all(|b| !b.timed_out));
    assert!(report.buckets.windows(2).all(|w| w[1].started_ms >= w[0].ended_ms), "buckets run one after another");
    assert_eq!((report.terminated(), report.remaining()), (4, 0), "{report:#?}");

    // What the cluster sees.
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n), Some(("True".into(), "GracefulShutdown".into())));
    let keys = taint_keys(&n);
    assert!(keys.contains(&TAINT_KEY.to_string()) && keys.contains(&"example.com/other".to_string()), "{keys:?}");
    let kubelet_ready = n.status.unwrap().conditions.unwrap().iter().any(|c| c.type_ == "Ready" && c.status == "True");
    assert!(kubelet_ready, "the kubelet's Ready condition is kept (merged by type)");
    assert!(n.metadata.annotations.unwrap().contains_key(RECORD_ANNOTATION));
    let events: Vec<Event> = s.double.list("default");
    assert!(events.iter().any(|e| e.reason.as_deref() == Some("NodeShutdown")), "{events:?}");

    // The kubelet-compatible state file and gauges.
    let state = graceful::read_state(&o.state_file).unwrap().unwrap();
    assert!(humantime::parse_rfc3339(&state.start_time).is_ok() && humantime::parse_rfc3339(&state.end_time).is_ok(), "{state:?}");
    let m = metrics.encode();
    assert!(m.contains("graceful_shutdown_start_time_seconds") && !m.contains("graceful_shutdown_end_time_seconds 0.0"), "{m}");

    // Cancellation undoes it.
    graceful::cancel(&s.nc, &ep).await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n), Some(("False".into(), "ShutdownCancelled".into())));
    assert_eq!(taint_keys(&n), vec!["example.com/other".to_string()], "only our taint goes");
    let events: Vec<Event> = s.double.list("default");
    assert!(
        events.iter().any(|e| e.reason.as_deref() == Some("NodeShutdown") && e.note.as_deref().unwrap_or("").contains("cancellation")),
        "{events:?}"
    );
    std::fs::remove_dir_all(&s.dir).ok();
}

#[tokio::test]
async fn a_hanging_pod_holds_its_bucket_only_until_the_bucket_time() {
    let s = setup("hang", vec![pod("stuck", Some(0), None, json!({})), pod("after", Some(1000), None, json!({}))]).await;
    // A kubelet that never finishes the pods (stuck unmounts, say).
    s.double.kubelet().set_auto_finish(false);
    let (sig, ep) = graceful_episode();
    let o = opts(&s, vec![Bucket { priority: 0, seconds: 1 }, Bucket { priority: 1000, seconds: 2 }], Removal::Delete);
    let report = graceful::run(&s.nc, &o, &ep, &json!({"signal": sig}), &Metrics::default()).await.unwrap();
    assert_eq!(report.buckets.len(), 2);
    assert!(report.buckets.iter().all(|b| b.timed_out), "{report:?}");
    let b0 = &report.buckets[0];
    assert!(b0.ended_ms - b0.started_ms >= 1000, "the bucket had its full time: {b0:?}");
    assert!(report.buckets[1].started_ms >= b0.ended_ms, "then the next bucket ran");
    assert_eq!((report.terminated(), report.remaining()), (0, 2));
}

#[tokio::test]
async fn eviction_mode_honours_pdbs_and_falls_back_to_delete_near_the_end() {
    let db = |n: &str| pod(n, Some(0), None, json!({"metadata": {"labels": {"app": "db"}}}));
    let web = |n: &str| pod(n, Some(0), None, json!({"metadata": {"labels": {"app": "web"}}}));
    let s = setup("evict", vec![db("db-0"), db("db-1"), web("web-0"), web("web-1"), web("web-2")]).await;
    s.double
        .create_value(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "db-pdb", "namespace": "default"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "db"}}}
        }))
        .unwrap();
    s.double
        .create_value(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "web-pdb", "namespace": "default"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}
        }))
        .unwrap();
    let (sig, ep) = graceful_episode();
    let o = opts(&s, vec![Bucket { priority: 0, seconds: 4 }], Removal::Evict);
    let report = graceful::run(&s.nc, &o, &ep, &json!({"signal": sig}), &Metrics::default()).await.unwrap();
    let how: BTreeMap<&str, &str> = report.pods.iter().map(|p| (p.name.as_str(), p.how.as_str())).collect();
    assert_eq!(how["db-0"], "delete-after-pdb", "{report:#?}");
    assert_eq!(how["db-1"], "delete-after-pdb");
    let db0 = report.pods.iter().find(|p| p.name == "db-0").unwrap();
    assert!(db0.note.as_deref().unwrap_or("").contains("db-pdb"), "the refusal names the budget: {db0:?}");
    // web: two of three may go (minAvailable 1); the third falls back.
    let mut web: Vec<&str> = ["web-0", "web-1", "web-2"].iter().map(|n| how[n]).collect();
    web.sort();
    assert_eq!(web, vec!["delete-after-pdb", "evict", "evict"]);
    let evictions: Vec<_> = s.double.requests().into_iter().filter(|r| r.path.ends_with("/eviction")).collect();
    let codes: Vec<u16> = evictions.iter().map(|r| r.status).collect();
    assert!(codes.contains(&429) && codes.contains(&201), "{codes:?}");
    let sent_grace = evictions[0].body.as_ref().unwrap()["deleteOptions"]["gracePeriodSeconds"].as_i64();
    assert_eq!(sent_grace, Some(4), "the eviction carries the bucket's grace period");
    assert_eq!(report.remaining(), 0);
}

#[tokio::test]
async fn condition_and_taint_retry_through_409_and_5xx() {
    let s = setup("retry", vec![]).await;
    s.double.inject(Fault::status(500).method("PATCH").path_prefix("/api/v1/nodes/n1/status").times(2));
    s.double.inject(Fault::status(409).method("PATCH").path_regex("^/api/v1/nodes/n1$").unwrap().times(1));
    s.double.inject(Fault::status(503).method("GET").path_prefix("/api/v1/nodes/n1").times(1));
    s.nc.set_condition(true, "GracefulShutdown", "test").await.unwrap();
    s.nc.set_taint(true).await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n).unwrap().0, "True");
    assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
    let statuses: Vec<u16> = s
        .double
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH" && r.path == "/api/v1/nodes/n1/status")
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses, vec![500, 500, 200]);
}

/// A concurrent writer changes the taints between our read and our write:
/// the stale resourceVersion gets a real 409, and the retry keeps both.
#[tokio::test]
async fn taint_update_survives_a_concurrent_writer() {
    let s = setup("conflict", vec![]).await;
    s.double.inject(Fault::latency(Duration::from_millis(300)).method("PATCH").path_prefix("/api/v1/nodes/n1").times(1));
    let writer = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.double
            .modify::<Node, _>("", NODE, |n| {
                n.spec.as_mut().unwrap().taints.as_mut().unwrap().push(k8s_openapi::api::core::v1::Taint {
                    key: "example.com/late".into(),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                });
            })
            .unwrap();
    };
    let (r, _) = tokio::join!(s.nc.set_taint(true), writer);
    r.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    let keys = taint_keys(&n);
    assert!(keys.contains(&"example.com/late".to_string()) && keys.contains(&TAINT_KEY.to_string()), "{keys:?}");
    assert!(s.double.requests().iter().any(|r| r.method == "PATCH" && r.status == 409));
}

#[tokio::test]
async fn last_gasp_sets_condition_taint_and_record_in_one_round_trip() {
    let s = setup("lastgasp", vec![]).await;
    let lg = LastGasp::start(s.double.client_without_retry().await, s.double.client_without_retry().await, NODE).await.unwrap();
    let mut sig = logind_signal();
    sig.source = Source::RebootSyscall;
    sig.forced = true;
    let ep = Decider::new().decide(&sig).episode.unwrap();
    let (status, spec) = lg.bodies("ForcedShutdown", "poweroff", &json!({"episode": ep, "signal": sig}), SystemTime::now());
    s.double.clear_requests();
    let sent = lg.send(&status, &spec).await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n), Some(("True".into(), "ForcedShutdown".into())));
    let keys = taint_keys(&n);
    assert!(keys.contains(&TAINT_KEY.to_string()) && keys.contains(&"example.com/other".to_string()), "{keys:?}");
    let rec: serde_json::Value = serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
    assert_eq!(rec["signal"]["kind"], "poweroff");
    // Nothing but the two patches: no list, no discovery, no GET.
    let reqs = s.double.requests();
    let paths: Vec<(String, String)> = reqs.iter().filter(|r| !r.watch).map(|r| (r.method.clone(), r.path.clone())).collect();
    assert_eq!(paths.len(), 2, "{paths:?}");
    assert!(paths.iter().all(|(m, _)| m == "PATCH"));
    assert!(sent.status_done > Duration::ZERO && sent.spec_done > Duration::ZERO);
}

#[tokio::test]
async fn the_pod_watch_sees_only_this_node() {
    let s = setup("watch", vec![pod("mine", None, None, json!({}))]).await;
    s.double
        .create_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "theirs", "namespace": "default"},
            "spec": {"nodeName": "n2", "containers": [{"name": "c", "image": "x"}]}}))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let names: Vec<String> = s.nc.pods.state().iter().map(|p| p.metadata.name.clone().unwrap()).collect();
    assert_eq!(names, vec!["mine".to_string()]);
    let _: Vec<Pod> = s.double.list("default");
}
