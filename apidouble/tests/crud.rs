//! GET/LIST/CREATE/PUT/PATCH basics, conflicts, status subresource isolation,
//! error Status bodies, content types and discovery — all through kube::Client.

mod common;

use common::{api_err, node, pod};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use lastgasp_apidouble::ApiDouble;

#[tokio::test]
async fn get_list_with_field_and_label_selectors() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    d.create(&node("n2")).unwrap();
    d.create(&pod(
        "default",
        "a",
        "n1",
        json!({"app": "web", "tier": "front"}),
    ))
    .unwrap();
    d.create(&pod(
        "default",
        "b",
        "n2",
        json!({"app": "web", "tier": "back"}),
    ))
    .unwrap();
    d.create(&pod("kube-system", "c", "n1", json!({"app": "dns"})))
        .unwrap();
    d.create(&pod("default", "pending", "", json!({"app": "batch"})))
        .unwrap();
    let c = d.client().await;

    let all: Api<Pod> = Api::all(c.clone());
    let names = |l: kube::core::ObjectList<Pod>| -> Vec<String> {
        l.items
            .iter()
            .map(|p| {
                format!(
                    "{}/{}",
                    p.metadata.namespace.clone().unwrap(),
                    p.metadata.name.clone().unwrap()
                )
            })
            .collect()
    };
    let l = all.list(&ListParams::default()).await.unwrap();
    assert_eq!(
        names(l.clone()),
        ["default/a", "default/b", "default/pending", "kube-system/c"]
    );
    assert!(l.metadata.resource_version.unwrap().parse::<u64>().unwrap() > 0);

    let on_n1 = all
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(names(on_n1), ["default/a", "kube-system/c"]);
    let not_n1 = all
        .list(&ListParams::default().fields("spec.nodeName!=n1,metadata.namespace==default"))
        .await
        .unwrap();
    assert_eq!(names(not_n1), ["default/b", "default/pending"]);
    let running = all
        .list(&ListParams::default().fields("status.phase=Running"))
        .await
        .unwrap();
    assert_eq!(names(running).len(), 3);
    let by_name = all
        .list(&ListParams::default().fields("metadata.name=b"))
        .await
        .unwrap();
    assert_eq!(names(by_name), ["default/b"]);

    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let sel = |s: &str| ListParams::default().labels(s);
    assert_eq!(
        names(pods.list(&sel("app=web,tier!=back")).await.unwrap()),
        ["default/a"]
    );
    assert_eq!(
        names(
            pods.list(&sel("app in (web,batch),tier notin (front)"))
                .await
                .unwrap()
        ),
        ["default/b", "default/pending"]
    );
    assert_eq!(
        names(pods.list(&sel("!tier")).await.unwrap()),
        ["default/pending"]
    );
    assert_eq!(
        names(pods.list(&sel("tier")).await.unwrap()),
        ["default/a", "default/b"]
    );

    let e = api_err(
        all.list(&ListParams::default().fields("spec.bogus=1"))
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (400, "BadRequest"));
    assert_eq!(e.message, "field label not supported: spec.bogus");

    let nodes: Api<Node> = Api::all(c.clone());
    let n = nodes.get("n2").await.unwrap();
    assert_eq!(n.metadata.name.as_deref(), Some("n2"));
    assert!(n.metadata.uid.is_some() && n.metadata.creation_timestamp.is_some());
    let e = api_err(nodes.get("nope").await.unwrap_err());
    assert_eq!(
        (e.code, e.reason.as_str(), e.message.as_str()),
        (404, "NotFound", "nodes \"nope\" not found")
    );
    let details = e.details.unwrap();
    assert_eq!(
        (details.name.as_str(), details.kind.as_str()),
        ("nope", "nodes")
    );
}

#[tokio::test]
async fn create_sets_system_fields_and_rejects_duplicates_and_invalid() {
    let d = ApiDouble::start().await.unwrap();
    let c = d.client().await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let mut p = pod("default", "web", "", json!({}));
    p.status = Some(serde_json::from_value(json!({"phase": "Running"})).unwrap());
    let created = pods.create(&PostParams::default(), &p).await.unwrap();
    // the pod strategy resets status on create and sets generation 1
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(created.metadata.generation, Some(1));
    assert_eq!(
        created.spec.unwrap().termination_grace_period_seconds,
        Some(30)
    );
    let rv: u64 = created.metadata.resource_version.unwrap().parse().unwrap();
    assert_eq!(rv, d.resource_version());

    let e = api_err(pods.create(&PostParams::default(), &p).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(e.message, "pods \"web\" already exists");

    let mut bad = pod("default", "Bad_Name", "", json!({}));
    bad.metadata.namespace = None;
    let e = api_err(pods.create(&PostParams::default(), &bad).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    assert!(
        e.message
            .starts_with("Pod \"Bad_Name\" is invalid: metadata.name: Invalid value"),
        "{}",
        e.message
    );

    let mut gen = pod("default", "", "", json!({}));
    gen.metadata.name = None;
    gen.metadata.generate_name = Some("worker-".into());
    let g = pods.create(&PostParams::default(), &gen).await.unwrap();
    let name = g.metadata.name.unwrap();
    assert!(
        name.starts_with("worker-") && name.len() == "worker-".len() + 5,
        "{name}"
    );

    // namespace mismatch between URL and body
    let other: Api<Pod> = Api::namespaced(c.clone(), "other");
    let e = api_err(
        other
            .create(&PostParams::default(), &pod("default", "x", "", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 400);
    assert_eq!(
        e.message,
        "the namespace of the provided object does not match the namespace sent on the request"
    );

    // dry run does not store
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    pods.create(&dry, &pod("default", "dry", "", json!({})))
        .await
        .unwrap();
    assert!(d.get::<Pod>("default", "dry").is_none());
}

#[tokio::test]
async fn put_and_patch_with_stale_resource_version_conflict() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let c = d.client().await;
    let nodes: Api<Node> = Api::all(c);
    let n0 = nodes.get("n1").await.unwrap();

    let mut n1 = n0.clone();
    n1.metadata
        .labels
        .get_or_insert_default()
        .insert("a".into(), "1".into());
    let updated = nodes
        .replace("n1", &PostParams::default(), &n1)
        .await
        .unwrap();
    assert_ne!(
        updated.metadata.resource_version,
        n0.metadata.resource_version
    );

    // the same stale object again: 409 Conflict with the apiserver's message
    let e = api_err(
        nodes
            .replace("n1", &PostParams::default(), &n1)
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        e.message,
        "Operation cannot be fulfilled on nodes \"n1\": the object has been modified; please apply your changes to the latest version and try again"
    );
    // a patch carrying a stale resourceVersion conflicts too
    let stale = n0.metadata.resource_version.clone().unwrap();
    let p = json!({"metadata": {"resourceVersion": stale, "labels": {"b": "2"}}});
    let e = api_err(
        nodes
            .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    // without one it applies
    let ok = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"b": "2"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        ok.metadata.labels.unwrap().get("b").map(String::as_str),
        Some("2")
    );
    // an unconditional PUT (no resourceVersion) is allowed for nodes
    let mut n2 = nodes.get("n1").await.unwrap();
    n2.metadata.resource_version = None;
    n2.spec.get_or_insert_default().unschedulable = Some(true);
    let r = nodes
        .replace("n1", &PostParams::default(), &n2)
        .await
        .unwrap();
    assert_eq!(r.spec.unwrap().unschedulable, Some(true));
    // a no-op patch writes nothing: same resourceVersion
    let before = d.resource_version();
    let same = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    assert_eq!(same.metadata.resource_version, r.metadata.resource_version);
    assert_eq!(d.resource_version(), before);
    // name mismatch between URL and body
    let mut wrong = nodes.get("n1").await.unwrap();
    wrong.metadata.name = Some("n9".into());
    let e = api_err(
        nodes
            .replace("n1", &PostParams::default(), &wrong)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 400);
    assert_eq!(
        e.message,
        "the name of the object (n9) does not match the name on the URL (n1)"
    );
    // PUT on a missing node is 404 (nodes do not allow create-on-update)
    let mut ghost = node("ghost");
    ghost.metadata.resource_version = None;
    let e = api_err(
        nodes
            .replace("ghost", &PostParams::default(), &ghost)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 404);
}

#[tokio::test]
async fn status_subresource_isolation_and_generation() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().set_auto_start(false);
    d.create(&pod("default", "p", "n1", json!({}))).unwrap();
    d.create(&node("n1")).unwrap();
    let c = d.client().await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let p0 = pods.get("p").await.unwrap();
    assert_eq!(p0.metadata.generation, Some(1));

    // main resource: status changes are ignored, spec changes bump generation
    let patch = json!({
        "status": {"phase": "Failed"},
        "spec": {"activeDeadlineSeconds": 60},
        "metadata": {"labels": {"x": "y"}}
    });
    let p1 = pods
        .patch("p", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    assert_eq!(
        p1.status.as_ref().unwrap().phase.as_deref(),
        Some("Running")
    );
    assert_eq!(p1.spec.as_ref().unwrap().active_deadline_seconds, Some(60));
    assert_eq!(p1.metadata.generation, Some(2));
    assert_eq!(p1.metadata.labels.as_ref().unwrap()["x"], "y");

    // status subresource: only status changes, generation stays
    let sp = json!({"status": {"phase": "Succeeded"}, "spec": {"activeDeadlineSeconds": 5}});
    let p2 = pods
        .patch_status("p", &PatchParams::default(), &Patch::Merge(&sp))
        .await
        .unwrap();
    assert_eq!(
        p2.status.as_ref().unwrap().phase.as_deref(),
        Some("Succeeded")
    );
    assert_eq!(p2.spec.as_ref().unwrap().active_deadline_seconds, Some(60));
    assert_eq!(p2.metadata.generation, Some(2));

    // replace_status likewise
    let mut p3 = p2.clone();
    p3.spec.as_mut().unwrap().active_deadline_seconds = Some(1);
    p3.status.as_mut().unwrap().phase = Some("Failed".into());
    let p3 = pods
        .replace_status("p", &PostParams::default(), &p3)
        .await
        .unwrap();
    assert_eq!(p3.status.unwrap().phase.as_deref(), Some("Failed"));
    assert_eq!(p3.spec.unwrap().active_deadline_seconds, Some(60));

    // a pod's spec is mostly immutable
    let e = api_err(
        pods.patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"nodeName": "elsewhere"}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    assert!(
        e.message.contains("pod updates may not change fields"),
        "{}",
        e.message
    );

    // node status through /status, spec untouched
    let nodes: Api<Node> = Api::all(c);
    let ns = json!({"spec": {"unschedulable": true}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}});
    let n = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Strategic(&ns))
        .await
        .unwrap();
    assert_eq!(n.spec.and_then(|s| s.unschedulable), None);
    assert_eq!(n.status.unwrap().conditions.unwrap()[0].status, "False");
    // node has no generation
    assert_eq!(n.metadata.generation, None);
}

async fn raw(
    d: &ApiDouble,
    method: &str,
    path: &str,
    ct: Option<&str>,
    body: &str,
) -> (u16, serde_json::Value) {
    let c = d.client().await;
    let mut b = http::Request::builder().method(method).uri(path);
    if let Some(ct) = ct {
        b = b.header("content-type", ct);
    }
    let req = b.body(body.as_bytes().to_vec()).unwrap();
    match c.request_text(req).await {
        Ok(t) => (
            200,
            serde_json::from_str(&t).unwrap_or(serde_json::Value::String(t)),
        ),
        Err(kube::Error::Api(s)) => (s.code, serde_json::to_value(&*s).unwrap()),
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn errors_content_types_and_unknown_paths() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let (code, st) = raw(&d, "GET", "/api/v1/widgets", None, "").await;
    assert_eq!(code, 404);
    assert_eq!(st["reason"], "NotFound");
    let (code, st) = raw(
        &d,
        "POST",
        "/api/v1/nodes",
        Some("application/json"),
        "{not json",
    )
    .await;
    assert_eq!(code, 400);
    assert_eq!(st["reason"], "BadRequest");
    let (code, _) = raw(&d, "POST", "/api/v1/nodes", Some("text/plain"), "{}").await;
    assert_eq!(code, 415);
    let (code, st) = raw(
        &d,
        "PATCH",
        "/api/v1/nodes/n1",
        Some("application/apply-patch+yaml"),
        "{}",
    )
    .await;
    assert_eq!(code, 415);
    assert!(st["message"]
        .as_str()
        .unwrap()
        .contains("server-side apply"));
    let (code, _) = raw(
        &d,
        "PATCH",
        "/api/v1/nodes/n1",
        Some("application/json"),
        "{}",
    )
    .await;
    assert_eq!(code, 415);
    // kind mismatch
    let (code, _) = raw(
        &d,
        "POST",
        "/api/v1/nodes",
        Some("application/json"),
        r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"x"}}"#,
    )
    .await;
    assert_eq!(code, 400);
    // namespaced resource without namespace on an item path
    let (code, _) = raw(&d, "GET", "/api/v1/pods/x", None, "").await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn discovery_and_version_work_for_kube() {
    let d = ApiDouble::start().await.unwrap();
    let c = d.client().await;
    let v = c.apiserver_version().await.unwrap();
    assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", "37"));
    let disc = kube::Discovery::new(c.clone()).run().await.unwrap();
    let mut found = Vec::new();
    for g in disc.groups() {
        for (ar, caps) in g.recommended_resources() {
            found.push(format!(
                "{}/{}:{}",
                ar.group,
                ar.plural,
                caps.scope == kube::discovery::Scope::Namespaced
            ));
        }
    }
    for want in [
        "/pods:true",
        "/nodes:false",
        "policy/poddisruptionbudgets:true",
        "coordination.k8s.io/leases:true",
        "events.k8s.io/events:true",
    ] {
        assert!(found.iter().any(|f| f == want), "{want} not in {found:?}");
    }
    let core = c.list_core_api_resources("v1").await.unwrap();
    assert!(core.resources.iter().any(|r| r.name == "pods/eviction"));
}

/// The default admission plugins the double models on create, as the real
/// v1.32 server answered the same requests: Priority, NamespaceLifecycle,
/// TaintNodesByCondition.
#[tokio::test]
async fn creates_meet_priority_namespace_and_node_admission() {
    let d = ApiDouble::start().await.unwrap();
    let c = d.client_without_retry().await;
    let pp = PostParams::default();
    let pcs: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(c.clone());
    pcs.create(
        &pp,
        &serde_json::from_value(json!({"metadata": {"name": "high"}, "value": 1000})).unwrap(),
    )
    .await
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let mk = |name: &str, extra: serde_json::Value| -> Pod {
        let mut p = json!({"metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}});
        p["spec"]
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(p).unwrap()
    };
    let p = pods
        .create(&pp, &mk("classed", json!({"priorityClassName": "high"})))
        .await
        .unwrap();
    assert_eq!(p.spec.as_ref().unwrap().priority, Some(1000));
    assert_eq!(
        p.spec.unwrap().preemption_policy.as_deref(),
        Some("PreemptLowerPriority")
    );
    let p = pods.create(&pp, &mk("plain", json!({}))).await.unwrap();
    assert_eq!(p.spec.unwrap().priority, Some(0));
    let p = pods
        .create(
            &pp,
            &mk(
                "critical",
                json!({"priorityClassName": "system-node-critical"}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(p.spec.unwrap().priority, Some(2_000_001_000));
    let e = api_err(
        pods.create(&pp, &mk("given", json!({"priority": 5})))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 403);
    assert_eq!(
        e.message,
        "pods \"given\" is forbidden: the integer value of priority (5) must not be provided in pod spec; priority admission controller computed 0 from the given PriorityClass name"
    );
    let e = api_err(
        pods.create(&pp, &mk("unknown", json!({"priorityClassName": "nope"})))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (e.code, e.message.as_str()),
        (
            403,
            "pods \"unknown\" is forbidden: no PriorityClass with name nope was found"
        )
    );

    // NamespaceLifecycle: nothing is created in a namespace that does not exist.
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(c.clone(), "missing");
    let lease: k8s_openapi::api::coordination::v1::Lease =
        serde_json::from_value(json!({"metadata": {"name": "l"}})).unwrap();
    let e = api_err(leases.create(&pp, &lease).await.unwrap_err());
    assert_eq!(
        (e.code, e.message.as_str()),
        (404, "namespaces \"missing\" not found")
    );
    let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(c.clone());
    nss.create(
        &pp,
        &serde_json::from_value(json!({"metadata": {"name": "missing"}})).unwrap(),
    )
    .await
    .unwrap();
    leases.create(&pp, &lease).await.unwrap();

    // TaintNodesByCondition: a Node created through the API is not-ready.
    let nodes: Api<Node> = Api::all(c.clone());
    let n = nodes
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "fresh"}})).unwrap(),
        )
        .await
        .unwrap();
    let taints = n.spec.unwrap().taints.unwrap();
    assert_eq!(
        (taints[0].key.as_str(), taints[0].effect.as_str()),
        ("node.kubernetes.io/not-ready", "NoSchedule")
    );

    // A metadata-only GET is a PartialObjectMetadata.
    let m = nodes.get_metadata("fresh").await.unwrap();
    assert_eq!(m.metadata.name.as_deref(), Some("fresh"));
    assert_eq!(
        m.types.as_ref().map(|t| t.kind.as_str()),
        Some("PartialObjectMetadata")
    );
    let raw = c
        .request_text(
            http::Request::get("/api/v1/nodes/fresh")
                .header(
                    "Accept",
                    "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1",
                )
                .body(vec![])
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(!raw.contains("\"spec\""), "metadata only: {raw}");
}
