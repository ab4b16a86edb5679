//! The fleet's shutdown ledger on the real API server (v1.32.13) with this
//! checkout's kustomize install (the CRD included): the controller, with the
//! bound token of its own pod, writes one NodeShutdown per episode from
//! what the server holds, keeps the fence once the node is back, and the
//! retention prunes. SKIPPED with the reason without the control plane or
//! kustomize.
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::{
    api::{DynamicObject, ListParams},
    Api, Client, ResourceExt,
};
use lastgasp::controller::{ledger, ledger_writer};
use lastgasp_tests::{
    controlplane::{self, pod_token},
    nodesim::{self, Sim},
    recovery,
    render::{apply, kustomize, kustomize_dir, render_kustomize_dir},
    support::{agent_bin, kernel_poweroff, rt},
};
use serde_json::Value;

const NS: &str = "lastgasp";

/// The bound token of the Running pod of `component` on `node`.
async fn token_of(admin: &Client, component: &str, node: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let selector = format!("app.kubernetes.io/component={component}");
    let t0 = Instant::now();
    loop {
        let list = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap();
        let found = list.items.into_iter().find(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        });
        if let Some(p) = found {
            let sa = p
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap();
            return pod_token(admin, NS, &sa, Some(&p)).await;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "no Running {component} pod on {node}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
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
        let ctl = cp.agent_client(
            &token_of(&admin, "controller", "ledger-ctl").await,
            lastgasp::act::kube::Use::Watch,
        );
        let mut cfg = recovery::controller_config("ledger");
        cfg.lease_namespace = NS.into();
        cfg.lease_name = "lastgasp-controller".into();
        cfg.ledger = Some(ledger_writer::Retention {
            max_age: Duration::from_secs(30 * 86_400),
            max_per_node: 100,
        });
        let _ctl = recovery::spawn_controller(ctl, cfg).await.unwrap();
        let agent = cp.agent_client(
            &token_of(&admin, "agent", "ledger-a").await,
            lastgasp::act::kube::Use::Requests,
        );
        let boot = sim.boot_id("ledger-a").unwrap();
        recovery::last_gasp(&agent, "ledger-a", &boot, kernel_poweroff())
            .await
            .unwrap();
        let gasped = Instant::now();
        sim.power_off("ledger-a");
        let api: Api<DynamicObject> = Api::all_with(admin.clone(), &ledger_writer::resource());
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
        let all = api.list(&ListParams::default()).await.unwrap();
        let mine: Vec<String> = all
            .items
            .iter()
            .map(ResourceExt::name_any)
            .filter(|n| n.starts_with("ledger-a."))
            .collect();
        assert_eq!(mine, [name], "one entry per episode");
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
        assert!(text.starts_with("1 shutdown episodes since"), "{text}");
        assert!(text.contains("by ending: back 1"), "{text}");
        assert!(
            text.contains("(the agents' claim): systemd-shutdow 1"),
            "{text}"
        );
    });
}
