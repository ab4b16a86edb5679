//! One suite, two backends: the agent's cluster paths (last gasp, the next
//! boot's clearing, cancel, the graceful path by priority, PDB-aware
//! eviction) written once against the Kubernetes API, and run against the
//! API double (`double_*`) and the real kube-apiserver v1.32.13 with its
//! controllers (`real_*`, tests/src/controlplane.rs; SKIPPED with the reason
//! when the binaries are missing). The same requests and the same
//! assertions: where the two disagree the real server is right, and the
//! double is fixed (apidouble/README.md lists what remains). Objects are
//! created through the API, so the double's admission meets the same
//! objects as the real one. What only the real server can show (the
//! deployed RBAC and admission policy, the controller's fence, recovery) is
//! in tests/realserver.rs and tests/controlplane.rs; fault injection stays
//! with the double (tests/cluster/).
use std::time::{Duration, Instant};

use k8s_openapi::api::{
    core::v1::{Node, Pod},
    events::v1::Event,
    policy::v1::PodDisruptionBudget,
};
use kube::{
    api::{ListParams, PostParams},
    Api, Client,
};
use lastgasp::{
    act::report::BootEnd,
    act::Cluster,
    act::{
        audit::{self, Entry, Outcome},
        kube::{
            graceful::{self, GracefulOptions, Removal},
            NodeClient, CONDITION, TAINT_KEY,
        },
        last_gasp::LastGasp,
        metrics::Metrics,
    },
    apiserver::Use,
    decide::{Action, Decider, Episode},
    grace::Bucket,
    record::{Closing, ShutdownRecord},
    signal::ShutdownSignal,
};
use lastgasp_apidouble::ApiDouble;
use lastgasp_tests::{
    controlplane::{self, ControlPlane},
    nodes::{self, record, status_reason, taint_keys},
    nodesim::{self, Sim},
    support::{agent_at, forced_exec, logind_signal, rt},
};
use serde_json::json;

enum Backend {
    Double(ApiDouble),
    Real { cp: &'static ControlPlane, sim: Sim },
}

impl Backend {
    /// The backend, or None when the real control plane cannot run here
    /// (printed as SKIPPED by `controlplane::shared`).
    async fn start(real: bool, test: &str) -> Option<Backend> {
        if !real {
            let d = ApiDouble::start().await.unwrap();
            d.kubelet()
                .set_default_termination(Duration::from_millis(100));
            return Some(Backend::Double(d));
        }
        let cp = controlplane::shared(test)?;
        let sim = Sim::start(cp.admin()).await.unwrap();
        Some(Backend::Real { cp, sim })
    }

    fn name(&self) -> &'static str {
        match self {
            Backend::Double(_) => "double",
            Backend::Real { .. } => "real",
        }
    }

    async fn admin(&self) -> Client {
        match self {
            Backend::Double(d) => d.client_without_retry().await,
            Backend::Real { cp, .. } => cp.admin(),
        }
    }

    /// A client with the agent's own settings (the admin's token on the
    /// real server: its RBAC is tests/realserver.rs's subject).
    async fn agent(&self, usage: Use) -> Client {
        match self {
            Backend::Double(d) => d.client_without_retry().await,
            Backend::Real { cp, .. } => cp.agent_client(controlplane::ADMIN_TOKEN, usage),
        }
    }

    /// A Ready node whose kubelet runs the pods bound to it.
    async fn node(&self, name: &str) {
        match self {
            Backend::Double(d) => {
                d.create_value(nodes::node(name).hostname_label().json())
                    .unwrap();
            }
            Backend::Real { cp, sim } => {
                sim.add_node(name).await.unwrap();
                nodesim::schedulable(&cp.admin(), &[name], Duration::from_secs(60))
                    .await
                    .unwrap();
            }
        }
    }

    async fn node_client(&self, node: &str) -> NodeClient {
        NodeClient::start_with(
            self.agent(Use::Watch).await,
            self.agent(Use::Requests).await,
            node,
        )
        .await
        .unwrap()
    }

    /// The answers to evictions of pod `name` in `ns`, as the server logged
    /// them (the double's request log, the real server's audit log).
    /// The agent's cluster half for `node`: its Node client, the last
    /// gasp's warm client, a graceful path that deletes, state in `dir`.
    async fn cluster(&self, node: &str, dir: &std::path::Path) -> std::sync::Arc<Cluster> {
        let lastgasp = LastGasp::start(
            self.agent(Use::Watch).await,
            self.agent(Use::Requests).await,
            node,
        )
        .await
        .unwrap();
        std::sync::Arc::new(Cluster {
            node: self.node_client(node).await,
            lastgasp,
            graceful: std::sync::Arc::new(options(dir, vec![], Removal::Delete)),
        })
    }

    fn evictions(&self, ns: &str, name: &str) -> Vec<u16> {
        match self {
            Backend::Double(d) => d
                .requests()
                .iter()
                .filter(|r| {
                    r.method == "POST"
                        && r.path == format!("/api/v1/namespaces/{ns}/pods/{name}/eviction")
                })
                .map(|r| r.status)
                .collect(),
            Backend::Real { cp, .. } => cp
                .audit("admin")
                .iter()
                .filter(|e| e.subresource == "eviction" && e.namespace == ns && e.name == name)
                .map(|e| e.code)
                .collect(),
        }
    }

    fn dir(&self, test: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "lastgasp-backends-{test}-{}-{}",
            self.name(),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

/// Each scenario once per backend.
macro_rules! both {
    ($scenario:ident) => {
        mod $scenario {
            #[test]
            fn double() {
                super::run(false, stringify!($scenario), super::$scenario);
            }
            #[test]
            fn real() {
                super::run(true, stringify!($scenario), super::$scenario);
            }
        }
    };
}

fn run<F>(real: bool, test: &str, scenario: impl FnOnce(Backend, String) -> F)
where
    F: std::future::Future<Output = ()>,
{
    rt().block_on(async {
        let Some(b) = Backend::start(real, test).await else {
            return;
        };
        // Names unique on the shared real server.
        let prefix = format!("{}-{}", test.replace('_', "-"), b.name());
        scenario(b, prefix).await;
    });
}

async fn namespace_with_classes(admin: &Client, ns: &str) {
    nodesim::namespace(admin, ns).await.unwrap();
    for (c, v) in [("bk-low", 0), ("bk-mid", 1000), ("bk-high", 100_000)] {
        let pcs: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(admin.clone());
        let pc = serde_json::from_value(json!({"metadata": {"name": c}, "value": v})).unwrap();
        match pcs.create(&PostParams::default(), &pc).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("PriorityClass {c}: {e}"),
        }
    }
}

/// A pod on `node` in class `class`, created through the API (admission
/// sets its priority), Running once its node's kubelet starts it.
async fn pod(admin: &Client, ns: &str, name: &str, node: &str, class: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let p = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"nodeName": node, "priorityClassName": class, "terminationGracePeriodSeconds": 2,
                 "containers": [{"name": "c", "image": "registry.invalid/none"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &p).await.unwrap();
}

async fn running(admin: &Client, ns: &str, n: usize) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let t0 = Instant::now();
    loop {
        let list = pods.list(&ListParams::default()).await.unwrap().items;
        let up = list
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .count();
        if up >= n {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{up}/{n} pods Running"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn episode() -> (ShutdownSignal, Episode) {
    let s = logind_signal();
    let ep = Decider::new().decide(&s).episode.unwrap();
    (s, ep)
}

fn options(dir: &std::path::Path, buckets: Vec<Bucket>, removal: Removal) -> GracefulOptions {
    GracefulOptions {
        buckets,
        removal,
        own_pod: None,
        state_file: dir.join("graceful_node_shutdown_state"),
        keep: Default::default(),
    }
}

/// A forced shutdown: the agent's last gasp puts the condition, the taint
/// and the record on the Node and audits the delivery; after the next boot,
/// with the node Ready, the agent reports the previous boot (an Event) and
/// clears its marks (the record is kept, marked back).
async fn last_gasp_then_the_next_boot_clears(b: Backend, node: String) {
    b.node(&node).await;
    let admin = b.admin().await;
    let nodes: Api<Node> = Api::all(admin.clone());
    let dir = b.dir("lastgasp");
    let cluster = b.cluster(&node, &dir).await;
    let mut agent = agent_at(&dir, "boot-1", Some(cluster.clone()));
    let d = agent.handle(forced_exec()).await.unwrap();
    assert!(matches!(d.action, Action::Immediate { escalated: false }));
    let n = nodes.get(&node).await.unwrap();
    assert_eq!(
        status_reason(&n, CONDITION),
        Some(("True".into(), "ForcedShutdown".into()))
    );
    assert!(
        taint_keys(&n).contains(&TAINT_KEY.to_string()),
        "{:?}",
        taint_keys(&n)
    );
    let rec = record(&n).expect("the record annotation");
    assert_eq!(rec.boot_id, "boot-1");
    let recs = audit::read(&dir.join(audit::FILE_NAME)).unwrap().records;
    assert!(
        recs.iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::LastGaspDelivered { .. },
                ..
            }
        )),
        "{recs:#?}"
    );

    drop(agent);
    let mut next = agent_at(&dir, "boot-2", Some(cluster));
    let after = next.after_boot("boot-2").await.unwrap().expect("boot-1");
    let settled = after.delivery.expect("cluster mode").await.unwrap();
    assert_eq!((settled.end, settled.undelivered), (BootEnd::Forced, false));
    let t0 = Instant::now();
    loop {
        let n = nodes.get(&node).await.unwrap();
        let back = record(&n).is_some_and(|r| r.closed.is_some_and(|c| c.how == Closing::Back));
        if back && !taint_keys(&n).contains(&TAINT_KEY.to_string()) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the marks were not cleared: {:?} {:?}",
            taint_keys(&n),
            record(&n)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let events: Vec<Event> = Api::all(admin)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert!(
        events
            .iter()
            .any(|e| e.action.as_deref() == Some("PreviousBoot")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.as_str())
                && e.note
                    .as_deref()
                    .is_some_and(|n| n.contains("ended forced"))),
        "a PreviousBoot Event about {node}"
    );
}
both!(last_gasp_then_the_next_boot_clears);

/// A boot that ended with no shutdown the agent saw (a power loss): the next
/// boot's agent reports it unannounced and says so on its Node (the
/// annotation the controller's ledger reads).
async fn an_unannounced_end_is_said_on_the_node(b: Backend, node: String) {
    b.node(&node).await;
    let nodes: Api<Node> = Api::all(b.admin().await);
    let dir = b.dir("unannounced");
    let cluster = b.cluster(&node, &dir).await;
    // Boot 1: the agent starts, and then the power goes.
    let mut first = agent_at(&dir, "boot-1", Some(cluster.clone()));
    assert!(first.after_boot("boot-1").await.unwrap().is_none());
    drop(first);
    let before = std::time::SystemTime::now();
    let mut next = agent_at(&dir, "boot-2", Some(cluster));
    let after = next.after_boot("boot-2").await.unwrap().expect("boot-1");
    let settled = after.delivery.expect("cluster mode").await.unwrap();
    assert_eq!(settled.end, BootEnd::Unannounced);
    let n = nodes.get(&node).await.unwrap();
    let said = lastgasp::record::unannounced_of(&n).expect("the unannounced end on the Node");
    assert_eq!(said.boot_id, "boot-1");
    assert!(said.last_seen.is_some_and(|t| t <= before), "{said:?}");
    assert!(said.reported_at >= before, "{said:?}");
}
both!(an_unannounced_end_is_said_on_the_node);

/// A shutdown that does not come: the cancel turns the condition False and
/// takes the taint off; another taint on the node stays.
async fn cancel_undoes_the_marks(b: Backend, node: String) {
    b.node(&node).await;
    let admin = b.admin().await;
    let nodes: Api<Node> = Api::all(admin.clone());
    let nc = b.node_client(&node).await;
    let (_, ep) = episode();
    nc.set_condition(true, "GracefulShutdown", "test")
        .await
        .unwrap();
    nc.set_taint(true).await.unwrap();
    let n = nodes.get(&node).await.unwrap();
    assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
    graceful::cancel(&nc, &ep).await.unwrap();
    let n = nodes.get(&node).await.unwrap();
    assert_eq!(
        status_reason(&n, CONDITION).map(|c| c.0),
        Some("False".to_string())
    );
    assert!(
        !taint_keys(&n).contains(&TAINT_KEY.to_string()),
        "{:?}",
        taint_keys(&n)
    );
}
both!(cancel_undoes_the_marks);

/// The graceful path with the kubelet's bucket semantics: pods leave lowest
/// priority first, each bucket done before the next starts; a pod of
/// another node is not touched.
async fn graceful_path_by_priority(b: Backend, prefix: String) {
    let (node, other) = (format!("{prefix}-a"), format!("{prefix}-b"));
    b.node(&node).await;
    b.node(&other).await;
    let admin = b.admin().await;
    let ns = prefix.clone();
    namespace_with_classes(&admin, &ns).await;
    for (p, c) in [("low", "bk-low"), ("mid", "bk-mid"), ("high", "bk-high")] {
        pod(&admin, &ns, p, &node, c).await;
    }
    pod(&admin, &ns, "elsewhere", &other, "bk-low").await;
    running(&admin, &ns, 4).await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    assert_eq!(
        pods.get("high").await.unwrap().spec.unwrap().priority,
        Some(100_000),
        "priority admission"
    );
    let nc = b.node_client(&node).await;
    let dir = b.dir(&prefix);
    let buckets = vec![
        Bucket {
            priority: 0,
            seconds: 5,
        },
        Bucket {
            priority: 1000,
            seconds: 5,
        },
        Bucket {
            priority: 100_000,
            seconds: 5,
        },
    ];
    let (s, ep) = episode();
    let report = graceful::run(
        &nc,
        &options(&dir, buckets, Removal::Delete),
        &ep,
        &ShutdownRecord::new("boot-x", &s, &ep),
        &Metrics::default(),
    )
    .await
    .unwrap();
    let mine: Vec<_> = report.pods.iter().filter(|p| p.namespace == ns).collect();
    println!("{}: {mine:?}", b.name());
    let at = |name: &str| {
        let p = mine
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("{name} not in the run"));
        assert!(p.gone_ms.is_some(), "{p:?} did not go");
        (p.requested_ms, p.gone_ms.unwrap())
    };
    let (low, mid, high) = (at("low"), at("mid"), at("high"));
    assert!(
        low.1 <= mid.0 && mid.1 <= high.0,
        "each bucket gone before the next: low {low:?} mid {mid:?} high {high:?}"
    );
    assert!(!mine.iter().any(|p| p.name == "elsewhere"));
    let left: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(left, vec!["elsewhere".to_string()]);
}
both!(graceful_path_by_priority);

/// Eviction honours a PodDisruptionBudget: the budget's 429 comes back to
/// the graceful path within the bucket, which then deletes the pod
/// (`delete-after-pdb`); an unguarded pod is evicted.
async fn eviction_meets_the_budget(b: Backend, prefix: String) {
    let node = format!("{prefix}-a");
    b.node(&node).await;
    let admin = b.admin().await;
    let ns = prefix.clone();
    namespace_with_classes(&admin, &ns).await;
    pod(&admin, &ns, "guarded", &node, "bk-low").await;
    pod(&admin, &ns, "free", &node, "bk-low").await;
    running(&admin, &ns, 2).await;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(admin.clone(), &ns);
    let pdb = serde_json::from_value(json!({"metadata": {"name": "guarded"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}}))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    // The disruption controller (the real one, or the double's) counted the
    // Running pod: 1 healthy, 0 disruptions allowed.
    let t0 = Instant::now();
    loop {
        let p = pdbs.get("guarded").await.unwrap();
        let st = p.status.clone().unwrap_or_default();
        if st.current_healthy == Some(1) && st.disruptions_allowed == Some(0) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{st:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let nc = b.node_client(&node).await;
    let dir = b.dir(&prefix);
    let (s, ep) = episode();
    let report = graceful::run(
        &nc,
        &options(
            &dir,
            vec![Bucket {
                priority: 0,
                seconds: 4,
            }],
            Removal::Evict,
        ),
        &ep,
        &ShutdownRecord::new("boot-x", &s, &ep),
        &Metrics::default(),
    )
    .await
    .unwrap();
    println!("{}: {:?}", b.name(), report.pods);
    let of = |name: &str| {
        report
            .pods
            .iter()
            .find(|p| p.name == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} not in the run"))
    };
    assert_eq!(of("free").how, "evict");
    let guarded = of("guarded");
    assert_eq!(guarded.how, "delete-after-pdb");
    assert!(
        guarded.requested_ms <= 4_000,
        "within its bucket: {guarded:?}"
    );
    assert!(guarded.gone_ms.is_some(), "{guarded:?}");
    let answers = b.evictions(&ns, "guarded");
    assert!(
        answers.contains(&429),
        "the budget answered 429: {answers:?}"
    );
    assert_eq!(
        b.evictions(&ns, "free"),
        vec![201],
        "the free pod's eviction"
    );
}
both!(eviction_meets_the_budget);
