//! /version, /api, /apis and the per-group-version resource lists.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::resources::RESOURCES;

pub const GIT_VERSION: &str = "v1.37.0-lastgasp-apidouble";

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "37",
        "emulationMajor": "1",
        "emulationMinor": "37",
        "minCompatibilityMajor": "1",
        "minCompatibilityMinor": "36",
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.25",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

pub fn api_versions(addr: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": addr }]
    })
}

fn groups() -> BTreeMap<&'static str, Vec<&'static str>> {
    let mut g: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for d in RESOURCES.iter().filter(|d| !d.group.is_empty()) {
        let v = g.entry(d.group).or_default();
        if !v.contains(&d.version) {
            v.push(d.version);
        }
    }
    g
}

fn group_json(name: &str, versions: &[&str]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|v| json!({ "groupVersion": format!("{name}/{v}"), "version": v }))
        .collect();
    json!({ "name": name, "versions": vs, "preferredVersion": vs[0] })
}

pub fn api_group_list() -> Value {
    let groups: Vec<Value> = groups().iter().map(|(n, v)| group_json(n, v)).collect();
    json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
}

pub fn api_group(name: &str) -> Option<Value> {
    let g = groups();
    let versions = g.get(name)?;
    let mut v = group_json(name, versions);
    v["kind"] = json!("APIGroup");
    v["apiVersion"] = json!("v1");
    Some(v)
}

pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    let defs: Vec<_> = RESOURCES
        .iter()
        .filter(|d| d.group == group && d.version == version)
        .collect();
    if defs.is_empty() {
        return None;
    }
    let mut resources = Vec::new();
    for d in defs {
        resources.push(json!({
            "name": d.plural,
            "singularName": d.singular,
            "namespaced": d.namespaced,
            "kind": d.kind,
            "verbs": d.verbs,
            "shortNames": d.short_names,
        }));
        if d.has_status {
            resources.push(json!({
                "name": format!("{}/status", d.plural),
                "singularName": "",
                "namespaced": d.namespaced,
                "kind": d.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        if d.plural == "pods" {
            resources.push(json!({
                "name": "pods/eviction", "singularName": "", "namespaced": true,
                "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"],
            }));
            resources.push(json!({
                "name": "pods/binding", "singularName": "", "namespaced": true, "kind": "Binding", "verbs": ["create"],
            }));
        }
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({ "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources }),
    )
}
