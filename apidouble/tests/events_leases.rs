//! core/v1 and events.k8s.io/v1 events (one storage, two views), kube's
//! event Recorder, and leases with optimistic concurrency.

mod common;

use common::{api_err, node};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node};
use k8s_openapi::api::events::v1::Event as NewEvent;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Resource;
use serde_json::json;

use lastgasp_apidouble::ApiDouble;

#[tokio::test]
async fn core_and_events_k8s_io_are_views_of_one_store() {
    let d = ApiDouble::start().await.unwrap();
    let c = d.client().await;
    let core: Api<CoreEvent> = Api::namespaced(c.clone(), "default");
    let ev: CoreEvent = serde_json::from_value(json!({
        "metadata": {"name": "n1.1", "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": "n1", "apiVersion": "v1"},
        "reason": "NodeShutdown", "message": "poweroff requested", "type": "Warning",
        "source": {"component": "lastgasp"}, "count": 1
    }))
    .unwrap();
    core.create(&PostParams::default(), &ev).await.unwrap();
    let newer: Api<NewEvent> = Api::namespaced(c.clone(), "default");
    let seen = newer.get("n1.1").await.unwrap();
    assert_eq!(seen.note.as_deref(), Some("poweroff requested"));
    assert_eq!(seen.regarding.unwrap().name.as_deref(), Some("n1"));
    assert_eq!(seen.deprecated_count, Some(1));
    assert_eq!(
        seen.deprecated_source.unwrap().component.as_deref(),
        Some("lastgasp")
    );
    // field selectors on events
    let l = core
        .list(&ListParams::default().fields("involvedObject.kind=Node,reason=NodeShutdown"))
        .await
        .unwrap();
    assert_eq!(l.items.len(), 1);
    let l = core
        .list(&ListParams::default().fields("type=Normal"))
        .await
        .unwrap();
    assert_eq!(l.items.len(), 0);
    // patch through the events.k8s.io view, read back through core
    newer
        .patch(
            "n1.1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"note": "changed"})),
        )
        .await
        .unwrap();
    assert_eq!(
        core.get("n1.1").await.unwrap().message.as_deref(),
        Some("changed")
    );
    // events.k8s.io/v1 validates new-style events strictly
    let bad: NewEvent = serde_json::from_value(json!({"metadata": {"name": "bad"}, "eventTime": "2026-01-01T00:00:00.000000Z", "type": "Normal"})).unwrap();
    let e = api_err(
        newer
            .create(&PostParams::default(), &bad)
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    assert!(
        e.message.contains("reportingController: Required value"),
        "{}",
        e.message
    );
}

#[tokio::test]
async fn kube_recorder_creates_then_patches_a_series() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let c = d.client().await;
    let n: Node = Api::<Node>::all(c.clone()).get("n1").await.unwrap();
    let recorder = Recorder::new(
        c.clone(),
        Reporter {
            controller: "lastgasp".into(),
            instance: Some("agent-n1".into()),
        },
    );
    let event = Event {
        type_: EventType::Warning,
        reason: "NodeShutdown".into(),
        note: Some("systemctl poweroff".into()),
        action: "Shutdown".into(),
        secondary: None,
    };
    let reference = n.object_ref(&());
    recorder.publish(&event, &reference).await.unwrap();
    recorder.publish(&event, &reference).await.unwrap();
    let writes: Vec<(String, String, u16)> = d
        .requests()
        .into_iter()
        .filter(|r| r.path.contains("/events"))
        .map(|r| (r.method, r.path, r.status))
        .collect();
    assert_eq!(
        writes[0],
        (
            "POST".into(),
            "/apis/events.k8s.io/v1/namespaces/default/events".into(),
            201
        )
    );
    assert_eq!(writes[1].0, "PATCH");
    assert_eq!(writes[1].2, 200);
    let evs: Vec<NewEvent> = d.list::<NewEvent>("default");
    assert_eq!(evs.len(), 1);
    let e = &evs[0];
    assert_eq!(e.reason.as_deref(), Some("NodeShutdown"));
    assert_eq!(e.reporting_controller.as_deref(), Some("lastgasp"));
    assert_eq!(e.series.as_ref().unwrap().count, 2);
    assert_eq!(e.regarding.as_ref().unwrap().kind.as_deref(), Some("Node"));
    // and kubectl-style core readers see it
    let core = d.list::<CoreEvent>("default");
    assert_eq!(core[0].reporting_component.as_deref(), Some("lastgasp"));
}

#[tokio::test]
async fn leases_with_conflicts() {
    let d = ApiDouble::start().await.unwrap();
    let leases: Api<Lease> = Api::namespaced(d.client().await, "kube-node-lease");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "lastgasp-leader", "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}
    }))
    .unwrap();
    // leases allow create-on-update
    let created = leases
        .replace("lastgasp-leader", &PostParams::default(), &lease)
        .await
        .unwrap();
    let rv0 = created.metadata.resource_version.clone();
    let mut mine = created.clone();
    mine.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let taken = leases
        .replace("lastgasp-leader", &PostParams::default(), &mine)
        .await
        .unwrap();
    assert_ne!(taken.metadata.resource_version, rv0);
    // a competitor with the old resourceVersion loses
    let mut theirs = created.clone();
    theirs.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let e = api_err(
        leases
            .replace("lastgasp-leader", &PostParams::default(), &theirs)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 409);
    assert_eq!(
        e.message,
        "Operation cannot be fulfilled on leases.coordination.k8s.io \"lastgasp-leader\": the object has been modified; please apply your changes to the latest version and try again"
    );
    let renew = json!({"spec": {"renewTime": "2026-01-01T00:00:00.000000Z"}});
    let r = leases
        .patch(
            "lastgasp-leader",
            &PatchParams::default(),
            &Patch::Merge(&renew),
        )
        .await
        .unwrap();
    assert_eq!(r.spec.unwrap().holder_identity.as_deref(), Some("b"));
    let e = api_err(
        leases
            .create(&PostParams::default(), &lease)
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"));
    let bad = json!({"spec": {"leaseDurationSeconds": 0}});
    assert_eq!(
        api_err(
            leases
                .patch(
                    "lastgasp-leader",
                    &PatchParams::default(),
                    &Patch::Merge(&bad)
                )
                .await
                .unwrap_err()
        )
        .code,
        422
    );
    assert_eq!(
        leases
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}
