//! The README's five minutes, on a fresh real control plane (this test
//! binary's own): every command run as written where this machine can run
//! it, and each of the others said. `helm install` runs as written (the
//! registry named `registry.example`); the kubectl lines run as their API
//! calls (kubectl is not one of the project's tools); `kubectl exec
//! ds/lastgasp-agent -- lastgasp check` runs the agent's binary with what
//! that pod has: its bound token, its environment, its ConfigMap, on a
//! simulated node, limited to the sections this machine can answer for a
//! node (cluster, fence). The drill's `shutdown` lines need a real node.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, Namespace, Pod},
};
use kube::{
    api::{ListParams, Patch, PatchParams, PostParams},
    Api,
};
use lastgasp_tests::{
    controlplane::{self, ADMIN_TOKEN},
    doccmd::{commands, filled, DocCommand},
    nodesim::{self, Sim},
    render::{helm, helm_command, repo},
    support::{agent_bin, rt},
};
use serde_json::json;

/// The README's commands from `## Five minutes` to the next section.
fn five_minutes() -> Vec<DocCommand> {
    let readme = repo().join("README.md");
    let text = std::fs::read_to_string(&readme).unwrap();
    let start = text
        .lines()
        .position(|l| l == "## Five minutes")
        .expect("a Five minutes section")
        + 1;
    let end = text
        .lines()
        .skip(start)
        .position(|l| l.starts_with("## "))
        .map_or(usize::MAX, |n| start + n);
    commands(&readme)
        .into_iter()
        .filter(|c| c.line > start && c.line <= end)
        .collect()
}

#[test]
fn the_readmes_five_minutes_install_and_check_on_the_real_control_plane() {
    let test = "the_readmes_five_minutes_install_and_check_on_the_real_control_plane";
    let Some(cp) = controlplane::shared(test) else {
        return;
    };
    let Some(helm) = helm() else {
        return println!("SKIPPED {test}: no helm (cargo xtask test installs it)");
    };
    let bin = agent_bin();
    if !bin.is_file() {
        return println!("SKIPPED {test}: no agent binary (cargo xtask test builds it)");
    }
    let steps = five_minutes();
    assert!(
        steps.len() >= 9,
        "the five minutes changed shape: {steps:#?}"
    );
    rt().block_on(async {
        let admin = cp.admin();
        let sim = Sim::start(admin.clone()).await.unwrap();
        let nodes = ["five-a", "five-b"];
        for n in nodes {
            sim.add_node(n).await.unwrap();
        }
        nodesim::schedulable(&admin, &nodes, Duration::from_secs(60))
            .await
            .unwrap();
        let kubeconfig = cp
            .write_kubeconfig("five-minutes.kubeconfig", ADMIN_TOKEN)
            .unwrap();
        let home = std::env::temp_dir().join(format!("lastgasp-five-{}", std::process::id()));
        // helm as the README runs it: from the repository, on this cluster.
        let run_helm = |args: &[String]| {
            helm_command(&helm, &home)
                .current_dir(repo())
                .args(args)
                .env("KUBECONFIG", &kubeconfig)
                .output()
                .unwrap()
        };
        let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let mut ran = Vec::new();
        for c in &steps {
            let w: Vec<&str> = c.words.iter().map(String::as_str).collect();
            let shown = c.words.join(" ");
            match w.as_slice() {
                ["podman", "build", .., "."] | ["podman", "push", ..] => {
                    println!(
                        "by `cargo xtask test`'s release step (this Containerfile's build, a real registry): {shown}"
                    );
                }
                ["kubectl", "create", "namespace", ns] => {
                    let nss: Api<Namespace> = Api::all(admin.clone());
                    nss.create(
                        &PostParams::default(),
                        &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
                    )
                    .await
                    .unwrap();
                    ran.push(shown);
                }
                ["kubectl", "label", "namespace", ns, kv] => {
                    let (k, v) = kv.split_once('=').unwrap();
                    let nss: Api<Namespace> = Api::all(admin.clone());
                    nss.patch(
                        ns,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"metadata": {"labels": {k: v}}})),
                    )
                    .await
                    .unwrap();
                    ran.push(shown);
                }
                ["helm", "install", ..] => {
                    let args: Vec<String> = c.words[1..].iter().map(|a| filled(a)).collect();
                    let out = run_helm(&args);
                    assert!(
                        out.status.success(),
                        "{c}:\n{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    ran.push(shown);
                }
                ["kubectl", "-n", ns, "rollout", "status", ds] => {
                    let name = ds.strip_prefix("ds/").unwrap();
                    let dss: Api<DaemonSet> = Api::namespaced(admin.clone(), ns);
                    let t0 = Instant::now();
                    loop {
                        let st = dss.get(name).await.unwrap().status.unwrap_or_default();
                        if st.desired_number_scheduled >= nodes.len() as i32
                            && st.number_available == Some(st.desired_number_scheduled)
                        {
                            break;
                        }
                        assert!(
                            t0.elapsed() < Duration::from_secs(90),
                            "{c}: not rolled out in 90 s: {st:?}"
                        );
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    ran.push(shown);
                }
                ["kubectl", "-n", ns, "exec", ds, "--", "lastgasp", rest @ ..] => {
                    let report =
                        exec_check(cp, &admin, ns, ds.strip_prefix("ds/").unwrap(), rest).await;
                    println!("{report}");
                    ran.push(shown);
                }
                ["shutdown", ..] | ["kubectl", "get", ..] => {
                    println!("on a real node (the drill): {shown}");
                }
                _ => panic!("{c}: a step this test does not know; run it here or say why not"),
            }
        }
        // One lastgasp per cluster: a second release is refused at install
        // (its policies would refuse the first's agents), an upgrade of the
        // first is not.
        let second = run_helm(&words(
            "install second deploy/helm/lastgasp --namespace second --create-namespace --set nameOverride=second",
        ));
        let said = String::from_utf8_lossy(&second.stderr);
        assert!(!second.status.success(), "a second release installed");
        assert!(said.contains("another lastgasp is installed in this cluster (its evidence policy lastgasp-evidence, release \"lastgasp\" in namespace \"lastgasp\")"), "{said}");
        let upgrade = run_helm(&words(
            "upgrade lastgasp deploy/helm/lastgasp --namespace lastgasp --reuse-values",
        ));
        let said = String::from_utf8_lossy(&upgrade.stderr);
        assert!(upgrade.status.success(), "the release's own upgrade: {said}");
        std::fs::remove_dir_all(&home).ok();
        // Safe first: the five minutes install observe (nothing fenced, no
        // pod removed).
        let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
            Api::namespaced(admin.clone(), "lastgasp");
        let ctl = deployments.get("lastgasp-controller").await.unwrap();
        let args = ctl.spec.template.spec.unwrap().containers[0]
            .args
            .clone()
            .unwrap_or_default();
        assert!(
            args.windows(2)
                .any(|w| w[0] == "--policy" && w[1] == "observe"),
            "{args:?}"
        );
        let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "lastgasp");
        let config = cms
            .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
            .await
            .unwrap()
            .items
            .into_iter()
            .flat_map(|c| c.data.unwrap_or_default().into_values())
            .collect::<String>();
        assert!(config.contains("podRemoval: none"), "{config}");
        println!("ran as written, or as their API calls: {ran:#?}");
        assert_eq!(
            ran.len(),
            5,
            "create, label, install, rollout, check: {ran:?}"
        );
    });
}

/// `kubectl -n NS exec ds/DS -- lastgasp ARGS` as this machine can run it:
/// the binary with the pod's token (bound to it, as the kubelet projects
/// it), its container's environment and its ConfigMap, and only the
/// sections that ask the cluster (the others would check this machine, not
/// the simulated node). Asked again for up to 30 s: an admission policy is
/// in force a moment after it is created. Returns the report.
async fn exec_check(
    cp: &controlplane::ControlPlane,
    admin: &kube::Client,
    ns: &str,
    ds: &str,
    args: &[&str],
) -> String {
    let dss: Api<DaemonSet> = Api::namespaced(admin.clone(), ns);
    let spec = dss.get(ds).await.unwrap().spec.template.spec.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let pod = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .expect("a Running agent pod");
    let node = pod.spec.as_ref().unwrap().node_name.clone().unwrap();
    let sa = spec.service_account_name.clone().unwrap();
    let token = controlplane::pod_token(admin, ns, &sa, Some(&pod)).await;
    let kubeconfig = cp
        .write_kubeconfig("five-minutes-agent.kubeconfig", &token)
        .unwrap();
    // The ConfigMap where the pod mounts it.
    let cm: ConfigMap = Api::namespaced(admin.clone(), ns).get(ds).await.unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-five-etc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (k, v) in cm.data.unwrap_or_default() {
        std::fs::write(dir.join(k), v).unwrap();
    }
    let container = &spec.containers[0];
    let mut cmd = Command::new(agent_bin());
    cmd.args(args)
        .args(["--only", "cluster,fence"])
        .env_clear()
        .env("KUBECONFIG", &kubeconfig);
    for e in container.env.iter().flatten() {
        let value = match (e.name.as_str(), e.value.as_deref()) {
            ("LASTGASP_CONFIG", Some(v)) => v.replace("/etc/lastgasp", &dir.display().to_string()),
            (_, Some(v)) => v.to_string(),
            ("NODE_NAME", None) => node.clone(),
            (_, None) => continue,
        };
        cmd.env(&e.name, value);
    }
    let t0 = Instant::now();
    loop {
        let out = cmd.output().unwrap();
        let report = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.success() {
            std::fs::remove_dir_all(&dir).ok();
            assert!(report.contains("refused (dry run)"), "{report}");
            return report;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "`lastgasp {}` as in the agent's pod on {node} fails:\n{report}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
