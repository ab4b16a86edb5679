//! The three patch types through kube::Client.

mod common;

use common::{api_err, node, pod};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use lastgasp_apidouble::ApiDouble;

fn tainted_node() -> Node {
    let mut n = node("n1");
    n.spec = Some(
        serde_json::from_value(json!({
            "taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoExecute"}]
        }))
        .unwrap(),
    );
    n.status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .push(serde_json::from_value(json!({"type": "DiskPressure", "status": "False"})).unwrap());
    n
}

#[tokio::test]
async fn strategic_merge_conditions_by_type_taints_replaced() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&tainted_node()).unwrap();
    let nodes: Api<Node> = Api::all(d.client().await);
    let p = json!({
        "spec": {"taints": [{"key": "lastgasp.dev/shutting-down", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "ShutdownInProgress", "status": "True", "reason": "GracefulShutdown"}]}
    });
    nodes
        .patch("n1", &PatchParams::default(), &Patch::Strategic(&p))
        .await
        .unwrap();
    let n = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Strategic(&p))
        .await
        .unwrap();
    let taints: Vec<String> = n
        .spec
        .unwrap()
        .taints
        .unwrap()
        .into_iter()
        .map(|t| t.key)
        .collect();
    assert_eq!(
        taints,
        ["lastgasp.dev/shutting-down"],
        "a list without a merge key is replaced"
    );
    let conds: Vec<(String, String)> = n
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    assert_eq!(
        conds,
        [
            ("Ready".into(), "True".into()),
            ("DiskPressure".into(), "False".into()),
            ("ShutdownInProgress".into(), "True".into())
        ]
    );
    // merging into an existing condition by type; $patch: delete removes one
    let p = json!({"status": {"conditions": [
        {"type": "Ready", "status": "False"},
        {"type": "DiskPressure", "$patch": "delete"}
    ]}});
    let n = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Strategic(&p))
        .await
        .unwrap();
    let conds: Vec<(String, String, Option<String>)> = n
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .map(|c| (c.type_, c.status, c.reason))
        .collect();
    assert_eq!(
        conds,
        [
            ("Ready".into(), "False".into(), Some("KubeletReady".into())),
            (
                "ShutdownInProgress".into(),
                "True".into(),
                Some("GracefulShutdown".into())
            )
        ]
    );
    // the same list under a JSON merge patch is replaced wholesale
    let m = json!({"status": {"conditions": [{"type": "Only", "status": "True"}]}});
    let n = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Merge(&m))
        .await
        .unwrap();
    assert_eq!(n.status.unwrap().conditions.unwrap().len(), 1);
}

#[tokio::test]
async fn strategic_merge_containers_by_name_and_directives() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().set_auto_start(false);
    let mut p = pod("default", "p", "n1", json!({"a": "1", "b": "2"}));
    p.metadata.finalizers = Some(vec!["x/one".into()]);
    p.spec
        .as_mut()
        .unwrap()
        .containers
        .push(serde_json::from_value(json!({"name": "side", "image": "side:1"})).unwrap());
    d.create(&p).unwrap();
    let pods: Api<Pod> = Api::namespaced(d.client().await, "default");
    let patch = json!({
        "metadata": {"labels": {"a": null, "c": "3"}, "finalizers": ["x/two"]},
        "spec": {"containers": [{"name": "side", "image": "side:2"}]}
    });
    let out = pods
        .patch("p", &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap();
    let cs: Vec<(String, String)> = out
        .spec
        .unwrap()
        .containers
        .into_iter()
        .map(|c| (c.name, c.image.unwrap()))
        .collect();
    assert_eq!(
        cs,
        [
            ("app".into(), "registry.example/app:1".into()),
            ("side".into(), "side:2".into())
        ]
    );
    let labels = out.metadata.labels.unwrap();
    assert_eq!(
        (labels.get("a"), labels.get("c").map(String::as_str)),
        (None, Some("3"))
    );
    assert_eq!(
        out.metadata.finalizers.unwrap(),
        ["x/one", "x/two"],
        "finalizers merge as a set"
    );
    let del = json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["x/one"], "labels": {"$patch": "replace", "only": "1"}}});
    let out = pods
        .patch("p", &PatchParams::default(), &Patch::Strategic(&del))
        .await
        .unwrap();
    assert_eq!(out.metadata.finalizers.unwrap(), ["x/two"]);
    assert_eq!(
        out.metadata.labels.unwrap().into_iter().collect::<Vec<_>>(),
        [("only".to_string(), "1".to_string())]
    );
    // ownerReferences merge by uid
    let owners = |uid: &str| json!({"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": uid, "uid": uid}]}});
    pods.patch(
        "p",
        &PatchParams::default(),
        &Patch::Strategic(&owners("u1")),
    )
    .await
    .unwrap();
    let out = pods
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Strategic(&owners("u2")),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.owner_references.unwrap().len(), 2);
}

#[tokio::test]
async fn json_patch_and_failed_test_is_422() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&tainted_node()).unwrap();
    let nodes: Api<Node> = Api::all(d.client().await);
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/taints/0/key", "value": "a"},
        {"op": "remove", "path": "/spec/taints/0"},
        {"op": "add", "path": "/metadata/labels/x", "value": "1"}
    ]))
    .unwrap();
    let n = nodes
        .patch("n1", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .unwrap();
    assert_eq!(n.spec.unwrap().taints.unwrap().len(), 1);
    assert_eq!(n.metadata.labels.unwrap()["x"], "1");
    let failing: json_patch::Patch =
        serde_json::from_value(json!([{"op": "test", "path": "/spec/taints/0/key", "value": "a"}]))
            .unwrap();
    let e = api_err(
        nodes
            .patch("n1", &PatchParams::default(), &Patch::<()>::Json(failing))
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        e.message,
        "the server rejected our request due to an error in our request"
    );
    // nothing was written by the failed patch
    assert_eq!(
        d.get::<Node>("", "n1").unwrap().metadata.labels.unwrap()["x"],
        "1"
    );
    // patching a missing object is 404
    let e = api_err(
        nodes
            .patch("zz", &PatchParams::default(), &Patch::Merge(&json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 404);
}
