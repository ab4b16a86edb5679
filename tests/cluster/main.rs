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
            NodeClient, CONDITION, RECORD_ANNOTATION, TAINT_KEY,
        },
        last_gasp::Refusal,
        metrics::Metrics,
    },
    decide::{Action, Decider, Episode},
    grace::Bucket,
    record::{self, Closing, ShutdownRecord},
    signal::{Scope, ShutdownSignal, Source},
};
use lastgasp_apidouble::{ApiDouble, Fault};
use lastgasp_tests::{
    nodes::{self, taint_keys},
    support::{agent_at, forced_exec, last_gasp_clients, logind_signal, record_of},
};
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
    nodes::node(NODE)
        .hostname_label()
        .taint("example.com/other", "x", "PreferNoSchedule")
        .json()
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

/// The agent's marks, for `reason`: its condition True, its taint beside
/// the node's other one.
fn assert_marked(n: &Node, reason: &str) {
    assert_eq!(condition(n), Some(("True".into(), reason.into())));
    let keys = taint_keys(n);
    assert!(
        keys.contains(&TAINT_KEY.to_string()) && keys.contains(&"example.com/other".to_string()),
        "{keys:?}"
    );
}

fn condition(n: &Node) -> Option<(String, String)> {
    nodes::status_reason(n, CONDITION)
}

/// `podRemoval: none` announces only (condition, taint, record, Events) and
/// removes no pod; `ignoreDaemonSets`, `excludeNamespaces` and
/// `excludePodLabels` leave their pods out of a drain.
mod agent_flow;
mod drain;
