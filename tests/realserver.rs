//! The deploy manifests on the real API server (v1.32.13, tests/src/controlplane.rs),
//! as an operator applies them: the kustomize render applied, the Helm render
//! checked by a server-side dry run. The agent and the controller then run
//! with the real bound ServiceAccount tokens of their own pods (a TokenRequest
//! bound to the pod: v1.32 puts the pod's node in it), and the API server's
//! own audit log shows what they asked and what it answered. SKIPPED with the
//! reason when the binaries or kustomize/helm are not on this machine.
use std::{
    collections::BTreeSet,
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::{
    core::v1::{Node, Pod},
    events::v1::Event,
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    Api, Client, ResourceExt,
};
use lastgasp::{
    act::{
        kube::{
            graceful::{self, GracefulOptions, Removal},
            NodeClient, RECORD_ANNOTATION, TAINT_KEY,
        },
        metrics::Metrics,
    },
    apiserver::Use,
    controller::{
        rule::has_out_of_service, FENCED_BOOT_ANNOTATION, FENCED_CONDITION, OUT_OF_SERVICE_KEY,
        TAINTED_BY_ANNOTATION,
    },
    decide::{Action, Decider, Episode},
    grace::Bucket,
    signal::ShutdownSignal,
};
use lastgasp_tests::{
    controlplane::{self, pod_token, AuditEvent, ControlPlane},
    nodesim::{self, Sim},
    recovery,
    render::{helm, kustomize, kustomize_dir, render_helm, render_kustomize_dir},
    support::{logind_signal, rt},
};
use serde_json::{json, Value};

const NS: &str = "lastgasp";
const AGENT_SA: &str = "lastgasp-agent";
const CONTROLLER_SA: &str = "lastgasp-controller";

fn user(sa: &str) -> String {
    format!("system:serviceaccount:{NS}:{sa}")
}

/// The control plane and the kustomize render, or SKIPPED with the reason.
fn setup(test: &str) -> Option<(&'static ControlPlane, Vec<Value>)> {
    let cp = controlplane::shared(test)?;
    let Some(k) = kustomize() else {
        println!("SKIPPED {test}: no kustomize (`cargo xtask test` installs it, or set LASTGASP_KUSTOMIZE)");
        return None;
    };
    Some((cp, render_kustomize_dir(&k, &kustomize_dir())))
}

/// The namespace as the kustomization's header says, then every object
/// server-side applied (or only validated, `dry_run`), in render order.
async fn apply(client: &Client, objs: &[Value], dry_run: bool) {
    lastgasp_tests::render::apply(client, objs, dry_run)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
}

/// A Running pod of `selector` in lastgasp that `ok` accepts (given the pod's
/// name and node), once the workload controllers and the simulated kubelet
/// have made it.
async fn pod_of(client: &Client, selector: &str, ok: impl Fn(&str, &str) -> bool) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let t0 = Instant::now();
    loop {
        let list = pods
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        if let Some(p) = list.into_iter().find(|p| {
            let on = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                && p.metadata.deletion_timestamp.is_none()
                && on.is_some_and(|n| ok(&p.name_any(), n))
        }) {
            return p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "no Running pod {selector} as wanted within 90 s: {:?}",
            pods.list(&ListParams::default().labels(selector))
                .await
                .map(|l| l
                    .items
                    .iter()
                    .map(|p| (p.name_any(), p.status.clone()))
                    .collect::<Vec<_>>())
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The client of `node`'s agent as deployed: a token bound to its pod.
async fn agent_of(cp: &ControlPlane, admin: &Client, node: &str) -> Client {
    let pod = pod_of(admin, "app.kubernetes.io/component=agent", |_, n| n == node).await;
    cp.agent_client(
        &pod_token(admin, NS, AGENT_SA, Some(&pod)).await,
        Use::Requests,
    )
}

/// `node`'s agent, as deployed, sends the kernel's power-off record of its boot.
async fn kernel_last_gasp(cp: &ControlPlane, admin: &Client, sim: &Sim, node: &str) {
    let agent = agent_of(cp, admin, node).await;
    let boot = sim.boot_id(node).unwrap();
    recovery::last_gasp(
        &agent,
        node,
        &boot,
        lastgasp_tests::support::kernel_poweroff(),
    )
    .await
    .unwrap();
}

/// The (group, resource[/subresource], verb) triples the render grants `sa`.
fn grants(objs: &[Value], sa: &str) -> BTreeSet<(String, String, String)> {
    let bound: BTreeSet<(String, String)> =
        objs.iter()
            .filter(|o| {
                matches!(
                    o["kind"].as_str(),
                    Some("ClusterRoleBinding" | "RoleBinding")
                )
            })
            .filter(|o| {
                o["subjects"].as_array().into_iter().flatten().any(|s| {
                    s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == NS
                })
            })
            .map(|o| {
                (
                    o["roleRef"]["kind"].as_str().unwrap().to_string(),
                    o["roleRef"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
    let mut out = BTreeSet::new();
    for o in objs {
        let key = (
            o["kind"].as_str().unwrap_or("").to_string(),
            o["metadata"]["name"].as_str().unwrap_or("").to_string(),
        );
        if !bound.contains(&key) {
            continue;
        }
        for rule in o["rules"].as_array().into_iter().flatten() {
            let strs = |k: &str| -> Vec<String> {
                rule[k]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect()
            };
            for g in strs("apiGroups") {
                for r in strs("resources") {
                    for v in strs("verbs") {
                        out.insert((g.clone(), r.clone(), v));
                    }
                }
            }
        }
    }
    out
}

fn used(events: &[AuditEvent]) -> BTreeSet<(String, String, String)> {
    events
        .iter()
        .map(|e| {
            let res = if e.subresource.is_empty() {
                e.resource.clone()
            } else {
                format!("{}/{}", e.resource, e.subresource)
            };
            (e.group.clone(), res, e.verb.clone())
        })
        .collect()
}

/// No request of `who` was refused, and it used exactly `grants`, but for
/// `unused_ok`: grants this run has no reason to use.
fn assert_exactly_enough(
    who: &str,
    events: &[AuditEvent],
    grants: &BTreeSet<(String, String, String)>,
    unused_ok: &[(&str, &str, &str)],
) {
    assert!(
        !events.is_empty(),
        "{who}: the audit log has none of its requests"
    );
    // 401/403: authentication, RBAC or the admission policy; 422: an
    // admission expression that failed to evaluate (failurePolicy: Fail).
    let refused: Vec<_> = events
        .iter()
        .filter(|e| matches!(e.code, 401 | 403 | 422))
        .collect();
    assert!(
        refused.is_empty(),
        "{who}: refused by the real API server: {refused:#?}"
    );
    let used = used(events);
    let missing: Vec<_> = used.difference(grants).collect();
    let unused: Vec<_> = grants.difference(&used).collect();
    println!("{who}: {} requests, {} (group, resource, verb) used, all granted; granted but unused in this run: {unused:?}", events.len(), used.len());
    assert!(
        missing.is_empty(),
        "{who}: used without a grant: {missing:?}"
    );
    let unexplained: Vec<_> = unused
        .iter()
        .filter(|(g, r, v)| !unused_ok.contains(&(g.as_str(), r.as_str(), v.as_str())))
        .collect();
    assert!(
        unexplained.is_empty(),
        "{who}: granted and never used: {unexplained:?}"
    );
}

fn logind_episode() -> (ShutdownSignal, Episode) {
    let s = logind_signal();
    let d = Decider::new().decide(&s);
    assert!(matches!(d.action, Action::Graceful { .. }));
    (s, d.episode.unwrap())
}

/// A workload pod bound to `node` in namespace `ns`, with a priority class.
async fn workload(client: &Client, ns: &str, name: &str, node: &str, class: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {"nodeName": node, "priorityClassName": class, "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &p).await.unwrap();
}

async fn priority_class(client: &Client, name: &str, value: i32) {
    let api: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(client.clone());
    let pc = json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": name}, "value": value});
    api.patch(
        name,
        &PatchParams::apply("lastgasp-test").force(),
        &Patch::Apply(&pc),
    )
    .await
    .unwrap();
}

/// Waits until the API server enforces the evidence policy (a policy takes
/// effect a few seconds after it is created): probed with a dry run.
async fn evidence_enforced(admin: &Client, node: &str) {
    let probe =
        Patch::Merge(json!({"metadata": {"annotations": {RECORD_ANNOTATION: "{\"probe\":1}"}}}));
    let dry = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let t0 = Instant::now();
    loop {
        match Api::<Node>::all(admin.clone())
            .patch(node, &dry, &probe)
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 403 => return,
            r => assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the evidence policy is not enforced after 30 s: {r:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn condition_of(node: &Node, type_: &str) -> Option<k8s_openapi::api::core::v1::NodeCondition> {
    lastgasp_tests::nodes::condition(node, type_).cloned()
}

/// Expects the request to be refused with 403 and `why` in the message.
fn denied<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>, why: &str) {
    denied_by(what, r, &[why]);
}

/// Expects a 403 whose message names one of `whys` (where two policies
/// refuse the same request, the server may report either).
fn denied_by<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>, whys: &[&str]) {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 && whys.iter().any(|w| s.message.contains(w)) => {
            println!("denied, as it must be: {what}: {}", s.message);
        }
        other => panic!("{what}: expected 403 with one of {whys:?}, got {other:?}"),
    }
}

/// The agent as deployed: its DaemonSet pod's bound token on node A. A full
/// graceful run (three priority classes), a cancel, a last gasp and the
/// after-boot clearing meet no 403 and use exactly the ClusterRole; then
/// every change the admission policy forbids is refused by the real server.
#[test]
fn the_agent_as_deployed_is_fenced_to_its_node_and_its_rbac_is_exactly_enough() {
    let test = "the_agent_as_deployed_is_fenced_to_its_node_and_its_rbac_is_exactly_enough";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let (a, b) = ("agent-a", "agent-b");
        sim.add_node(a).await.unwrap();
        sim.add_node(b).await.unwrap();
        nodesim::schedulable(&admin, &[a, b], Duration::from_secs(60)).await.unwrap();
        apply(&admin, &objs, false).await;
        if let Some(h) = helm() {
            apply(&admin, &render_helm(&h, &[]), true).await;
            println!("the Helm render passes the real server's validation and admission (dry run)");
        } else {
            println!("SKIPPED the Helm dry run: no helm");
        }
        let agent_pod = pod_of(&admin, "app.kubernetes.io/component=agent", |_, n| n == a).await;
        let token = pod_token(&admin, NS, AGENT_SA, Some(&agent_pod)).await;
        // The agent's own client settings: watches on one, requests on another.
        let agent = cp.agent_client(&token, Use::Requests);
        let agent_watch = cp.agent_client(&token, Use::Watch);

        // `lastgasp check`'s fence probe (and the chart's `helm test`): the
        // policy refuses both dry runs for the agent's token; for a client
        // the policy does not judge (the admin), the probe FAILs.
        // A policy is in force a moment after it is created: ask until then.
        let t0 = Instant::now();
        let probe = loop {
            let mut probe = lastgasp::preflight::Report::default();
            lastgasp::check::fence(&mut probe, &agent, a).await;
            if probe.failures() == 0 || t0.elapsed() > Duration::from_secs(30) {
                break probe;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        println!("the fence probe passed {:?} after the policy's creation", t0.elapsed());
        for (what, says) in [
            ("own node", "may not change the labels"),
            ("other node", "may only change its own Node, not agent-b"),
        ] {
            let line = probe.line(what).unwrap_or_else(|| panic!("no {what} line: {probe}"));
            assert_eq!(line.status, lastgasp::preflight::Status::Ok, "{probe}");
            assert!(line.text.contains(says), "{what}: {}", line.text);
        }
        let mut unfenced = lastgasp::preflight::Report::default();
        lastgasp::check::fence(&mut unfenced, &admin, a).await;
        assert_eq!(unfenced.failures(), 2, "the admin's dry runs are admitted: {unfenced}");
        assert!(unfenced.line("own node").unwrap().text.contains("ADMITTED"), "{unfenced}");
        let stored = Api::<Node>::all(admin.clone()).get(a).await.unwrap();
        assert!(
            !stored.labels().contains_key("lastgasp.dev/check-probe"),
            "a dry run stored the probe's label"
        );
        println!("check's fence probe: {probe}");

        // The workload: three priority classes on A, one pod on B.
        let work = "agent-work";
        nodesim::namespace(&admin, work).await.unwrap();
        for (c, v) in [("lg-low", 0), ("lg-mid", 1000), ("lg-high", 100_000)] {
            priority_class(&admin, c, v).await;
        }
        for (p, c) in [("low", "lg-low"), ("mid", "lg-mid"), ("high", "lg-high")] {
            workload(&admin, work, p, a, c).await;
        }
        workload(&admin, work, "elsewhere", b, "lg-low").await;
        let pods: Api<Pod> = Api::namespaced(admin.clone(), work);
        for p in ["low", "mid", "high", "elsewhere"] {
            let pod = pods.get(p).await.unwrap();
            let want = match p {
                "mid" => 1000,
                "high" => 100_000,
                _ => 0,
            };
            assert_eq!(pod.spec.unwrap().priority, Some(want), "priority admission set {p}'s priority");
        }
        let t0 = Instant::now();
        while pods.list(&ListParams::default()).await.unwrap().items.iter().filter(|p| {
            p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        }).count() < 4 {
            assert!(t0.elapsed() < Duration::from_secs(30), "the workload did not run");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let audit_from = cp.audit(&user(AGENT_SA)).len();

        // 1. The last gasp, 2. the next boot clears the marks.
        let nc = NodeClient::start_with(agent_watch, agent.clone(), a).await.unwrap();
        let boot = sim.boot_id(a).unwrap();
        recovery::last_gasp(&agent, a, &boot, lastgasp_tests::support::direct_poweroff()).await.unwrap();
        let nodes: Api<Node> = Api::all(admin.clone());
        let n = nodes.get(a).await.unwrap();
        assert!(n.annotations().contains_key(RECORD_ANNOTATION));
        assert!(n.spec.clone().unwrap().taints.unwrap_or_default().iter().any(|t| t.key == TAINT_KEY));
        nc.clear_when_ready("the-next-boot").await.unwrap();
        let n = nodes.get(a).await.unwrap();
        assert!(
            !n.spec.clone().unwrap().taints.unwrap_or_default().iter().any(|t| t.key == TAINT_KEY),
            "the taint is cleared"
        );
        let rec = lastgasp::record::of_node(&n).unwrap().unwrap();
        assert_eq!(rec.closed.map(|c| c.how), Some(lastgasp::record::Closing::Back));

        // 3. The graceful path, by priority; the agent's own pod stays.
        let (_, ep) = logind_episode();
        let dir = std::env::temp_dir().join(format!("lastgasp-realserver-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let opts = GracefulOptions {
            buckets: vec![
                Bucket { priority: 0, seconds: 5 },
                Bucket { priority: 1000, seconds: 5 },
                Bucket { priority: 100_000, seconds: 5 },
            ],
            removal: Removal::Delete,
            own_pod: Some((NS.into(), agent_pod.name_any())),
            state_file: dir.join("graceful_node_shutdown_state"),
            keep: Default::default(),
        };
        let record = lastgasp::record::ShutdownRecord::new(&boot, &lastgasp_tests::support::logind_signal(), &ep);
        let report = graceful::run(&nc, &opts, &ep, &record, &Metrics::default()).await.unwrap();
        let order: Vec<(String, i64)> = report
            .pods
            .iter()
            .filter(|p| p.namespace == work)
            .map(|p| (p.name.clone(), p.grace_seconds))
            .collect();
        println!("graceful run on the real server: {order:?}");
        for p in report.pods.iter().filter(|p| p.namespace == work) {
            assert!(p.gone_ms.is_some(), "{p:?} did not go");
        }
        // The deletes as the API server received them: the workload lowest
        // priority first (other pods of A, such as a controller replica, in
        // their own buckets); never the agent's own pod.
        let deletes: Vec<(String, String)> = cp.audit(&user(AGENT_SA))[audit_from..]
            .iter()
            .filter(|e| e.verb == "delete" && e.resource == "pods")
            .map(|e| (e.namespace.clone(), e.name.clone()))
            .collect();
        let work_order: Vec<&str> =
            deletes.iter().filter(|(ns, _)| ns == work).map(|(_, n)| n.as_str()).collect();
        assert_eq!(work_order, ["low", "mid", "high"], "priority order: {deletes:?}");
        assert!(
            !deletes.iter().any(|(_, n)| *n == agent_pod.name_any()),
            "the agent's own pod stays, to send its last word: {deletes:?}"
        );
        assert!(pods.get_opt("elsewhere").await.unwrap().is_some(), "node B's pod is untouched");
        // Upstream's drain conditions, reason NodeShutdown, after the drain;
        // never the kubelet's own GracefulNodeShutdownInProgress.
        let nodes: Api<Node> = Api::all(admin.clone());
        let drained = nodes.get(a).await.unwrap();
        let st = |n: &Node, t: &str| {
            condition_of(n, t).map(|c| (c.status, c.reason.unwrap_or_default()))
        };
        let reason = || "NodeShutdown".to_string();
        assert_eq!(st(&drained, "ShutdownInProgress"), Some(("True".into(), "GracefulShutdown".into())));
        assert_eq!(st(&drained, "DrainInProgress"), Some(("False".into(), reason())));
        assert_eq!(st(&drained, "Drained"), Some(("True".into(), reason())));
        assert_eq!(st(&drained, "GracefulNodeShutdownInProgress"), None);

        // 4. The same agent (its pod stayed) cancels: all three False.
        graceful::cancel(&nc, &ep).await.unwrap();
        let cancelled = nodes.get(a).await.unwrap();
        for t in ["ShutdownInProgress", "DrainInProgress", "Drained"] {
            assert_eq!(st(&cancelled, t), Some(("False".into(), "ShutdownCancelled".into())), "{t}");
        }
        // Its health on its Node, admitted by the policy: degraded, then back.
        nc.set_degraded(Some(("GracefulPathNotArmed", "logind: gone"))).await.unwrap();
        let degraded = nodes.get(a).await.unwrap();
        assert_eq!(st(&degraded, "LastgaspDegraded"), Some(("True".into(), "GracefulPathNotArmed".into())));
        nc.set_degraded(None).await.unwrap();
        let back = nodes.get(a).await.unwrap();
        assert_eq!(st(&back, "LastgaspDegraded"), Some(("False".into(), "Armed".into())));
        assert_eq!(st(&back, "Ready"), st(&degraded, "Ready"), "the kubelet's conditions stay");
        // An uninstall: the agent's own conditions leave; the kubelet's stay.
        nc.remove_own_conditions().await.unwrap();
        let gone = nodes.get(a).await.unwrap();
        for t in ["ShutdownInProgress", "DrainInProgress", "Drained", "LastgaspDegraded"] {
            assert_eq!(st(&gone, t), None, "{t}");
        }
        assert_eq!(st(&gone, "Ready"), st(&degraded, "Ready"), "the kubelet's conditions stay");

        // At its stop: its own DaemonSet, read with its own token (a Role,
        // by name): there, so no uninstall and nothing removed.
        let deleted = lastgasp::host_files::daemonset_deleted(agent.clone(), NS, "lastgasp-agent");
        assert!(!deleted.await.unwrap(), "its DaemonSet is there: not an uninstall");

        // Every request of the agent: none refused, exactly its grants.
        let full = cp.audit(&user(AGENT_SA));
        for e in &full[audit_from..] {
            assert_eq!(
                e.extra["authentication.kubernetes.io/node-name"][0], a,
                "the bound token carries the node claim: {e:?}"
            );
        }
        // A repeated Event (the same note again) is a PATCH: no repeat here; the
        // double's RBAC test (tests/manifests/rbac.rs) drives it.
        assert_exactly_enough(
            "agent (podRemoval: delete)",
            &full[audit_from..],
            &grants(&objs, AGENT_SA),
            &[("events.k8s.io", "events", "patch")],
        );

        // 5. What the admission policy forbids, refused by the real server.
        let nodes_as_agent: Api<Node> = Api::all(agent.clone());
        let merge = |v: Value| Patch::Merge(v);
        let pp = PatchParams::default();
        // Both the agent's policy and the evidence policy refuse it.
        denied_by(
            "the last-gasp annotation on node B",
            nodes_as_agent.patch(b, &pp, &merge(json!({"metadata": {"annotations": {RECORD_ANNOTATION: "{}"}}}))).await,
            &[
                &format!("may only change its own Node, not {b}"),
                &format!("of Node {b} is written only by the lastgasp agent on that node"),
            ],
        );
        denied(
            "a label on its own node",
            nodes_as_agent.patch(a, &pp, &merge(json!({"metadata": {"labels": {"x": "y"}}}))).await,
            "labels, finalizers or owners",
        );
        denied(
            "another annotation on its own node",
            nodes_as_agent.patch(a, &pp, &merge(json!({"metadata": {"annotations": {"x": "y"}}}))).await,
            "only its own annotation",
        );
        denied(
            "cordoning its own node",
            nodes_as_agent.patch(a, &pp, &merge(json!({"spec": {"unschedulable": true}}))).await,
            "only its own taint",
        );
        denied(
            "another taint on its own node",
            nodes_as_agent.patch(a, &pp, &merge(json!({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}))).await,
            "only its own taint",
        );
        denied(
            "the kubelet's Ready condition",
            nodes_as_agent
                .patch_status(a, &pp, &Patch::Strategic(json!({"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "x", "message": "x"}]}})))
                .await,
            "only its own condition",
        );
        let pods_as_agent: Api<Pod> = Api::namespaced(agent.clone(), work);
        denied(
            "deleting a pod of node B",
            pods_as_agent.delete("elsewhere", &DeleteParams::default()).await,
            "may only delete pods bound to that node",
        );
        let events_as_agent: Api<Event> = Api::namespaced(agent.clone(), "default");
        let ev: Event = serde_json::from_value(json!({
            "metadata": {"name": "lastgasp-test-forged"},
            "eventTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now()),
            "reportingController": "lastgasp", "reportingInstance": a,
            "action": "Shutdown", "reason": "NodeShutdown", "type": "Warning",
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": b},
        }))
        .unwrap();
        denied(
            "an Event about node B",
            events_as_agent.create(&PostParams::default(), &ev).await,
            "may only report Events about its own Node",
        );
        // A token of the same ServiceAccount bound to no pod has no node claim.
        let unbound = cp.agent_client(&pod_token(&admin, NS, AGENT_SA, None).await, Use::Requests);
        // Both the agent's policy and the evidence policy refuse it.
        denied_by(
            "a write with a token that has no node claim",
            Api::<Node>::all(unbound)
                .patch(a, &pp, &merge(json!({"metadata": {"annotations": {RECORD_ANNOTATION: "{}"}}})))
                .await,
            &["no node-name claim", "is written only by the lastgasp agent on that node"],
        );
        std::fs::remove_dir_all(&dir).ok();
    });
}

/// The controller as deployed: a token bound to one of its Deployment's pods.
/// A node with a record goes silent: fenced (taint, grace-0 delete of its
/// pods); it comes back on a new boot: the taint goes. No 403, and nothing
/// used outside its grants.
#[test]
fn the_controller_as_deployed_fences_and_lifts_with_its_own_token() {
    let test = "the_controller_as_deployed_fences_and_lifts_with_its_own_token";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let names = ["ctl-a", "ctl-b", "ctl-c"];
        for n in names {
            sim.add_node(n).await.unwrap();
        }
        nodesim::schedulable(&admin, &names, Duration::from_secs(60))
            .await
            .unwrap();
        apply(&admin, &objs, false).await;
        // Not on node A, which this test fences (a fence deletes A's pods, and a
        // bound token dies with its pod).
        let ctl_pod = pod_of(&admin, "app.kubernetes.io/component=controller", |_, n| {
            n != names[0]
        })
        .await;
        let token = pod_token(&admin, NS, CONTROLLER_SA, Some(&ctl_pod)).await;
        // As `lastgasp controller` builds its client.
        let client = cp.agent_client(&token, Use::Watch);
        let a = names[0];
        let work = "ctl-work";
        nodesim::namespace(&admin, work).await.unwrap();
        priority_class(&admin, "lg-low", 0).await;
        workload(&admin, work, "on-a", a, "lg-low").await;

        let mut cfg = recovery::controller_config("deployed");
        cfg.lease_namespace = NS.into();
        cfg.lease_name = "lastgasp-controller".into();
        // As the chart runs it (`--deployment`): it reads its Deployment's
        // creation, to tell a reinstall's pause from a running one's.
        cfg.deployment = Some("lastgasp-controller".into());
        // And writes the ledger, as by default.
        cfg.ledger = Some(lastgasp::controller::ledger_writer::Retention {
            max_age: Duration::from_secs(720 * 3600),
            max_per_node: 100,
        });
        let from = cp.audit(&user(CONTROLLER_SA)).len();
        let ctl = recovery::spawn_controller(client.clone(), cfg).await.unwrap();

        // The record comes from A's own agent (the admission policy refuses
        // it from anyone else).
        let agent = agent_of(cp, &admin, a).await;
        let boot = sim.boot_id(a).unwrap();
        recovery::last_gasp(&agent, a, &boot, lastgasp_tests::support::kernel_poweroff())
            .await
            .unwrap();
        sim.power_off(a);
        let nodes: Api<Node> = Api::all(admin.clone());
        let pods: Api<Pod> = Api::namespaced(admin.clone(), work);
        let tainted = has_out_of_service;
        let t0 = Instant::now();
        loop {
            if tainted(&nodes.get(a).await.unwrap())
                && pods.get_opt("on-a").await.unwrap().is_none()
            {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "node A was not fenced within 40 s"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        println!(
            "fenced with the controller's own token after {:?}",
            t0.elapsed()
        );
        // The remediators' condition: True since the API server's time of
        // the proof, and only the controller may write it.
        let fenced = nodes.get(a).await.unwrap();
        let cond = condition_of(&fenced, FENCED_CONDITION).expect("the condition is set at the fence");
        assert_eq!((cond.status.as_str(), cond.reason.as_deref()), ("True", Some("PoweredOff")), "{cond:?}");
        let proof = lastgasp::record::written_at(&fenced).expect("the record's write time");
        assert_eq!(
            cond.last_transition_time.as_ref().map(|t| SystemTime::from(t.0)),
            Some(proof),
            "lastTransitionTime is the time of the evidence"
        );
        let forged = json!({"status": {"conditions": [{"type": FENCED_CONDITION, "status": "True", "reason": "PoweredOff"}]}});
        denied(
            "the admin sets PoweredOffAndFenced on node C",
            nodes.patch_status(names[2], &PatchParams::default(), &Patch::Strategic(&forged)).await,
            "is written only by the lastgasp controller",
        );
        sim.add_node(a).await.unwrap();
        let t0 = Instant::now();
        while tainted(&nodes.get(a).await.unwrap()) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the taint stayed after a new boot"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let t0 = Instant::now();
        loop {
            let back = nodes.get(a).await.unwrap();
            let cond = condition_of(&back, FENCED_CONDITION).expect("the condition stays, False");
            if cond.status == "False" {
                assert_eq!(cond.reason.as_deref(), Some("NodeBack"));
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "still {cond:?} after the untaint");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        ctl.abort();

        // Uninstall: `lastgasp controller --lift-fences` (the chart's
        // pre-delete hook) with the controller's own token lifts every fence
        // it set (B's, as a fence leaves it), and no one else's (C's).
        let (b, c) = (names[1], names[2]);
        // B's agent asked for it (admission admits no fence without that).
        kernel_last_gasp(cp, &admin, &sim, b).await;
        let fence = json!({
            "metadata": {"annotations": {TAINTED_BY_ANNOTATION: "deployed", FENCED_BOOT_ANNOTATION: sim.boot_id(b).unwrap()}},
            "spec": {"taints": [{"key": OUT_OF_SERVICE_KEY, "value": "nodeshutdown", "effect": "NoExecute"}]},
        });
        let as_controller: Api<Node> = Api::all(client.clone());
        let pp = PatchParams {
            field_manager: Some("lastgasp-controller".into()),
            ..Default::default()
        };
        as_controller.patch(b, &pp, &Patch::Merge(&fence)).await.unwrap();
        let foreign = json!({"spec": {"taints": [{"key": OUT_OF_SERVICE_KEY, "value": "by-hand", "effect": "NoExecute"}]}});
        nodes.patch(c, &PatchParams::default(), &Patch::Merge(&foreign)).await.unwrap();
        lastgasp::controller::lift::pause(client.clone(), NS, "lastgasp-controller")
            .await
            .unwrap();
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(admin.clone(), NS);
        let lease = leases.get("lastgasp-controller").await.unwrap();
        assert_eq!(
            lease.annotations().get("lastgasp.dev/paused").map(String::as_str),
            Some("true"),
            "the replicas still running are paused first"
        );
        let lifted = lastgasp::controller::lift::lift_all(client.clone()).await.unwrap();
        // The control plane is shared: other tests' fences are lifted too.
        assert!(lifted.iter().any(|n| n == b), "B lifted: {lifted:?}");
        assert!(!lifted.iter().any(|n| n == c), "C is not the controller's: {lifted:?}");
        let nb = nodes.get(b).await.unwrap();
        assert!(!tainted(&nb), "B's fence lifted");
        for ann in [TAINTED_BY_ANNOTATION, FENCED_BOOT_ANNOTATION] {
            assert!(!nb.annotations().contains_key(ann), "B keeps {ann}");
        }
        assert!(tainted(&nodes.get(c).await.unwrap()), "C's taint is not the controller's");
        let cond = condition_of(&nb, FENCED_CONDITION).expect("B's condition is cleared");
        assert_eq!((cond.status.as_str(), cond.reason.as_deref()), ("False", Some("FenceLifted")));
        let events = cp.audit(&user(CONTROLLER_SA));
        assert_exactly_enough(
            "controller",
            &events[from..],
            &grants(&objs, CONTROLLER_SA),
            // The ledger prunes nothing here, and its apply of a new entry
            // is logged as a patch (tests/ledger.rs checks both).
            &[
                ("events.k8s.io", "events", "patch"),
                ("lastgasp.dev", "nodeshutdowns", "create"),
                ("lastgasp.dev", "nodeshutdowns", "delete"),
            ],
        );
    });
}

/// Install, uninstall, install, on the real server: the uninstall's lift
/// (the chart's pre-delete Job, the controller's token) pauses the Lease;
/// the old release's controller stays paused and fences nothing; after the
/// Deployment is deleted and created again (a reinstall), its controller
/// lifts that pause and fences the node that went down meanwhile.
#[test]
fn a_reinstall_after_an_uninstall_fences_again() {
    let test = "a_reinstall_after_an_uninstall_fences_again";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    rt().block_on(async {
        use k8s_openapi::api::{apps::v1::Deployment, coordination::v1::Lease};
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let names = ["re-a", "re-b"];
        for n in names {
            sim.add_node(n).await.unwrap();
        }
        nodesim::schedulable(&admin, &names, Duration::from_secs(60))
            .await
            .unwrap();
        apply(&admin, &objs, false).await;
        let a = names[0];
        let controller = |admin: Client| async move {
            let pod = pod_of(&admin, "app.kubernetes.io/component=controller", |_, n| {
                n != a
            })
            .await;
            let token = pod_token(&admin, NS, CONTROLLER_SA, Some(&pod)).await;
            let mut cfg = recovery::controller_config("reinstall");
            cfg.lease_namespace = NS.into();
            cfg.lease_name = "lastgasp-controller".into();
            cfg.deployment = Some("lastgasp-controller".into());
            (cp.agent_client(&token, Use::Watch), cfg)
        };
        let (client, cfg) = controller(admin.clone()).await;
        let old = recovery::spawn_controller(client.clone(), cfg.clone())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1100)).await;
        // Uninstall: the lift Job pauses every replica first.
        lastgasp::controller::lift::pause(client.clone(), NS, "lastgasp-controller")
            .await
            .unwrap();
        let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
        let paused = || async {
            leases
                .get("lastgasp-controller")
                .await
                .unwrap()
                .annotations()
                .contains_key("lastgasp.dev/paused")
        };
        kernel_last_gasp(cp, &admin, &sim, a).await;
        sim.power_off(a);
        let nodes: Api<Node> = Api::all(admin.clone());
        let tainted = has_out_of_service;
        // The Lease silent for its 40 s and more: the paused controller holds.
        tokio::time::sleep(Duration::from_secs(50)).await;
        assert!(
            !tainted(&nodes.get(a).await.unwrap()),
            "a paused controller fenced"
        );
        assert!(
            paused().await,
            "the uninstalled release's controller lifted the pause"
        );
        old.abort();
        // The rest of the uninstall, then the reinstall: a new Deployment.
        let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NS);
        deployments
            .delete("lastgasp-controller", &Default::default())
            .await
            .unwrap();
        let t0 = Instant::now();
        while deployments
            .get_opt("lastgasp-controller")
            .await
            .unwrap()
            .is_some()
        {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the Deployment was not deleted"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        tokio::time::sleep(Duration::from_millis(1100)).await;
        apply(&admin, &objs, false).await;
        let (client, cfg) = controller(admin.clone()).await;
        let new = recovery::spawn_controller(client, cfg).await.unwrap();
        let t0 = Instant::now();
        while !tainted(&nodes.get(a).await.unwrap()) {
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "the reinstalled controller did not fence within 40 s (paused: {})",
                paused().await
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert!(
            !paused().await,
            "the reinstall lifted the uninstall's pause"
        );
        println!("reinstalled: fenced after {:?}", t0.elapsed());
        new.abort();
        // Leave the shared control plane unfenced.
        lastgasp::controller::lift::lift_all(
            cp.agent_client(
                &pod_token(
                    &admin,
                    NS,
                    CONTROLLER_SA,
                    Some(
                        &pod_of(&admin, "app.kubernetes.io/component=controller", |_, n| {
                            n != a
                        })
                        .await,
                    ),
                )
                .await,
                Use::Watch,
            ),
        )
        .await
        .unwrap();
        // The control plane is shared: the next test's controller creates its Lease.
        leases
            .delete("lastgasp-controller", &Default::default())
            .await
            .unwrap();
    });
}

/// The evidence and the fence, at admission, on the real server: a Node's
/// shutdown record is written only by that node's own agent (not by an
/// identity that may patch Nodes, an administrator, or another node's
/// agent), the fence's annotations only by the controller; the controller
/// itself touches only its taint and its annotations, and deletes only the
/// pods the taint eviction controller is evicting.
#[test]
fn only_a_nodes_own_agent_writes_its_evidence_and_the_controller_only_its_fence() {
    let test = "only_a_nodes_own_agent_writes_its_evidence_and_the_controller_only_its_fence";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let (a, b) = ("ev-a", "ev-b");
        sim.add_node(a).await.unwrap();
        sim.add_node(b).await.unwrap();
        nodesim::schedulable(&admin, &[a, b], Duration::from_secs(60))
            .await
            .unwrap();
        apply(&admin, &objs, false).await;
        let patcher = node_patcher(cp, &admin).await;
        evidence_enforced(&admin, a).await;
        let pod_a = pod_of(&admin, "app.kubernetes.io/component=agent", |_, n| n == a).await;
        let pod_b = pod_of(&admin, "app.kubernetes.io/component=agent", |_, n| n == b).await;
        let agent_a = cp.agent_client(
            &pod_token(&admin, NS, AGENT_SA, Some(&pod_a)).await,
            Use::Requests,
        );
        let agent_b = cp.agent_client(
            &pod_token(&admin, NS, AGENT_SA, Some(&pod_b)).await,
            Use::Requests,
        );
        let controller = cp.agent_client(
            &pod_token(&admin, NS, CONTROLLER_SA, None).await,
            Use::Requests,
        );

        // A's own agent writes A's record (the record's own field manager).
        let boot = sim.boot_id(a).unwrap();
        let rec =
            lastgasp_tests::support::record_of(&boot, &lastgasp_tests::support::kernel_poweroff());
        let body = |v: Value| json!({"metadata": {"annotations": v}});
        let params = lastgasp::act::kube::record_params();
        let record_patch = Patch::Merge(body(json!({RECORD_ANNOTATION: rec.to_json()})));
        Api::<Node>::all(agent_a.clone())
            .patch(a, &params, &record_patch)
            .await
            .unwrap();
        let n = Api::<Node>::all(admin.clone()).get(a).await.unwrap();
        assert!(
            lastgasp::record::written_at(&n).is_some(),
            "the server stamped the record's write"
        );

        let forged = rec.clone().closed(
            lastgasp::record::Closing::Back,
            "x",
            std::time::SystemTime::now(),
        );
        let forge = Patch::Merge(body(json!({RECORD_ANNOTATION: forged.to_json()})));
        let refused = "is written only by the lastgasp agent on that node";
        for (who, client) in [
            ("a node patcher", &patcher),
            ("an administrator", &admin),
            ("node B's agent", &agent_b),
        ] {
            denied_by(
                &format!("{who} writing node A's record"),
                Api::<Node>::all(client.clone())
                    .patch(a, &params, &forge)
                    .await,
                &[refused, "may only change its own Node"],
            );
        }
        denied(
            "a node patcher writing node B's record",
            Api::<Node>::all(patcher.clone())
                .patch(b, &params, &record_patch)
                .await,
            refused,
        );
        let fence = Patch::Merge(body(
            json!({TAINTED_BY_ANNOTATION: "me", FENCED_BOOT_ANNOTATION: boot}),
        ));
        denied(
            "a node patcher marking node A fenced",
            Api::<Node>::all(patcher.clone())
                .patch(a, &PatchParams::default(), &fence)
                .await,
            "written only by the lastgasp controller",
        );
        denied_by(
            "A's agent marking node A fenced",
            Api::<Node>::all(agent_a.clone())
                .patch(a, &PatchParams::default(), &fence)
                .await,
            &[
                "only its own annotation",
                "written only by the lastgasp controller",
            ],
        );
        // Taking the record away is allowed: it can only prevent a fence.
        Api::<Node>::all(patcher.clone())
            .patch(
                a,
                &PatchParams::default(),
                &Patch::Merge(body(json!({RECORD_ANNOTATION: null}))),
            )
            .await
            .unwrap();
        // Other writes of the others are not judged: the patcher's own label.
        Api::<Node>::all(patcher.clone())
            .patch(
                b,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"example.com/x": "y"}}})),
            )
            .await
            .unwrap();

        // The controller: its fence, and nothing else.
        let nodes = Api::<Node>::all(controller.clone());
        let pp = PatchParams::default();
        nodes
            .patch(b, &pp, &fence)
            .await
            .expect("the controller writes its annotations");
        for (what, patch, why) in [
            (
                "a label",
                json!({"metadata": {"labels": {"x": "y"}}}),
                "only its own annotations",
            ),
            (
                "another annotation",
                json!({"metadata": {"annotations": {"x": "y"}}}),
                "only its own annotations",
            ),
            (
                "the record",
                json!({"metadata": {"annotations": {RECORD_ANNOTATION: forged.to_json()}}}),
                "only its own annotations",
            ),
            (
                "cordoning",
                json!({"spec": {"unschedulable": true}}),
                "only its own taint",
            ),
            (
                "another taint",
                json!({"spec": {"taints": [{"key": "x", "effect": "NoExecute"}]}}),
                "only its own taint",
            ),
        ] {
            denied_by(
                &format!("the controller writing {what} of node B"),
                nodes.patch(b, &pp, &Patch::Merge(patch)).await,
                &[why, refused],
            );
        }
        let work = "ev-work";
        nodesim::namespace(&admin, work).await.unwrap();
        priority_class(&admin, "lg-low", 0).await;
        workload(&admin, work, "running", b, "lg-low").await;
        denied(
            "the controller deleting a pod nothing evicts",
            Api::<Pod>::namespaced(controller.clone(), work)
                .delete(
                    "running",
                    &DeleteParams {
                        grace_period_seconds: Some(0),
                        ..Default::default()
                    },
                )
                .await,
            "only pods already being deleted",
        );
    });
}

/// A ServiceAccount of somebody else's node controller (a CNI, NFD, the
/// autoscaler) that may get and patch Nodes, and its client.
async fn node_patcher(cp: &ControlPlane, admin: &Client) -> Client {
    let other = json!([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "node-patcher", "namespace": NS}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "lastgasp-test-node-patcher"},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "lastgasp-test-node-patcher"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "lastgasp-test-node-patcher"},
         "subjects": [{"kind": "ServiceAccount", "name": "node-patcher", "namespace": NS}]}
    ]);
    apply(admin, other.as_array().unwrap(), false).await;
    cp.agent_client(
        &pod_token(admin, NS, "node-patcher", None).await,
        Use::Requests,
    )
}

/// The stamps the verdict reads and the fence are the node's agent's to
/// give, on the real server: nobody else writes under the record's field
/// manager (a patch of another field with its fieldManager, forged
/// managedFields), so an old record cannot be made new; the controller's
/// token adds the out-of-service taint only to a Node whose agent wrote a
/// proof of death for its present boot; the fence's annotations go only
/// with the taint.
#[test]
fn the_record_stamp_and_the_fence_are_the_node_agents_to_give() {
    let test = "the_record_stamp_and_the_fence_are_the_node_agents_to_give";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let (a, b) = ("st-a", "st-b");
        sim.add_node(a).await.unwrap();
        sim.add_node(b).await.unwrap();
        nodesim::schedulable(&admin, &[a, b], Duration::from_secs(60)).await.unwrap();
        apply(&admin, &objs, false).await;
        let patcher = node_patcher(cp, &admin).await;
        evidence_enforced(&admin, a).await;
        let agent_a = agent_of(cp, &admin, a).await;
        let controller = cp.agent_client(&pod_token(&admin, NS, CONTROLLER_SA, None).await, Use::Requests);
        let nodes = Api::<Node>::all(admin.clone());

        // A's agent writes its record, with its proof beside it.
        let boot = sim.boot_id(a).unwrap();
        recovery::last_gasp(&agent_a, a, &boot, lastgasp_tests::support::kernel_poweroff())
            .await
            .unwrap();
        let n = nodes.get(a).await.unwrap();
        assert_eq!(
            n.annotations().get(lastgasp::record::PROOF_ANNOTATION).map(String::as_str),
            Some(format!("kernel/{boot}").as_str()),
            "the proof beside the record"
        );
        let stamp = lastgasp::record::written_at(&n).expect("the record's write time");
        // The next second: a write under the record's manager would move it.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let as_record = PatchParams {
            field_manager: Some(lastgasp::record::RECORD_MANAGER.into()),
            ..Default::default()
        };
        let label = Patch::Merge(json!({"metadata": {"labels": {"example.com/touched": "yes"}}}));
        // The re-dated entry must move in the list (sorted by time) for the
        // server to keep it: the patcher's own write comes after the record.
        // Their own writes under their own names pass (and are newer than the record).
        Api::<Node>::all(patcher.clone()).patch(a, &PatchParams::default(), &label).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let refused = "is written under only by the lastgasp agent on that node";
        for (who, client) in [("a node patcher", &patcher), ("an administrator", &admin)] {
            denied(
                &format!("{who} patching a label of node A as lastgasp-record"),
                Api::<Node>::all(client.clone()).patch(a, &as_record, &label).await,
                refused,
            );
            // managedFields in the body: the record's entry re-dated.
            let mut fields = nodes.get(a).await.unwrap().metadata.managed_fields.unwrap();
            for m in fields.iter_mut().filter(|m| m.manager.as_deref() == Some(lastgasp::record::RECORD_MANAGER)) {
                m.time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
            }
            denied(
                &format!("{who} re-dating the record's managedFields on node A"),
                Api::<Node>::all(client.clone())
                    .patch(a, &PatchParams::default(), &Patch::Merge(json!({"metadata": {"managedFields": fields}})))
                    .await,
                refused,
            );
        }
        let n = nodes.get(a).await.unwrap();
        assert_eq!(lastgasp::record::written_at(&n), Some(stamp), "the stamp did not move");

        // The fence: the controller's token alone cannot set it.
        let pp = PatchParams { field_manager: Some("lastgasp-controller".into()), ..Default::default() };
        let fence = |boot: &str| {
            Patch::Merge(json!({
                "metadata": {"annotations": {TAINTED_BY_ANNOTATION: "test", FENCED_BOOT_ANNOTATION: boot}},
                "spec": {"taints": [{"key": OUT_OF_SERVICE_KEY, "value": "nodeshutdown", "effect": "NoExecute"}]},
            }))
        };
        let as_controller = Api::<Node>::all(controller.clone());
        let no_proof = "only with its agent's proof of death for its present boot";
        denied(
            "the controller fencing node B, whose agent sent nothing",
            as_controller.patch(b, &pp, &fence(&sim.boot_id(b).unwrap())).await,
            no_proof,
        );
        // A's proof is of its present boot: the fence is admitted.
        as_controller.patch(a, &pp, &fence(&boot)).await.expect("A's agent asked for it");
        // Its annotations go only with the taint.
        let keep_taint = Patch::Merge(json!({"metadata": {"annotations": {FENCED_BOOT_ANNOTATION: null}}}));
        for (who, client) in [("a node patcher", &patcher), ("an administrator", &admin)] {
            denied(
                &format!("{who} removing the fence's boot annotation of node A, taint kept"),
                Api::<Node>::all(client.clone()).patch(a, &PatchParams::default(), &keep_taint).await,
                "are removed only with its out-of-service taint",
            );
        }
        nodes
            .patch(a, &PatchParams::default(), &Patch::Merge(json!({
                "metadata": {"annotations": {TAINTED_BY_ANNOTATION: null, FENCED_BOOT_ANNOTATION: null}},
                "spec": {"taints": []},
            })))
            .await
            .expect("the taint and its annotations together");
        // A reboots: the proof is of the boot before; no fence on it.
        sim.add_node(a).await.unwrap();
        denied(
            "the controller fencing node A on its previous boot's proof",
            as_controller.patch(a, &pp, &fence(&sim.boot_id(a).unwrap())).await,
            no_proof,
        );
    });
}

/// The remediators' condition follows the taint: the taint removed by hand,
/// the condition is False within a pass, and the fence is not set again on
/// that record. A new leader (no memory) never force-deletes the pods of a
/// fenced node that came back on the boot it was fenced in.
#[test]
fn the_condition_follows_the_taint_and_a_live_nodes_pods_are_never_forced() {
    let test = "the_condition_follows_the_taint_and_a_live_nodes_pods_are_never_forced";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let names = ["cf-a", "cf-b", "cf-c"];
        for n in names {
            sim.add_node(n).await.unwrap();
        }
        nodesim::schedulable(&admin, &names, Duration::from_secs(60)).await.unwrap();
        apply(&admin, &objs, false).await;
        let (a, b) = (names[0], names[1]);
        let ctl_pod = pod_of(&admin, "app.kubernetes.io/component=controller", |_, n| {
            n != names[0] && n != names[1]
        })
        .await;
        let controller = cp.agent_client(&pod_token(&admin, NS, CONTROLLER_SA, Some(&ctl_pod)).await, Use::Watch);
        let work = "cf-work";
        nodesim::namespace(&admin, work).await.unwrap();
        // A pod on B that stays terminating (a finalizer): what a recovery deletes.
        let pods: Api<Pod> = Api::namespaced(admin.clone(), work);
        let held: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "held", "namespace": work, "finalizers": ["example.com/hold"]},
            "spec": {"nodeName": b, "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &held).await.unwrap();
        // Two replicas' Leases of this test's own (the chart grants one name).
        let leases = json!([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "lastgasp-test-cf-leases", "namespace": NS},
             "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                        "resourceNames": ["lastgasp-controller-cf-1", "lastgasp-controller-cf-2"], "verbs": ["get", "update"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "lastgasp-test-cf-leases", "namespace": NS},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lastgasp-test-cf-leases"},
             "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER_SA, "namespace": NS}]}
        ]);
        apply(&admin, leases.as_array().unwrap(), false).await;
        let replica = |id: &str| {
            let mut cfg = recovery::controller_config(id);
            cfg.lease_namespace = NS.into();
            cfg
        };
        let c1 = recovery::spawn_controller(controller.clone(), replica("cf-1")).await.unwrap();
        let nodes = Api::<Node>::all(admin.clone());
        let fence = |node: &'static str| {
            let (nodes, sim, cp, admin) = (nodes.clone(), &sim, cp, admin.clone());
            async move {
                kernel_last_gasp(cp, &admin, sim, node).await;
                let boot = sim.boot_id(node).unwrap();
                sim.power_off(node);
                let t0 = Instant::now();
                loop {
                    let n = nodes.get(node).await.unwrap();
                    let cond = condition_of(&n, FENCED_CONDITION).map(|c| c.status);
                    if has_out_of_service(&n) && cond.as_deref() == Some("True") {
                        return boot;
                    }
                    assert!(t0.elapsed() < Duration::from_secs(40), "{node} not fenced within 40 s");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
        };
        fence(a).await;
        // The taint removed by hand, its annotations kept.
        nodes
            .patch(a, &PatchParams::default(), &Patch::Merge(json!({"spec": {"taints": []}})))
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            let n = nodes.get(a).await.unwrap();
            let cond = condition_of(&n, FENCED_CONDITION).unwrap();
            if cond.status == "False" {
                assert_eq!(cond.reason.as_deref(), Some("FenceLifted"));
                println!("condition False {:?} after the taint was removed by hand", t0.elapsed());
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "still {cond:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!has_out_of_service(&nodes.get(a).await.unwrap()), "fenced again on the same record");

        // B fenced, its held pod force-deleted once; then B lives on, on the
        // boot it was fenced in, and a new leader takes over.
        let boot_b = fence(b).await;
        let t0 = Instant::now();
        while pods.get("held").await.unwrap().metadata.deletion_timestamp.is_none() {
            assert!(t0.elapsed() < Duration::from_secs(20), "B's pod was never marked");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        c1.abort();
        sim.resume(b, &boot_b).await.unwrap();
        let from = cp.audit(&user(CONTROLLER_SA)).len();
        let c2 = recovery::spawn_controller(controller.clone(), replica("cf-2")).await.unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        c2.abort();
        let forced: Vec<_> = cp.audit(&user(CONTROLLER_SA))[from..]
            .iter()
            .filter(|e| e.verb == "delete" && e.resource == "pods" && e.namespace == work)
            .map(|e| e.name.clone())
            .collect();
        assert!(forced.is_empty(), "the new leader force-deleted a live node's pods: {forced:?}");
        let n = nodes.get(b).await.unwrap();
        let cond = condition_of(&n, FENCED_CONDITION).unwrap();
        assert_eq!(cond.status, "False", "alive again on the fenced boot: {cond:?}");
        // Clean up: the finalizer off.
        pods.patch("held", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"finalizers": null}})))
            .await
            .unwrap();
    });
}

/// The VM scenarios' cluster (`tests/vm/cluster/objects.json`, which the API
/// double is seeded with) is a cluster the real server admits: its
/// PriorityClasses exist, and every pod's `spec.priority` is what priority
/// admission computes from its class (a differing value is a 403).
#[test]
fn the_vm_scenarios_cluster_is_admitted_by_the_real_server() {
    let Some(cp) = controlplane::shared("the_vm_scenarios_cluster_is_admitted_by_the_real_server")
    else {
        return;
    };
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/cluster/objects.json"),
    )
    .unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let mut objs: Vec<Value> = v["items"].as_array().or(v.as_array()).unwrap().clone();
    for o in &mut objs {
        // What the server owns (the double's seed keeps it as given).
        o.as_object_mut().unwrap().remove("status");
        let meta = o["metadata"].as_object_mut().unwrap();
        for k in ["uid", "creationTimestamp", "resourceVersion"] {
            meta.remove(k);
        }
    }
    rt().block_on(async {
        let admin = cp.admin();
        apply(&admin, &objs, false).await;
        let pods: Api<Pod> = Api::all(admin.clone());
        for o in objs.iter().filter(|o| o["kind"] == "Pod") {
            let ns = o["metadata"]["namespace"].as_str().unwrap();
            let name = o["metadata"]["name"].as_str().unwrap();
            let got = Api::<Pod>::namespaced(admin.clone(), ns)
                .get(name)
                .await
                .unwrap();
            assert_eq!(
                got.spec.unwrap().priority.map(i64::from),
                o["spec"]["priority"].as_i64(),
                "{ns}/{name}"
            );
        }
        println!(
            "{} objects admitted; {} pods",
            objs.len(),
            pods.list(&ListParams::default()).await.unwrap().items.len()
        );
    });
}

/// One release, two agent pools (`agent.pools`), on the real server: each
/// pool's DaemonSet runs on its own nodes only, and the one admission
/// policy admits each pool's agent on its own Node and refuses it on the
/// other pool's.
#[test]
fn two_agent_pools_of_one_release_each_run_on_their_nodes_and_are_admitted() {
    let test = "two_agent_pools_of_one_release_each_run_on_their_nodes_and_are_admitted";
    let Some((cp, objs)) = setup(test) else {
        return;
    };
    let Some(h) = helm() else {
        return println!("SKIPPED {test}: no helm (`cargo xtask test` installs it)");
    };
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let (a, b) = ("pool-main-1", "pool-bare-1");
        for (n, pool) in [(a, "main"), (b, "bare")] {
            sim.add_node(n).await.unwrap();
            let label = Patch::Merge(json!({"metadata": {"labels": {"lastgasp.dev/pool": pool}}}));
            Api::<Node>::all(admin.clone())
                .patch(n, &PatchParams::default(), &label)
                .await
                .unwrap();
        }
        nodesim::schedulable(&admin, &[a, b], Duration::from_secs(60))
            .await
            .unwrap();
        apply(&admin, &objs, false).await;
        let pools = render_helm(
            &h,
            &[
                "agent.pools[0].name=main",
                "agent.pools[0].nodeSelector.lastgasp\\.dev/pool=main",
                "agent.pools[1].name=bare",
                "agent.pools[1].nodeSelector.lastgasp\\.dev/pool=bare",
                "agent.pools[1].extraArgs[0]=--no-dbus",
            ],
        );
        // The pools' own objects (the rest is the kustomize render's twin).
        let own: Vec<Value> = pools
            .into_iter()
            .filter(|o| {
                let name = o["metadata"]["name"].as_str().unwrap_or("");
                ["DaemonSet", "ConfigMap"].contains(&o["kind"].as_str().unwrap_or(""))
                    && name.starts_with("lastgasp-agent-")
            })
            .collect();
        assert_eq!(own.len(), 4, "two DaemonSets, two ConfigMaps: {own:#?}");
        // The pools replace the one DaemonSet (its pods hold the host port).
        let ds: Api<k8s_openapi::api::apps::v1::DaemonSet> = Api::namespaced(admin.clone(), NS);
        ds.delete("lastgasp-agent", &DeleteParams::foreground())
            .await
            .unwrap();
        let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
        let t0 = Instant::now();
        // On these two nodes (other tests' nodes may be powered off, their
        // pods never confirmed gone).
        while pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
            .await
            .unwrap()
            .items
            .iter()
            .any(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some_and(|n| n == a || n == b)
            })
        {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the single DaemonSet's pods stay"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        apply(&admin, &own, false).await;
        evidence_enforced(&admin, a).await;

        let on = |pool: &'static str| format!("lastgasp.dev/pool={pool}");
        let main_a = pod_of(&admin, &on("main"), |_, n| n == a).await;
        let bare_b = pod_of(&admin, &on("bare"), |_, n| n == b).await;
        // Settled: no pool's pod on the other's node.
        tokio::time::sleep(Duration::from_secs(3)).await;
        for (pool, other) in [("main", b), ("bare", a)] {
            let list = pods
                .list(&ListParams::default().labels(&on(pool)))
                .await
                .unwrap();
            let wrong: Vec<_> = list
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(other))
                .map(ResourceExt::name_any)
                .collect();
            assert!(wrong.is_empty(), "pool {pool} on {other}: {wrong:?}");
        }
        let bare = ds.get("lastgasp-agent-bare").await.unwrap();
        let spec = serde_json::to_value(&bare).unwrap()["spec"]["template"]["spec"].clone();
        let args = spec["containers"][0]["args"].clone();
        assert_eq!(args, json!(["--json-logs", "run", "--no-dbus"]));

        // Each pool's agent writes its own Node's record, not the other's.
        let params = lastgasp::act::kube::record_params();
        for (pod, mine, other) in [(&main_a, a, b), (&bare_b, b, a)] {
            let client = cp.agent_client(
                &pod_token(&admin, NS, AGENT_SA, Some(pod)).await,
                Use::Requests,
            );
            let rec = lastgasp_tests::support::record_of(
                &sim.boot_id(mine).unwrap(),
                &lastgasp_tests::support::kernel_poweroff(),
            );
            let patch = Patch::Merge(
                json!({"metadata": {"annotations": {RECORD_ANNOTATION: rec.to_json()}}}),
            );
            Api::<Node>::all(client.clone())
                .patch(mine, &params, &patch)
                .await
                .unwrap();
            denied_by(
                &format!("{}'s agent writing {other}'s record", pod.name_any()),
                Api::<Node>::all(client).patch(other, &params, &patch).await,
                &[
                    "may only change its own Node",
                    "is written only by the lastgasp agent on that node",
                ],
            );
        }
        println!(
            "two pools: {} on {a}, {} on {b}; each admitted on its own Node only",
            main_a.name_any(),
            bare_b.name_any()
        );
        // Leave the shared control plane as the other tests expect it: the
        // one DaemonSet back.
        for o in &own {
            let name = o["metadata"]["name"].as_str().unwrap();
            match o["kind"].as_str().unwrap() {
                "DaemonSet" => drop(ds.delete(name, &DeleteParams::default()).await),
                _ => drop(
                    Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(admin.clone(), NS)
                        .delete(name, &DeleteParams::default())
                        .await,
                ),
            }
        }
        apply(&admin, &objs, false).await;
    });
}
