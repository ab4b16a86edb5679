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
        // JSON has one number type: a schema's `minimum: 0` comes back as 0.0.
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
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
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            strict::<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>(v)?.1
        }
        _ => return Err(format!("unexpected object {api} {kind}: add it to `typed`")),
    };
    Ok(back)
}

const CLUSTER_SCOPED: [&str; 7] = [
    "CustomResourceDefinition",
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

/// Helm alone can hash the config into the pod template (`checksum/config`,
/// so that `helm upgrade` rolls the agents when it changes) and knows the
/// release and the chart (the standard `helm.sh/chart` and
/// `app.kubernetes.io/{managed-by,instance,version}` labels): left out of
/// the comparison with kustomize. So are Helm's hooks (the uninstall's
/// `--lift-fences` Job: kustomize has no uninstall to hook) and its
/// resource policy (the ledger's CRD outlives `helm uninstall`).
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
            // Helm's own: `helm uninstall` keeps the ledger's CRD.
            if let Some(a) = v
                .pointer_mut("/metadata/annotations")
                .and_then(Value::as_object_mut)
            {
                a.remove("helm.sh/resource-policy");
                if a.is_empty() {
                    v["metadata"].as_object_mut().unwrap().remove("annotations");
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

/// A rule as granted to a subject: from a ClusterRole through a
/// ClusterRoleBinding (any namespace), or from a Role (its namespace).
#[derive(Debug, Clone)]
struct Grant {
    rule: PolicyRule,
    namespace: Option<String>,
}

fn agent_pod(objs: &BTreeMap<Key, Value>) -> PodSpec {
    let ds: DaemonSet = get(objs, "DaemonSet", "lastgasp-agent");
    ds.spec.template.spec.unwrap()
}

/// The value of the container's environment variable `name`.
fn env_value(c: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<String> {
    c.env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
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

fn controller_pod(objs: &BTreeMap<Key, Value>) -> PodSpec {
    let d: Deployment = get(objs, "Deployment", "lastgasp-controller");
    d.spec.template.spec.unwrap()
}

fn skip(test: &str, why: &str) {
    println!("SKIPPED {test}: {why}; `cargo xtask test` installs helm and kustomize and passes LASTGASP_HELM / LASTGASP_KUSTOMIZE");
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

fn covers(list: &[String], x: &str) -> bool {
    list.iter().any(|v| v == "*" || v == x)
}

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

mod admission;
mod chart;
mod parsers;
mod parsing;
mod privileges;
mod rbac;
mod rendering;
