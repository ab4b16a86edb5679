//! The graceful path's drain against the double: pods by priority bucket,
//! grace periods, removal by delete or eviction, the node's marks.
use super::*;

#[tokio::test]
async fn announce_only_and_the_pods_a_drain_leaves() {
    let s = setup(
        "keep",
        vec![
            pod("web", Some(0), None, json!({})),
            pod(
                "ds-pod",
                Some(0),
                None,
                json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u1"}]}}),
            ),
            pod("kept", Some(0), None, json!({"metadata": {"labels": {"keep": "yes"}}})),
        ],
    )
    .await;
    let buckets = vec![Bucket {
        priority: 0,
        seconds: 3,
    }];
    let announce = opts(&s, buckets.clone(), Removal::None);
    let r = drain(&s, &announce, &Metrics::default()).await.unwrap();
    assert!(
        deletions(&s.double).is_empty(),
        "announce only: no pod removed"
    );
    assert!(
        r.pods.iter().all(|p| p.how == "skipped-announce-only"),
        "{r:#?}"
    );
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n).map(|c| c.1), Some("GracefulShutdown".into()));
    assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
    let types = |n: &Node| -> Vec<String> {
        let conds = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        conds.into_iter().map(|c| c.type_).collect()
    };
    assert!(
        !types(&n)
            .iter()
            .any(|t| t == "DrainInProgress" || t == "Drained"),
        "announce only drains nothing, and says no drain: {:?}",
        types(&n)
    );

    let mut keep = opts(&s, buckets, Removal::Delete);
    keep.keep.daemonsets = true;
    keep.keep.labels.insert("keep".into(), "yes".into());
    let r = drain(&s, &keep, &Metrics::default()).await.unwrap();
    let how = |name: &str| {
        r.pods
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.how.clone())
    };
    assert_eq!(how("ds-pod").as_deref(), Some("skipped-daemonset"));
    assert_eq!(how("kept").as_deref(), Some("skipped-labels"));
    assert_eq!(how("web").as_deref(), Some("delete"));
    let n: Node = s.double.get("", NODE).unwrap();
    let drained = n.status.and_then(|s| s.conditions).unwrap_or_default();
    let st = |t: &str| {
        drained
            .iter()
            .find(|c| c.type_ == t)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    assert_eq!(
        st("DrainInProgress"),
        Some(("False".into(), Some("NodeShutdown".into())))
    );
    assert_eq!(
        st("Drained"),
        Some(("True".into(), Some("NodeShutdown".into())))
    );
    assert_eq!(
        deletions(&s.double)
            .into_iter()
            .map(|(n, _)| n)
            .collect::<Vec<_>>(),
        vec!["web".to_string()]
    );
}

/// The kubelet-compatible state file cannot be written (a read-only or
/// full disk): the drain goes on all the same.
#[tokio::test]
async fn a_state_file_that_cannot_be_written_does_not_stop_the_drain() {
    let s = setup("statefile", vec![pod("web", Some(0), None, json!({}))]).await;
    let mut o = opts(
        &s,
        vec![Bucket {
            priority: 0,
            seconds: 3,
        }],
        Removal::Delete,
    );
    o.state_file = "/proc/lastgasp-no-such-dir/graceful_node_shutdown_state".into();
    let metrics = Metrics::default();
    let r = drain(&s, &o, &metrics).await.expect("the drain ran");
    assert_eq!((r.terminated(), r.remaining()), (1, 0), "{r:#?}");
    assert!(
        metrics
            .encode()
            .contains("lastgasp_audit_write_failures_total 2"),
        "both writes counted: {}",
        metrics.encode()
    );
}

#[tokio::test]
async fn graceful_run_terminates_by_priority_with_kubelet_grace_semantics() {
    let s = setup(
        "graceful",
        vec![
            pod("low-a", None, None, json!({})),
            pod("low-b", Some(0), Some(1), json!({})),
            pod("mid", Some(1000), None, json!({})),
            pod("high", Some(100000), None, json!({})),
            pod(
                "static",
                Some(2000001000),
                None,
                json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "abc"}}}),
            ),
            pod(
                "done",
                Some(0),
                None,
                json!({"status": {"phase": "Succeeded"}}),
            ),
            pod("lastgasp-agent", Some(2000001000), None, json!({})),
        ],
    )
    .await;
    let buckets = vec![
        Bucket {
            priority: 0,
            seconds: 3,
        },
        Bucket {
            priority: 1000,
            seconds: 3,
        },
        Bucket {
            priority: 10000,
            seconds: 30,
        },
        Bucket {
            priority: 100000,
            seconds: 3,
        },
        Bucket {
            priority: 2000000000,
            seconds: 2,
        },
    ];
    let metrics = Metrics::default();
    let o = opts(&s, buckets, Removal::Delete);
    let report = drain(&s, &o, &metrics).await.unwrap();

    // The start's writes do not trip over each other (a 409 costs a backoff).
    let conflicts: Vec<String> = s
        .double
        .requests()
        .iter()
        .filter(|r| r.status == 409)
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(
        conflicts.is_empty(),
        "conflicts at the graceful start: {conflicts:?}"
    );

    // Order and grace periods: bucket by bucket, lowest first; the pod's own
    // shorter grace wins; our own pod stays (it must live to send its last
    // word); mirror and finished pods untouched.
    let dels = deletions(&s.double);
    let names: Vec<&str> = dels.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 4, "{dels:?}");
    assert!(
        names[..2].contains(&"low-a") && names[..2].contains(&"low-b"),
        "{names:?}"
    );
    assert_eq!(&names[2..], &["mid", "high"]);
    let grace: BTreeMap<_, _> = dels.into_iter().collect();
    assert_eq!(grace["low-a"], 3);
    assert_eq!(
        grace["low-b"], 1,
        "its own terminationGracePeriodSeconds is shorter"
    );
    assert_eq!(grace["mid"], 3);
    assert_eq!(grace["high"], 3);
    let skipped: Vec<_> = report
        .pods
        .iter()
        .filter(|p| p.how.starts_with("skipped"))
        .map(|p| (p.name.as_str(), p.how.as_str()))
        .collect();
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    assert!(
        skipped.contains(&("static", "skipped-mirror"))
            && skipped.contains(&("done", "skipped-finished"))
            && skipped.contains(&("lastgasp-agent", "skipped-self"))
    );

    // The empty 10000 bucket (30 s) was skipped, not waited for.
    let ran: Vec<i32> = report.buckets.iter().map(|b| b.priority).collect();
    assert_eq!(ran, vec![0, 1000, 100000]);
    assert!(report.buckets.iter().all(|b| !b.timed_out));
    assert!(
        report
            .buckets
            .windows(2)
            .all(|w| w[1].started_ms >= w[0].ended_ms),
        "buckets run one after another"
    );
    assert_eq!(
        (report.terminated(), report.remaining()),
        (4, 0),
        "{report:#?}"
    );

    // What the cluster sees.
    let n: Node = s.double.get("", NODE).unwrap();
    assert_marked(&n, "GracefulShutdown");
    let kubelet_ready = n
        .status
        .unwrap()
        .conditions
        .unwrap()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    assert!(
        kubelet_ready,
        "the kubelet's Ready condition is kept (merged by type)"
    );
    assert!(n
        .metadata
        .annotations
        .unwrap()
        .contains_key(RECORD_ANNOTATION));
    let events: Vec<Event> = s.double.list("default");
    let notes: Vec<&str> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("NodeShutdown"))
        .filter_map(|e| e.note.as_deref())
        .collect();
    // Two Events under one action: the end's text is not folded into the
    // start's series (kube's Recorder keys without the note).
    assert!(
        notes.iter().any(|n| n.contains("detected shutdown event"))
            && notes.iter().any(|n| n.contains("graceful shutdown done")),
        "{notes:?}"
    );

    // The kubelet-compatible state file and gauges.
    let state = graceful::read_state(&o.state_file).unwrap().unwrap();
    assert!(
        humantime::parse_rfc3339(&state.start_time).is_ok()
            && humantime::parse_rfc3339(&state.end_time).is_ok(),
        "{state:?}"
    );
    let m = metrics.encode();
    assert!(
        m.contains("graceful_shutdown_start_time_seconds")
            && !m.contains("graceful_shutdown_end_time_seconds 0.0"),
        "{m}"
    );

    // Cancellation undoes it.
    graceful::cancel(&s.nc, &graceful_episode().1)
        .await
        .unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        condition(&n),
        Some(("False".into(), "ShutdownCancelled".into()))
    );
    assert_eq!(
        taint_keys(&n),
        vec!["example.com/other".to_string()],
        "only our taint goes"
    );
    let events: Vec<Event> = s.double.list("default");
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("NodeShutdown")
                && e.note.as_deref().unwrap_or("").contains("cancellation")),
        "{events:?}"
    );
    std::fs::remove_dir_all(&s.dir).ok();
}

#[tokio::test]
async fn a_hanging_pod_holds_its_bucket_only_until_the_bucket_time() {
    let s = setup(
        "hang",
        vec![
            pod("stuck", Some(0), None, json!({})),
            pod("after", Some(1000), None, json!({})),
        ],
    )
    .await;
    // A kubelet that never finishes the pods (stuck unmounts, say).
    s.double.kubelet().set_auto_finish(false);
    let o = opts(
        &s,
        vec![
            Bucket {
                priority: 0,
                seconds: 1,
            },
            Bucket {
                priority: 1000,
                seconds: 2,
            },
        ],
        Removal::Delete,
    );
    let report = drain(&s, &o, &Metrics::default()).await.unwrap();
    assert_eq!(report.buckets.len(), 2);
    assert!(report.buckets.iter().all(|b| b.timed_out), "{report:?}");
    let b0 = &report.buckets[0];
    assert!(
        b0.ended_ms - b0.started_ms >= 1000,
        "the bucket had its full time: {b0:?}"
    );
    assert!(
        report.buckets[1].started_ms >= b0.ended_ms,
        "then the next bucket ran"
    );
    assert_eq!((report.terminated(), report.remaining()), (0, 2));
}

#[tokio::test]
async fn eviction_mode_honours_pdbs_and_falls_back_to_delete_near_the_end() {
    let db = |n: &str| {
        pod(
            n,
            Some(0),
            None,
            json!({"metadata": {"labels": {"app": "db"}}}),
        )
    };
    let web = |n: &str| {
        pod(
            n,
            Some(0),
            None,
            json!({"metadata": {"labels": {"app": "web"}}}),
        )
    };
    let s = setup(
        "evict",
        vec![
            db("db-0"),
            db("db-1"),
            web("web-0"),
            web("web-1"),
            web("web-2"),
        ],
    )
    .await;
    s.double
        .create_value(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "db-pdb", "namespace": "default"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "db"}}}
        }))
        .unwrap();
    s.double
        .create_value(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "web-pdb", "namespace": "default"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}
        }))
        .unwrap();
    let o = opts(
        &s,
        vec![Bucket {
            priority: 0,
            seconds: 4,
        }],
        Removal::Evict,
    );
    let report = drain(&s, &o, &Metrics::default()).await.unwrap();
    let how: BTreeMap<&str, &str> = report
        .pods
        .iter()
        .map(|p| (p.name.as_str(), p.how.as_str()))
        .collect();
    assert_eq!(how["db-0"], "delete-after-pdb", "{report:#?}");
    assert_eq!(how["db-1"], "delete-after-pdb");
    let db0 = report.pods.iter().find(|p| p.name == "db-0").unwrap();
    assert!(
        db0.note.as_deref().unwrap_or("").contains("db-pdb"),
        "the refusal names the budget: {db0:?}"
    );
    // web: two of three may go (minAvailable 1); the third falls back.
    let mut web: Vec<&str> = ["web-0", "web-1", "web-2"].iter().map(|n| how[n]).collect();
    web.sort();
    assert_eq!(web, vec!["delete-after-pdb", "evict", "evict"]);
    let evictions: Vec<_> = s
        .double
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/eviction"))
        .collect();
    let codes: Vec<u16> = evictions.iter().map(|r| r.status).collect();
    assert!(codes.contains(&429) && codes.contains(&201), "{codes:?}");
    let sent_grace =
        evictions[0].body.as_ref().unwrap()["deleteOptions"]["gracePeriodSeconds"].as_i64();
    assert_eq!(
        sent_grace,
        Some(4),
        "the eviction carries the bucket's grace period"
    );
    assert_eq!(report.remaining(), 0);
}

#[tokio::test]
async fn condition_and_taint_retry_through_409_and_5xx() {
    let s = setup("retry", vec![]).await;
    s.double.inject(
        Fault::status(500)
            .method("PATCH")
            .path_prefix("/api/v1/nodes/n1/status")
            .times(2),
    );
    s.double.inject(
        Fault::status(409)
            .method("PATCH")
            .path_regex("^/api/v1/nodes/n1$")
            .unwrap()
            .times(1),
    );
    s.double.inject(
        Fault::status(503)
            .method("GET")
            .path_prefix("/api/v1/nodes/n1")
            .times(1),
    );
    s.nc.set_condition(true, "GracefulShutdown", "test")
        .await
        .unwrap();
    s.nc.set_taint(true).await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n).unwrap().0, "True");
    assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
    let statuses: Vec<u16> = s
        .double
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH" && r.path == "/api/v1/nodes/n1/status")
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses, vec![500, 500, 200]);
}

/// A concurrent writer changes the taints between our read and our write:
/// the stale resourceVersion gets a real 409, and the retry keeps both.
#[tokio::test]
async fn taint_update_survives_a_concurrent_writer() {
    let s = setup("conflict", vec![]).await;
    s.double.inject(
        Fault::latency(Duration::from_millis(300))
            .method("PATCH")
            .path_prefix("/api/v1/nodes/n1")
            .times(1),
    );
    let writer = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.double
            .modify::<Node, _>("", NODE, |n| {
                n.spec.as_mut().unwrap().taints.as_mut().unwrap().push(
                    k8s_openapi::api::core::v1::Taint {
                        key: "example.com/late".into(),
                        effect: "NoSchedule".into(),
                        ..Default::default()
                    },
                );
            })
            .unwrap();
    };
    let (r, _) = tokio::join!(s.nc.set_taint(true), writer);
    r.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    let keys = taint_keys(&n);
    assert!(
        keys.contains(&"example.com/late".to_string()) && keys.contains(&TAINT_KEY.to_string()),
        "{keys:?}"
    );
    assert!(s
        .double
        .requests()
        .iter()
        .any(|r| r.method == "PATCH" && r.status == 409));
}

#[tokio::test]
async fn last_gasp_sends_the_evidence_in_one_write_then_the_rest() {
    let s = setup("lastgasp", vec![]).await;
    let lg = last_gasp_clients(&s.double, NODE).await;
    let mut sig = logind_signal();
    sig.source = Source::RebootSyscall;
    sig.forced = true;
    let ep = Decider::new().decide(&sig).episode.unwrap();
    let bodies = lg.bodies(
        "ForcedShutdown",
        "poweroff",
        &ShutdownRecord::new("boot-x", &sig, &ep),
        SystemTime::now(),
    );
    // No time left (a reboot(2)): the evidence alone.
    s.double.clear_requests();
    let sent = lg.send(&bodies, Instant::now()).await.unwrap();
    assert_eq!(sent.tries, 1);
    assert!(sent.condition.is_err() && sent.taint.is_err(), "{sent:?}");
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(condition(&n), None);
    assert_eq!(taint_keys(&n), ["example.com/other"]);
    let rec: serde_json::Value =
        serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
    assert_eq!(rec["signal"]["kind"], "poweroff");
    assert!(rec["signal"].get("detail").is_none(), "{rec}");
    let writes = |s: &Setup| -> Vec<(String, String)> {
        s.double
            .requests()
            .iter()
            .filter(|r| !r.watch)
            .map(|r| (r.method.clone(), r.path.clone()))
            .collect()
    };
    // Nothing but the one write: no list, no discovery, no GET; and in it
    // only the record (annotations merge by key: nothing read, nothing stale).
    assert_eq!(
        writes(&s),
        vec![("PATCH".to_string(), format!("/api/v1/nodes/{NODE}"))]
    );
    let body = s
        .double
        .requests()
        .into_iter()
        .find(|r| r.method == "PATCH")
        .unwrap()
        .body
        .unwrap();
    assert_eq!(
        body["metadata"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["annotations"]
    );
    assert_eq!(body.as_object().unwrap().len(), 1, "{body}");
    // With time left, the condition and the taint follow the evidence,
    // side by side, never beside it.
    s.double.clear_requests();
    let sent = lg
        .send(&bodies, Instant::now() + Duration::from_secs(2))
        .await
        .unwrap();
    let (c, t) = (sent.condition.clone().unwrap(), sent.taint.clone().unwrap());
    assert!(
        c >= sent.evidence_done && t >= sent.evidence_done,
        "{sent:?}"
    );
    let w = writes(&s);
    assert_eq!(w.len(), 3, "{w:?}");
    assert_eq!(w[0], ("PATCH".to_string(), format!("/api/v1/nodes/{NODE}")));
    assert!(w.contains(&("PATCH".to_string(), format!("/api/v1/nodes/{NODE}/status"))));
    let n: Node = s.double.get("", NODE).unwrap();
    assert_marked(&n, "ForcedShutdown");
}

/// A 429 is sent again only when the server's wait ends before the node's
/// expected end; otherwise the evidence is reported undelivered at once.
#[tokio::test]
async fn a_refused_last_gasp_is_not_retried_past_the_nodes_end() {
    let s = setup("lastgasp-429", vec![]).await;
    let lg = last_gasp_clients(&s.double, NODE).await;
    let bodies = lg.bodies(
        "ForcedShutdown",
        "poweroff",
        &record_of("boot-x", &forced_exec()),
        SystemTime::now(),
    );
    let evidence_path = format!("/api/v1/nodes/{NODE}");
    // The next evidence PATCH answered 429, Retry-After: 1 s.
    let throttled = |s: &Setup| {
        s.double.clear_requests();
        s.double.inject(
            Fault::status(429)
                .retry_after(1)
                .method("PATCH")
                .path_prefix(&evidence_path),
        );
    };
    let patches = |s: &Setup| {
        s.double
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH" && r.path == evidence_path)
            .map(|r| r.status)
            .collect::<Vec<u16>>()
    };
    // The wait (1 s) ends after the end (0.5 s): one send, and why.
    throttled(&s);
    let t = Instant::now();
    let e = lg
        .send(&bodies, t + Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(e.tries, 1);
    assert!(
        matches!(e.last, Refusal::Status { code: 429, retry_after: Some(w), .. } if w == Duration::from_secs(1)),
        "{e}"
    );
    assert!(e.to_string().contains("after the next boot"), "{e}");
    assert_eq!(patches(&s), vec![429]);
    // The wait ends before the end (3 s): sent again once it is over.
    throttled(&s);
    let t = Instant::now();
    let sent = lg.send(&bodies, t + Duration::from_secs(3)).await.unwrap();
    assert_eq!(sent.tries, 2);
    assert!(sent.evidence_done >= Duration::from_secs(1), "{sent:?}");
    // The evidence twice, then (time left) the taint on the same path.
    assert_eq!(patches(&s), vec![429, 200, 200]);
    // Any other refusal is final.
    s.double.clear_requests();
    s.double.inject(
        Fault::status(403)
            .method("PATCH")
            .path_prefix(&evidence_path),
    );
    let e = lg
        .send(&bodies, Instant::now() + Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!((e.tries, patches(&s)), (1, vec![403]));
}

#[tokio::test]
async fn the_pod_watch_sees_only_this_node() {
    let s = setup("watch", vec![pod("mine", None, None, json!({}))]).await;
    s.double
        .create_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "theirs", "namespace": "default"},
            "spec": {"nodeName": "n2", "containers": [{"name": "c", "image": "x"}]}}))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let names: Vec<String> =
        s.nc.pods
            .state()
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
    assert_eq!(names, vec!["mine".to_string()]);
    let _: Vec<Pod> = s.double.list("default");
}
