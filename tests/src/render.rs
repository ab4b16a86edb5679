//! The deploy manifests as an operator gets them: `kustomize build` and
//! `helm template`, with the tools `cargo xtask test` installs (or
//! LASTGASP_KUSTOMIZE / LASTGASP_HELM).
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};
use kube::{
    api::{DynamicObject, GroupVersionKind, Patch, PatchParams},
    discovery::{Discovery, Scope},
    Api, Client, ResourceExt,
};
use serde::Deserialize;
use serde_json::{json, Value};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn kustomize_dir() -> PathBuf {
    repo().join("deploy/kustomize")
}

pub fn chart_dir() -> PathBuf {
    repo().join("deploy/helm/lastgasp")
}

/// Multi-document YAML into JSON values (empty documents dropped).
pub fn split_yaml(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| {
            Value::deserialize(doc).unwrap_or_else(|e| panic!("unparsable YAML: {e}\n{text}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

pub fn tool(var: &str, cached: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
        });
    let p = cache.join("lastgasp/tools").join(cached);
    p.is_file().then_some(p)
}

pub fn helm() -> Option<PathBuf> {
    tool("LASTGASP_HELM", "helm-3.17.3/helm")
}

pub fn kustomize() -> Option<PathBuf> {
    tool("LASTGASP_KUSTOMIZE", "kustomize-4.5.4/kustomize")
}

pub fn run_tool(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn render_kustomize_dir(bin: &Path, dir: &Path) -> Vec<Value> {
    split_yaml(&run_tool(Command::new(bin).arg("build").arg(dir)))
}

/// helm with its config, cache and data under `home`: Helm wants writable
/// directories, and the tests keep them out of $HOME.
pub fn helm_command(bin: &Path, home: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    cmd
}

/// `helm template` with the chart's defaults, or with `--set` values.
pub fn render_helm(bin: &Path, set: &[&str]) -> Vec<Value> {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let home = std::env::temp_dir().join(format!("lastgasp-helm-home-{}-{n}", std::process::id()));
    let mut cmd = helm_command(bin, &home);
    cmd.args(["template", "lastgasp"])
        .arg(chart_dir())
        .args(["--namespace", "lastgasp"]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = run_tool(&mut cmd);
    std::fs::remove_dir_all(&home).ok();
    split_yaml(&out)
}

/// The namespace `lastgasp` as the kustomization's header says (Pod
/// Security: privileged), then every object of `objs` server-side applied
/// (or only validated, `dry_run`), in order.
pub async fn apply(client: &Client, objs: &[Value], dry_run: bool) -> Result<()> {
    let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "lastgasp",
        "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}});
    nss.patch(
        "lastgasp",
        &PatchParams::apply("lastgasp-test").force(),
        &Patch::Apply(&ns),
    )
    .await
    .context("namespace lastgasp")?;
    let discovery = Discovery::new(client.clone())
        .run()
        .await
        .context("discovery")?;
    let mut pp = PatchParams::apply("lastgasp-test").force();
    pp.dry_run = dry_run;
    for o in objs {
        let (api_version, kind) = (
            o["apiVersion"].as_str().unwrap_or_default(),
            o["kind"].as_str().unwrap_or_default(),
        );
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (ar, caps) = discovery
            .resolve_gvk(&gvk)
            .with_context(|| format!("the real server does not serve {api_version} {kind}"))?;
        let obj: DynamicObject = serde_json::from_value(o.clone())?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                obj.metadata
                    .namespace
                    .as_deref()
                    .context("a namespaced object names its namespace")?,
                &ar,
            ),
            Scope::Cluster => Api::all_with(client.clone(), &ar),
        };
        api.patch(&obj.name_any(), &pp, &Patch::Apply(&obj))
            .await
            .with_context(|| format!("applying {kind} {} (dry run: {dry_run})", obj.name_any()))?;
    }
    Ok(())
}
