//! The eviction subresource against PodDisruptionBudgets.

mod common;

use common::{api_err, pod};
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, EvictParams, ListParams};
use serde_json::json;

use lastgasp_apidouble::ApiDouble;

fn pdb(name: &str, spec: serde_json::Value) -> PodDisruptionBudget {
    serde_json::from_value(json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": { "name": name, "namespace": "default" },
        "spec": spec
    }))
    .unwrap()
}

fn status(d: &ApiDouble, name: &str) -> (Option<i32>, Option<i32>, Option<i32>, Option<i32>) {
    let s = d
        .get::<PodDisruptionBudget>("default", name)
        .unwrap()
        .status
        .unwrap();
    (
        s.expected_pods,
        s.current_healthy,
        s.desired_healthy,
        s.disruptions_allowed,
    )
}

async fn setup(n: usize) -> (ApiDouble, Api<Pod>) {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().set_auto_finish(false);
    for i in 0..n {
        d.create(&pod(
            "default",
            &format!("web-{i}"),
            "n1",
            json!({"app": "web"}),
        ))
        .unwrap();
    }
    let pods = Api::namespaced(d.client_without_retry().await, "default");
    (d, pods)
}

#[tokio::test]
async fn eviction_allowed_then_429_naming_the_budget() {
    let (d, pods) = setup(3).await;
    d.create(&pdb(
        "web-pdb",
        json!({"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}),
    ))
    .unwrap();
    assert_eq!(status(&d, "web-pdb"), (Some(3), Some(3), Some(2), Some(1)));

    let st = pods.evict("web-0", &EvictParams::default()).await.unwrap();
    assert!(st.is_success());
    assert_eq!(st.code, 201);
    let p = d.get::<Pod>("default", "web-0").unwrap();
    assert!(p.metadata.deletion_timestamp.is_some());
    let cond = p
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "DisruptionTarget")
        .unwrap();
    assert_eq!(
        (cond.status.as_str(), cond.reason.as_deref()),
        ("True", Some("EvictionByEvictionAPI"))
    );
    // the budget is in step: the terminating pod no longer counts as healthy
    assert_eq!(status(&d, "web-pdb"), (Some(3), Some(2), Some(2), Some(0)));

    let e = api_err(
        pods.evict("web-1", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(
        e.message,
        "Cannot evict pod as it would violate the pod's disruption budget."
    );
    let cause = &e.details.unwrap().causes[0];
    assert_eq!(cause.reason, "DisruptionBudget");
    assert_eq!(
        cause.message,
        "The disruption budget web-pdb needs 2 healthy pods and has 2 currently"
    );
    assert!(d
        .get::<Pod>("default", "web-1")
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_none());

    // a pod that is already terminating may be evicted (again)
    assert!(pods
        .evict("web-0", &EvictParams::default())
        .await
        .unwrap()
        .is_success());
    // once it is gone the budget still has only two healthy pods of the two it needs
    assert!(d.finish_pod("default", "web-0"));
    assert_eq!(status(&d, "web-pdb"), (Some(2), Some(2), Some(2), Some(0)));
    // a replacement that becomes ready frees one disruption
    d.create(&pod("default", "web-3", "n2", json!({"app": "web"})))
        .unwrap();
    assert_eq!(status(&d, "web-pdb"), (Some(3), Some(3), Some(2), Some(1)));
    let budgets: Api<PodDisruptionBudget> =
        Api::namespaced(d.client_without_retry().await, "default");
    let listed = budgets.list(&ListParams::default()).await.unwrap();
    assert_eq!(
        listed.items[0].status.as_ref().unwrap().disruptions_allowed,
        Some(1)
    );
    let conds = listed.items[0]
        .status
        .as_ref()
        .unwrap()
        .conditions
        .clone()
        .unwrap();
    assert_eq!(
        (
            conds[0].type_.as_str(),
            conds[0].status.as_str(),
            conds[0].reason.as_str()
        ),
        ("DisruptionAllowed", "True", "SufficientPods")
    );
}

#[tokio::test]
async fn eviction_honours_delete_options_and_pending_pods_skip_the_budget() {
    let (d, pods) = setup(1).await;
    d.create(&pod("default", "pending", "", json!({"app": "web"})))
        .unwrap();
    d.create(&pdb(
        "strict",
        json!({"maxUnavailable": 0, "selector": {"matchLabels": {"app": "web"}}}),
    ))
    .unwrap();
    // a Pending pod ignores budgets
    assert!(pods
        .evict("pending", &EvictParams::default())
        .await
        .unwrap()
        .is_success());
    assert!(d.get::<Pod>("default", "pending").is_none());
    let e = api_err(
        pods.evict("web-0", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 429);
    // without a budget the eviction deletes with its deleteOptions' grace period
    d.remove::<PodDisruptionBudget>("default", "strict")
        .unwrap();
    d.create(&pod("default", "web-1", "n1", json!({"app": "web"})))
        .unwrap();
    let body = json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web-1"},
                      "deleteOptions": {"gracePeriodSeconds": 7}});
    let req = http::Request::post("/api/v1/namespaces/default/pods/web-1/eviction")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .unwrap();
    d.client_without_retry()
        .await
        .request_text(req)
        .await
        .unwrap();
    assert_eq!(
        d.get::<Pod>("default", "web-1")
            .unwrap()
            .metadata
            .deletion_grace_period_seconds,
        Some(7)
    );
    // kube 5's EvictParams sends its options as `delete_options`, a field the apiserver does
    // not know and drops: the pod's own grace period applies
    let ep = EvictParams {
        delete_options: Some(DeleteParams::default().grace_period(7)),
        ..Default::default()
    };
    assert!(pods.evict("web-0", &ep).await.unwrap().is_success());
    assert_eq!(
        d.get::<Pod>("default", "web-0")
            .unwrap()
            .metadata
            .deletion_grace_period_seconds,
        Some(30)
    );
    let e = api_err(
        pods.evict("nope", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 404);
}

#[tokio::test]
async fn more_than_one_budget_is_500() {
    let (d, pods) = setup(2).await;
    d.create(&pdb(
        "one",
        json!({"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}),
    ))
    .unwrap();
    d.create(&pdb("two", json!({"maxUnavailable": 1, "selector": {}})))
        .unwrap();
    let e = api_err(
        pods.evict("web-0", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 500);
    assert_eq!(e.message, "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.");
    assert!(d
        .get::<Pod>("default", "web-0")
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_none());
}

fn owned(name: &str, rs: &ReplicaSet) -> Pod {
    let mut p = pod("default", name, "n1", json!({"app": "db"}));
    p.metadata.owner_references = Some(vec![serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs.metadata.name, "uid": rs.metadata.uid, "controller": true
    })).unwrap()]);
    p
}

#[tokio::test]
async fn percentages_round_up_against_the_controller_scale() {
    let (d, pods) = setup(0).await;
    let rs: ReplicaSet = d
        .create(&serde_json::from_value::<ReplicaSet>(json!({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "db", "namespace": "default"},
            "spec": {"replicas": 4, "selector": {"matchLabels": {"app": "db"}},
                     "template": {"metadata": {"labels": {"app": "db"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}
        })).unwrap())
        .unwrap();
    for i in 0..4 {
        d.create(&owned(&format!("db-{i}"), &rs)).unwrap();
    }
    // maxUnavailable 30% of 4 = 1.2, rounded up to 2 unavailable: 2 healthy needed
    d.create(&pdb(
        "db",
        json!({"maxUnavailable": "30%", "selector": {"matchLabels": {"app": "db"}}}),
    ))
    .unwrap();
    assert_eq!(status(&d, "db"), (Some(4), Some(4), Some(2), Some(2)));
    pods.evict("db-0", &EvictParams::default()).await.unwrap();
    d.finish_pod("default", "db-0");
    // the ReplicaSet still wants 4: expected stays at its scale
    assert_eq!(status(&d, "db"), (Some(4), Some(3), Some(2), Some(1)));
    pods.evict("db-1", &EvictParams::default()).await.unwrap();
    let e = api_err(
        pods.evict("db-2", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 429);
    assert_eq!(
        e.details.unwrap().causes[0].message,
        "The disruption budget db needs 2 healthy pods and has 2 currently"
    );

    // minAvailable 50% of 3 = 1.5 -> 2
    d.remove::<PodDisruptionBudget>("default", "db").unwrap();
    d.modify::<ReplicaSet, _>("default", "db", |r| r.spec.replicas = Some(3))
        .unwrap();
    d.create(&pdb(
        "db",
        json!({"minAvailable": "50%", "selector": {"matchLabels": {"app": "db"}}}),
    ))
    .unwrap();
    assert_eq!(status(&d, "db"), (Some(3), Some(2), Some(2), Some(0)));

    // percentages over pods without a controller: the controller expects 0 pods, so nothing may be disrupted
    d.create(&pod("default", "bare", "n1", json!({"app": "bare"})))
        .unwrap();
    d.create(&pdb(
        "bare",
        json!({"minAvailable": "10%", "selector": {"matchLabels": {"app": "bare"}}}),
    ))
    .unwrap();
    assert_eq!(status(&d, "bare"), (Some(0), Some(1), Some(0), Some(0)));
    assert_eq!(
        api_err(
            pods.evict("bare", &EvictParams::default())
                .await
                .unwrap_err()
        )
        .code,
        429
    );
}
