//! The fleet's shutdown ledger on the real API server (v1.32.13) with this
//! checkout's kustomize install (the CRD included): the controller, with the
//! bound token of its own pod, writes one NodeShutdown per episode from
//! what the server holds, keeps the fence once the node is back, and the
//! retention prunes. SKIPPED with the reason without the control plane or
//! kustomize.
use std::time::{Duration, Instant};

use kube::{
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams},
    Api, ResourceExt,
};
use lastgasp::{
    act::kube::NodeClient,
    controller::{ledger, ledger_writer},
    record::{DrainNote, SlowPod, UnannouncedEnd, UNANNOUNCED_ANNOTATION},
};
use lastgasp_tests::{
    controlplane::{self, running_pod_token},
    nodesim::{self, Sim},
    recovery,
    render::{apply, kustomize, kustomize_dir, render_kustomize_dir},
    support::{agent_bin, kernel_poweroff, rt},
};
use serde_json::{json, Value};
use std::collections::BTreeSet;

const NS: &str = "lastgasp";

const CONTROLLER: &str = "system:serviceaccount:lastgasp:lastgasp-controller";
const STALE: &str = "ledger-gone.0000abcd.1";

/// A well-formed entry of a node that went down 40 days ago.
fn stale_entry() -> Value {
    let opened = std::time::SystemTime::now() - Duration::from_secs(40 * 86_400);
    json!({
        "apiVersion": "lastgasp.dev/v1alpha1", "kind": "NodeShutdown",
        "metadata": {"name": STALE, "labels": {"lastgasp.dev/node": "ledger-gone"}},
        "spec": {
            "node": "ledger-gone", "bootID": "0000abcd-0000", "episode": 1,
            "kind": "poweroff", "path": "immediate", "graceful": false, "forced": true,
            "openedAt": humantime::format_rfc3339(opened).to_string(),
            "ending": "down", "agentClaims": {}
        }
    })
}

/// The controller's ClusterRole grants on the ledger exactly what its
/// requests used, as the API server's audit log saw them, and `create`,
/// which RBAC asks of a server-side apply that makes a new object (logged
/// as a patch).
fn ledger_grants_are_what_the_controller_uses(
    cp: &controlplane::ControlPlane,
    objs: &[Value],
    audit_from: usize,
) {
    let role = objs
        .iter()
        .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "lastgasp-controller")
        .expect("the controller's ClusterRole");
    let granted: BTreeSet<String> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["apiGroups"] == json!(["lastgasp.dev"]))
        .flat_map(|r| r["verbs"].as_array().unwrap().clone())
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let mut used: BTreeSet<String> = cp.audit(CONTROLLER)[audit_from..]
        .iter()
        .filter(|e| e.group == "lastgasp.dev")
        .inspect(|e| assert!(e.code < 300, "{e:?}"))
        .map(|e| e.verb.clone())
        .collect();
    println!("the controller's ledger requests: {used:?}");
    used.insert("create".into());
    assert_eq!(granted, used);
}

/// Waits up to `within` for the ledger entry `name` to satisfy `ok`.
async fn entry_when(
    api: &Api<DynamicObject>,
    name: &str,
    within: Duration,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        if let Ok(o) = api.get(name).await {
            let v = serde_json::to_value(&o).unwrap();
            if ok(&v) {
                return v;
            }
        }
        assert!(
            t0.elapsed() < within,
            "{name} not as wanted within {within:?}: {:?}",
            api.get(name)
                .await
                .map(|o| serde_json::to_value(o).unwrap())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn every_episode_leaves_one_entry_that_keeps_its_fence() {
    let test = "every_episode_leaves_one_entry_that_keeps_its_fence";
    let Some(cp) = controlplane::shared(test) else {
        return;
    };
    let Some(k) = kustomize() else {
        return println!("SKIPPED {test}: no kustomize (`cargo xtask test` installs it, or set LASTGASP_KUSTOMIZE)");
    };
    let objs = render_kustomize_dir(&k, &kustomize_dir());
    rt().block_on(async {
        let admin = cp.admin();
        apply(&admin, &objs, false).await.unwrap();
        let sim = Sim::start(admin.clone()).await.unwrap();
        for n in ["ledger-ctl", "ledger-a"] {
            sim.add_node(n).await.unwrap();
        }
        nodesim::schedulable(&admin, &["ledger-ctl", "ledger-a"], Duration::from_secs(60))
            .await
            .unwrap();
        let ctl_token = running_pod_token(&admin, NS, "controller", "ledger-ctl").await;
        let ctl = cp.agent_client(&ctl_token, lastgasp::apiserver::Use::Watch);
        let api: Api<DynamicObject> = Api::all_with(admin.clone(), &ledger_writer::resource());
        // An entry past the retention's age, which the controller's first
        // round prunes (planted with the controller's own token: nobody else
        // may create one, as the admin is about to find).
        let stale = stale_entry();
        let forged = api
            .create(
                &PostParams::default(),
                &serde_json::from_value(stale.clone()).unwrap(),
            )
            .await
            .expect_err("the admission rule refuses the admin's entry");
        println!("the admin's entry: {forged}");
        assert!(
            forged
                .to_string()
                .contains("written only by the lastgasp controller"),
            "{forged}"
        );
        Api::<DynamicObject>::all_with(ctl.clone(), &ledger_writer::resource())
            .create(
                &PostParams::default(),
                &serde_json::from_value(stale).unwrap(),
            )
            .await
            .unwrap();
        let audit_from = cp.audit(CONTROLLER).len();
        let mut cfg = recovery::controller_config("ledger");
        cfg.lease_namespace = NS.into();
        cfg.lease_name = "lastgasp-controller".into();
        cfg.ledger = Some(ledger_writer::Retention {
            max_age: Duration::from_secs(30 * 86_400),
            max_per_node: 100,
        });
        let _ctl = recovery::spawn_controller(ctl, cfg).await.unwrap();
        let agent = cp.agent_client(
            &running_pod_token(&admin, NS, "agent", "ledger-a").await,
            lastgasp::apiserver::Use::Requests,
        );
        let boot = sim.boot_id("ledger-a").unwrap();
        let agent_node = NodeClient::start_with(agent.clone(), agent.clone(), "ledger-a")
            .await
            .unwrap();
        recovery::last_gasp(&agent, "ledger-a", &boot, kernel_poweroff())
            .await
            .unwrap();
        let gasped = Instant::now();
        // The drain's end as the graceful path says it (the agent's
        // conditions): through the CRD's schema, which prunes what it lacks.
        let note = DrainNote {
            gone: 2,
            left: 1,
            slowest: Some(SlowPod {
                pod: "default/db-0".into(),
                seconds: 3.5,
            }),
        };
        agent_node
            .set_drained(false, &note.to_string())
            .await
            .unwrap();
        sim.power_off("ledger-a");
        let name = ledger::name("ledger-a", &boot, 1);
        let down = entry_when(&api, &name, Duration::from_secs(10), |v| {
            v["spec"]["down"]["proof"] == "kernel"
        })
        .await;
        println!(
            "entry with the proof {:?} after the last gasp",
            gasped.elapsed()
        );
        assert_eq!(down["metadata"]["labels"]["lastgasp.dev/node"], "ledger-a");
        assert_eq!(down["spec"]["agentClaims"]["source"], "reboot-syscall");
        let drained = entry_when(&api, &name, Duration::from_secs(10), |v| {
            !v["spec"]["agentClaims"]["drain"].is_null()
        })
        .await;
        let d = &drained["spec"]["agentClaims"]["drain"];
        assert_eq!(
            (&d["gone"], &d["left"], &d["drained"]),
            (&json!(2), &json!(1), &json!(false)),
            "{d}"
        );
        assert_eq!(
            d["slowest"],
            json!({"pod": "default/db-0", "seconds": 3.5}),
            "{d}"
        );
        assert!(d["ended"].is_string(), "{d}");
        let fenced = entry_when(&api, &name, Duration::from_secs(40), |v| {
            v["spec"]["ending"] == "fenced"
        })
        .await;
        assert!(fenced["spec"]["fence"]["at"].is_string(), "{fenced}");
        // Back on a new boot: the controller lifts its fence; the entry keeps it.
        let new_boot = sim.add_node("ledger-a").await.unwrap();
        let back = entry_when(&api, &name, Duration::from_secs(40), |v| {
            v["spec"]["ending"] == "back"
        })
        .await;
        assert_eq!(back["spec"]["back"]["bootID"], new_boot);
        assert_eq!(
            back["spec"]["fence"], fenced["spec"]["fence"],
            "the fence is kept"
        );
        // Then the power goes on that boot: nothing announced it. The next
        // boot's agent says so on its Node (as its after-boot report does),
        // and nobody else may.
        let lost_boot = new_boot;
        sim.power_off("ledger-a");
        let third_boot = sim.add_node("ledger-a").await.unwrap();
        let said = UnannouncedEnd {
            boot_id: lost_boot.clone(),
            last_seen: Some(std::time::SystemTime::now() - Duration::from_secs(60)),
            reported_at: std::time::SystemTime::now(),
        };
        let body = json!({"metadata": {"annotations": {
            UNANNOUNCED_ANNOTATION: serde_json::to_string(&said).unwrap()}}});
        let forged = Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
            .patch("ledger-a", &PatchParams::default(), &Patch::Merge(&body))
            .await
            .expect_err("only the node's agent says its boot ended unannounced");
        assert!(forged.to_string().contains("unannounced-end"), "{forged}");
        agent_node.set_unannounced(&said).await.unwrap();
        let unannounced = ledger::name("ledger-a", &lost_boot, 0);
        let u = entry_when(&api, &unannounced, Duration::from_secs(10), |v| {
            v["spec"]["ending"] == "unannounced"
        })
        .await;
        assert_eq!(u["spec"]["back"]["bootID"], third_boot);
        assert_eq!(u["metadata"]["labels"]["lastgasp.dev/unannounced"], "true");
        let all = api.list(&ListParams::default()).await.unwrap();
        let mut mine: Vec<String> = all
            .items
            .iter()
            .map(ResourceExt::name_any)
            .filter(|n| n.starts_with("ledger-a."))
            .collect();
        mine.sort();
        let mut want = [name, unannounced];
        want.sort();
        assert_eq!(mine, want, "one entry per episode");
        assert!(
            api.get_opt(STALE).await.unwrap().is_none(),
            "the retention pruned the entry past its age"
        );
        ledger_grants_are_what_the_controller_uses(cp, &objs, audit_from);
        // The fleet's view, as an operator asks for it.
        let kubeconfig = cp
            .write_kubeconfig("ledger-admin.kubeconfig", controlplane::ADMIN_TOKEN)
            .unwrap();
        let out = std::process::Command::new(agent_bin())
            .args(["history", "--cluster", "--since", "1h"])
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{text}");
        assert!(text.starts_with("2 shutdown episodes since"), "{text}");
        assert!(text.contains("by ending: back 1, unannounced 1"), "{text}");
        assert!(text.contains("unannounced boots (1): ledger-a."), "{text}");
        assert!(
            text.contains("(the agents' claim): - 1, systemd-shutdow 1"),
            "{text}"
        );
    });
}
