//! The `lastgasp-apidouble` binary: starts, loads objects, serves kube, exposes its log and control calls.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use serde_json::json;

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn binary_serves_seeded_objects_and_its_log() {
    let dir = std::env::temp_dir().join(format!("apidouble-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let objects = dir.join("objects.json");
    std::fs::write(
        &objects,
        serde_json::to_vec(&json!([
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "vm-node"}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "default"},
             "spec": {"nodeName": "vm-node", "containers": [{"name": "c", "image": "i"}]},
             "status": {"phase": "Running"}}
        ]))
        .unwrap(),
    )
    .unwrap();
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_lastgasp-apidouble"))
            .args(["--listen", "127.0.0.1:0", "--objects"])
            .arg(&objects)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect("address line")
        .to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let mut cfg = kube::Config::new(url.parse().unwrap());
    cfg.default_retry = false;
    let client = kube::Client::try_from(cfg).unwrap();
    let node: Node = Api::all(client.clone()).get("vm-node").await.unwrap();
    assert!(node.metadata.uid.is_some());
    let pod: Pod = Api::namespaced(client.clone(), "default")
        .get("web")
        .await
        .unwrap();
    assert_eq!(pod.status.unwrap().phase.as_deref(), Some("Running"));

    // control: a fault, then the log as JSON lines
    let req = http::Request::post("/_double/faults")
        .header("content-type", "application/json")
        .body(
            serde_json::to_vec(
                &json!({"method": "GET", "pathPrefix": "/api/v1/nodes", "status": 503}),
            )
            .unwrap(),
        )
        .unwrap();
    client.request_text(req).await.unwrap();
    match Api::<Node>::all(client.clone()).get("vm-node").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 503),
        other => panic!("{other:?}"),
    }
    let log = client
        .request_text(http::Request::get("/_double/log").body(vec![]).unwrap())
        .await
        .unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary: Vec<(String, String, u64)> = lines
        .iter()
        .map(|l| {
            (
                l["method"].as_str().unwrap().into(),
                l["path"].as_str().unwrap().into(),
                l["status"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("GET".into(), "/api/v1/nodes/vm-node".into(), 200),
            (
                "GET".into(),
                "/api/v1/namespaces/default/pods/web".into(),
                200
            ),
            ("GET".into(), "/api/v1/nodes/vm-node".into(), 503),
        ]
    );
    assert!(lines[0]["at"].as_str().unwrap().ends_with('Z'));
    assert!(
        lines[2]["sinceStartMs"].as_f64().unwrap() >= lines[0]["sinceStartMs"].as_f64().unwrap()
    );
    // the kubelet control: finish the pod after a delete
    client
        .request_text(
            http::Request::put("/_double/kubelet")
                .header("content-type", "application/json")
                .body(br#"{"autoFinish": false}"#.to_vec())
                .unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.delete("web", &Default::default()).await.unwrap();
    assert!(pods
        .get("web")
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_some());
    let r = client
        .request_text(
            http::Request::post("/_double/pods/default/web/finish")
                .body(vec![])
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&r).unwrap()["finished"],
        true
    );
    assert!(pods.get_opt("web").await.unwrap().is_none());
    let _ = std::fs::remove_dir_all(&dir);
}
