//! The deployment manifests (`deploy/`): every object parses into its typed
//! k8s-openapi struct with no field lost, kustomize and Helm render the same
//! objects, the RBAC rules are exactly the API calls the code makes (driven
//! against the API double), the ConfigMap parses with the agent's own
//! `Config::parse` and the DaemonSet's args with the agent's own CLI.
//!
//! Rendering needs helm and kustomize: `cargo xtask test` installs them and
//! passes `LASTGASP_HELM` / `LASTGASP_KUSTOMIZE`; without them the rendering
//! tests print SKIPPED (the others read `deploy/kustomize/*.yaml`, which are
//! plain manifests, directly).
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, SystemTime},
};

use k8s_openapi::api::{
    admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding},
    apps::v1::{DaemonSet, Deployment},
    core::v1::{ConfigMap, Container, Namespace, Node, Pod, PodSpec, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding},
};
use lastgasp::{
    act::Cluster,
    act::{
        audit::AuditLog,
        kube::graceful::{self, GracefulOptions, Removal},
        metrics::Metrics,
    },
    agent::Agent,
    config::Config,
    controller::{Controller, ControllerConfig},
    decide::Decider,
    grace::Bucket,
    signal::{Actor, Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};
use lastgasp_apidouble::{ApiDouble, Fault, RequestRecord};
use lastgasp_tests::{
    render::{helm, kustomize, kustomize_dir, render_helm, render_kustomize_dir, repo, split_yaml},
    support::warm_clients,
};
use serde::{de::DeserializeOwned, Serialize};
use serde_json::{json, Value};

// ---------------------------------------------------------------- sources

/// The kustomize base as written: `resources:` of kustomization.yaml, in
/// order. They are plain manifests (no patches, no generators), so this is
/// what `kustomize build` renders; `rendered_objects_*` checks that.
fn source_objects() -> Vec<Value> {
    let k: Value = serde_norway::from_str(
        &std::fs::read_to_string(kustomize_dir().join("kustomization.yaml")).unwrap(),
    )
    .unwrap();
    let keys: BTreeSet<&str> = k.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        BTreeSet::from(["apiVersion", "kind", "resources"]),
        "kustomization.yaml grew transformers: read it through `kustomize build` only"
    );
    let mut out = Vec::new();
    for r in k["resources"].as_array().unwrap() {
        let path = kustomize_dir().join(r.as_str().unwrap());
        out.extend(split_yaml(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        ));
    }
    out
}

/// A renderer: `LASTGASP_HELM` / `LASTGASP_KUSTOMIZE` (set by `cargo xtask
/// test`), else the copy `cargo xtask test` cached under ~/.cache/lastgasp/tools, else None.
fn render_kustomize(bin: &Path) -> Vec<Value> {
    render_kustomize_dir(bin, &kustomize_dir())
}

/// The objects of `podRemoval: evict`: the overlay that adds the kustomize
/// component (pods/eviction granted, the config's podRemoval). `None` (with
/// a printed reason) without kustomize.
fn evict_objects(test: &str) -> Option<BTreeMap<Key, Value>> {
    let Some(k) = kustomize() else {
        skip(test, "no kustomize: the evict overlay is not rendered");
        return None;
    };
    Some(objects(
        "kustomize build deploy/overlays/evict",
        &render_kustomize_dir(&k, &repo().join("deploy/overlays/evict")),
    ))
}

// ------------------------------------------------ strict typed parsing

/// k8s-openapi's `Deserialize` ignores fields it does not know (so would a
/// typo such as `readOnlyRootFileSystem`). So: deserialize into the typed
/// struct, serialize it back, and compare with the input. A key present in
/// the input and absent after the round trip is a field the type does not
/// have. Normalisation: a `null` in the input means "unset" and is skipped
/// (the typed value drops it as `None`); keys the round trip *adds* are
/// ignored (`apiVersion`/`kind` are always written); a scalar must come back
/// equal (a string where a number belongs fails to deserialize at all).
fn strict<T: DeserializeOwned + Serialize>(v: &Value) -> Result<(T, Value), String> {
    let t: T =
        serde_json::from_value(v.clone()).map_err(|e| format!("does not deserialize: {e}"))?;
    let back = serde_json::to_value(&t).map_err(|e| e.to_string())?;
    let mut lost = Vec::new();
    lost_fields(v, &back, "", &mut lost);
    if lost.is_empty() {
        Ok((t, back))
    } else {
        Err(format!("unknown or lost field(s): {}", lost.join(", ")))
    }
}

fn lost_fields(input: &Value, back: &Value, path: &str, lost: &mut Vec<String>) {
    match (input, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match b.get(k) {
                    _ if v.is_null() => {}
                    None => lost.push(p),
                    Some(bv) => lost_fields(v, bv, &p, lost),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                lost_fields(x, y, &format!("{path}[{i}]"), lost);
            }
        }
        (a, b) if a == b => {}
        (a, b) => lost.push(format!("{path} ({a} became {b})")),
    }
}

/// The typed round trip of any object the manifests may hold, by
/// apiVersion/kind; anything else is an error.
fn typed(v: &Value) -> Result<Value, String> {
    let (api, kind) = (
        v["apiVersion"].as_str().unwrap_or(""),
        v["kind"].as_str().unwrap_or(""),
    );
    let back = match (api, kind) {
        ("v1", "Namespace") => strict::<Namespace>(v)?.1,
        ("v1", "ServiceAccount") => strict::<ServiceAccount>(v)?.1,
        ("v1", "ConfigMap") => strict::<ConfigMap>(v)?.1,
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => strict::<ClusterRole>(v)?.1,
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            strict::<ClusterRoleBinding>(v)?.1
        }
        ("rbac.authorization.k8s.io/v1", "Role") => strict::<Role>(v)?.1,
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => strict::<RoleBinding>(v)?.1,
        ("apps/v1", "DaemonSet") => strict::<DaemonSet>(v)?.1,
        ("apps/v1", "Deployment") => strict::<Deployment>(v)?.1,
        ("v1", "ResourceQuota") => strict::<k8s_openapi::api::core::v1::ResourceQuota>(v)?.1,
        ("v1", "Pod") => strict::<Pod>(v)?.1,
        ("batch/v1", "Job") => strict::<k8s_openapi::api::batch::v1::Job>(v)?.1,
        ("policy/v1", "PodDisruptionBudget") => {
            strict::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(v)?.1
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            strict::<ValidatingAdmissionPolicy>(v)?.1
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            strict::<ValidatingAdmissionPolicyBinding>(v)?.1
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            strict::<k8s_openapi::api::networking::v1::NetworkPolicy>(v)?.1
        }
        ("flowcontrol.apiserver.k8s.io/v1", "FlowSchema") => {
            strict::<k8s_openapi::api::flowcontrol::v1::FlowSchema>(v)?.1
        }
        ("flowcontrol.apiserver.k8s.io/v1", "PriorityLevelConfiguration") => {
            strict::<k8s_openapi::api::flowcontrol::v1::PriorityLevelConfiguration>(v)?.1
        }
        _ => return Err(format!("unexpected object {api} {kind}: add it to `typed`")),
    };
    Ok(back)
}

const CLUSTER_SCOPED: [&str; 6] = [
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "FlowSchema",
    "PriorityLevelConfiguration",
];

type Key = (String, String, String, String);

/// Every object strictly parsed, keyed by (apiVersion, kind, namespace,
/// name); panics naming each object that fails.
fn objects(what: &str, values: &[Value]) -> BTreeMap<Key, Value> {
    let mut out = BTreeMap::new();
    let mut errors = Vec::new();
    for v in values {
        let s = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let key = (
            s("/apiVersion"),
            s("/kind"),
            s("/metadata/namespace"),
            s("/metadata/name"),
        );
        match typed(v) {
            Ok(back) => {
                assert!(
                    out.insert(key.clone(), back).is_none(),
                    "{what}: {key:?} twice"
                );
            }
            Err(e) => errors.push(format!("{key:?}: {e}")),
        }
    }
    assert!(errors.is_empty(), "{what}:\n{}", errors.join("\n"));
    for (_, kind, ns, name) in out.keys() {
        if CLUSTER_SCOPED.contains(&kind.as_str()) {
            assert_eq!(
                ns, "",
                "{what}: cluster-scoped {kind} {name} has a namespace"
            );
        } else {
            assert_eq!(
                ns, "lastgasp",
                "{what}: {kind} {name} is not in namespace lastgasp"
            );
        }
    }
    out
}

fn get<T: DeserializeOwned>(objs: &BTreeMap<Key, Value>, kind: &str, name: &str) -> T {
    let v = objs
        .iter()
        .find(|((_, k, _, n), _)| k == kind && n == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
        .1;
    serde_json::from_value(v.clone()).unwrap()
}

fn all<T: DeserializeOwned>(objs: &BTreeMap<Key, Value>, kind: &str) -> Vec<T> {
    objs.iter()
        .filter(|((_, k, _, _), _)| k == kind)
        .map(|(_, v)| serde_json::from_value(v.clone()).unwrap())
        .collect()
}

// ------------------------------------------------------------- parsing

#[test]
fn every_source_manifest_parses_strictly() {
    let objs = objects("deploy/kustomize", &source_objects());
    let kinds: BTreeSet<&str> = objs.keys().map(|k| k.1.as_str()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from([
            "ClusterRole",
            "ClusterRoleBinding",
            "PodDisruptionBudget",
            "ConfigMap",
            "DaemonSet",
            "Deployment",
            "Role",
            "RoleBinding",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "FlowSchema",
            "PriorityLevelConfiguration",
            "NetworkPolicy"
        ])
    );
}

#[test]
fn a_misspelled_field_is_caught() {
    let text = std::fs::read_to_string(kustomize_dir().join("agent-daemonset.yaml")).unwrap();
    let good = split_yaml(&text);
    assert!(typed(&good[0]).is_ok());
    // A typo k8s-openapi alone would drop without a word.
    let typo = text.replace("readOnlyRootFilesystem:", "readOnlyRootFileSystem:");
    assert_ne!(typo, text);
    let bad = split_yaml(&typo);
    assert!(
        serde_json::from_value::<DaemonSet>(bad[0].clone()).is_ok(),
        "k8s-openapi itself accepts it"
    );
    let e = typed(&bad[0]).unwrap_err();
    assert!(
        e.contains("spec.template.spec.containers[0].securityContext.readOnlyRootFileSystem"),
        "the path is named: {e}"
    );
    // Deeper and in another kind: a misspelled key in a VAP rule.
    let mut vap = split_yaml(
        &std::fs::read_to_string(kustomize_dir().join("agent-admission-policy.yaml")).unwrap(),
    );
    vap[0]["spec"]["matchConstraints"]["resourceRules"][0]["operation"] = json!(["UPDATE"]);
    let e = typed(&vap[0]).unwrap_err();
    assert!(
        e.contains("spec.matchConstraints.resourceRules[0].operation"),
        "{e}"
    );
    // A wrong type is a plain deserialization error.
    let mut ds = good[0].clone();
    ds["spec"]["template"]["spec"]["hostPID"] = json!("yes");
    assert!(typed(&ds).unwrap_err().contains("does not deserialize"));
    // An unknown kind is refused rather than passed.
    assert!(
        typed(&json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}})).is_err()
    );
}

/// `deploy/namespace.yaml`, applied before either install: the namespace
/// every object lives in, at the Pod Security level the agent's pod needs.
#[test]
fn the_namespace_admits_the_agents_pod() {
    let docs = split_yaml(&std::fs::read_to_string(repo().join("deploy/namespace.yaml")).unwrap());
    assert_eq!(docs.len(), 1);
    typed(&docs[0]).unwrap();
    let ns: Namespace = serde_json::from_value(docs[0].clone()).unwrap();
    assert_eq!(ns.metadata.name.as_deref(), Some("lastgasp"));
    let labels = ns.metadata.labels.unwrap();
    assert_eq!(
        labels["pod-security.kubernetes.io/enforce"], "privileged",
        "hostPID, hostNetwork, hostPath and capabilities"
    );
    // Neither install holds it (Helm cannot own its release's namespace).
    assert!(source_objects().iter().all(|o| o["kind"] != "Namespace"));
}

// ------------------------------------------------------------ rendering

fn skip(test: &str, why: &str) {
    println!("SKIPPED {test}: {why}; `cargo xtask test` installs helm and kustomize and passes LASTGASP_HELM / LASTGASP_KUSTOMIZE");
}

#[test]
fn kustomize_renders_the_source_manifests() {
    let Some(k) = kustomize() else {
        return skip("kustomize_renders_the_source_manifests", "no kustomize");
    };
    let rendered = objects("kustomize build", &render_kustomize(&k));
    let source = objects("deploy/kustomize", &source_objects());
    assert_same(
        "deploy/kustomize files",
        &source,
        "kustomize build",
        &rendered,
    );
}

#[test]
fn kustomize_and_helm_render_the_same_objects() {
    let (Some(k), Some(h)) = (kustomize(), helm()) else {
        return skip(
            "kustomize_and_helm_render_the_same_objects",
            "no helm or kustomize",
        );
    };
    let kust = objects("kustomize build", &render_kustomize(&k));
    let helm = objects("helm template", &render_helm(&h, &[]));
    assert_same("kustomize build", &kust, "helm template", &helm);
    // podRemoval: evict, both ways.
    let kust = evict_objects("kustomize_and_helm_render_the_same_objects").unwrap();
    let helm = objects(
        "helm template --set agent.podRemoval=evict",
        &render_helm(&h, &["agent.podRemoval=evict"]),
    );
    assert_same(
        "the evict overlay",
        &kust,
        "helm --set agent.podRemoval=evict",
        &helm,
    );
    let evicts =
        |o: &BTreeMap<Key, Value>| o.values().any(|v| v.to_string().contains("pods/eviction"));
    assert!(evicts(&kust), "the evict variant grants pods/eviction");
    assert!(
        !evicts(&objects("kustomize build", &render_kustomize(&k))),
        "the default grants no pods/eviction"
    );
}

/// Helm alone can hash the config into the pod template (`checksum/config`,
/// so that `helm upgrade` rolls the agents when it changes) and knows the
/// release and the chart (the standard `helm.sh/chart` and
/// `app.kubernetes.io/{managed-by,instance,version}` labels): left out of
/// the comparison with kustomize. So are Helm's hooks (the uninstall's
/// `--lift-fences` Job: kustomize has no uninstall to hook).
fn without_helm_only(objs: &BTreeMap<Key, Value>) -> BTreeMap<Key, Value> {
    const HELM_LABELS: [&str; 4] = [
        "helm.sh/chart",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
    ];
    objs.iter()
        .filter(|(_, v)| v.pointer("/metadata/annotations/helm.sh~1hook").is_none())
        .map(|(k, v)| {
            let mut v = v.clone();
            if let Some(l) = v
                .pointer_mut("/metadata/labels")
                .and_then(Value::as_object_mut)
            {
                for h in HELM_LABELS {
                    l.remove(h);
                }
            }
            if let Some(a) = v
                .pointer_mut("/spec/template/metadata/annotations")
                .and_then(Value::as_object_mut)
            {
                a.remove("checksum/config");
                if a.is_empty() {
                    v["spec"]["template"]["metadata"]
                        .as_object_mut()
                        .unwrap()
                        .remove("annotations");
                }
            }
            (k.clone(), v)
        })
        .collect()
}

fn assert_same(an: &str, a: &BTreeMap<Key, Value>, bn: &str, b: &BTreeMap<Key, Value>) {
    let (a, b) = (&without_helm_only(a), &without_helm_only(b));
    let ka: BTreeSet<_> = a.keys().collect();
    let kb: BTreeSet<_> = b.keys().collect();
    assert_eq!(ka, kb, "{an} and {bn} render different objects");
    for (k, va) in a {
        let vb = &b[k];
        if va != vb {
            let mut d = Vec::new();
            diff(va, vb, "", &mut d);
            panic!("{k:?} differs between {an} and {bn}:\n{}", d.join("\n"));
        }
    }
}

fn diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys()).collect::<BTreeSet<_>>() {
                let p = format!("{path}.{k}");
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => diff(u, v, &p, out),
                    (u, v) => out.push(format!("  {p}: {u:?} vs {v:?}")),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                diff(u, v, &format!("{path}[{i}]"), out);
            }
        }
        (u, v) if u == v => {}
        (u, v) => out.push(format!("  {path}: {u} vs {v}")),
    }
}

/// The chart's one structural option: the grace periods from the node's
/// KubeletConfiguration, mounted read-only where the config says.
#[test]
fn helm_mounts_the_kubelets_config_to_check_its_shutdown_is_off() {
    let Some(h) = helm() else {
        return skip(
            "helm_mounts_the_kubelets_config_to_check_its_shutdown_is_off",
            "no helm",
        );
    };
    let path = "/var/lib/kubelet/config.yaml";
    let objs = objects(
        "helm template --set agent.kubeletConfigPath",
        &render_helm(&h, &[&format!("agent.kubeletConfigPath={path}")]),
    );
    let cm: ConfigMap = get(&objs, "ConfigMap", "lastgasp-agent");
    let text = cm.data.unwrap()["config.yaml"].clone();
    assert!(
        text.contains("\nshutdownGracePeriod: 30s"),
        "the agent's own grace periods stay: {text}"
    );
    // Parsed by the agent with a kubelet configuration standing in for the node's.
    let dir = std::env::temp_dir().join(format!("lastgasp-manifests-kcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kcfg = dir.join("config.yaml");
    std::fs::write(
        &kcfg,
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nshutdownGracePeriod: 30s\nshutdownGracePeriodCriticalPods: 10s\n",
    )
    .unwrap();
    let cfg = Config::parse(&text.replace(path, kcfg.to_str().unwrap()))
        .unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    assert_eq!(cfg.buckets().unwrap().len(), 2);
    assert!(
        cfg.kubelet_graceful_shutdown().unwrap().is_some(),
        "the kubelet's shutdownGracePeriod: 30s is found on"
    );
    std::fs::remove_dir_all(&dir).ok();
    let pod = agent_pod(&objs);
    let m = pod.containers[0]
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .find(|m| m.mount_path == path)
        .expect("mounted");
    assert_eq!(m.read_only, Some(true));
    let v = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == m.name)
        .unwrap()
        .host_path
        .unwrap();
    assert_eq!((v.path.as_str(), v.type_.as_deref()), (path, Some("File")));
}

// ------------------------------------------------- the agent's own parsers

fn agent_pod(objs: &BTreeMap<Key, Value>) -> PodSpec {
    let ds: DaemonSet = get(objs, "DaemonSet", "lastgasp-agent");
    ds.spec.template.spec.unwrap()
}

fn controller_pod(objs: &BTreeMap<Key, Value>) -> PodSpec {
    let d: Deployment = get(objs, "Deployment", "lastgasp-controller");
    d.spec.template.spec.unwrap()
}

/// A flag's value in an args list (`--flag value` or `--flag=value`).
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| {
        if a == name {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix(&format!("{name}=")).map(str::to_string)
        }
    })
}

/// The value of the container's environment variable `name`.
fn env_value(c: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<String> {
    c.env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

/// The environment variable clap reads for `--long` of the subcommand `A`.
fn env_of<A: clap::Args>(long: &str) -> Option<String> {
    A::augment_args(clap::Command::new("x"))
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
}

#[test]
fn check_exec_in_the_agents_pod_reads_the_settings_run_reads() {
    // `kubectl exec ds/lastgasp-agent -- lastgasp check`, as written: the
    // settings are environment, which run and check both read; none is an
    // argument of run's alone. (The chart renders the same DaemonSet: see
    // the kustomize/helm comparison.)
    {
        let dir = "deploy/kustomize";
        let objs = objects(dir, &source_objects());
        let pod = agent_pod(&objs);
        let c = &pod.containers[0];
        assert_eq!(
            c.args.clone().unwrap(),
            ["--json-logs", "run"],
            "{dir}: run's settings belong in env, where check finds them too"
        );
        for (long, want) in [
            ("config", "/etc/lastgasp/config.yaml"),
            ("logind-root", "/host"),
        ] {
            let var = env_of::<lastgasp::agent::RunArgs>(long).expect("run reads it from env");
            assert_eq!(
                env_of::<lastgasp::check::CheckArgs>(long).as_deref(),
                Some(var.as_str()),
                "check reads --{long} from the same variable"
            );
            assert_eq!(env_value(c, &var).as_deref(), Some(want), "{dir}: {var}");
        }
        let var = env_of::<lastgasp::agent::RunArgs>("shutdown-hook-dir").unwrap();
        assert_eq!(
            env_value(c, &var).as_deref(),
            Some("/host/usr/lib/systemd/system-shutdown"),
            "{dir}: {var}"
        );
    }
}

#[test]
fn the_config_map_parses_with_the_agents_config_and_fits_the_daemonset() {
    let objs = objects("deploy/kustomize", &source_objects());
    let cm: ConfigMap = get(&objs, "ConfigMap", "lastgasp-agent");
    let text = &cm.data.unwrap()["config.yaml"];
    let cfg = Config::parse(text).unwrap_or_else(|e| panic!("the ConfigMap's config.yaml: {e:#}"));
    assert_eq!(cfg.node_name, None, "the node's name comes from $NODE_NAME");
    assert_eq!(cfg.pod_removal, Removal::Delete);
    let pod = agent_pod(&objs);
    let c = &pod.containers[0];

    // The config file is in the ConfigMap's mount.
    let config_path = PathBuf::from(env_value(c, "LASTGASP_CONFIG").expect("LASTGASP_CONFIG"));
    let mounts = c.volume_mounts.clone().unwrap();
    let volumes = pod.volumes.clone().unwrap();
    let m = mounts
        .iter()
        .find(|m| config_path.starts_with(&m.mount_path))
        .expect("--config is mounted");
    let v = volumes.iter().find(|v| v.name == m.name).unwrap();
    assert_eq!(v.config_map.as_ref().unwrap().name, "lastgasp-agent");
    assert_eq!(config_path.file_name().unwrap(), "config.yaml");

    // auditDir is the host path, mounted at the same place.
    let m = mounts
        .iter()
        .find(|m| Path::new(&m.mount_path) == cfg.audit_dir)
        .expect("auditDir is mounted");
    let hp = volumes
        .iter()
        .find(|v| v.name == m.name)
        .unwrap()
        .host_path
        .clone()
        .expect("a hostPath");
    assert_eq!(
        (hp.path.as_str(), hp.type_.as_deref()),
        ("/var/lib/lastgasp", Some("DirectoryOrCreate"))
    );
    assert_ne!(m.read_only, Some(true));

    // The pod outlives a graceful run the agent may be in when SIGTERM comes.
    let total: i64 = cfg
        .buckets()
        .unwrap()
        .iter()
        .map(|b: &Bucket| b.seconds)
        .sum();
    let tgps = pod.termination_grace_period_seconds.unwrap();
    assert!(
        tgps > total,
        "terminationGracePeriodSeconds {tgps} must exceed the graceful path's {total}s"
    );

    // The downward API gives the names the code reads.
    let env: BTreeMap<String, String> = c
        .env
        .clone()
        .unwrap()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value_from?.field_ref?.field_path)))
        .collect();
    assert_eq!(env["NODE_NAME"], "spec.nodeName");
    assert_eq!(env["POD_NAME"], "metadata.name");
    assert_eq!(env["POD_NAMESPACE"], "metadata.namespace");
    assert_eq!(env["POD_IP"], "status.podIP");
}

/// The agent binary (`LASTGASP_BIN`, set by `cargo xtask test`), if built.
fn agent_bin() -> Option<PathBuf> {
    let p = lastgasp_tests::support::agent_bin();
    p.is_file().then_some(p)
}

/// Runs the container's args through the agent's own CLI (clap): with
/// `--help` appended, clap parses every argument before it (an unknown flag or
/// a bad value exits 2) and then prints the help and exits 0.
fn parses_with_the_cli(bin: &Path, c: &Container) {
    let env = [
        ("POD_IP", "10.0.0.7"),
        ("NODE_NAME", "n1"),
        ("POD_NAME", "p"),
        ("POD_NAMESPACE", "lastgasp"),
    ];
    let args: Vec<String> = c
        .args
        .clone()
        .unwrap()
        .into_iter()
        .map(|a| {
            env.iter()
                .fold(a, |a, (k, v)| a.replace(&format!("$({k})"), v))
        })
        .collect();
    assert!(c.command.is_none(), "the image's entrypoint is the agent");
    let out = Command::new(bin)
        .args(&args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "`lastgasp {}` does not parse:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn container_args_parse_with_the_agents_cli() {
    let Some(bin) = agent_bin() else {
        return println!("SKIPPED container_args_parse_with_the_agents_cli: no agent binary (cargo xtask test builds it and sets LASTGASP_BIN)");
    };
    let objs = objects("deploy/kustomize", &source_objects());
    for pod in [agent_pod(&objs), controller_pod(&objs)] {
        parses_with_the_cli(&bin, &pod.containers[0]);
    }
    // The chart's uninstall hook: `lastgasp controller ... --lift-fences`.
    if let Some(h) = helm() {
        let chart = objects("helm template", &render_helm(&h, &[]));
        let job: k8s_openapi::api::batch::v1::Job = get(&chart, "Job", "lastgasp-lift-fences");
        let spec = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("lastgasp-controller")
        );
        let c = &spec.containers[0];
        assert!(c
            .args
            .as_ref()
            .unwrap()
            .contains(&"--lift-fences".to_string()));
        parses_with_the_cli(&bin, c);
    }
    // `helm test`'s pod: `lastgasp check` with exactly the agent's spec.
    if let Some(h) = helm() {
        let chart = objects("helm template", &render_helm(&h, &[]));
        let test: Pod = get(&chart, "Pod", "lastgasp-test-check");
        let spec = test.spec.unwrap();
        parses_with_the_cli(&bin, &spec.containers[0]);
        assert_eq!(
            spec.containers[0].args.as_deref(),
            Some(&["check".to_string()][..])
        );
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let mut agent = agent_pod(&chart);
        let c = &mut agent.containers[0];
        // What differs: the subcommand, and no port (the agent on the same
        // node holds 9850 on the host network) and so no probes.
        (c.args, c.ports, c.readiness_probe, c.liveness_probe) =
            (Some(vec!["check".into()]), None, None, None);
        agent.restart_policy = Some("Never".into());
        assert_eq!(
            spec, agent,
            "the helm test pod's spec is the agent's, but for the above"
        );
        let off = objects("helm template", &render_helm(&h, &["tests.enabled=false"]));
        assert!(
            off.values().all(|v| v["kind"] != "Pod"),
            "tests.enabled=false still renders a test pod"
        );
    }
    // And a wrong flag is caught, so the check is real.
    let mut c = agent_pod(&objs).containers[0].clone();
    c.args.as_mut().unwrap().push("--no-such-flag".into());
    let out = Command::new(&bin)
        .args(c.args.unwrap())
        .arg("--help")
        .output()
        .unwrap();
    assert!(!out.status.success());
}

// ------------------------------------------------------------- privileges

#[test]
fn the_agent_runs_unprivileged_with_the_documented_capabilities() {
    let objs = objects("deploy/kustomize", &source_objects());
    let pod = agent_pod(&objs);
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tol = pod.tolerations.clone().unwrap();
    assert!(
        tol.iter().any(|t| t.operator.as_deref() == Some("Exists")
            && t.key.is_none()
            && t.effect.is_none()),
        "every taint is tolerated"
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("lastgasp-agent"));
    let c = &pod.containers[0];
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.run_as_user, Some(0));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.allow_privilege_escalation, None,
        "`false` is invalid with SYS_ADMIN"
    );
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    let add: BTreeSet<String> = caps.add.unwrap().into_iter().collect();
    assert_eq!(
        add,
        ["BPF", "PERFMON", "SYS_ADMIN", "SYS_PTRACE"]
            .map(String::from)
            .into()
    );
    let seccomp = pod.security_context.unwrap().seccomp_profile.unwrap();
    assert_eq!(seccomp.type_, "RuntimeDefault");

    // Host paths: what each mount is for is commented in the manifest.
    let volumes: BTreeMap<String, (String, Option<String>)> = pod
        .volumes
        .unwrap()
        .into_iter()
        .filter_map(|v| v.host_path.map(|h| (v.name, (h.path, h.type_))))
        .collect();
    let mounts: BTreeMap<String, (String, bool)> = c
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .filter(|m| volumes.contains_key(&m.name))
        .map(|m| {
            (
                volumes[&m.name].0.clone(),
                (m.mount_path, m.read_only == Some(true)),
            )
        })
        .collect();
    let want: BTreeMap<&str, (&str, bool)> = BTreeMap::from([
        ("/var/lib/lastgasp", ("/var/lib/lastgasp", false)),
        ("/run/dbus", ("/run/dbus", false)),
        ("/sys/kernel/btf", ("/sys/kernel/btf", true)),
        ("/sys/kernel/tracing", ("/sys/kernel/tracing", true)),
        ("/etc/systemd", ("/host/etc/systemd", true)),
        (
            "/etc/systemd/logind.conf.d",
            ("/host/etc/systemd/logind.conf.d", false),
        ),
        ("/run/systemd", ("/host/run/systemd", true)),
        ("/usr/lib/systemd", ("/host/usr/lib/systemd", true)),
        (
            "/usr/lib/systemd/system-shutdown",
            ("/host/usr/lib/systemd/system-shutdown", false),
        ),
        ("/run/lastgasp", ("/run/lastgasp", false)),
    ]);
    let got: BTreeMap<&str, (&str, bool)> = mounts
        .iter()
        .map(|(h, (m, ro))| (h.as_str(), (m.as_str(), *ro)))
        .collect();
    assert_eq!(got, want);
    // The drop-in lands where logind reads it: the logind root + etc/systemd/logind.conf.d.
    // The hook lands in systemd-shutdown's directory, the FIFO in the shared run dir.
    assert_eq!(
        env_value(c, "LASTGASP_SHUTDOWN_HOOK_DIR").as_deref(),
        Some("/host/usr/lib/systemd/system-shutdown")
    );
    let root = env_value(c, "LASTGASP_LOGIND_ROOT").expect("LASTGASP_LOGIND_ROOT");
    assert_eq!(
        lastgasp::detect::logind::config::dropin_path(Path::new(&root)),
        Path::new("/host/etc/systemd/logind.conf.d/99-lastgasp.conf")
    );
    // Probes on the metrics port, which is the cluster-mode default.
    let port = c
        .ports
        .clone()
        .unwrap()
        .into_iter()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap();
    assert_eq!(port.container_port, 9850);
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.clone().unwrap().http_get.unwrap().path.unwrap()
    };
    assert_eq!(probe_path(&c.readiness_probe), "/readyz");
    assert_eq!(probe_path(&c.liveness_probe), "/healthz");

    // The controller: non-root, read-only, no capabilities at all.
    let pod = controller_pod(&objs);
    let psc = pod.security_context.clone().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    let sc = pod.containers[0].security_context.clone().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_string()]));
    let d: Deployment = get(&objs, "Deployment", "lastgasp-controller");
    assert_eq!(d.spec.replicas, Some(2));
}

// ------------------------------------------------------------------ RBAC

/// One API request as RBAC sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Attr {
    group: String,
    /// `resource` or `resource/subresource`.
    resource: String,
    verb: String,
    namespace: String,
    name: String,
}

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

/// A rule as granted to a subject: from a ClusterRole through a
/// ClusterRoleBinding (any namespace), or from a Role (its namespace).
#[derive(Debug, Clone)]
struct Grant {
    rule: PolicyRule,
    namespace: Option<String>,
}

fn covers(list: &[String], x: &str) -> bool {
    list.iter().any(|v| v == "*" || v == x)
}

impl Grant {
    fn allows(&self, a: &Attr) -> bool {
        let r = &self.rule;
        self.namespace.as_ref().is_none_or(|ns| *ns == a.namespace)
            && covers(r.api_groups.as_deref().unwrap_or_default(), &a.group)
            && covers(r.resources.as_deref().unwrap_or_default(), &a.resource)
            && covers(&r.verbs, &a.verb)
            && r.resource_names
                .as_ref()
                .is_none_or(|n| n.is_empty() || n.contains(&a.name))
    }

    /// (group, resource, verb) triples this rule grants.
    fn triples(&self) -> Vec<(String, String, String)> {
        let r = &self.rule;
        assert!(
            r.non_resource_urls.is_none(),
            "no non-resource URLs are used"
        );
        let mut out = Vec::new();
        for g in r.api_groups.as_deref().unwrap_or_default() {
            for res in r.resources.as_deref().unwrap_or_default() {
                for v in &r.verbs {
                    assert!(g != "*" && res != "*" && v != "*", "no wildcards: {r:?}");
                    out.push((g.clone(), res.clone(), v.clone()));
                }
            }
        }
        out
    }
}

/// Everything the manifests grant the ServiceAccount `ns/name`.
fn grants(objs: &BTreeMap<Key, Value>, ns: &str, sa: &str) -> Vec<Grant> {
    let is_sa = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(ns)
        })
    };
    let mut out = Vec::new();
    for b in all::<ClusterRoleBinding>(objs, "ClusterRoleBinding")
        .into_iter()
        .filter(|b| is_sa(&b.subjects))
    {
        assert_eq!(b.role_ref.kind, "ClusterRole");
        let role: ClusterRole = get(objs, "ClusterRole", &b.role_ref.name);
        out.extend(
            role.rules
                .unwrap_or_default()
                .into_iter()
                .map(|rule| Grant {
                    rule,
                    namespace: None,
                }),
        );
    }
    for b in all::<RoleBinding>(objs, "RoleBinding")
        .into_iter()
        .filter(|b| is_sa(&b.subjects))
    {
        let bns = b.metadata.namespace.clone().unwrap();
        let rules = match b.role_ref.kind.as_str() {
            "Role" => {
                let role: Role = get(objs, "Role", &b.role_ref.name);
                assert_eq!(role.metadata.namespace.as_deref(), Some(bns.as_str()));
                role.rules.unwrap_or_default()
            }
            _ => get::<ClusterRole>(objs, "ClusterRole", &b.role_ref.name)
                .rules
                .unwrap_or_default(),
        };
        out.extend(rules.into_iter().map(|rule| Grant {
            rule,
            namespace: Some(bns.clone()),
        }));
    }
    out
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
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}
    })
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
            ..Default::default()
        }),
        sender: None,
        at: SystemTime::now(),
        boot_ns: 0,
        deadline: (!forced).then(|| SystemTime::now() + Duration::from_secs(30)),
        detail: if forced {
            Detail::Exec {
                path: "/sbin/poweroff".into(),
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
        "a grace-0 delete"
    );
    assert_rbac_exact("controller", &grants, &requests);
}

// ----------------------------------------------------- the admission fence

/// The policy judges exactly the agent's ServiceAccount, and every write its
/// RBAC allows is fenced, but for pods/eviction (documented in the policy:
/// admission cannot see an evicted pod's node).
#[test]
fn the_admission_policy_fences_every_write_the_agent_may_make() {
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = agent_pod(&objs).service_account_name.unwrap();
    let vap: ValidatingAdmissionPolicy = get(
        &objs,
        "ValidatingAdmissionPolicy",
        "lastgasp-agent-own-node",
    );
    let binding: ValidatingAdmissionPolicyBinding = get(
        &objs,
        "ValidatingAdmissionPolicyBinding",
        "lastgasp-agent-own-node",
    );
    let bspec = binding.spec;
    assert_eq!(bspec.policy_name, "lastgasp-agent-own-node");
    assert_eq!(bspec.validation_actions, vec!["Deny".to_string()]);
    let spec = vap.spec.unwrap();
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let mc = spec.match_conditions.unwrap();
    assert_eq!(mc.len(), 1);
    assert_eq!(
        mc[0].expression,
        format!("request.userInfo.username == 'system:serviceaccount:lastgasp:{sa}'")
    );
    let claim = "request.userInfo.extra['authentication.kubernetes.io/node-name']";
    let vars = spec.variables.unwrap();
    assert!(vars
        .iter()
        .any(|v| v.name == "nodeName" && v.expression.contains(claim)));
    let validations = spec.validations.unwrap();
    assert!(
        validations[0]
            .expression
            .contains("variables.nodeName != ''"),
        "a missing claim denies first"
    );

    // (group, resource, operation) the policy sees.
    let mut fenced = BTreeSet::new();
    for r in spec.match_constraints.unwrap().resource_rules.unwrap() {
        for g in r.api_groups.unwrap() {
            for res in r.resources.clone().unwrap() {
                for op in r.operations.clone().unwrap() {
                    fenced.insert((g.clone(), res.clone(), op));
                }
            }
        }
    }
    // RBAC verbs as admission operations (PATCH and PUT are UPDATE).
    let op = |verb: &str| match verb {
        "create" => Some("CREATE"),
        "update" | "patch" => Some("UPDATE"),
        "delete" | "deletecollection" => Some("DELETE"),
        _ => None,
    };
    let unfenced = |objs: &BTreeMap<Key, Value>| {
        let mut out = BTreeSet::new();
        for g in grants(objs, "lastgasp", &sa) {
            for (group, res, verb) in g.triples() {
                if let Some(o) = op(&verb) {
                    if !fenced.contains(&(group.clone(), res.clone(), o.to_string())) {
                        out.insert(format!("{group}/{res} {verb}"));
                    }
                }
            }
        }
        out
    };
    assert_eq!(
        unfenced(&objs),
        BTreeSet::new(),
        "the default: every write fenced"
    );
    if let Some(evict) = evict_objects("the_admission_policy_fences_every_write_the_agent_may_make")
    {
        assert_eq!(
            unfenced(&evict),
            BTreeSet::from(["/pods/eviction create".to_string()]),
            "podRemoval: evict adds the one write admission cannot fence"
        );
    }
}

/// `lastgasp check` asks the API server (SelfSubjectAccessReview) for the
/// permissions it believes the agent needs: the same set as the ClusterRole.
#[test]
fn the_preflight_checks_exactly_the_agents_rbac() {
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = agent_pod(&objs).service_account_name.unwrap();
    let granted: BTreeSet<(String, String, String)> = grants(&objs, "lastgasp", &sa)
        .iter()
        .flat_map(Grant::triples)
        .collect();
    let checked: BTreeSet<(String, String, String)> = lastgasp::check::PERMISSIONS
        .iter()
        .filter(|(_, _, _, sub, _, _)| *sub != "eviction")
        .map(|(verb, group, res, sub, _, _)| {
            let res = if sub.is_empty() {
                res.to_string()
            } else {
                format!("{res}/{sub}")
            };
            (group.to_string(), res, verb.to_string())
        })
        .collect();
    assert_eq!(
        checked, granted,
        "lastgasp check's PERMISSIONS (without podRemoval: evict) and the agent's ClusterRole differ"
    );
    if let Some(evict) = evict_objects("the_preflight_checks_exactly_the_agents_rbac") {
        let granted: BTreeSet<(String, String, String)> = grants(&evict, "lastgasp", &sa)
            .iter()
            .flat_map(Grant::triples)
            .collect();
        let all: BTreeSet<(String, String, String)> = lastgasp::check::PERMISSIONS
            .iter()
            .map(|(verb, group, res, sub, _, _)| {
                let res = if sub.is_empty() {
                    res.to_string()
                } else {
                    format!("{res}/{sub}")
                };
                (group.to_string(), res, verb.to_string())
            })
            .collect();
        assert_eq!(all, granted, "with podRemoval: evict");
    }
}

/// What the policy decides for one request: None = allowed (or not judged),
/// Some(message) = denied. Follows the apiserver's order: matchConditions
/// (any false: not judged), then the variables, then each validation; an
/// evaluation error denies (failurePolicy: Fail). Evaluated with cel-rust;
/// the apiserver uses cel-go with Kubernetes' extra libraries, which these
/// expressions do not need (core CEL only: has, in, size, ?:, +, ==).
fn admit(
    vap: &ValidatingAdmissionPolicy,
    request: &Value,
    object: &Value,
    old: &Value,
) -> Option<String> {
    let spec = vap.spec.clone().unwrap();
    let eval = |expr: &str, vars: &Value| -> Result<cel::Value, String> {
        let mut ctx = cel::Context::default();
        ctx.add_variable("request", request.clone()).unwrap();
        ctx.add_variable("object", object.clone()).unwrap();
        ctx.add_variable("oldObject", old.clone()).unwrap();
        ctx.add_variable("variables", vars.clone()).unwrap();
        let program = cel::Program::compile(expr).map_err(|e| format!("{expr}: {e}"))?;
        program.execute(&ctx).map_err(|e| format!("{expr}: {e}"))
    };
    let fail = spec.failure_policy.as_deref() == Some("Fail");
    let mut vars = json!({});
    for mc in spec.match_conditions.unwrap_or_default() {
        match eval(&mc.expression, &vars) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => return None,
            other if fail => return Some(format!("matchCondition {}: {other:?}", mc.name)),
            _ => return None,
        }
    }
    for v in spec.variables.unwrap_or_default() {
        let value = match eval(&v.expression, &vars) {
            Ok(cel::Value::String(s)) => json!(s.as_str()),
            Ok(cel::Value::Bool(b)) => json!(b),
            other => return Some(format!("variable {}: {other:?}", v.name)),
        };
        vars[v.name.as_str()] = value;
    }
    for val in spec.validations.unwrap_or_default() {
        match eval(&val.expression, &vars) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => {
                let msg = match &val.message_expression {
                    Some(m) => match eval(m, &vars) {
                        Ok(cel::Value::String(s)) => s.to_string(),
                        other => panic!("messageExpression {m}: {other:?}"),
                    },
                    None => val
                        .message
                        .clone()
                        .unwrap_or_else(|| format!("failed expression: {}", val.expression)),
                };
                return Some(msg);
            }
            other => return Some(format!("error: {other:?}")),
        }
    }
    None
}

/// An AdmissionRequest as the policy sees it: `what` is (operation, group,
/// resource, subresource), `object` (namespace, name).
fn request(
    user: &str,
    node_claim: Option<Vec<&str>>,
    what: [&str; 4],
    object: (&str, &str),
) -> Value {
    let [op, group, resource, sub] = what;
    let (ns, name) = object;
    let mut user_info =
        json!({"username": user, "groups": ["system:serviceaccounts", "system:authenticated"]});
    if let Some(n) = node_claim {
        user_info["extra"] = json!({
            "authentication.kubernetes.io/node-name": n,
            "authentication.kubernetes.io/pod-name": ["lastgasp-agent-x"],
        });
    }
    // As the API server builds it: an empty subresource is left out.
    let mut req = json!({
        "operation": op, "userInfo": user_info,
        "resource": {"group": group, "version": "v1", "resource": resource},
        "namespace": ns, "name": name,
    });
    if !sub.is_empty() {
        req["subResource"] = json!(sub);
    }
    req
}

#[test]
fn the_admission_policy_lets_an_agent_write_only_its_own_node() {
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = format!(
        "system:serviceaccount:lastgasp:{}",
        agent_pod(&objs).service_account_name.unwrap()
    );
    let vap: ValidatingAdmissionPolicy = get(
        &objs,
        "ValidatingAdmissionPolicy",
        "lastgasp-agent-own-node",
    );
    let n1 = Some(vec!["n1"]);
    let node = |name: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    let pod_on = |node: Option<&str>| {
        let mut p = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": []}});
        if let Some(n) = node {
            p["spec"]["nodeName"] = json!(n);
        }
        p
    };
    let event = |kind: &str, name: &str| {
        json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e", "namespace": "default"},
               "regarding": {"kind": kind, "name": name}, "reason": "NodeShutdown"})
    };
    let null = Value::Null;
    let allowed = |r: &Value, o: &Value, old: &Value| {
        let d = admit(&vap, r, o, old);
        assert!(d.is_none(), "denied: {d:?} for {r}");
    };
    let denied = |r: &Value, o: &Value, old: &Value, why: &str| {
        let d = admit(&vap, r, o, old).unwrap_or_else(|| panic!("allowed: {r}"));
        assert!(d.contains(why), "{d:?} should say {why:?}");
    };

    // Its own Node, both the object and the status (a PATCH is an UPDATE).
    allowed(
        &request(&sa, n1.clone(), ["UPDATE", "", "nodes", ""], ("", "n1")),
        &node("n1"),
        &node("n1"),
    );
    allowed(
        &request(
            &sa,
            n1.clone(),
            ["UPDATE", "", "nodes", "status"],
            ("", "n1"),
        ),
        &node("n1"),
        &node("n1"),
    );
    // Another node's.
    for sub in ["", "status"] {
        denied(
            &request(&sa, n1.clone(), ["UPDATE", "", "nodes", sub], ("", "n2")),
            &node("n2"),
            &node("n2"),
            "the agent on node n1 may only change its own Node, not n2",
        );
    }
    // No claim (a legacy token, a token not bound to a pod), or a garbled one.
    for claim in [None, Some(vec![]), Some(vec!["n1", "n2"]), Some(vec![""])] {
        denied(
            &request(&sa, claim, ["UPDATE", "", "nodes", ""], ("", "n1")),
            &node("n1"),
            &node("n1"),
            "no node-name claim",
        );
    }
    // Pods: only those bound to its node.
    allowed(
        &request(
            &sa,
            n1.clone(),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(Some("n1")),
    );
    denied(
        &request(
            &sa,
            n1.clone(),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(Some("n2")),
        "may only delete pods bound to that node, not default/p",
    );
    denied(
        &request(
            &sa,
            n1.clone(),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(None),
        "may only delete pods bound",
    );
    // Events: only about its own Node, created or (a repeat) patched.
    for op in ["CREATE", "UPDATE"] {
        let r = request(
            &sa,
            n1.clone(),
            [op, "events.k8s.io", "events", ""],
            ("default", "e"),
        );
        allowed(&r, &event("Node", "n1"), &null);
        denied(
            &r,
            &event("Node", "n2"),
            &null,
            "may only report Events about its own Node",
        );
        denied(
            &r,
            &event("Pod", "n1"),
            &null,
            "may only report Events about its own Node",
        );
    }
    // Anyone else is not judged at all (the controller patches every node).
    let other = "system:serviceaccount:lastgasp:lastgasp-controller";
    allowed(
        &request(other, None, ["UPDATE", "", "nodes", ""], ("", "n2")),
        &node("n2"),
        &node("n2"),
    );
    allowed(
        &request(
            "system:node:n2",
            Some(vec!["n2"]),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(Some("n1")),
    );
}

/// On its own Node the agent may change only its own marks: its taint, its
/// record annotation, its condition. Everything else the policy denies.
#[test]
fn the_admission_policy_keeps_the_agent_to_its_own_marks() {
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = format!(
        "system:serviceaccount:lastgasp:{}",
        agent_pod(&objs).service_account_name.unwrap()
    );
    let vap: ValidatingAdmissionPolicy = get(
        &objs,
        "ValidatingAdmissionPolicy",
        "lastgasp-agent-own-node",
    );
    let old = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1", "labels": {"role": "db"},
                     "annotations": {"other.io/a": "1", "lastgasp.dev/last-shutdown": "{}"}},
        "spec": {"podCIDR": "10.0.0.0/24",
                 "taints": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]},
        "status": {"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "ShutdownInProgress", "status": "False"}],
            "nodeInfo": {"bootID": "b1"}}
    });
    let main = request(
        &sa,
        Some(vec!["n1"]),
        ["UPDATE", "", "nodes", ""],
        ("", "n1"),
    );
    let status = request(
        &sa,
        Some(vec!["n1"]),
        ["UPDATE", "", "nodes", "status"],
        ("", "n1"),
    );
    let changed = |f: &dyn Fn(&mut Value)| {
        let mut n = old.clone();
        f(&mut n);
        n
    };
    let allowed = |r: &Value, o: &Value| {
        let d = admit(&vap, r, o, &old);
        assert!(d.is_none(), "denied: {d:?} for {o}");
    };
    let denied = |r: &Value, o: &Value, why: &str| {
        let d = admit(&vap, r, o, &old).unwrap_or_else(|| panic!("allowed: {o}"));
        assert!(d.contains(why), "{d:?} should say {why:?}");
    };
    // Its own taint and record: allowed (added, changed, removed).
    allowed(
        &main,
        &changed(&|n| {
            n["spec"]["taints"].as_array_mut().unwrap().push(json!(
                {"key": "lastgasp.dev/shutting-down", "value": "true", "effect": "NoSchedule"}));
        }),
    );
    allowed(
        &main,
        &changed(&|n| {
            n["metadata"]["annotations"]["lastgasp.dev/last-shutdown"] = json!("{\"back\":true}");
        }),
    );
    allowed(&main, &old);
    // Its own condition: allowed.
    allowed(
        &status,
        &changed(&|n| n["status"]["conditions"][1]["status"] = json!("True")),
    );
    // A label change, spec.unschedulable, another taint removed or changed,
    // another annotation, a finalizer: denied.
    denied(
        &main,
        &changed(&|n| n["metadata"]["labels"]["role"] = json!("web")),
        "labels",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["labels"].as_object_mut().unwrap().clear()),
        "labels",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["unschedulable"] = json!(true)),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["podCIDR"] = json!("10.9.0.0/24")),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["taints"] = json!([])),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["taints"][0]["effect"] = json!("PreferNoSchedule")),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["annotations"]["other.io/a"] = json!("2")),
        "its own annotation",
    );
    denied(
        &main,
        &changed(&|n| {
            n["metadata"]["annotations"]
                .as_object_mut()
                .unwrap()
                .remove("other.io/a");
        }),
        "its own annotation",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["annotations"]["lastgasp.dev/other"] = json!("x")),
        "its own annotation",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["finalizers"] = json!(["x.io/hold"])),
        "finalizers",
    );
    // The kubelet's condition, or another status field: denied.
    denied(
        &status,
        &changed(&|n| n["status"]["conditions"][0]["status"] = json!("False")),
        "its own condition",
    );
    denied(
        &status,
        &changed(&|n| n["status"]["nodeInfo"]["bootID"] = json!("b2")),
        "its own condition",
    );
}

/// The chart's knobs: each value set changes what it says and nothing else
/// breaks the strict parse.
/// The API Priority and Fairness objects: on by default in both installs,
/// off with the overlay and the Helm value (nothing else changes); the
/// agent's FlowSchema takes exactly its last-gasp writes (Node, its status,
/// Events) into one FIFO queue of its own level, never lent; the
/// controller's takes all it asks; the values size them.
#[test]
fn flow_control_is_on_by_default_and_off_by_a_switch() {
    let (Some(k), Some(h)) = (kustomize(), helm()) else {
        return skip(
            "flow_control_is_on_by_default_and_off_by_a_switch",
            "no helm or kustomize",
        );
    };
    let is_apf = |k: &Key| k.0.starts_with("flowcontrol.apiserver.k8s.io/");
    let base = objects("kustomize build", &render_kustomize(&k));
    let apf: Vec<&Key> = base.keys().filter(|k| is_apf(k)).collect();
    assert_eq!(apf.len(), 4, "{apf:?}");
    let off = objects(
        "kustomize build deploy/overlays/no-flowcontrol",
        &render_kustomize_dir(&k, &repo().join("deploy/overlays/no-flowcontrol")),
    );
    let without: BTreeMap<Key, Value> = base
        .iter()
        .filter(|(k, _)| !is_apf(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_same("the base without APF", &without, "no-flowcontrol", &off);
    let helm_off = objects(
        "helm template --set flowControl.enabled=false",
        &render_helm(&h, &["flowControl.enabled=false"]),
    );
    assert_same(
        "no-flowcontrol",
        &off,
        "helm --set flowControl.enabled=false",
        &without_helm_only(&helm_off),
    );
    let fs: k8s_openapi::api::flowcontrol::v1::FlowSchema =
        get(&base, "FlowSchema", "lastgasp-agent-evidence");
    let spec = fs.spec;
    assert_eq!(spec.priority_level_configuration.name, "lastgasp-evidence");
    // Before `service-accounts` (9000), where the agent falls otherwise.
    assert!(spec.matching_precedence.unwrap() < 9000);
    let rule = &spec.rules.unwrap()[0];
    let subject = rule.subjects[0].service_account.as_ref().unwrap();
    assert_eq!(
        (subject.namespace.as_str(), subject.name.as_str()),
        ("lastgasp", "lastgasp-agent")
    );
    let writes: Vec<(Vec<String>, Vec<String>, Vec<String>)> = rule
        .resource_rules
        .as_ref()
        .unwrap()
        .iter()
        .map(|r| (r.api_groups.clone(), r.resources.clone(), r.verbs.clone()))
        .collect();
    let v = |x: &[&str]| {
        x.iter()
            .map(std::string::ToString::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        writes,
        [
            (v(&[""]), v(&["nodes", "nodes/status"]), v(&["patch"])),
            (
                v(&["events.k8s.io"]),
                v(&["events"]),
                v(&["create", "patch"])
            ),
        ],
        "the last gasp's writes only: no reads, no pod deletions"
    );
    assert!(rule.non_resource_rules.is_none());
    let pl: k8s_openapi::api::flowcontrol::v1::PriorityLevelConfiguration =
        get(&base, "PriorityLevelConfiguration", "lastgasp-evidence");
    let limited = pl.spec.limited.unwrap();
    assert_eq!(
        limited.lendable_percent,
        Some(0),
        "its seats are there when the burst comes"
    );
    let q = limited.limit_response.queuing.unwrap();
    assert_eq!(
        (q.queues, q.hand_size),
        (Some(1), Some(1)),
        "one FIFO queue"
    );
    assert_eq!(q.queue_length_limit, Some(2000));
    let ctl: k8s_openapi::api::flowcontrol::v1::FlowSchema =
        get(&base, "FlowSchema", "lastgasp-controller");
    let ctl = ctl.spec;
    assert_eq!(ctl.priority_level_configuration.name, "lastgasp-controller");
    assert_eq!(
        ctl.rules.unwrap()[0].subjects[0]
            .service_account
            .as_ref()
            .unwrap()
            .name,
        "lastgasp-controller"
    );
    // The values size the level.
    let sized = render_helm(
        &h,
        &[
            "flowControl.evidence.queueLengthLimit=10000",
            "flowControl.evidence.nominalConcurrencyShares=20",
        ],
    );
    let pl = sized
        .iter()
        .find(|o| {
            o["kind"] == "PriorityLevelConfiguration"
                && o["metadata"]["name"] == "lastgasp-evidence"
        })
        .unwrap();
    assert_eq!(pl["spec"]["limited"]["nominalConcurrencyShares"], 20);
    assert_eq!(
        pl["spec"]["limited"]["limitResponse"]["queuing"]["queueLengthLimit"],
        10000
    );
}

#[test]
fn the_charts_values_take_effect() {
    let Some(h) = helm() else {
        return skip("the_charts_values_take_effect", "no helm");
    };
    let render = |set: &[&str]| -> Vec<Value> { render_helm(&h, set) };
    let find = |objs: &[Value], kind: &str, name: &str| -> Value {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    let ds = |objs: &[Value]| find(objs, "DaemonSet", "lastgasp-agent");
    let default = render(&[]);
    // The controller's policy and ceiling.
    let ctl_args = |objs: &[Value]| {
        find(objs, "Deployment", "lastgasp-controller")["spec"]["template"]["spec"]["containers"][0]
            ["args"]
            .clone()
    };
    let flag_of = |args: &Value, f: &str| {
        let a = args.as_array().unwrap();
        a.iter()
            .position(|x| x == f)
            .map(|i| a[i + 1].as_str().unwrap().to_string())
    };
    let a = ctl_args(&default);
    assert_eq!(flag_of(&a, "--policy").as_deref(), Some("poweroff-only"));
    assert_eq!(flag_of(&a, "--max-fenced").as_deref(), Some("0"));
    let a = ctl_args(&render(&[
        "controller.policy=observe",
        "controller.maxFenced=3",
    ]));
    assert_eq!(flag_of(&a, "--policy").as_deref(), Some("observe"));
    assert_eq!(flag_of(&a, "--max-fenced").as_deref(), Some("3"));
    let d = ds(&default);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"], json!({"kubernetes.io/os": "linux"}));
    assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    let checksum = d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(checksum.len(), 64, "a sha256 of the config");
    // A changed config changes the checksum: `helm upgrade` rolls the agents.
    let other = ds(&render(&["agent.shutdownGracePeriod=40s"]));
    assert_ne!(
        other["spec"]["template"]["metadata"]["annotations"]["checksum/config"],
        json!(checksum)
    );
    let set = render(&[
        "agent.nodeSelector.pool=batch",
        "agent.tolerations[0].key=x",
        "agent.tolerations[0].operator=Exists",
        "agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "agent.priorityClassName=high",
        "agent.updateStrategy.rollingUpdate.maxUnavailable=10%",
        "agent.podAnnotations.team=infra",
        "agent.extraArgs[0]=--metrics-listen",
        "agent.extraArgs[1]=off",
        "agent.extraEnv[0].name=RUST_LOG",
        "agent.extraEnv[0].value=debug",
        "imagePullSecrets[0].name=regcred",
        "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "controller.pdb.enabled=false",
        "controller.nodeSelector.pool=system",
        "podMonitor.enabled=true",
    ]);
    let d = ds(&set);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        json!({"kubernetes.io/os": "linux", "pool": "batch"}),
        "--set merges into the default"
    );
    assert_eq!(pod["tolerations"][0]["key"], "x");
    assert!(pod["affinity"]["nodeAffinity"].is_object());
    assert_eq!(pod["priorityClassName"], "high");
    assert_eq!(
        d["spec"]["updateStrategy"],
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}})
    );
    assert_eq!(
        d["spec"]["template"]["metadata"]["annotations"]["team"],
        "infra"
    );
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(&args[args.len() - 2..], ["--metrics-listen", "off"]);
    assert!(c["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "RUST_LOG" && e["value"] == "debug"));
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "regcred"}]));
    assert!(
        c["image"].as_str().unwrap().starts_with("lastgasp@sha256:"),
        "{}",
        c["image"]
    );
    let ctl = find(&set, "Deployment", "lastgasp-controller");
    assert_eq!(
        ctl["spec"]["template"]["spec"]["nodeSelector"],
        json!({"pool": "system"})
    );
    assert_eq!(
        ctl["spec"]["template"]["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}])
    );
    assert!(
        !set.iter().any(|o| o["kind"] == "PodDisruptionBudget"),
        "controller.pdb.enabled=false"
    );
    assert!(default.iter().any(|o| o["kind"] == "PodDisruptionBudget"));
    let pm = find(&set, "PodMonitor", "lastgasp-agent");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    assert!(!default.iter().any(|o| o["kind"] == "PodMonitor"), "opt-in");
    // The standard labels, on every object Helm renders.
    for o in &default {
        assert_eq!(
            o["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm",
            "{}",
            o["kind"]
        );
        assert!(o["metadata"]["labels"]["helm.sh/chart"]
            .as_str()
            .is_some_and(|c| c.starts_with("lastgasp-")));
    }
    // nameOverride renames every object, and the admission policy follows
    // the agent's ServiceAccount.
    let renamed = render(&["nameOverride=shutdown"]);
    assert!(
        renamed.iter().all(|o| o["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("shutdown")),
        "every name"
    );
    let vap = find(
        &renamed,
        "ValidatingAdmissionPolicy",
        "shutdown-agent-own-node",
    );
    assert!(vap["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap()
        .contains("system:serviceaccount:lastgasp:shutdown-agent"));
    // rbac.create / serviceAccount.create off: those objects are the user's.
    let bare = render(&["rbac.create=false", "serviceAccount.create=false"]);
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ] {
        assert!(!bare.iter().any(|o| o["kind"] == kind), "{kind} rendered");
    }
    // Everything but the PodMonitor (a CRD) parses strictly.
    let typed: Vec<Value> = set
        .into_iter()
        .filter(|o| o["kind"] != "PodMonitor")
        .collect();
    objects("helm template with every value set", &typed);
}

/// The config's field names, as its parser knows them (serde's
/// deny_unknown_fields error lists every one).
fn config_fields() -> BTreeSet<String> {
    let err = format!("{:#}", Config::parse("noSuchField: 1").unwrap_err());
    let fields: BTreeSet<String> = err
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|f| *f != "noSuchField")
        .map(str::to_string)
        .collect();
    assert!(fields.contains("podRemoval"), "{err}");
    fields
}

#[test]
fn the_values_schema_covers_every_config_field_and_refuses_a_typo() {
    let Some(h) = helm() else {
        return skip(
            "the_values_schema_covers_every_config_field_and_refuses_a_typo",
            "no helm",
        );
    };
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(lastgasp_tests::render::chart_dir().join("values.schema.json"))
            .unwrap(),
    )
    .unwrap();
    let agent = &schema["properties"]["agent"]["properties"];
    // Every field the agent reads is settable: its own value, agent.config,
    // or fixed by the DaemonSet (the audit dir's host path, $NODE_NAME).
    let mut settable: BTreeSet<String> = agent["config"]["properties"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    for own in [
        "podRemoval",
        "shutdownGracePeriod",
        "shutdownGracePeriodCriticalPods",
        "kubeletConfigPath",
    ] {
        assert!(agent.get(own).is_some(), "agent.{own} in the schema");
        assert!(settable.insert(own.into()), "{own} settable twice");
    }
    settable.extend(["auditDir".to_string(), "nodeName".to_string()]);
    assert_eq!(
        settable,
        config_fields(),
        "the schema and the config's fields"
    );
    assert_eq!(agent["config"]["additionalProperties"], false);

    // Every agent.config field, set, renders a config the agent accepts.
    let set = [
        "agent.config.ignoreDaemonSets=true",
        "agent.config.excludeNamespaces={kube-system,monitoring}",
        "agent.config.excludePodLabels.keep=yes",
        "agent.config.shutdownGracePeriodByPodPriority[0].priority=0",
        "agent.config.shutdownGracePeriodByPodPriority[0].shutdownGracePeriodSeconds=20",
        "agent.config.shutdownGracePeriodByPodPriority[1].priority=100000",
        "agent.config.shutdownGracePeriodByPodPriority[1].shutdownGracePeriodSeconds=10",
        "agent.config.trust.pendingExpiry=90s",
        "agent.config.apiServer.endpoint=https://10.0.0.10:6443",
        "agent.config.auditMaxFileMiB=32",
        "agent.config.auditFiles=8",
        "agent.shutdownGracePeriod=",
        "agent.shutdownGracePeriodCriticalPods=",
    ];
    // A by-priority list excludes the two grace periods (the kubelet's
    // rule): the schema lets them be emptied, the agent's parser decides.
    // render_helm panics with helm's stderr if the schema refuses any.
    let objs = objects("helm template --set agent.config.*", &render_helm(&h, &set));
    let cm: ConfigMap = get(&objs, "ConfigMap", "lastgasp-agent");
    let yaml = &cm.data.unwrap()["config.yaml"];
    let cfg = Config::parse(yaml).unwrap_or_else(|e| panic!("{e:#}\n{yaml}"));
    assert!(cfg.ignore_daemon_sets);
    assert_eq!(cfg.exclude_namespaces, ["kube-system", "monitoring"]);
    assert_eq!(cfg.audit_max_file_mib, 32);
    assert_eq!(cfg.audit_files, 8);
    assert_eq!(cfg.trust.pending_expiry, Duration::from_secs(90));
    assert_eq!(
        cfg.api_server.endpoint.as_deref(),
        Some("https://10.0.0.10:6443")
    );

    // Typos and wrong types fail at `helm template`, before anything is applied.
    for bad in [
        "agent.config.ignoreDaemonSet=true",
        "agent.config.auditFiles=many",
        "agent.podRemoval=drain",
        "controller.policy=poweroff",
        "controller.proofQuiet=soon",
        "agent.shutdownGracePeriod=30",
        "nosuchvalue=1",
    ] {
        let out = Command::new(&h)
            .args(["template", "lastgasp"])
            .arg(lastgasp_tests::render::chart_dir())
            .args(["--set", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--set {bad} was accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("schema"),
            "--set {bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_charts_controller_flags_reach_the_controller() {
    let (Some(h), Some(bin)) = (helm(), agent_bin()) else {
        return skip(
            "the_charts_controller_flags_reach_the_controller",
            "no helm or no agent binary (LASTGASP_BIN)",
        );
    };
    let objs = objects(
        "helm template --set controller.*",
        &render_helm(
            &h,
            &[
                "controller.proofQuiet=5s",
                "controller.leaseMargin=3s",
                "controller.rebootTimeout=15m",
                "controller.maxFencesPerMinute=0",
                "controller.concurrency=4",
                "controller.priorityClassName=lastgasp-high",
                "controller.extraEnv[0].name=RUST_LOG",
                "controller.extraEnv[0].value=debug",
                "agent.extraEnv[0].name=RUST_LOG",
                "agent.extraEnv[0].value=debug",
                "agent.appArmorProfile.type=Unconfined",
                "agent.seLinuxOptions.type=spc_t",
                "priorityClassQuota.enabled=true",
            ],
        ),
    );
    let pod = controller_pod(&objs);
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    for (f, v) in [
        ("--proof-quiet", "5s"),
        ("--lease-margin", "3s"),
        ("--reboot-timeout", "15m"),
        ("--max-fences-per-minute", "0"),
        ("--concurrency", "4"),
    ] {
        assert_eq!(flag(&args, f).as_deref(), Some(v), "{f}");
    }
    parses_with_the_cli(&bin, c);
    assert_eq!(pod.priority_class_name.as_deref(), Some("lastgasp-high"));
    assert!(c.env.as_ref().unwrap().iter().any(|e| e.name == "RUST_LOG"));
    let a = &agent_pod(&objs).containers[0];
    assert!(a.env.as_ref().unwrap().iter().any(|e| e.name == "RUST_LOG"));
    let sc = a.security_context.clone().unwrap();
    assert_eq!(sc.app_armor_profile.unwrap().type_, "Unconfined");
    assert_eq!(sc.se_linux_options.unwrap().type_.as_deref(), Some("spc_t"));
    let q: k8s_openapi::api::core::v1::ResourceQuota =
        get(&objs, "ResourceQuota", "lastgasp-critical-pods");
    let sel = q
        .spec
        .unwrap()
        .scope_selector
        .unwrap()
        .match_expressions
        .unwrap();
    assert_eq!(
        sel[0].values.clone().unwrap(),
        ["system-node-critical", "lastgasp-high"]
    );
    // Unset, the binary's defaults: no flag rendered.
    let defaults = objects("helm template", &render_helm(&h, &[]));
    let args = controller_pod(&defaults).containers[0]
        .args
        .clone()
        .unwrap();
    assert_eq!(flag(&args, "--proof-quiet"), None);
}

#[test]
fn helm_lint_passes_strict_and_renders_the_notes() {
    let Some(h) = helm() else {
        return skip("helm_lint_passes_strict_and_renders_the_notes", "no helm");
    };
    // `helm lint` renders every template, NOTES.txt included.
    let out = Command::new(&h)
        .args(["lint", "--strict"])
        .arg(lastgasp_tests::render::chart_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm lint --strict:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_chart_readme_names_every_top_level_value() {
    let dir = lastgasp_tests::render::chart_dir();
    let values: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("values.yaml")).unwrap()).unwrap();
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let mut missing = Vec::new();
    for (k, v) in values.as_object().unwrap() {
        // Sections are named by their keys: `agent.podRemoval`, `controller.policy`...
        match v.as_object() {
            Some(m) if !m.is_empty() && k != "rbac" && k != "serviceAccount" => {
                for sub in m.keys() {
                    if !readme.contains(&format!("`{k}.{sub}")) {
                        missing.push(format!("{k}.{sub}"));
                    }
                }
            }
            _ => {
                if !readme.contains(&format!("`{k}")) {
                    missing.push(k.clone());
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "deploy/helm/lastgasp/README.md does not name: {missing:?}"
    );
}
