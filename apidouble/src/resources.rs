//! The resource table: which kinds the double serves, how they are stored,
//! their selectable fields, strategic-merge-patch metadata, and typed
//! normalisation through k8s-openapi.

use serde_json::{Map, Value};

use crate::util::{get, s};

/// How a list field merges under a strategic merge patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListRule {
    /// No patch strategy: the patch's list replaces the original.
    Replace,
    /// `patchStrategy:"merge"` with `patchMergeKey`.
    MergeByKey(&'static str),
    /// `patchStrategy:"merge"` on a list of primitives: set union.
    MergePrimitive,
}

/// How objects are presented to the client (events.k8s.io is a view on core events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    Identity,
    EventsV1,
}

pub struct ResourceDef {
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Storage key: two definitions sharing it are views of the same objects.
    pub storage: &'static str,
    pub has_status: bool,
    /// `metadata.generation` is set to 1 on create and bumped on spec changes.
    pub generation: bool,
    /// Supports graceful deletion (pods).
    pub graceful: bool,
    pub allow_create_on_update: bool,
    pub return_deleted_object: bool,
    pub short_names: &'static [&'static str],
    pub view: View,
    pub verbs: &'static [&'static str],
    normalize: fn(Value) -> Result<Value, String>,
}

const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

fn typed<K: serde::de::DeserializeOwned + serde::Serialize>(v: Value) -> Result<Value, String> {
    let k: K = serde_json::from_value(v).map_err(|e| e.to_string())?;
    serde_json::to_value(k).map_err(|e| e.to_string())
}

use k8s_openapi::api::{
    apps::v1 as apps, coordination::v1 as coord, core::v1 as core, policy::v1 as policy,
    scheduling::v1 as scheduling,
};

pub static RESOURCES: &[ResourceDef] = &[
    ResourceDef {
        group: "",
        version: "v1",
        plural: "nodes",
        singular: "node",
        kind: "Node",
        namespaced: false,
        storage: "nodes",
        has_status: true,
        generation: false,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["no"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<core::Node>,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
        storage: "pods",
        has_status: true,
        generation: true,
        graceful: true,
        allow_create_on_update: false,
        return_deleted_object: true,
        short_names: &["po"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<core::Pod>,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        namespaced: false,
        storage: "namespaces",
        has_status: true,
        generation: false,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["ns"],
        view: View::Identity,
        verbs: &[
            "create", "delete", "get", "list", "patch", "update", "watch",
        ],
        normalize: typed::<core::Namespace>,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        storage: "events",
        has_status: false,
        generation: false,
        graceful: false,
        allow_create_on_update: true,
        return_deleted_object: false,
        short_names: &["ev"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<core::Event>,
    },
    ResourceDef {
        group: "events.k8s.io",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        storage: "events",
        has_status: false,
        generation: false,
        graceful: false,
        allow_create_on_update: true,
        return_deleted_object: false,
        short_names: &["ev"],
        view: View::EventsV1,
        verbs: ALL_VERBS,
        normalize: typed::<core::Event>,
    },
    ResourceDef {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
        storage: "leases",
        has_status: false,
        generation: false,
        graceful: false,
        allow_create_on_update: true,
        return_deleted_object: false,
        short_names: &[],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<coord::Lease>,
    },
    ResourceDef {
        group: "policy",
        version: "v1",
        plural: "poddisruptionbudgets",
        singular: "poddisruptionbudget",
        kind: "PodDisruptionBudget",
        namespaced: true,
        storage: "poddisruptionbudgets",
        has_status: true,
        generation: true,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["pdb"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<policy::PodDisruptionBudget>,
    },
    ResourceDef {
        group: "apps",
        version: "v1",
        plural: "replicasets",
        singular: "replicaset",
        kind: "ReplicaSet",
        namespaced: true,
        storage: "replicasets",
        has_status: true,
        generation: true,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["rs"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<apps::ReplicaSet>,
    },
    ResourceDef {
        group: "apps",
        version: "v1",
        plural: "deployments",
        singular: "deployment",
        kind: "Deployment",
        namespaced: true,
        storage: "deployments",
        has_status: true,
        generation: true,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["deploy"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<apps::Deployment>,
    },
    ResourceDef {
        group: "apps",
        version: "v1",
        plural: "daemonsets",
        singular: "daemonset",
        kind: "DaemonSet",
        namespaced: true,
        storage: "daemonsets",
        has_status: true,
        generation: true,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["ds"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<apps::DaemonSet>,
    },
    ResourceDef {
        group: "apps",
        version: "v1",
        plural: "statefulsets",
        singular: "statefulset",
        kind: "StatefulSet",
        namespaced: true,
        storage: "statefulsets",
        has_status: true,
        generation: true,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["sts"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<apps::StatefulSet>,
    },
    ResourceDef {
        group: "scheduling.k8s.io",
        version: "v1",
        plural: "priorityclasses",
        singular: "priorityclass",
        kind: "PriorityClass",
        namespaced: false,
        storage: "priorityclasses",
        has_status: false,
        generation: false,
        graceful: false,
        allow_create_on_update: false,
        return_deleted_object: false,
        short_names: &["pc"],
        view: View::Identity,
        verbs: ALL_VERBS,
        normalize: typed::<scheduling::PriorityClass>,
    },
];

impl ResourceDef {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `GroupResource.String()`: `pods`, `leases.coordination.k8s.io`.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `GroupKind.String()`: `Pod`, `Lease.coordination.k8s.io`.
    pub fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// Decode into the typed object and back: unknown fields are dropped and
    /// type errors rejected, as the apiserver's decoder does.
    pub fn normalize(&self, v: Value) -> Result<Value, String> {
        (self.normalize)(v)
    }

    /// Stored form -> the form this endpoint serves (with apiVersion/kind).
    pub fn to_view(&self, stored: &Value) -> Value {
        let mut v = match self.view {
            View::Identity => stored.clone(),
            View::EventsV1 => core_event_to_v1(stored),
        };
        if let Some(m) = v.as_object_mut() {
            m.insert("apiVersion".into(), Value::String(self.api_version()));
            m.insert("kind".into(), Value::String(self.kind.into()));
        }
        v
    }

    /// The endpoint's form -> stored form (with the stored apiVersion/kind).
    pub fn view_to_stored(&self, v: Value) -> Value {
        match self.view {
            View::Identity => v,
            View::EventsV1 => v1_event_to_core(&v),
        }
    }

    pub fn stored_def(&self) -> &'static ResourceDef {
        RESOURCES
            .iter()
            .find(|d| d.storage == self.storage && d.view == View::Identity)
            .expect("every storage has an identity view")
    }

    /// Selectable fields (`fieldSelector`), as each registry's `GetAttrs` returns them.
    pub fn fields(&self, stored: &Value) -> Vec<(&'static str, String)> {
        let st = |p: &[&str]| s(stored, p).unwrap_or("").to_string();
        let mut f = vec![("metadata.name", st(&["metadata", "name"]))];
        if self.namespaced {
            f.push(("metadata.namespace", st(&["metadata", "namespace"])));
        }
        match self.storage {
            "pods" => {
                f.push(("spec.nodeName", st(&["spec", "nodeName"])));
                f.push(("spec.restartPolicy", st(&["spec", "restartPolicy"])));
                f.push(("spec.schedulerName", st(&["spec", "schedulerName"])));
                f.push((
                    "spec.serviceAccountName",
                    st(&["spec", "serviceAccountName"]),
                ));
                let host_net = get(stored, &["spec", "hostNetwork"])
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                f.push(("spec.hostNetwork", host_net.to_string()));
                f.push(("status.phase", st(&["status", "phase"])));
                let ip = get(stored, &["status", "podIPs"])
                    .and_then(Value::as_array)
                    .and_then(|a| a.first())
                    .and_then(|x| x.get("ip"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                f.push(("status.podIP", ip));
                f.push((
                    "status.nominatedNodeName",
                    st(&["status", "nominatedNodeName"]),
                ));
            }
            "nodes" => {
                let u = get(stored, &["spec", "unschedulable"])
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                f.push(("spec.unschedulable", u.to_string()));
            }
            "namespaces" => f.push(("status.phase", st(&["status", "phase"]))),
            "events" => {
                for (core, v1) in [
                    ("involvedObject.kind", "regarding.kind"),
                    ("involvedObject.namespace", "regarding.namespace"),
                    ("involvedObject.name", "regarding.name"),
                    ("involvedObject.uid", "regarding.uid"),
                    ("involvedObject.apiVersion", "regarding.apiVersion"),
                    (
                        "involvedObject.resourceVersion",
                        "regarding.resourceVersion",
                    ),
                    ("involvedObject.fieldPath", "regarding.fieldPath"),
                ] {
                    let sub = core.split('.').nth(1).unwrap_or("");
                    let val = st(&["involvedObject", sub]);
                    f.push((core, val.clone()));
                    f.push((v1, val));
                }
                f.push(("reason", st(&["reason"])));
                f.push(("reportingComponent", st(&["reportingComponent"])));
                f.push(("reportingController", st(&["reportingComponent"])));
                f.push(("source", st(&["source", "component"])));
                f.push(("type", st(&["type"])));
            }
            _ => {}
        }
        f
    }

    /// Strategic-merge-patch metadata for the list at `path` (map keys joined by '.').
    pub fn list_rule(&self, path: &str) -> ListRule {
        match path {
            "metadata.finalizers" => return ListRule::MergePrimitive,
            "metadata.ownerReferences" => return ListRule::MergeByKey("uid"),
            _ => {}
        }
        let pod_spec = match self.storage {
            "pods" => path.strip_prefix("spec."),
            "replicasets" | "deployments" | "statefulsets" => {
                path.strip_prefix("spec.template.spec.")
            }
            _ => None,
        };
        if let Some(p) = pod_spec {
            if let Some(rule) = pod_spec_rule(p) {
                return rule;
            }
        }
        match (self.storage, path) {
            ("pods", "status.conditions") => ListRule::MergeByKey("type"),
            ("pods", "status.podIPs" | "status.hostIPs") => ListRule::MergeByKey("ip"),
            ("pods", "status.resourceClaimStatuses") => ListRule::MergeByKey("name"),
            ("nodes", "status.conditions") => ListRule::MergeByKey("type"),
            ("nodes", "status.addresses") => ListRule::MergeByKey("type"),
            ("nodes", "spec.podCIDRs") => ListRule::MergePrimitive,
            ("namespaces", "status.conditions") => ListRule::MergeByKey("type"),
            ("poddisruptionbudgets", "status.conditions") => ListRule::MergeByKey("type"),
            ("replicasets" | "deployments" | "statefulsets", "status.conditions") => {
                ListRule::MergeByKey("type")
            }
            _ => ListRule::Replace,
        }
    }
}

fn pod_spec_rule(p: &str) -> Option<ListRule> {
    let containers = ["containers", "initContainers", "ephemeralContainers"];
    if containers.contains(&p) {
        return Some(ListRule::MergeByKey("name"));
    }
    for c in containers {
        if let Some(rest) = p.strip_prefix(c).and_then(|r| r.strip_prefix('.')) {
            return Some(match rest {
                "ports" => ListRule::MergeByKey("containerPort"),
                "env" => ListRule::MergeByKey("name"),
                "volumeMounts" => ListRule::MergeByKey("mountPath"),
                "volumeDevices" => ListRule::MergeByKey("devicePath"),
                _ => return None,
            });
        }
    }
    Some(match p {
        "volumes" | "imagePullSecrets" | "resourceClaims" | "schedulingGates" => {
            ListRule::MergeByKey("name")
        }
        "hostAliases" => ListRule::MergeByKey("ip"),
        _ => return None,
    })
}

/// Find the endpoint for a group/version/plural.
pub fn lookup(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|d| d.group == group && d.version == version && d.plural == plural)
}

/// Find the definition for an object's `apiVersion` and `kind`.
pub fn lookup_kind(api_version: &str, kind: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|d| d.api_version() == api_version && d.kind == kind)
}

const EVENT_RENAMES: &[(&str, &str)] = &[
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
    ("reportingComponent", "reportingController"),
];

fn rename(v: &Value, from_core: bool) -> Value {
    let Some(m) = v.as_object() else {
        return v.clone();
    };
    let mut out = Map::new();
    for (k, val) in m {
        let new_key = EVENT_RENAMES
            .iter()
            .find_map(|(c, e)| {
                if from_core && k == c {
                    Some(*e)
                } else if !from_core && k == e {
                    Some(*c)
                } else {
                    None
                }
            })
            .map(str::to_string)
            .unwrap_or_else(|| k.clone());
        out.insert(new_key, val.clone());
    }
    Value::Object(out)
}

/// core/v1 Event -> events.k8s.io/v1 Event (pkg/apis/events/v1 conversion).
pub fn core_event_to_v1(v: &Value) -> Value {
    let mut out = rename(v, true);
    if let Some(m) = out.as_object_mut() {
        m.insert(
            "apiVersion".into(),
            Value::String("events.k8s.io/v1".into()),
        );
        m.insert("kind".into(), Value::String("Event".into()));
    }
    out
}

/// events.k8s.io/v1 Event -> core/v1 Event.
pub fn v1_event_to_core(v: &Value) -> Value {
    let mut out = rename(v, false);
    if let Some(m) = out.as_object_mut() {
        m.insert("apiVersion".into(), Value::String("v1".into()));
        m.insert("kind".into(), Value::String("Event".into()));
    }
    out
}

/// The pod's QoS class (`qos.GetPodQOS`, simplified to cpu and memory).
pub fn pod_qos(pod: &Value) -> &'static str {
    let containers: Vec<&Value> = ["containers", "initContainers"]
        .iter()
        .filter_map(|k| get(pod, &["spec", k]).and_then(Value::as_array))
        .flatten()
        .collect();
    let mut any = false;
    let mut guaranteed = true;
    for c in containers {
        let req = get(c, &["resources", "requests"]).and_then(Value::as_object);
        let lim = get(c, &["resources", "limits"]).and_then(Value::as_object);
        for r in ["cpu", "memory"] {
            let rq = req.and_then(|m| m.get(r));
            let lm = lim.and_then(|m| m.get(r));
            if rq.is_some() || lm.is_some() {
                any = true;
            }
            match (rq, lm) {
                (_, None) => guaranteed = false,
                (Some(a), Some(b)) if a != b => guaranteed = false,
                _ => {}
            }
        }
    }
    if !any {
        "BestEffort"
    } else if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}
