//! The RBAC rules are exactly the API calls the code makes, driven against the API double.
use super::*;

/// Maps a logged request to RBAC's attributes with the apiserver's rules
/// (`RequestInfoFactory`): GET of one object → get, of a collection → list,
/// `?watch` → watch, POST → create, PUT → update, PATCH → patch, DELETE of
/// one → delete, of a collection → deletecollection.
fn attr(r: &RequestRecord) -> Attr {
    let parts: Vec<&str> = r.path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _v, rest @ ..] => (String::new(), rest),
        ["apis", g, _v, rest @ ..] => (g.to_string(), rest),
        _ => panic!("not a resource request: {} {}", r.method, r.path),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (ns.to_string(), rest),
        _ => (String::new(), rest),
    };
    let (resource, name) = match rest {
        [res] => (res.to_string(), String::new()),
        [res, name] => (res.to_string(), name.to_string()),
        [res, name, sub] => (format!("{res}/{sub}"), name.to_string()),
        _ => panic!("unexpected path {}", r.path),
    };
    let watch = r.watch
        || r.query_param("watch")
            .is_some_and(|w| w == "true" || w == "1");
    let verb = match (r.method.as_str(), name.is_empty()) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "list",
        ("GET", false) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "deletecollection",
        ("DELETE", false) => "delete",
        (m, _) => panic!("unexpected method {m}"),
    };
    // A create's name is not an authorization attribute (RBAC: resourceNames
    // cannot limit create) unless it names a subresource of an object.
    let name = if r.method == "POST" && !resource.contains('/') {
        String::new()
    } else {
        name
    };
    Attr {
        group,
        resource,
        verb: verb.into(),
        namespace,
        name,
    }
}

/// Every request allowed by some grant, and every granted (group, resource,
/// verb) used by some request: the rules are exactly what the code does.
fn assert_rbac_exact(who: &str, grants: &[Grant], requests: &[RequestRecord]) {
    let attrs: BTreeSet<Attr> = requests.iter().map(attr).collect();
    let denied: Vec<&Attr> = attrs
        .iter()
        .filter(|a| !grants.iter().any(|g| g.allows(a)))
        .collect();
    let granted: BTreeSet<(String, String, String)> =
        grants.iter().flat_map(Grant::triples).collect();
    let used: BTreeSet<(String, String, String)> = attrs
        .iter()
        .map(|a| (a.group.clone(), a.resource.clone(), a.verb.clone()))
        .collect();
    let unused: Vec<_> = granted.difference(&used).collect();
    println!("{who}: API calls made (group, resource, verb): {used:?}");
    assert!(
        denied.is_empty(),
        "{who}: the code makes calls its RBAC does not allow: {denied:#?}"
    );
    assert!(
        unused.is_empty(),
        "{who}: RBAC grants what the code never does: {unused:?}"
    );
    assert_eq!(granted, used);
}

const NODE: &str = "n1";

fn node() -> Value {
    lastgasp_tests::nodes::node(NODE).json()
}

fn pod(ns: &str, name: &str, priority: i32, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": NODE, "priority": priority, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

fn signal(source: Source, forced: bool) -> ShutdownSignal {
    ShutdownSignal {
        source,
        kind: Kind::Poweroff,
        forced,
        bypasses_logind: forced,
        calls_reboot: false,
        scope: Scope::Node,
        effect: Effect::Now,
        actor: Some(Actor {
            pid: 1,
            comm: "systemctl".into(),
            borrowed: Some(false),
            ..Default::default()
        }),
        sender: None,
        at: SystemTime::now(),
        boot_ns: 0,
        deadline: (!forced).then(|| SystemTime::now() + Duration::from_secs(30)),
        detail: if forced {
            Detail::Exec {
                path: "/sbin/poweroff".into(),
                binary: None,
                argv: vec!["poweroff".into(), "-ff".into()],
                raw: String::new(),
                truncated: false,
            }
        } else {
            Detail::Dbus {
                member: "PrepareForShutdown".into(),
                unit: None,
            }
        },
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..100 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Every path of the agent that talks to the API server, through the real
/// code: the warm watches and connections of start-up, the graceful path
/// (delete and evict, with the PDB fallback), its cancellation, the last
/// gasp, a last gasp lost to a dead API server, and the next boot's report,
/// late delivery and clean-up. `lastgasp check`'s SelfSubjectAccessReview is
/// not driven here: every authenticated user may create one
/// (system:basic-user), so it needs no rule.
#[tokio::test]
async fn agent_rbac_is_exactly_what_the_agent_calls() {
    let objs = objects("deploy/kustomize", &source_objects());
    let pod_spec = agent_pod(&objs);
    let sa = pod_spec.service_account_name.clone().unwrap();
    let grants = grants(&objs, "lastgasp", &sa);

    let double = ApiDouble::start().await.unwrap();
    double.create_value(node()).unwrap();
    double
        .create_value(pod("default", "low", 0, json!({"app": "low"})))
        .unwrap();
    double
        .create_value(pod(
            "lastgasp",
            "lastgasp-agent-x",
            2_000_001_000,
            json!({"app": "agent"}),
        ))
        .unwrap();
    double
        .kubelet()
        .set_default_termination(Duration::from_millis(50));
    let dir = std::env::temp_dir().join(format!("lastgasp-manifests-rbac-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // Start-up, as `run` does it: two clients, the warm watches.
    let (nc, lg) = warm_clients(&double, NODE).await;
    let opts = |removal, seconds| GracefulOptions {
        buckets: vec![
            Bucket {
                priority: 0,
                seconds,
            },
            Bucket {
                priority: 2_000_000_000,
                seconds: 1,
            },
        ],
        removal,
        own_pod: Some(("lastgasp".into(), "lastgasp-agent-x".into())),
        state_file: dir.join("graceful_node_shutdown_state"),
        keep: Default::default(),
    };
    let cluster = |removal, seconds| {
        Arc::new(Cluster {
            node: nc.clone(),
            lastgasp: lg.clone(),
            graceful: Arc::new(opts(removal, seconds)),
        })
    };

    // The graceful path, pods deleted (condition, taint, record, Event).
    let s = signal(Source::Logind, false);
    let ep = Decider::new().decide(&s).episode.unwrap();
    let record = lastgasp::record::ShutdownRecord::new("boot-x", &s, &ep);
    let r = graceful::run(
        &nc,
        &opts(Removal::Delete, 2),
        &ep,
        &record,
        &Metrics::default(),
    )
    .await
    .unwrap();
    assert_eq!(r.remaining(), 0, "{r:#?}");
    // Cancelled: condition False, taint off, Event.
    graceful::cancel(&nc, &ep).await.unwrap();

    // Everything so far is podRemoval: delete's: exactly the default grants.
    let before_evict = double.requests().len();

    // podRemoval: evict, with a budget that allows one of two: one eviction,
    // one 429, then the DELETE fallback.
    for n in ["db-0", "db-1"] {
        double
            .create_value(pod("default", n, 0, json!({"app": "db"})))
            .unwrap();
    }
    double
        .create_value(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "db", "namespace": "default"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}}
        }))
        .unwrap();
    until("the pod watch sees the new pods", || {
        nc.pods
            .state()
            .iter()
            .filter(|p| {
                p.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("db-"))
            })
            .count()
            == 2
    })
    .await;
    let r = graceful::run(
        &nc,
        &opts(Removal::Evict, 2),
        &ep,
        &record,
        &Metrics::default(),
    )
    .await
    .unwrap();
    let how: BTreeSet<&str> = r.pods.iter().map(|p| p.how.as_str()).collect();
    assert!(
        how.contains("evict") && how.contains("delete-after-pdb"),
        "{r:#?}"
    );

    // Through the agent's loop: a forced power-off is the last gasp (two
    // patches) and an Event.
    let mut agent = Agent::new(
        AuditLog::open(&dir, "boot-1").unwrap(),
        Some(cluster(Removal::Delete, 2)),
        None,
        Metrics::default(),
    );
    agent.handle(signal(Source::Exec, true)).await.unwrap();

    // A last gasp lost to a dead API server (boot-2), then the next boot
    // (boot-3): the previous-boot Event, the late record, the clean-up once
    // Ready (node read, condition, taint and record).
    double.inject(Fault::status(503).method("PATCH").always());
    drop(agent);
    let mut agent = Agent::new(
        AuditLog::open(&dir, "boot-2").unwrap(),
        Some(cluster(Removal::Delete, 2)),
        None,
        Metrics::default(),
    );
    agent.handle(signal(Source::Exec, true)).await.unwrap();
    double.clear_faults();
    drop(agent);
    let mut agent = Agent::new(
        AuditLog::open(&dir, "boot-3").unwrap(),
        Some(cluster(Removal::Delete, 2)),
        None,
        Metrics::default(),
    );
    let report = agent.after_boot("boot-3").await.unwrap().unwrap().report;
    assert!(report.undelivered);
    until("the shutdown marks are cleared", || {
        let n: Node = double.get("", NODE).unwrap();
        let back = lastgasp::record::of_node(&n)
            .and_then(Result::ok)
            .and_then(|r| r.closed)
            .is_some_and(|c| c.how == lastgasp::record::Closing::Back);
        back && n.spec.and_then(|s| s.taints).unwrap_or_default().is_empty()
    })
    .await;
    // kube's Recorder patches a repeated Event (same reason and action
    // within its cache's lifetime) instead of creating another.
    for _ in 0..2 {
        nc.event(
            kube::runtime::events::EventType::Normal,
            "Repeat",
            "twice".into(),
        )
        .await
        .unwrap();
    }

    // At its stop: is its own DaemonSet deleted (an uninstall)?
    let ds = env_value(&pod_spec.containers[0], "LASTGASP_DAEMONSET").unwrap();
    let deleted = lastgasp::host_files::daemonset_deleted(nc.client.clone(), "lastgasp", &ds);
    assert!(
        deleted.await.unwrap(),
        "no DaemonSet in the double: deleted"
    );

    let requests = double.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.method == "PATCH" && r.path.contains("events")),
        "a repeated Event is a PATCH"
    );
    // podRemoval: delete (the default): every call but the evict section's.
    let (delete_calls, evict_calls): (Vec<_>, Vec<_>) = requests
        .iter()
        .cloned()
        .enumerate()
        .partition(|(i, r)| *i < before_evict || !r.path.contains("/eviction"));
    let delete_calls: Vec<_> = delete_calls.into_iter().map(|(_, r)| r).collect();
    assert!(!evict_calls.is_empty(), "the evict section evicted");
    assert_rbac_exact("agent (podRemoval: delete)", &grants, &delete_calls);
    if let Some(evict) = evict_objects("agent_rbac_is_exactly_what_the_agent_calls") {
        let grants = self::grants(&evict, "lastgasp", &sa);
        assert_rbac_exact("agent (podRemoval: evict)", &grants, &requests);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The controller's paths: the warm node watch, the Lease (created, then
/// read and renewed; a second replica reads and stands by), the kubelets'
/// Leases (one LIST, then a live GET before a fence), the live Node read,
/// the out-of-service taint on and off, the grace-0 delete of the pods the
/// taint evicts, and its Events (a repeat is a PATCH).
#[tokio::test]
async fn controller_rbac_is_exactly_what_the_controller_calls() {
    use lastgasp_tests::support::{kernel_poweroff, put_lease, put_record, record_of};
    let objs = objects("deploy/kustomize", &source_objects());
    let pod_spec = controller_pod(&objs);
    let sa = pod_spec.service_account_name.clone().unwrap();
    let grants = grants(&objs, "lastgasp", &sa);
    let args = pod_spec.containers[0].args.clone().unwrap();
    let cfg = |id: &str| ControllerConfig {
        lease_namespace: flag(&args, "--lease-namespace").unwrap_or("kube-system".into()),
        lease_name: flag(&args, "--lease-name").unwrap_or("lastgasp-controller".into()),
        deployment: flag(&args, "--deployment"),
        ..ControllerConfig::new(id)
    };
    assert_eq!(cfg("a").lease_namespace, "lastgasp");

    let double = ApiDouble::start().await.unwrap();
    double.create_value(node()).unwrap();
    // The namespace the Deployment runs in (the Lease goes there).
    double
        .create_value(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "lastgasp"}}),
        )
        .unwrap();
    let c = || async { double.client_without_retry().await };
    let mut a = Controller::start(c().await, c().await, cfg("a"))
        .await
        .unwrap();
    let mut b = Controller::start(c().await, c().await, cfg("b"))
        .await
        .unwrap();
    assert!(a.tick().await.unwrap(), "a creates the Lease");
    assert!(!b.tick().await.unwrap(), "b reads it and stands by");
    let boot = |node_boot: &str, ready: &str| {
        double
            .modify::<Node, _>("", NODE, |n| {
                let st = n.status.as_mut().unwrap();
                st.conditions.as_mut().unwrap()[0].status = ready.into();
                st.node_info = Some(k8s_openapi::api::core::v1::NodeSystemInfo {
                    boot_id: node_boot.into(),
                    ..Default::default()
                });
            })
            .unwrap();
    };
    let settle = || tokio::time::sleep(Duration::from_millis(200));
    let long_ago = SystemTime::now() - Duration::from_secs(60);
    put_lease(&double, NODE, long_ago);
    double
        .create_value(pod("default", "stateful-0", 0, json!({})))
        .unwrap();
    // Powered off (the kernel's proof, standing for a while): taint, then
    // the pod the taint evicts is deleted with grace 0; back on a new boot:
    // untaint; again: a repeated Event (PATCH).
    let mut off = kernel_poweroff();
    off.at = long_ago;
    for (down, back) in [("boot-1", "boot-2"), ("boot-2", "boot-3")] {
        boot(down, "Unknown");
        put_record(&double, NODE, &record_of(down, &off), long_ago);
        settle().await;
        a.tick().await.unwrap();
        boot(back, "True");
        settle().await;
        a.tick().await.unwrap();
    }
    let kinds: Vec<&str> = a.actions.iter().map(|(_, v)| v.kind()).collect();
    assert_eq!(kinds, ["Fence", "Untaint", "Fence", "Untaint"]);
    assert!(
        double
            .list::<k8s_openapi::api::core::v1::Pod>("default")
            .iter()
            .all(|p| p.metadata.name.as_deref() != Some("stateful-0")),
        "the fenced node's pod is deleted"
    );

    let requests = double.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.method == "PUT" && r.path.contains("/leases/")),
        "the Lease is renewed"
    );
    assert!(
        requests.iter().any(|r| r.method == "GET"
            && r.path
                == format!(
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}"
                )),
        "the kubelet's Lease is read live before the fence"
    );
    assert!(
        requests
            .iter()
            .any(|r| r.method == "DELETE" && r.path.ends_with("/pods/stateful-0")),
        "a grace-0 delete: {:#?}",
        requests
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect::<Vec<_>>()
    );
    // The double serves no custom resources: the ledger's grants
    // (lastgasp.dev nodeshutdowns) are checked against the real API server's
    // audit log in tests/ledger.rs.
    let grants: Vec<Grant> = grants
        .into_iter()
        .filter(|g| {
            !g.triples()
                .iter()
                .all(|(group, ..)| group == "lastgasp.dev")
        })
        .collect();
    assert_rbac_exact("controller", &grants, &requests);
}
