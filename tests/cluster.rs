//! The graceful path and the last gasp, end to end against the Kubernetes API
//! double (real HTTP/JSON, kube-rs unchanged). No root needed.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::{
    core::v1::{Node, Pod},
    events::v1::Event,
};
use lastgasp::{
    act::{
        kube::{
            graceful::{self, GracefulOptions, Removal},
            lastgasp::{LastGasp, Refusal},
            NodeClient, CONDITION, RECORD_ANNOTATION, TAINT_KEY,
        },
        metrics::Metrics,
    },
    decide::{Action, Decider, Episode},
    grace::Bucket,
    record::{self, Closing, ShutdownRecord},
    signal::{Scope, ShutdownSignal, Source},
};
use lastgasp_apidouble::{ApiDouble, Fault};
use lastgasp_tests::support::{agent_at, forced_exec, logind_signal, record_of};
use serde_json::json;

const NODE: &str = "n1";

/// The record annotation of NODE, as written by some earlier agent.
fn put_record(s: &Setup, v: &str) {
    s.double
        .modify::<Node, _>("", NODE, |n| {
            n.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(RECORD_ANNOTATION.into(), v.into());
        })
        .unwrap();
}

fn node() -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "spec": {"taints": [{"key": "example.com/other", "value": "x", "effect": "PreferNoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}
    })
}

fn pod(
    name: &str,
    priority: Option<i32>,
    tgps: Option<i64>,
    extra: serde_json::Value,
) -> serde_json::Value {
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

fn graceful_episode() -> (ShutdownSignal, Episode) {
    let s = logind_signal();
    let d = Decider::new().decide(&s);
    assert!(matches!(d.action, Action::Graceful { .. }));
    (s, d.episode.unwrap())
}

/// One drain of the node for a logind power-off, with its record.
async fn drain(
    s: &Setup,
    o: &GracefulOptions,
    metrics: &Metrics,
) -> anyhow::Result<graceful::GracefulReport> {
    let (sig, ep) = graceful_episode();
    graceful::run(&s.nc, o, &ep, &record_of("boot-x", &sig), metrics).await
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
    double
        .kubelet()
        .set_default_termination(Duration::from_millis(100));
    let nc = NodeClient::start(double.client_without_retry().await, NODE)
        .await
        .unwrap();
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
        keep: Default::default(),
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
                .or_else(|| {
                    r.query
                        .split('&')
                        .find_map(|kv| kv.strip_prefix("gracePeriodSeconds=")?.parse().ok())
                })
                .unwrap_or(-1);
            (name, grace)
        })
        .collect()
}

fn condition(n: &Node) -> Option<(String, String)> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION)
        .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

fn taint_keys(n: &Node) -> Vec<String> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect()
}

/// `podRemoval: none` announces only (condition, taint, record, Events) and
/// removes no pod; `ignoreDaemonSets`, `excludeNamespaces` and
/// `excludePodLabels` leave their pods out of a drain.
#[tokio::test]
async fn announce_only_and_the_pods_a_drain_leaves() {
    let s = setup(
        "keep",
        vec![
            pod("web", Some(0), None, json!({})),
            pod(
                "ds-pod",
                Some(0),
                None,
                json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u1"}]}}),
            ),
            pod("kept", Some(0), None, json!({"metadata": {"labels": {"keep": "yes"}}})),
        ],
    )
    .await;
    let buckets = vec![Bucket {
        priority: 0,
        seconds: 3,
    }];
    let announce = opts(&s, buckets.clone(), Removal::None);
    let r = drain(&s, &announce, &Metrics::default()).await.unwrap();
    assert!(
        deletions(&s.double).is_empty(),
        "announce only: no pod removed"
    );
    assert!(
        r.pods.iter().all(|p| p.how == "skipped-announce-only"),
        "{r:#?}"
    );
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n).map(|c| c.1), Some("GracefulShutdown".into()));
    assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
    let types = |n: &Node| -> Vec<String> {
        let conds = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        conds.into_iter().map(|c| c.type_).collect()
    };
    assert!(
        !types(&n)
            .iter()
            .any(|t| t == "DrainInProgress" || t == "Drained"),
        "announce only drains nothing, and says no drain: {:?}",
        types(&n)
    );

    let mut keep = opts(&s, buckets, Removal::Delete);
    keep.keep.daemonsets = true;
    keep.keep.labels.insert("keep".into(), "yes".into());
    let r = drain(&s, &keep, &Metrics::default()).await.unwrap();
    let how = |name: &str| {
        r.pods
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.how.clone())
    };
    assert_eq!(how("ds-pod").as_deref(), Some("skipped-daemonset"));
    assert_eq!(how("kept").as_deref(), Some("skipped-labels"));
    assert_eq!(how("web").as_deref(), Some("delete"));
    let n: Node = s.double.get("", NODE).unwrap();
    let drained = n.status.and_then(|s| s.conditions).unwrap_or_default();
    let st = |t: &str| {
        drained
            .iter()
            .find(|c| c.type_ == t)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    assert_eq!(
        st("DrainInProgress"),
        Some(("False".into(), Some("NodeShutdown".into())))
    );
    assert_eq!(
        st("Drained"),
        Some(("True".into(), Some("NodeShutdown".into())))
    );
    assert_eq!(
        deletions(&s.double)
            .into_iter()
            .map(|(n, _)| n)
            .collect::<Vec<_>>(),
        vec!["web".to_string()]
    );
}

/// The kubelet-compatible state file cannot be written (a read-only or
/// full disk): the drain goes on all the same.
#[tokio::test]
async fn a_state_file_that_cannot_be_written_does_not_stop_the_drain() {
    let s = setup("statefile", vec![pod("web", Some(0), None, json!({}))]).await;
    let mut o = opts(
        &s,
        vec![Bucket {
            priority: 0,
            seconds: 3,
        }],
        Removal::Delete,
    );
    o.state_file = "/proc/lastgasp-no-such-dir/graceful_node_shutdown_state".into();
    let metrics = Metrics::default();
    let r = drain(&s, &o, &metrics).await.expect("the drain ran");
    assert_eq!((r.terminated(), r.remaining()), (1, 0), "{r:#?}");
    assert!(
        metrics
            .encode()
            .contains("lastgasp_audit_write_failures_total 2"),
        "both writes counted: {}",
        metrics.encode()
    );
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
            pod(
                "static",
                Some(2000001000),
                None,
                json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "abc"}}}),
            ),
            pod(
                "done",
                Some(0),
                None,
                json!({"status": {"phase": "Succeeded"}}),
            ),
            pod("lastgasp-agent", Some(2000001000), None, json!({})),
        ],
    )
    .await;
    let buckets = vec![
        Bucket {
            priority: 0,
            seconds: 3,
        },
        Bucket {
            priority: 1000,
            seconds: 3,
        },
        Bucket {
            priority: 10000,
            seconds: 30,
        },
        Bucket {
            priority: 100000,
            seconds: 3,
        },
        Bucket {
            priority: 2000000000,
            seconds: 2,
        },
    ];
    let metrics = Metrics::default();
    let o = opts(&s, buckets, Removal::Delete);
    let report = drain(&s, &o, &metrics).await.unwrap();

    // The start's writes do not trip over each other (a 409 costs a backoff).
    let conflicts: Vec<String> = s
        .double
        .requests()
        .iter()
        .filter(|r| r.status == 409)
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(
        conflicts.is_empty(),
        "conflicts at the graceful start: {conflicts:?}"
    );

    // Order and grace periods: bucket by bucket, lowest first; the pod's own
    // shorter grace wins; our own pod stays (it must live to send its last
    // word); mirror and finished pods untouched.
    let dels = deletions(&s.double);
    let names: Vec<&str> = dels.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 4, "{dels:?}");
    assert!(
        names[..2].contains(&"low-a") && names[..2].contains(&"low-b"),
        "{names:?}"
    );
    assert_eq!(&names[2..], &["mid", "high"]);
    let grace: BTreeMap<_, _> = dels.into_iter().collect();
    assert_eq!(grace["low-a"], 3);
    assert_eq!(
        grace["low-b"], 1,
        "its own terminationGracePeriodSeconds is shorter"
    );
    assert_eq!(grace["mid"], 3);
    assert_eq!(grace["high"], 3);
    let skipped: Vec<_> = report
        .pods
        .iter()
        .filter(|p| p.how.starts_with("skipped"))
        .map(|p| (p.name.as_str(), p.how.as_str()))
        .collect();
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    assert!(
        skipped.contains(&("static", "skipped-mirror"))
            && skipped.contains(&("done", "skipped-finished"))
            && skipped.contains(&("lastgasp-agent", "skipped-self"))
    );

    // The empty 10000 bucket (30 s) was skipped, not waited for.
    let ran: Vec<i32> = report.buckets.iter().map(|b| b.priority).collect();
    assert_eq!(ran, vec![0, 1000, 100000]);
    assert!(report.buckets.iter().all(|b| !b.timed_out));
    assert!(
        report
            .buckets
            .windows(2)
            .all(|w| w[1].started_ms >= w[0].ended_ms),
        "buckets run one after another"
    );
    assert_eq!(
        (report.terminated(), report.remaining()),
        (4, 0),
        "{report:#?}"
    );

    // What the cluster sees.
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        condition(&n),
        Some(("True".into(), "GracefulShutdown".into()))
    );
    let keys = taint_keys(&n);
    assert!(
        keys.contains(&TAINT_KEY.to_string()) && keys.contains(&"example.com/other".to_string()),
        "{keys:?}"
    );
    let kubelet_ready = n
        .status
        .unwrap()
        .conditions
        .unwrap()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    assert!(
        kubelet_ready,
        "the kubelet's Ready condition is kept (merged by type)"
    );
    assert!(n
        .metadata
        .annotations
        .unwrap()
        .contains_key(RECORD_ANNOTATION));
    let events: Vec<Event> = s.double.list("default");
    let notes: Vec<&str> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("NodeShutdown"))
        .filter_map(|e| e.note.as_deref())
        .collect();
    // Two Events under one action: the end's text is not folded into the
    // start's series (kube's Recorder keys without the note).
    assert!(
        notes.iter().any(|n| n.contains("detected shutdown event"))
            && notes.iter().any(|n| n.contains("graceful shutdown done")),
        "{notes:?}"
    );

    // The kubelet-compatible state file and gauges.
    let state = graceful::read_state(&o.state_file).unwrap().unwrap();
    assert!(
        humantime::parse_rfc3339(&state.start_time).is_ok()
            && humantime::parse_rfc3339(&state.end_time).is_ok(),
        "{state:?}"
    );
    let m = metrics.encode();
    assert!(
        m.contains("graceful_shutdown_start_time_seconds")
            && !m.contains("graceful_shutdown_end_time_seconds 0.0"),
        "{m}"
    );

    // Cancellation undoes it.
    graceful::cancel(&s.nc, &graceful_episode().1)
        .await
        .unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        condition(&n),
        Some(("False".into(), "ShutdownCancelled".into()))
    );
    assert_eq!(
        taint_keys(&n),
        vec!["example.com/other".to_string()],
        "only our taint goes"
    );
    let events: Vec<Event> = s.double.list("default");
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("NodeShutdown")
                && e.note.as_deref().unwrap_or("").contains("cancellation")),
        "{events:?}"
    );
    std::fs::remove_dir_all(&s.dir).ok();
}

#[tokio::test]
async fn a_hanging_pod_holds_its_bucket_only_until_the_bucket_time() {
    let s = setup(
        "hang",
        vec![
            pod("stuck", Some(0), None, json!({})),
            pod("after", Some(1000), None, json!({})),
        ],
    )
    .await;
    // A kubelet that never finishes the pods (stuck unmounts, say).
    s.double.kubelet().set_auto_finish(false);
    let o = opts(
        &s,
        vec![
            Bucket {
                priority: 0,
                seconds: 1,
            },
            Bucket {
                priority: 1000,
                seconds: 2,
            },
        ],
        Removal::Delete,
    );
    let report = drain(&s, &o, &Metrics::default()).await.unwrap();
    assert_eq!(report.buckets.len(), 2);
    assert!(report.buckets.iter().all(|b| b.timed_out), "{report:?}");
    let b0 = &report.buckets[0];
    assert!(
        b0.ended_ms - b0.started_ms >= 1000,
        "the bucket had its full time: {b0:?}"
    );
    assert!(
        report.buckets[1].started_ms >= b0.ended_ms,
        "then the next bucket ran"
    );
    assert_eq!((report.terminated(), report.remaining()), (0, 2));
}

#[tokio::test]
async fn eviction_mode_honours_pdbs_and_falls_back_to_delete_near_the_end() {
    let db = |n: &str| {
        pod(
            n,
            Some(0),
            None,
            json!({"metadata": {"labels": {"app": "db"}}}),
        )
    };
    let web = |n: &str| {
        pod(
            n,
            Some(0),
            None,
            json!({"metadata": {"labels": {"app": "web"}}}),
        )
    };
    let s = setup(
        "evict",
        vec![
            db("db-0"),
            db("db-1"),
            web("web-0"),
            web("web-1"),
            web("web-2"),
        ],
    )
    .await;
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
    let o = opts(
        &s,
        vec![Bucket {
            priority: 0,
            seconds: 4,
        }],
        Removal::Evict,
    );
    let report = drain(&s, &o, &Metrics::default()).await.unwrap();
    let how: BTreeMap<&str, &str> = report
        .pods
        .iter()
        .map(|p| (p.name.as_str(), p.how.as_str()))
        .collect();
    assert_eq!(how["db-0"], "delete-after-pdb", "{report:#?}");
    assert_eq!(how["db-1"], "delete-after-pdb");
    let db0 = report.pods.iter().find(|p| p.name == "db-0").unwrap();
    assert!(
        db0.note.as_deref().unwrap_or("").contains("db-pdb"),
        "the refusal names the budget: {db0:?}"
    );
    // web: two of three may go (minAvailable 1); the third falls back.
    let mut web: Vec<&str> = ["web-0", "web-1", "web-2"].iter().map(|n| how[n]).collect();
    web.sort();
    assert_eq!(web, vec!["delete-after-pdb", "evict", "evict"]);
    let evictions: Vec<_> = s
        .double
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/eviction"))
        .collect();
    let codes: Vec<u16> = evictions.iter().map(|r| r.status).collect();
    assert!(codes.contains(&429) && codes.contains(&201), "{codes:?}");
    let sent_grace =
        evictions[0].body.as_ref().unwrap()["deleteOptions"]["gracePeriodSeconds"].as_i64();
    assert_eq!(
        sent_grace,
        Some(4),
        "the eviction carries the bucket's grace period"
    );
    assert_eq!(report.remaining(), 0);
}

#[tokio::test]
async fn condition_and_taint_retry_through_409_and_5xx() {
    let s = setup("retry", vec![]).await;
    s.double.inject(
        Fault::status(500)
            .method("PATCH")
            .path_prefix("/api/v1/nodes/n1/status")
            .times(2),
    );
    s.double.inject(
        Fault::status(409)
            .method("PATCH")
            .path_regex("^/api/v1/nodes/n1$")
            .unwrap()
            .times(1),
    );
    s.double.inject(
        Fault::status(503)
            .method("GET")
            .path_prefix("/api/v1/nodes/n1")
            .times(1),
    );
    s.nc.set_condition(true, "GracefulShutdown", "test")
        .await
        .unwrap();
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
    s.double.inject(
        Fault::latency(Duration::from_millis(300))
            .method("PATCH")
            .path_prefix("/api/v1/nodes/n1")
            .times(1),
    );
    let writer = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.double
            .modify::<Node, _>("", NODE, |n| {
                n.spec.as_mut().unwrap().taints.as_mut().unwrap().push(
                    k8s_openapi::api::core::v1::Taint {
                        key: "example.com/late".into(),
                        effect: "NoSchedule".into(),
                        ..Default::default()
                    },
                );
            })
            .unwrap();
    };
    let (r, _) = tokio::join!(s.nc.set_taint(true), writer);
    r.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    let keys = taint_keys(&n);
    assert!(
        keys.contains(&"example.com/late".to_string()) && keys.contains(&TAINT_KEY.to_string()),
        "{keys:?}"
    );
    assert!(s
        .double
        .requests()
        .iter()
        .any(|r| r.method == "PATCH" && r.status == 409));
}

#[tokio::test]
async fn last_gasp_sends_the_evidence_in_one_write_then_the_rest() {
    let s = setup("lastgasp", vec![]).await;
    let lg = LastGasp::start(
        s.double.client_without_retry().await,
        s.double.client_without_retry().await,
        NODE,
    )
    .await
    .unwrap();
    let mut sig = logind_signal();
    sig.source = Source::RebootSyscall;
    sig.forced = true;
    let ep = Decider::new().decide(&sig).episode.unwrap();
    let bodies = lg.bodies(
        "ForcedShutdown",
        "poweroff",
        &ShutdownRecord::new("boot-x", &sig, &ep),
        SystemTime::now(),
    );
    // No time left (a reboot(2)): the evidence alone.
    s.double.clear_requests();
    let sent = lg.send(&bodies, Instant::now()).await.unwrap();
    assert_eq!(sent.tries, 1);
    assert!(sent.condition.is_err() && sent.taint.is_err(), "{sent:?}");
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n), None);
    assert_eq!(taint_keys(&n), ["example.com/other"]);
    let rec: serde_json::Value =
        serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
    assert_eq!(rec["signal"]["kind"], "poweroff");
    assert!(rec["signal"].get("detail").is_none(), "{rec}");
    let writes = |s: &Setup| -> Vec<(String, String)> {
        s.double
            .requests()
            .iter()
            .filter(|r| !r.watch)
            .map(|r| (r.method.clone(), r.path.clone()))
            .collect()
    };
    // Nothing but the one write: no list, no discovery, no GET; and in it
    // only the record (annotations merge by key: nothing read, nothing stale).
    assert_eq!(
        writes(&s),
        vec![("PATCH".to_string(), format!("/api/v1/nodes/{NODE}"))]
    );
    let body = s
        .double
        .requests()
        .into_iter()
        .find(|r| r.method == "PATCH")
        .unwrap()
        .body
        .unwrap();
    assert_eq!(
        body["metadata"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["annotations"]
    );
    assert_eq!(body.as_object().unwrap().len(), 1, "{body}");
    // With time left, the condition and the taint follow the evidence,
    // side by side, never beside it.
    s.double.clear_requests();
    let sent = lg
        .send(&bodies, Instant::now() + Duration::from_secs(2))
        .await
        .unwrap();
    let (c, t) = (sent.condition.clone().unwrap(), sent.taint.clone().unwrap());
    assert!(
        c >= sent.evidence_done && t >= sent.evidence_done,
        "{sent:?}"
    );
    let w = writes(&s);
    assert_eq!(w.len(), 3, "{w:?}");
    assert_eq!(w[0], ("PATCH".to_string(), format!("/api/v1/nodes/{NODE}")));
    assert!(w.contains(&("PATCH".to_string(), format!("/api/v1/nodes/{NODE}/status"))));
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        condition(&n),
        Some(("True".into(), "ForcedShutdown".into()))
    );
    let keys = taint_keys(&n);
    assert!(
        keys.contains(&TAINT_KEY.to_string()) && keys.contains(&"example.com/other".to_string()),
        "{keys:?}"
    );
}

/// A 429 is sent again only when the server's wait ends before the node's
/// expected end; otherwise the evidence is reported undelivered at once.
#[tokio::test]
async fn a_refused_last_gasp_is_not_retried_past_the_nodes_end() {
    let s = setup("lastgasp-429", vec![]).await;
    let lg = LastGasp::start(
        s.double.client_without_retry().await,
        s.double.client_without_retry().await,
        NODE,
    )
    .await
    .unwrap();
    let bodies = lg.bodies(
        "ForcedShutdown",
        "poweroff",
        &record_of("boot-x", &forced_exec()),
        SystemTime::now(),
    );
    let evidence_path = format!("/api/v1/nodes/{NODE}");
    let patches = |s: &Setup| {
        s.double
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH" && r.path == evidence_path)
            .map(|r| r.status)
            .collect::<Vec<u16>>()
    };
    // The wait (1 s) ends after the end (0.5 s): one send, and why.
    s.double.clear_requests();
    s.double.inject(
        Fault::status(429)
            .retry_after(1)
            .method("PATCH")
            .path_prefix(&evidence_path),
    );
    let t = Instant::now();
    let e = lg
        .send(&bodies, t + Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(e.tries, 1);
    assert!(
        matches!(e.last, Refusal::Status { code: 429, retry_after: Some(w), .. } if w == Duration::from_secs(1)),
        "{e}"
    );
    assert!(e.to_string().contains("after the next boot"), "{e}");
    assert_eq!(patches(&s), vec![429]);
    // The wait ends before the end (3 s): sent again once it is over.
    s.double.clear_requests();
    s.double.inject(
        Fault::status(429)
            .retry_after(1)
            .method("PATCH")
            .path_prefix(&evidence_path),
    );
    let t = Instant::now();
    let sent = lg.send(&bodies, t + Duration::from_secs(3)).await.unwrap();
    assert_eq!(sent.tries, 2);
    assert!(sent.evidence_done >= Duration::from_secs(1), "{sent:?}");
    // The evidence twice, then (time left) the taint on the same path.
    assert_eq!(patches(&s), vec![429, 200, 200]);
    // Any other refusal is final.
    s.double.clear_requests();
    s.double.inject(
        Fault::status(403)
            .method("PATCH")
            .path_prefix(&evidence_path),
    );
    let e = lg
        .send(&bodies, Instant::now() + Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!((e.tries, patches(&s)), (1, vec![403]));
}

#[tokio::test]
async fn the_pod_watch_sees_only_this_node() {
    let s = setup("watch", vec![pod("mine", None, None, json!({}))]).await;
    s.double
        .create_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "theirs", "namespace": "default"},
            "spec": {"nodeName": "n2", "containers": [{"name": "c", "image": "x"}]}}))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let names: Vec<String> =
        s.nc.pods
            .state()
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
    assert_eq!(names, vec!["mine".to_string()]);
    let _: Vec<Pod> = s.double.list("default");
}

mod agent_flow {
    use std::sync::Arc;

    use lastgasp::{
        act::audit::{self, AuditLog, Entry, Outcome},
        act::{Cluster, LAST_GASP_BOUND},
        agent::Agent,
        decide::{DecisionPolicy, HostAnswer, HostQuery},
    };

    use super::*;

    async fn cluster(s: &Setup) -> Arc<Cluster> {
        let lg = LastGasp::start(
            s.double.client_without_retry().await,
            s.double.client_without_retry().await,
            NODE,
        )
        .await
        .unwrap();
        Arc::new(Cluster {
            node: s.nc.clone(),
            lastgasp: lg,
            graceful: Arc::new(opts(
                s,
                vec![Bucket {
                    priority: 0,
                    seconds: 2,
                }],
                Removal::Delete,
            )),
        })
    }

    fn records(dir: &std::path::Path) -> Vec<audit::AuditRecord> {
        audit::read(&dir.join(audit::FILE_NAME)).unwrap().records
    }

    /// The API server is down when the node dies: the record waits on disk
    /// and reaches the cluster after the next boot, which clears the marks
    /// once the node is Ready.
    #[tokio::test]
    async fn a_last_gasp_lost_to_a_dead_api_server_is_delivered_after_the_next_boot() {
        let s = setup("nextboot", vec![]).await;
        let c = cluster(&s).await;
        s.double.inject(Fault::status(503).method("PATCH").always());
        let mut agent = agent_at(&s.dir, "boot-1", Some(c.clone()));
        let d = agent.handle(forced_exec()).await.unwrap();
        assert!(matches!(d.action, Action::Immediate { escalated: false }));
        let recs = records(&s.dir);
        assert!(
            matches!(recs[0].entry, Entry::Signal { .. }),
            "the signal is on disk first"
        );
        assert!(
            recs.iter().any(|r| matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::LastGaspFailed { .. },
                    ..
                }
            )),
            "{recs:#?}"
        );
        let n: Node = s.double.get("", NODE).unwrap();
        assert!(condition(&n).is_none(), "nothing reached the cluster");

        // The next boot, with the API server back. The node is still shown
        // with a shutdown taint from the old boot, and NotReady at first.
        s.double.clear_faults();
        s.nc.set_taint(true).await.unwrap();
        s.double
            .modify::<Node, _>("", NODE, |n| {
                n.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "False".into();
            })
            .unwrap();
        drop(agent);
        let mut next = agent_at(&s.dir, "boot-2", Some(c.clone()));
        let after = next
            .after_boot("boot-2")
            .await
            .unwrap()
            .expect("a previous boot");
        after.delivery.expect("cluster mode").await.unwrap();
        let report = after.report;
        assert_eq!(report.boot_id, "boot-1");
        assert_eq!(report.end, lastgasp::act::report::BootEnd::Forced);
        assert!(report.undelivered);
        let events: Vec<Event> = s.double.list("default");
        let ev = events
            .iter()
            .find(|e| e.action.as_deref() == Some("PreviousBoot"))
            .expect("a previous-boot event");
        let note = ev.note.clone().unwrap_or_default();
        assert!(
            note.contains("ended forced") && note.contains("reboot -ff"),
            "{note}"
        );
        let rec = record::of_node(&s.double.get::<Node>("", NODE).unwrap())
            .unwrap()
            .unwrap();
        assert!(rec.delivered_late);
        assert_eq!(
            rec.closed.map(|c| c.how),
            Some(Closing::Back),
            "a late record is closed: the node is back"
        );
        assert!(records(&s.dir).iter().any(|r| matches!(&r.entry, Entry::Outcome { outcome: Outcome::DeliveredLate { boot_id }, .. } if boot_id == "boot-1")));

        // Ready again: our taint goes, the record is marked back.
        s.double
            .modify::<Node, _>("", NODE, |n| {
                n.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "True".into();
            })
            .unwrap();
        let mut cleared = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let n: Node = s.double.get("", NODE).unwrap();
            let rec = record::of_node(&n).unwrap().unwrap();
            if !taint_keys(&n).contains(&TAINT_KEY.to_string())
                && rec.closed.is_some_and(|c| c.how == Closing::Back)
            {
                cleared = true;
                break;
            }
        }
        assert!(
            cleared,
            "the agent's taint and record were cleared once Ready"
        );

        // A third boot does not deliver it again.
        drop(next);
        let mut third = agent_at(&s.dir, "boot-3", Some(c));
        let r = third.after_boot("boot-3").await.unwrap().unwrap().report;
        assert_eq!(
            (r.boot_id.as_str(), r.end),
            ("boot-2", lastgasp::act::report::BootEnd::Unannounced)
        );
    }

    /// With the API server hanging at start, telling the cluster how the
    /// previous boot ended runs beside the loop: `after_boot` returns while
    /// that delivery still waits, and the next shutdown is audited and its
    /// last gasp sent at once.
    #[tokio::test]
    async fn the_previous_boot_report_does_not_hold_up_the_next_shutdown() {
        let s = setup("bootdown", vec![]).await;
        let c = cluster(&s).await;
        AuditLog::open(&s.dir, "boot-1")
            .unwrap()
            .agent_start()
            .unwrap();
        let hang = s
            .double
            .inject(Fault::latency(Duration::from_secs(600)).method("POST"));
        let mut agent = agent_at(&s.dir, "boot-2", Some(c));
        let after = agent.after_boot("boot-2").await.unwrap().expect("boot-1");
        assert_eq!(
            after.report.end,
            lastgasp::act::report::BootEnd::Unannounced
        );
        let delivery = after.delivery.expect("cluster mode delivers");
        let d = agent.handle(forced_exec()).await.unwrap();
        assert!(matches!(d.action, Action::Immediate { escalated: false }));
        assert!(
            !delivery.is_finished(),
            "the PreviousBoot Event is still waiting on the hung POST"
        );
        let recs = records(&s.dir);
        assert!(
            recs.iter().any(|r| r.boot_id == "boot-2"
                && matches!(
                    &r.entry,
                    Entry::Outcome {
                        outcome: Outcome::LastGaspDelivered { .. },
                        ..
                    }
                )),
            "boot-2's shutdown was audited and its last gasp delivered: {recs:#?}"
        );
        delivery.abort();
        s.double.remove_fault(hang);
    }

    /// The previous boot's undelivered record, delivered late, never
    /// replaces a record of this boot: a shutdown of this boot already on
    /// the Node (its last gasp got there first) is what the controller must
    /// see.
    #[tokio::test]
    async fn a_late_record_never_replaces_this_boots_record() {
        let s = setup("latenewer", vec![]).await;
        let c = cluster(&s).await;
        let fault = s.double.inject(Fault::status(503).method("PATCH").always());
        let mut agent = agent_at(&s.dir, "boot-1", Some(c.clone()));
        agent.handle(forced_exec()).await.unwrap();
        s.double.remove_fault(fault);
        let this_boot = record_of("boot-2", &logind_signal()).to_json();
        put_record(&s, &this_boot);
        drop(agent);
        let mut next = agent_at(&s.dir, "boot-2", Some(c));
        let after = next.after_boot("boot-2").await.unwrap().unwrap();
        assert!(after.report.undelivered);
        after.delivery.unwrap().await.unwrap();
        let n: Node = s.double.get("", NODE).unwrap();
        assert_eq!(
            n.metadata.annotations.unwrap()[RECORD_ANNOTATION],
            this_boot
        );
        assert!(
            !records(&s.dir).iter().any(|r| matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::DeliveredLate { .. },
                    ..
                }
            )),
            "not delivered, and not audited as delivered"
        );
    }

    /// The last gasp does not wait for the disk: with the audit fdatasync
    /// held (a loaded disk), both patches reach the API server, and `handle`
    /// returns only once the record is synced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_last_gasp_leaves_while_its_record_syncs() {
        let s = setup("beside", vec![]).await;
        let c = cluster(&s).await;
        let mut audit = AuditLog::open(&s.dir, "boot-1").unwrap();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = std::sync::Mutex::new(held);
        audit.before_beside_sync(move || {
            let _ = held.lock().unwrap().recv();
        });
        let mut agent = Agent::new(audit, Some(c), None, Metrics::default());
        let handled = tokio::spawn(async move { agent.handle(forced_exec()).await });
        let mut on_node = None;
        for _ in 0..100 {
            let n: Node = s.double.get("", NODE).unwrap();
            let rec = n
                .metadata
                .annotations
                .clone()
                .unwrap_or_default()
                .get(RECORD_ANNOTATION)
                .cloned();
            if rec.is_some() && condition(&n).is_some() {
                on_node = rec;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let rec: serde_json::Value =
            serde_json::from_str(&on_node.expect("both patches reached the API server")).unwrap();
        assert_eq!(rec["boot_id"], "boot-1");
        assert!(
            !handled.is_finished(),
            "the patches left while the audit fdatasync was still held"
        );
        release.send(()).unwrap();
        let d = handled.await.unwrap().unwrap();
        assert!(matches!(d.action, Action::Immediate { escalated: false }));
        let recs = records(&s.dir);
        assert!(matches!(recs[0].entry, Entry::Signal { .. }), "{recs:#?}");
        assert!(
            recs.iter().any(|r| matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::LastGaspDelivered { .. },
                    ..
                }
            )),
            "{recs:#?}"
        );
    }

    /// A boot whose last gasp the cluster acknowledged while the disk lost
    /// its audit record (the node died inside the fdatasync): the next boot
    /// finds it on the Node and reports the boot as forced, audits where it
    /// came from, and sends nothing late.
    #[tokio::test]
    async fn a_last_gasp_the_disk_lost_is_found_on_the_node() {
        let s = setup("lostdisk", vec![]).await;
        let c = cluster(&s).await;
        // The record reached the Node; this log is what survived on disk:
        // the agent's start, not the detection.
        let gone = s.dir.with_extension("gone");
        let _ = std::fs::remove_dir_all(&gone);
        let mut first = agent_at(&gone, "boot-1", Some(c.clone()));
        first.handle(forced_exec()).await.unwrap();
        AuditLog::open(&s.dir, "boot-1")
            .unwrap()
            .agent_start()
            .unwrap();
        let metrics = Metrics::default();
        let mut next = Agent::new(
            AuditLog::open(&s.dir, "boot-2").unwrap(),
            Some(c),
            None,
            metrics.clone(),
        );
        let after = next.after_boot("boot-2").await.unwrap().unwrap();
        assert_eq!(
            after.report.end,
            lastgasp::act::report::BootEnd::Unannounced
        );
        let settled = after.delivery.unwrap().await.unwrap();
        assert_eq!(
            (settled.end, settled.undelivered),
            (lastgasp::act::report::BootEnd::Forced, false)
        );
        assert_eq!(settled.episode.as_ref().map(|e| e.id), Some(1));
        let events: Vec<Event> = s.double.list("default");
        let note = events
            .iter()
            .find(|e| e.action.as_deref() == Some("PreviousBoot"))
            .and_then(|e| e.note.clone())
            .expect("a previous-boot event");
        assert!(
            note.contains("ended forced") && note.contains("found on the Node"),
            "{note}"
        );
        let recs = records(&s.dir);
        assert!(
            recs.iter().any(|r| r.boot_id == "boot-2"
                && matches!(&r.entry, Entry::Outcome { episode: 1, outcome: Outcome::FoundOnNode { boot_id, .. } } if boot_id == "boot-1")),
            "{recs:#?}"
        );
        assert_eq!(
            lastgasp::act::report::classify(&recs, "boot-1").end,
            lastgasp::act::report::BootEnd::Forced,
            "the log now tells the boot's end by itself"
        );
        let n: Node = s.double.get("", NODE).unwrap();
        let rec: serde_json::Value =
            serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
        assert_ne!(rec["delivered_late"], true, "nothing was sent late: {rec}");
        assert!(
            metrics.encode().contains(r#"end="forced""#),
            "{}",
            metrics.encode()
        );
        let _ = std::fs::remove_dir_all(&gone);
    }

    /// The detection reached the disk, its delivered outcome did not: the
    /// Node's record of the same episode shows it was delivered, so nothing
    /// goes out late.
    #[tokio::test]
    async fn a_delivery_the_disk_lost_is_found_on_the_node() {
        let s = setup("lostoutcome", vec![]).await;
        let c = cluster(&s).await;
        let mut first = agent_at(&s.dir, "boot-1", Some(c.clone()));
        first.handle(forced_exec()).await.unwrap();
        let path = s.dir.join(audit::FILE_NAME);
        let kept: Vec<String> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .filter(|l| !l.contains("last-gasp-delivered"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(kept.len(), records(&s.dir).len() - 1, "one outcome cut");
        std::fs::write(&path, kept.concat()).unwrap();
        drop(first);
        let mut next = agent_at(&s.dir, "boot-2", Some(c));
        let after = next.after_boot("boot-2").await.unwrap().unwrap();
        assert!(after.report.undelivered, "the log alone says undelivered");
        let settled = after.delivery.unwrap().await.unwrap();
        assert_eq!(
            (settled.end, settled.undelivered),
            (lastgasp::act::report::BootEnd::Forced, false)
        );
        let n: Node = s.double.get("", NODE).unwrap();
        let rec: serde_json::Value =
            serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
        assert_ne!(rec["delivered_late"], true, "nothing was sent late: {rec}");
        let recs = records(&s.dir);
        assert!(
            recs.iter().any(|r| matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::FoundOnNode { .. },
                    ..
                }
            )) && !recs.iter().any(|r| matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::DeliveredLate { .. },
                    ..
                }
            )),
            "{recs:#?}"
        );
    }

    /// PATCH/POST/DELETE requests the double answered since `from`.
    fn writes_since(s: &Setup, from: usize) -> Vec<String> {
        s.double.requests()[from..]
            .iter()
            .filter(|r| r.method != "GET")
            .map(|r| format!("{} {}", r.method, r.path))
            .collect()
    }

    fn host(answer: HostAnswer) -> (HostQuery, Arc<dyn Fn() -> bool + Send + Sync>) {
        (
            Arc::new(move || {
                let a = answer.clone();
                Box::pin(async move { a })
            }),
            Arc::new(|| true),
        )
    }

    fn quick_policy() -> DecisionPolicy {
        DecisionPolicy {
            pending_expiry: Duration::from_millis(300),
            immediate_end: Duration::from_millis(300),
            ..DecisionPolicy::default()
        }
    }

    /// A `systemctl poweroff` alone is a request: nothing reaches the
    /// cluster until logind, systemd or PID 1 confirms it, and unconfirmed it
    /// expires, audit-only.
    #[tokio::test]
    async fn a_request_nobody_confirms_moves_nothing_and_expires() {
        let s = setup("pending", vec![pod("web", Some(0), None, json!({}))]).await;
        let c = cluster(&s).await;
        let (q, r) = host(HostAnswer::NotUnderWay);
        let mut agent = agent_at(&s.dir, "b", Some(c))
            .with_policy(quick_policy())
            .with_host(q, r);
        let from = s.double.requests().len();
        let mut req = forced_exec();
        req.forced = false;
        req.actor.as_mut().unwrap().uid = 1000;
        let d = agent.handle(req).await.unwrap();
        assert!(matches!(d.action, Action::Pending { .. }), "{d:?}");
        agent.tick(SystemTime::now() + Duration::from_secs(1)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(writes_since(&s, from), Vec::<String>::new());
        let n: Node = s.double.get("", NODE).unwrap();
        assert!(condition(&n).is_none() && !taint_keys(&n).contains(&TAINT_KEY.to_string()));
        assert!(
            records(&s.dir).iter().any(|r| matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::Expired { .. },
                    ..
                }
            )),
            "{:#?}",
            records(&s.dir)
        );
    }

    /// An immediate episode whose shutdown never comes (the agent is alive
    /// past its expected end, and the host has none under way) is abandoned:
    /// every mark is undone, and the next shutdown is handled in full.
    #[tokio::test]
    async fn an_episode_that_never_ends_the_node_is_unwound() {
        let s = setup("abandon", vec![]).await;
        let c = cluster(&s).await;
        let (q, r) = host(HostAnswer::NotUnderWay);
        let mut agent = agent_at(&s.dir, "b", Some(c))
            .with_policy(quick_policy())
            .with_host(q, r);
        agent.handle(forced_exec()).await.unwrap();
        let n: Node = s.double.get("", NODE).unwrap();
        assert_eq!(
            condition(&n),
            Some(("True".into(), "ForcedShutdown".into()))
        );
        assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
        let rec: serde_json::Value =
            serde_json::from_str(&n.metadata.annotations.clone().unwrap()[RECORD_ANNOTATION])
                .unwrap();
        assert_eq!(rec["boot_id"], "b", "the record names its boot: {rec}");

        agent.tick(SystemTime::now() + Duration::from_secs(1)).await;
        let answer = tokio::time::timeout(Duration::from_secs(5), agent.next_answer())
            .await
            .expect("the host was asked");
        agent.host_answer(answer).await;
        let abandoned = |s: &Setup| {
            records(&s.dir).iter().any(|r| {
                matches!(
                    &r.entry,
                    Entry::Outcome {
                        outcome: Outcome::Abandoned { .. },
                        ..
                    }
                )
            })
        };
        let mut undone = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let n: Node = s.double.get("", NODE).unwrap();
            let closed = record::of_node(&n)
                .and_then(Result::ok)
                .and_then(|r| r.closed)
                .map(|c| c.how);
            if condition(&n) == Some(("False".into(), "ShutdownAbandoned".into()))
                && !taint_keys(&n).contains(&TAINT_KEY.to_string())
                && closed == Some(Closing::Abandoned)
                && abandoned(&s)
            {
                undone = true;
                break;
            }
        }
        assert!(
            undone,
            "condition False, taint off, record closed, outcome audited: {:?}",
            s.double.get::<Node>("", NODE)
        );
        assert!(
            taint_keys(&s.double.get::<Node>("", NODE).unwrap())
                .contains(&"example.com/other".to_string()),
            "another's taint stays"
        );
        assert!(records(&s.dir).iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::Abandoned { .. },
                ..
            }
        )));
        let d = agent.handle(forced_exec()).await.unwrap();
        assert_eq!(
            (short_action(&d.action), d.episode.map(|e| e.id)),
            ("immediate", Some(2)),
            "a new episode, handled in full"
        );
    }

    /// `clear_when_ready` leaves a record of this boot as it is (the start
    /// closes it, after asking the host); a new boot closes it as back. A
    /// record annotation that is unreadable is no record (and no panic), and
    /// closing leaves it as it was.
    #[tokio::test]
    async fn only_a_new_boot_marks_the_record_back() {
        let s = setup("sameboot", vec![]).await;
        let set = |v: &str| put_record(&s, v);
        let rec = record_of("boot-7", &logind_signal());
        set(&rec.to_json());
        s.nc.set_taint(true).await.unwrap();
        s.nc.clear_when_ready("boot-7").await.unwrap();
        let n: Node = s.double.get("", NODE).unwrap();
        assert!(
            taint_keys(&n).contains(&TAINT_KEY.to_string()),
            "same boot: marks stay"
        );
        let now = |n: &Node| record::of_node(n).unwrap().unwrap();
        assert_eq!(now(&n).closed, None);

        s.nc.clear_when_ready("boot-8").await.unwrap();
        let n: Node = s.double.get("", NODE).unwrap();
        assert!(!taint_keys(&n).contains(&TAINT_KEY.to_string()));
        let closed = now(&n).closed.expect("closed");
        assert_eq!(closed.how, Closing::Back);
        assert!(closed.why.contains("boot-8"), "{}", closed.why);

        for odd in [
            "[]",
            "42",
            "\"x\"",
            "not json",
            r#"{"boot_id":"boot-7","episode":{"id":1}}"#,
        ] {
            set(odd);
            s.nc.set_taint(true).await.unwrap();
            s.nc.clear_when_ready("boot-9").await.unwrap();
            s.nc.close_record(&rec.key(), Closing::Abandoned, "test")
                .await;
            let n: Node = s.double.get("", NODE).unwrap();
            assert!(!taint_keys(&n).contains(&TAINT_KEY.to_string()), "{odd}");
            assert_eq!(
                n.metadata.annotations.unwrap()[RECORD_ANNOTATION],
                odd,
                "left as it was"
            );
        }
    }

    fn short_action(a: &Action) -> &'static str {
        match a {
            Action::Immediate { .. } => "immediate",
            _ => "other",
        }
    }

    /// An API server that does not answer cannot hold the loop: the last
    /// gasp gives up at its bound, is recorded as failed (for the next
    /// boot), and the next record is handled at once.
    #[tokio::test]
    async fn a_silent_api_server_bounds_the_last_gasp() {
        let s = setup("slow", vec![]).await;
        let c = cluster(&s).await;
        s.double.inject(
            Fault::latency(Duration::from_secs(20))
                .method("PATCH")
                .always(),
        );
        let mut agent = agent_at(&s.dir, "b", Some(c));
        let t = std::time::Instant::now();
        agent.handle(forced_exec()).await.unwrap();
        let took = t.elapsed();
        assert!(
            took < LAST_GASP_BOUND + Duration::from_secs(1),
            "the last gasp took {took:?}"
        );
        let failed = records(&s.dir).into_iter().find_map(|r| match r.entry {
            Entry::Outcome {
                outcome: Outcome::LastGaspFailed { error },
                ..
            } => Some(error),
            _ => None,
        });
        assert!(
            failed
                .as_deref()
                .is_some_and(|e| e.contains("no answer within")),
            "{failed:?}"
        );
        let mut next = forced_exec();
        next.scope = Scope::Container;
        let t = std::time::Instant::now();
        agent.handle(next).await.unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn forced_detection_reaches_the_cluster_and_the_audit_says_so() {
        let s = setup("forced", vec![]).await;
        let c = cluster(&s).await;
        let mut agent = agent_at(&s.dir, "b", Some(c));
        agent.handle(forced_exec()).await.unwrap();
        let n: Node = s.double.get("", NODE).unwrap();
        assert_eq!(
            condition(&n),
            Some(("True".into(), "ForcedShutdown".into()))
        );
        let delivered = records(&s.dir).into_iter().find_map(|r| match r.entry {
            Entry::Outcome {
                outcome: Outcome::LastGaspDelivered { ms },
                ..
            } => Some(ms),
            _ => None,
        });
        assert!(delivered.is_some_and(|ms| ms >= 0.0));
    }
}
