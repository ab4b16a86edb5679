#![allow(dead_code)]

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

/// A Node with a Ready=True condition.
pub fn node(name: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name } },
        "status": { "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady" }] }
    }))
    .unwrap()
}

/// A running, ready pod bound to `node_name` (empty: unbound, Pending).
pub fn pod(ns: &str, name: &str, node_name: &str, labels: serde_json::Value) -> Pod {
    let running = !node_name.is_empty();
    let mut v = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": ns, "labels": labels },
        "spec": { "containers": [{ "name": "app", "image": "registry.example/app:1" }] },
        "status": { "phase": "Pending" }
    });
    if running {
        v["spec"]["nodeName"] = json!(node_name);
        v["status"] = json!({
            "phase": "Running",
            "conditions": [{ "type": "Ready", "status": "True" }, { "type": "ContainersReady", "status": "True" }]
        });
    }
    serde_json::from_value(v).unwrap()
}

/// Poll until `f` is true (or panic after `secs`).
pub async fn eventually<F: FnMut() -> bool>(secs: u64, what: &str, mut f: F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

pub fn api_err(e: kube::Error) -> Box<kube::core::Status> {
    match e {
        kube::Error::Api(s) => s,
        other => panic!("expected an API error, got {other:?}"),
    }
}
