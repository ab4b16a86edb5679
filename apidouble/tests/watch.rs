//! WATCH with selectors and resourceVersion, 410 Gone, kube-runtime's watcher
//! re-listing, bookmarks, streaming lists, paginated and exact lists.

mod common;

use std::time::Duration;

use common::{api_err, node, pod};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use serde_json::json;

use lastgasp_apidouble::ApiDouble;

fn kind<K: kube::Resource>(e: &WatchEvent<K>) -> String
where
    K::DynamicType: Default,
{
    match e {
        WatchEvent::Added(o) => format!("ADDED {}", o.meta().name.clone().unwrap()),
        WatchEvent::Modified(o) => format!("MODIFIED {}", o.meta().name.clone().unwrap()),
        WatchEvent::Deleted(o) => format!("DELETED {}", o.meta().name.clone().unwrap()),
        WatchEvent::Bookmark(b) => format!("BOOKMARK {}", b.metadata.resource_version),
        WatchEvent::Error(e) => format!("ERROR {}", e.code),
    }
}

async fn next<K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug>(
    s: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin),
) -> String
where
    K::DynamicType: Default,
{
    let e = tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .expect("watch event in time");
    kind(&e.expect("stream open").expect("event"))
}

#[tokio::test]
async fn watch_from_resource_version_with_field_and_label_selectors() {
    let d = ApiDouble::start().await.unwrap();
    d.kubelet().set_auto_start(false);
    d.create(&pod("default", "a", "n1", json!({"app": "web"})))
        .unwrap();
    let c = d.client().await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let list = pods.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();

    let wp = WatchParams::default()
        .fields("spec.nodeName=n1")
        .labels("app=web");
    let mut s = pods.watch(&wp, &rv).await.unwrap().boxed();
    // events after rv only: not the existing pod
    d.create(&pod("default", "b", "n1", json!({"app": "web"})))
        .unwrap();
    d.create(&pod("default", "other-node", "n2", json!({"app": "web"})))
        .unwrap();
    d.create(&pod("default", "other-label", "n1", json!({"app": "db"})))
        .unwrap();
    pods.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"annotations": {"k": "v"}}})),
    )
    .await
    .unwrap();
    assert_eq!(next(&mut s).await, "ADDED b");
    assert_eq!(next(&mut s).await, "MODIFIED a");
    // leaving the selector is a DELETED, entering it an ADDED (watch cache semantics)
    pods.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"app": "db"}}})),
    )
    .await
    .unwrap();
    assert_eq!(next(&mut s).await, "DELETED a");
    pods.patch(
        "other-label",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"app": "web"}}})),
    )
    .await
    .unwrap();
    assert_eq!(next(&mut s).await, "ADDED other-label");

    // a watch with resourceVersion "0" starts with the current state
    let all: Api<Pod> = Api::all(c.clone());
    let mut s0 = all
        .watch(&WatchParams::default().fields("metadata.name=b"), "0")
        .await
        .unwrap()
        .boxed();
    assert_eq!(next(&mut s0).await, "ADDED b");
    pods.delete("b", &Default::default()).await.unwrap();
    // graceful: MODIFIED (deletionTimestamp) then DELETED once the kubelet is done
    // MODIFIED (deletionTimestamp), MODIFIED (kubelet: terminal status), MODIFIED (grace 0), DELETED
    let mut seq = Vec::new();
    for _ in 0..4 {
        seq.push(next(&mut s0).await);
    }
    assert_eq!(seq, ["MODIFIED b", "MODIFIED b", "MODIFIED b", "DELETED b"]);
}

#[tokio::test]
async fn watch_from_compacted_resource_version_is_410_expired() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let nodes: Api<Node> = Api::all(d.client().await);
    let old = nodes
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    d.compact();
    let mut s = nodes
        .watch(&WatchParams::default(), &old)
        .await
        .unwrap()
        .boxed();
    let e = tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    match e {
        WatchEvent::Error(st) => {
            assert_eq!((st.code, st.reason.as_str()), (410, "Expired"));
            assert_eq!(
                st.message,
                format!("too old resource version: {old} ({})", d.resource_version())
            );
        }
        other => panic!("expected ERROR, got {}", kind(&other)),
    }
    // an exact list at a compacted resourceVersion is 410 too
    let lp = ListParams::default()
        .at(&old)
        .matching(kube::api::VersionMatch::Exact);
    let e = api_err(nodes.list(&lp).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
}

#[tokio::test]
async fn kube_runtime_watcher_relists_after_410() {
    let d = ApiDouble::start().await.unwrap();
    d.create(&node("n1")).unwrap();
    let nodes: Api<Node> = Api::all(d.client().await);
    // a short watch timeout makes the watcher re-watch from its last resourceVersion
    let cfg = watcher::Config::default().timeout(1);
    let mut s = watcher(nodes.clone(), cfg).boxed();
    let mut seen = Vec::new();
    let mut compacted = false;
    let mut added_n2 = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while tokio::time::Instant::now() < deadline {
        let ev = tokio::time::timeout(Duration::from_secs(5), s.next())
            .await
            .expect("watcher progress");
        match ev.expect("stream") {
            Ok(watcher::Event::Init) => seen.push("Init".to_string()),
            Ok(watcher::Event::InitApply(n)) => {
                seen.push(format!("InitApply {}", n.metadata.name.unwrap()));
            }
            Ok(watcher::Event::InitDone) => {
                seen.push("InitDone".into());
                if !compacted {
                    // while the watch is open: change something, then compact the history
                    // so the next re-watch from the old resourceVersion gets 410
                    compacted = true;
                    let rv = d.resource_version();
                    d.compact();
                    assert_eq!(d.resource_version(), rv);
                    // bump rv past the watcher's bookmark without a watch event for nodes
                    d.create(&pod("default", "x", "", json!({}))).unwrap();
                    d.compact();
                } else if !added_n2 {
                    added_n2 = true;
                    d.create(&node("n2")).unwrap();
                }
            }
            Ok(watcher::Event::Apply(n)) => {
                seen.push(format!("Apply {}", n.metadata.name.unwrap()));
                if added_n2 {
                    break;
                }
            }
            Ok(watcher::Event::Delete(_)) => {}
            Err(e) => seen.push(format!(
                "Err {}",
                if e.to_string().contains("410") || format!("{e:?}").contains("410") {
                    "410"
                } else {
                    "other"
                }
            )),
        }
    }
    let joined = seen.join(", ");
    assert!(joined.contains("Err 410"), "{joined}");
    // after the 410 the watcher lists again (a second Init) and keeps streaming
    assert_eq!(seen.iter().filter(|s| *s == "Init").count(), 2, "{joined}");
    assert!(joined.ends_with("Apply n2"), "{joined}");
    // and the request log shows the re-list
    let lists = d
        .requests()
        .iter()
        .filter(|r| r.path == "/api/v1/nodes" && !r.watch)
        .count();
    assert_eq!(lists, 2);
}

#[tokio::test]
async fn bookmarks_and_streaming_list() {
    let d = ApiDouble::start().await.unwrap();
    d.set_bookmark_interval(Duration::from_millis(100));
    d.create(&node("n1")).unwrap();
    d.create(&node("n2")).unwrap();
    let nodes: Api<Node> = Api::all(d.client().await);
    let rv = d.resource_version();
    let mut s = nodes
        .watch(&WatchParams::default(), &rv.to_string())
        .await
        .unwrap()
        .boxed();
    assert_eq!(next(&mut s).await, format!("BOOKMARK {rv}"));
    // sendInitialEvents: ADDED for the current state, then a bookmark marking its end
    let wp = WatchParams::default().initial_events();
    let mut s = nodes.watch(&wp, "0").await.unwrap().boxed();
    assert_eq!(next(&mut s).await, "ADDED n1");
    assert_eq!(next(&mut s).await, "ADDED n2");
    match tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Bookmark(b) => {
            assert_eq!(b.metadata.resource_version, rv.to_string());
            assert_eq!(
                b.metadata
                    .annotations
                    .get("k8s.io/initial-events-end")
                    .map(String::as_str),
                Some("true")
            );
        }
        other => panic!("expected bookmark, got {}", kind(&other)),
    }
    // kube-runtime's streaming-list watcher works end to end
    let cfg = watcher::Config::default().streaming_lists();
    let got: Vec<Node> = tokio::time::timeout(
        Duration::from_secs(5),
        watcher(nodes.clone(), cfg)
            .take(4)
            .try_filter_map(|e| async move {
                Ok(match e {
                    watcher::Event::InitApply(n) => Some(n),
                    _ => None,
                })
            })
            .try_collect(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(got.len(), 2);
    // timeoutSeconds ends the stream
    let t0 = std::time::Instant::now();
    let s = nodes
        .watch(
            &WatchParams::default().timeout(1),
            &d.resource_version().to_string(),
        )
        .await
        .unwrap();
    let evs: Vec<String> = s.map(|e| kind(&e.unwrap())).collect().await;
    assert!(evs.iter().all(|e| e.starts_with("BOOKMARK")), "{evs:?}");
    assert!(!evs.is_empty(), "bookmarks every 100ms");
    assert!(t0.elapsed() >= Duration::from_millis(900) && t0.elapsed() < Duration::from_secs(4));
}

#[tokio::test]
async fn paginated_and_exact_lists() {
    let d = ApiDouble::start().await.unwrap();
    for i in 0..5 {
        d.create(&node(&format!("n{i}"))).unwrap();
    }
    let nodes: Api<Node> = Api::all(d.client().await);
    let first = nodes.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(first.items.len(), 2);
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    let token = first.metadata.continue_.clone().unwrap();
    let rv_at_first = first.metadata.resource_version.clone().unwrap();
    // a change between pages is not seen: pages are a consistent snapshot
    d.create(&node("n10")).unwrap();
    let second = nodes
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    let names: Vec<String> = second
        .items
        .iter()
        .map(|n| n.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["n2", "n3"]);
    assert_eq!(
        second.metadata.resource_version.as_deref(),
        Some(rv_at_first.as_str())
    );
    let third = nodes
        .list(
            &ListParams::default()
                .limit(2)
                .continue_token(second.metadata.continue_.as_ref().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(third.items.len(), 1);
    assert!(third.metadata.continue_.is_none());
    // exact: the state at that resourceVersion
    nodes.delete("n0", &Default::default()).await.unwrap();
    let exact = nodes
        .list(
            &ListParams::default()
                .at(&rv_at_first)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .unwrap();
    assert_eq!(exact.items.len(), 5);
    assert_eq!(
        exact.metadata.resource_version.as_deref(),
        Some(rv_at_first.as_str())
    );
    let now = nodes.list(&ListParams::default()).await.unwrap();
    assert_eq!(now.items.len(), 5); // n0 gone, n10 added
    assert!(now
        .items
        .iter()
        .all(|n| n.metadata.name.as_deref() != Some("n0")));
}
