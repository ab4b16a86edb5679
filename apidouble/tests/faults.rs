//! Fault injection as the client sees it, and the request log.

mod common;

use std::time::{Duration, Instant};

use common::{api_err, node};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use lastgasp_apidouble::{ApiDouble, Fault};

#[tokio::test]
async fn status_faults_are_seen_and_kube_retries_503() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let plain: Api<Node> = Api::all(d.client_without_retry().await);
    d.inject(
        Fault::status(500)
            .method("GET")
            .path_prefix("/api/v1/nodes/n1"),
    );
    let e = api_err(plain.get("n1").await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (500, "InternalError"));
    plain.get("n1").await.unwrap();

    d.inject(
        Fault::status(429)
            .retry_after(1)
            .path_regex(r"^/api/v1/nodes/n\d$")
            .unwrap(),
    );
    let e = api_err(plain.get("n1").await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(e.details.unwrap().retry_after_seconds, 1);

    // kube's default client retries 503 by itself
    d.clear_requests();
    let retrying: Api<Node> = Api::all(d.client().await);
    d.inject(Fault::status(503).times(2));
    retrying.get("n1").await.unwrap();
    let statuses: Vec<(u16, Option<String>)> = d
        .requests()
        .into_iter()
        .map(|r| (r.status, r.fault))
        .collect();
    assert_eq!(
        statuses,
        [
            (503, Some("status 503".into())),
            (503, Some("status 503".into())),
            (200, None)
        ]
    );
}

#[tokio::test]
async fn latency_is_measurable_and_scoped() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let nodes: Api<Node> = Api::all(d.client_without_retry().await);
    let id = d.inject(Fault::latency(Duration::from_millis(250)).method("PATCH"));
    let t = Instant::now();
    nodes.get("n1").await.unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "GET is not delayed"
    );
    let t = Instant::now();
    nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert!(d.remove_fault(id));
    let t = Instant::now();
    nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"a": "c"}}})),
        )
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_millis(200));
    let log = d.requests();
    assert_eq!(log.len(), 3);
    assert!(log[1].elapsed >= Duration::from_millis(250));
    assert_eq!(log[1].fault.as_deref(), Some("latency 250ms"));
    assert!(log[0].instant < log[1].instant && log[1].instant < log[2].instant);
    assert_eq!(
        log[1].body.as_ref().unwrap()["metadata"]["labels"]["a"],
        "b"
    );
    assert_eq!(
        log[1].content_type.as_deref(),
        Some("application/merge-patch+json")
    );
}

#[tokio::test]
async fn dropped_connection_is_an_error_not_a_status() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let nodes: Api<Node> = Api::all(d.client_without_retry().await);
    d.inject(Fault::drop_connection().method("GET"));
    let err = nodes.get("n1").await.unwrap_err();
    assert!(
        !matches!(err, kube::Error::Api(_)),
        "a dropped connection has no Status: {err:?}"
    );
    // only once
    nodes.get("n1").await.unwrap();
    let log = d.requests();
    assert_eq!((log[0].status, log[0].fault.as_deref()), (0, Some("drop")));
    assert_eq!(log[1].status, 200);
}
