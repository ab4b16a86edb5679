//! Pod deletion: grace periods, the simulated kubelet, hanging pods,
//! preconditions, finalizers, binding.

mod common;

use std::time::{Duration, Instant};

use common::{api_err, eventually, pod};
use either::Either;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::json;

use lastgasp_apidouble::ApiDouble;

fn grace(p: &Pod) -> (bool, Option<i64>) {
    (
        p.metadata.deletion_timestamp.is_some(),
        p.metadata.deletion_grace_period_seconds,
    )
}

#[tokio::test]
async fn graceful_delete_sets_deletion_timestamp_then_kubelet_removes() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet()
        .set_termination("default", "web", Duration::from_millis(300));
    d.create(&pod("default", "web", "n1", json!({}))).unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    let t0 = Instant::now();
    let resp = pods
        .delete("web", &DeleteParams::default().grace_period(10))
        .await
        .unwrap();
    let Either::Left(p) = resp else {
        panic!("a graceful pod delete returns the pod")
    };
    assert_eq!(grace(&p), (true, Some(10)));
    let ts = p.metadata.deletion_timestamp.unwrap().0;
    let drift = (ts - jiff::Timestamp::now()).get_seconds();
    assert!(
        (8..=10).contains(&drift),
        "deletionTimestamp is now+grace: {drift}"
    );
    assert_eq!(
        p.metadata.generation,
        Some(2),
        "graceful deletion bumps generation"
    );
    // still there while the kubelet terminates it
    let p = pods.get("web").await.unwrap();
    assert_eq!(grace(&p), (true, Some(10)));
    // a second DELETE may only shorten the grace
    let Either::Left(p) = pods
        .delete("web", &DeleteParams::default().grace_period(20))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(10));
    let Either::Left(p) = pods
        .delete("web", &DeleteParams::default().grace_period(5))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(5));
    assert!(p.metadata.deletion_timestamp.unwrap().0 < ts);
    eventually(5, "the kubelet to remove the pod", || {
        d.get::<Pod>("default", "web").is_none()
    })
    .await;
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // the kubelet reported a clean exit before removing it
    let statuses: Vec<String> = d
        .requests()
        .iter()
        .map(|r| format!("{} {}", r.method, r.status))
        .collect();
    assert_eq!(
        statuses,
        ["DELETE 200", "GET 200", "DELETE 200", "DELETE 200"]
    );
    let e = api_err(pods.get("web").await.unwrap_err());
    assert_eq!(e.code, 404);
}

#[tokio::test]
async fn hanging_pod_is_killed_at_its_grace_deadline() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().hang("default", "stuck");
    let mut p = pod("default", "stuck", "n1", json!({}));
    p.spec.as_mut().unwrap().termination_grace_period_seconds = Some(1);
    d.create(&p).unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    let from = d.resource_version();
    let t0 = Instant::now();
    pods.delete("stuck", &DeleteParams::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        d.get::<Pod>("default", "stuck").is_some(),
        "a hanging pod outlives the default termination time"
    );
    eventually(5, "kill at the grace deadline", || {
        d.get::<Pod>("default", "stuck").is_none()
    })
    .await;
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(950) && took < Duration::from_millis(2500),
        "{took:?}"
    );
    // the kill is reported as a Failed pod with exit code 137 before the removal
    use futures::StreamExt;
    let mut w = pods
        .watch(&kube::api::WatchParams::default(), &from.to_string())
        .await
        .unwrap()
        .boxed();
    let mut killed = false;
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(Duration::from_secs(1), w.next()).await {
        match ev {
            kube::api::WatchEvent::Modified(p) => {
                let st = p.status.unwrap();
                if st.phase.as_deref() == Some("Failed") {
                    let cs = &st.container_statuses.unwrap()[0];
                    assert_eq!(
                        cs.state
                            .as_ref()
                            .unwrap()
                            .terminated
                            .as_ref()
                            .unwrap()
                            .exit_code,
                        137
                    );
                    killed = true;
                }
            }
            kube::api::WatchEvent::Deleted(_) => break,
            _ => {}
        }
    }
    assert!(killed);
}

#[tokio::test]
async fn dead_kubelet_keeps_pod_until_finish_pod_which_reports_succeeded() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().set_auto_finish(false);
    d.create(&pod("default", "a", "n1", json!({}))).unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    let lp = kube::api::WatchParams::default().fields("metadata.name=a");
    use futures::StreamExt;
    let mut w = pods
        .watch(&lp, &d.resource_version().to_string())
        .await
        .unwrap()
        .boxed();
    pods.delete("a", &DeleteParams::default()).await.unwrap();
    // with auto-finish off (a dead kubelet) the pod stays terminating
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(d
        .get::<Pod>("default", "a")
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_some());
    assert!(d.finish_pod("default", "a"));
    assert!(!d.finish_pod("default", "a"), "already gone");
    let mut phases = Vec::new();
    while let Some(Ok(ev)) = tokio::time::timeout(Duration::from_secs(2), w.next())
        .await
        .unwrap()
    {
        match ev {
            kube::api::WatchEvent::Modified(p) => phases.push(p.status.unwrap().phase.unwrap()),
            kube::api::WatchEvent::Deleted(p) => {
                phases.push(format!(
                    "DELETED grace={:?}",
                    p.metadata.deletion_grace_period_seconds
                ));
                break;
            }
            _ => {}
        }
    }
    assert_eq!(
        phases,
        ["Running", "Succeeded", "Succeeded", "DELETED grace=Some(0)"]
    );
}

#[tokio::test]
async fn immediate_deletes_unbound_zero_grace_and_preconditions() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().set_auto_finish(false);
    d.create(&pod("default", "unbound", "", json!({}))).unwrap();
    d.create(&pod("default", "forced", "n1", json!({})))
        .unwrap();
    d.create(&pod("default", "guarded", "n1", json!({})))
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    // an unscheduled pod goes at once
    let Either::Left(p) = pods
        .delete("unbound", &DeleteParams::default())
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(0));
    assert!(d.get::<Pod>("default", "unbound").is_none());
    // gracePeriodSeconds=0 on a bound pod goes at once, even with no kubelet
    pods.delete("forced", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert!(d.get::<Pod>("default", "forced").is_none());
    // preconditions
    let uid = d
        .get::<Pod>("default", "guarded")
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-it".into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    let e = api_err(pods.delete("guarded", &dp).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        e.message,
        format!("Operation cannot be fulfilled on Pod \"guarded\": the UID in the precondition (not-it) does not match the UID in record ({uid}). The object might have been deleted and then recreated")
    );
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: None,
            resource_version: Some("1".into()),
        }),
        ..Default::default()
    };
    assert_eq!(
        api_err(pods.delete("guarded", &dp).await.unwrap_err()).code,
        409
    );
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..Default::default()
    };
    let Either::Left(p) = pods.delete("guarded", &dp).await.unwrap() else {
        panic!()
    };
    assert_eq!(
        p.metadata.deletion_grace_period_seconds,
        Some(30),
        "default grace from the pod spec default"
    );
    let e = api_err(
        pods.delete("missing", &DeleteParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 404);
}

#[tokio::test]
async fn finalizers_hold_the_object_until_removed() {
    let d = ApiDouble::start().await.unwrap();
    let mut p = pod("default", "held", "n1", json!({}));
    p.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    d.create(&p).unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    pods.delete("held", &DeleteParams::default().grace_period(1))
        .await
        .unwrap();
    // the kubelet finishes it (grace -> 0) but the finalizer keeps it
    eventually(5, "kubelet final delete", || {
        d.get::<Pod>("default", "held")
            .is_some_and(|p| p.metadata.deletion_grace_period_seconds == Some(0))
    })
    .await;
    let e = api_err(
        pods.patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": ["example.com/hold", "new/one"]}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, 422, "no new finalizers while deleting");
    pods.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert!(d.get::<Pod>("default", "held").is_none());
}

#[tokio::test]
async fn binding_and_kubelet_start() {
    let d = ApiDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    pods.create(&PostParams::default(), &pod("default", "p", "", json!({})))
        .await
        .unwrap();
    let c = d.client().await;
    let body = serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"}, "target": {"kind": "Node", "name": "n1"}})).unwrap();
    let req = http::Request::post("/api/v1/namespaces/default/pods/p/binding")
        .header("content-type", "application/json")
        .body(body.clone())
        .unwrap();
    c.request_text(req).await.unwrap();
    eventually(5, "the kubelet to start the pod", || {
        d.get::<Pod>("default", "p")
            .and_then(|p| p.status)
            .and_then(|s| s.phase)
            .as_deref()
            == Some("Running")
    })
    .await;
    let p = pods.get("p").await.unwrap();
    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("n1"));
    let ready = p
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "True");
    let req = http::Request::post("/api/v1/namespaces/default/pods/p/binding")
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    match c.request_text(req).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("{other:?}"),
    }
}
