//! The registry: create / update / patch / delete with the generic store's
//! rules (`rest.BeforeCreate`, `BeforeUpdate`, `BeforeDelete`) and each
//! kind's strategy.

use std::time::Instant;

use serde_json::{json, Map, Value};

use crate::patch::{self, PatchType};
use crate::resources::ResourceDef;
use crate::status::{ApiError, ApiResult, FieldErr};
use crate::store::State;
use crate::util::{
    self, finalizers_of, get, is_deleting, meta_mut, name_of, now_time, rv_of, s, uid_of,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sub {
    Main,
    Status,
}

/// DeleteOptions, from the query and/or the body.
#[derive(Debug, Clone, Default)]
pub struct DeleteOpts {
    pub grace: Option<i64>,
    pub precond_uid: Option<String>,
    pub precond_rv: Option<String>,
    pub orphan_dependents: Option<bool>,
    pub propagation: Option<String>,
    pub dry_run: bool,
}

impl DeleteOpts {
    /// Fill from a `DeleteOptions` JSON body (fields there win over the query, as the apiserver decodes the body last).
    pub fn merge_body(&mut self, body: &Value) {
        if let Some(g) = body.get("gracePeriodSeconds").and_then(Value::as_i64) {
            self.grace = Some(g);
        }
        if let Some(p) = body.get("preconditions") {
            if let Some(u) = p.get("uid").and_then(Value::as_str) {
                self.precond_uid = Some(u.into());
            }
            if let Some(r) = p.get("resourceVersion").and_then(Value::as_str) {
                self.precond_rv = Some(r.into());
            }
        }
        if let Some(o) = body.get("orphanDependents").and_then(Value::as_bool) {
            self.orphan_dependents = Some(o);
        }
        if let Some(p) = body.get("propagationPolicy").and_then(Value::as_str) {
            self.propagation = Some(p.into());
        }
        if let Some(d) = body.get("dryRun").and_then(Value::as_array) {
            if d.iter().any(|x| x.as_str() == Some("All")) {
                self.dry_run = true;
            }
        }
    }
}

/// The outcome of a delete.
#[derive(Debug, Clone)]
pub enum Deleted {
    /// Removed from storage; the last stored state.
    Removed(Value),
    /// Still present (graceful deletion or finalizers pending).
    Pending(Value),
}

// ---------------------------------------------------------------- validation

const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

pub fn is_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_label)
}

fn validate(
    def: &ResourceDef,
    obj: &Value,
    old: Option<&Value>,
    events_v1_create: bool,
) -> Vec<FieldErr> {
    let mut errs = Vec::new();
    let name = name_of(obj);
    let name_ok = if def.storage == "namespaces" {
        is_label(name)
    } else {
        is_subdomain(name)
    };
    if !name_ok {
        let msg = if def.storage == "namespaces" {
            DNS1123_LABEL_MSG
        } else {
            DNS1123_SUBDOMAIN_MSG
        };
        errs.push(FieldErr::invalid("metadata.name", &json!(name), msg));
    }
    if let Some(old) = old {
        let old_f = finalizers_of(old);
        if is_deleting(old) {
            let new_f: Vec<String> = finalizers_of(obj)
                .into_iter()
                .filter(|f| !old_f.contains(f))
                .collect();
            if !new_f.is_empty() {
                errs.push(FieldErr::forbidden(
                    "metadata.finalizers",
                    &format!("no new finalizers can be added if the object is being deleted, found new finalizers {new_f:?}"),
                ));
            }
        }
    }
    match def.storage {
        "pods" => validate_pod(obj, old, &mut errs),
        "poddisruptionbudgets" => validate_pdb(obj, &mut errs),
        "leases" => validate_lease(obj, &mut errs),
        "events" => errs.extend(validate_event(obj, events_v1_create)),
        _ => {}
    }
    errs
}

/// ValidatePod / ValidatePodUpdate, the parts the tests reach.
fn validate_pod(obj: &Value, old: Option<&Value>, errs: &mut Vec<FieldErr>) {
    let containers = get(obj, &["spec", "containers"]).and_then(Value::as_array);
    match containers {
        None => errs.push(FieldErr::required("spec.containers", "")),
        Some(cs) if cs.is_empty() => errs.push(FieldErr::required("spec.containers", "")),
        Some(cs) => {
            for (i, c) in cs.iter().enumerate() {
                let n = c.get("name").and_then(Value::as_str).unwrap_or("");
                if n.is_empty() {
                    errs.push(FieldErr::required(
                        &format!("spec.containers[{i}].name"),
                        "",
                    ));
                } else if !is_label(n) {
                    errs.push(FieldErr::invalid(
                        &format!("spec.containers[{i}].name"),
                        &json!(n),
                        DNS1123_LABEL_MSG,
                    ));
                }
                if c.get("image")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .is_empty()
                    && old.is_none()
                {
                    errs.push(FieldErr::required(
                        &format!("spec.containers[{i}].image"),
                        "",
                    ));
                }
            }
        }
    }
    if let Some(old) = old {
        if let Some(e) = pod_spec_update_error(old, obj) {
            errs.push(e);
        }
    }
}

/// ValidatePodDisruptionBudgetSpec.
fn validate_pdb(obj: &Value, errs: &mut Vec<FieldErr>) {
    let spec = obj.get("spec");
    let min = spec
        .and_then(|s| s.get("minAvailable"))
        .filter(|v| !v.is_null());
    let max = spec
        .and_then(|s| s.get("maxUnavailable"))
        .filter(|v| !v.is_null());
    if min.is_some() && max.is_some() {
        errs.push(FieldErr::invalid(
            "spec",
            &spec.cloned().unwrap_or(Value::Null),
            "minAvailable and maxUnavailable cannot be both set",
        ));
    }
    for (field, v) in [("spec.minAvailable", min), ("spec.maxUnavailable", max)] {
        if let Some(v) = v {
            match int_or_percent(v, 100, true) {
                Some(n) if n < 0 => errs.push(FieldErr::invalid(field, v, "must be greater than or equal to 0")),
                None => errs.push(FieldErr::invalid(field, v, "a valid percent string must be a numeric string followed by an ending '%' (e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')")),
                _ => {
                    if let Some(p) = v.as_str().and_then(|s| s.strip_suffix('%')).and_then(|p| p.parse::<i64>().ok()) {
                        if p > 100 {
                            errs.push(FieldErr::invalid(field, v, "must not be greater than 100%"));
                        }
                    }
                }
            }
        }
    }
}

fn validate_lease(obj: &Value, errs: &mut Vec<FieldErr>) {
    if let Some(d) = get(obj, &["spec", "leaseDurationSeconds"]).and_then(Value::as_i64) {
        if d <= 0 {
            errs.push(FieldErr::invalid(
                "spec.leaseDurationSeconds",
                &json!(d),
                "must be greater than 0",
            ));
        }
    }
}

/// ValidateEventCreate / legacyValidateEvent (pkg/apis/core/validation/events.go).
fn validate_event(ev: &Value, strict_v1: bool) -> Vec<FieldErr> {
    let mut errs = Vec::new();
    let st = |p: &[&str]| s(ev, p).unwrap_or("").to_string();
    let ns = st(&["metadata", "namespace"]);
    let io_ns = st(&["involvedObject", "namespace"]);
    let has_event_time = get(ev, &["eventTime"]).is_some();
    let rc_field = if strict_v1 {
        "reportingController"
    } else {
        "reportingComponent"
    };
    if !has_event_time {
        if io_ns.is_empty() {
            if !ns.is_empty() && ns != "default" {
                errs.push(FieldErr::invalid(
                    "involvedObject.namespace",
                    &json!(io_ns),
                    "does not match event.namespace",
                ));
            }
        } else if ns != io_ns {
            errs.push(FieldErr::invalid(
                "involvedObject.namespace",
                &json!(io_ns),
                "does not match event.namespace",
            ));
        }
    } else {
        if io_ns.is_empty() && ns != "default" && ns != "kube-system" {
            errs.push(FieldErr::invalid(
                "involvedObject.namespace",
                &json!(io_ns),
                "does not match event.namespace",
            ));
        }
        if st(&["reportingComponent"]).is_empty() {
            errs.push(FieldErr::required(rc_field, ""));
        }
        if st(&["reportingInstance"]).is_empty() {
            errs.push(FieldErr::required("reportingInstance", ""));
        }
        if st(&["action"]).is_empty() {
            errs.push(FieldErr::required("action", ""));
        }
        if st(&["reason"]).is_empty() {
            errs.push(FieldErr::required("reason", ""));
        }
        if st(&["message"]).len() > 1024 {
            errs.push(FieldErr::invalid(
                "note",
                &json!(""),
                "can have at most 1024 characters",
            ));
        }
    }
    if strict_v1 {
        validate_event_v1(ev, has_event_time, &mut errs);
    }
    errs
}

/// What events.k8s.io/v1 adds: the v1 fields set, the core ones unset.
fn validate_event_v1(ev: &Value, has_event_time: bool, errs: &mut Vec<FieldErr>) {
    let st = |p: &[&str]| s(ev, p).unwrap_or("").to_string();
    if !has_event_time {
        errs.push(FieldErr::required("eventTime", ""));
    }
    let t = st(&["type"]);
    if t != "Normal" && t != "Warning" {
        errs.push(FieldErr::invalid(
            "type",
            &json!(""),
            &format!("has invalid value: {t}"),
        ));
    }
    for (core, v1) in [
        ("firstTimestamp", "deprecatedFirstTimestamp"),
        ("lastTimestamp", "deprecatedLastTimestamp"),
    ] {
        if get(ev, &[core]).is_some() {
            errs.push(FieldErr::invalid(v1, &json!(""), "needs to be unset"));
        }
    }
    if get(ev, &["count"]).and_then(Value::as_i64).unwrap_or(0) != 0 {
        errs.push(FieldErr::invalid(
            "deprecatedCount",
            &json!(""),
            "needs to be unset",
        ));
    }
    if !st(&["source", "component"]).is_empty() || !st(&["source", "host"]).is_empty() {
        errs.push(FieldErr::invalid(
            "deprecatedSource",
            &json!(""),
            "needs to be unset",
        ));
    }
    if let Some(series) = get(ev, &["series"]) {
        if series.get("count").and_then(Value::as_i64).unwrap_or(0) < 2 {
            errs.push(FieldErr::invalid(
                "series.count",
                &json!(""),
                "should be at least 2",
            ));
        }
        if series.get("lastObservedTime").is_none_or(Value::is_null) {
            errs.push(FieldErr::required("series.lastObservedTime", ""));
        }
    }
}

/// ValidatePodUpdate's "pod updates may not change fields other than ..." rule.
fn pod_spec_update_error(old: &Value, new: &Value) -> Option<FieldErr> {
    fn mask(spec: &Value) -> Value {
        let mut s = spec.clone();
        if let Some(m) = s.as_object_mut() {
            for k in [
                "activeDeadlineSeconds",
                "tolerations",
                "terminationGracePeriodSeconds",
                "schedulingGates",
            ] {
                m.remove(k);
            }
            for cs in ["containers", "initContainers"] {
                if let Some(Value::Array(a)) = m.get_mut(cs) {
                    for c in a {
                        if let Some(cm) = c.as_object_mut() {
                            cm.remove("image");
                            cm.remove("resources");
                        }
                    }
                }
            }
        }
        s
    }
    let os = old.get("spec").cloned().unwrap_or(Value::Null);
    let ns = new.get("spec").cloned().unwrap_or(Value::Null);
    let old_tol = os
        .get("tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let new_tol = ns
        .get("tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let tol_ok = old_tol.iter().all(|t| new_tol.contains(t));
    if mask(&os) != mask(&ns) || !tol_ok {
        return Some(FieldErr::forbidden(
            "spec",
            "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
        ));
    }
    None
}

/// `intstr.GetScaledValueFromIntOrPercent`.
pub fn int_or_percent(v: &Value, total: i64, round_up: bool) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => {
            let p: i64 = s.strip_suffix('%')?.parse().ok()?;
            let scaled = p * total;
            Some(if round_up {
                (scaled + 99).div_euclid(100)
            } else {
                scaled.div_euclid(100)
            })
        }
        _ => None,
    }
}

// ---------------------------------------------------------------- decoding

/// Decode a request body for `def` into its stored form.
pub fn decode_body(def: &ResourceDef, body: Value) -> ApiResult<Value> {
    if !body.is_object() {
        return Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: the body must be a JSON object",
            def.kind, def.version, def.kind
        )));
    }
    if let Some(av) = body.get("apiVersion").and_then(Value::as_str) {
        if av != def.api_version() {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({})",
                def.api_version()
            )));
        }
    }
    if let Some(k) = body.get("kind").and_then(Value::as_str) {
        if k != def.kind {
            return Err(ApiError::bad_request(format!(
                "the object provided is unrecognized (must be of type {}): {k}",
                def.kind
            )));
        }
    }
    let stored = def.view_to_stored(body);
    def.normalize(stored).map_err(|e| {
        ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: {e}",
            def.kind, def.version, def.kind
        ))
    })
}

fn set_meta(obj: &mut Value, key: &str, v: Value) {
    meta_mut(obj).insert(key.into(), v);
}

fn remove_meta(obj: &mut Value, key: &str) {
    meta_mut(obj).remove(key);
}

fn generation(v: &Value) -> i64 {
    get(v, &["metadata", "generation"])
        .and_then(Value::as_i64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------- create

fn prepare_for_create(def: &ResourceDef, obj: &mut Value) {
    match def.storage {
        "pods" => {
            let spec = util::obj_mut(obj, &["spec"]);
            spec.entry("terminationGracePeriodSeconds")
                .or_insert(json!(30));
            spec.entry("restartPolicy").or_insert(json!("Always"));
            spec.entry("dnsPolicy").or_insert(json!("ClusterFirst"));
            spec.entry("schedulerName")
                .or_insert(json!("default-scheduler"));
            for cs in ["containers", "initContainers"] {
                if let Some(Value::Array(a)) = spec.get_mut(cs) {
                    for c in a {
                        if let Some(cm) = c.as_object_mut() {
                            cm.entry("terminationMessagePath")
                                .or_insert(json!("/dev/termination-log"));
                            cm.entry("terminationMessagePolicy")
                                .or_insert(json!("File"));
                            let image = cm
                                .get("image")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string();
                            let tag = image.rsplit('/').next().unwrap_or("");
                            let latest = !tag.contains(':') || tag.ends_with(":latest");
                            cm.entry("imagePullPolicy").or_insert(json!(if latest
                                && !image.contains('@')
                            {
                                "Always"
                            } else {
                                "IfNotPresent"
                            }));
                        }
                    }
                }
            }
            let qos = crate::resources::pod_qos(obj);
            obj["status"] = json!({ "phase": "Pending", "qosClass": qos });
        }
        "namespaces" => {
            let name = name_of(obj).to_string();
            util::obj_mut(obj, &["metadata", "labels"])
                .insert("kubernetes.io/metadata.name".into(), json!(name));
            util::obj_mut(obj, &["spec"])
                .entry("finalizers")
                .or_insert(json!(["kubernetes"]));
            obj["status"] = json!({ "phase": "Active" });
        }
        "poddisruptionbudgets" => {
            obj["status"] = json!({ "disruptionsAllowed": 0, "currentHealthy": 0, "desiredHealthy": 0, "expectedPods": 0 });
        }
        "replicasets" | "deployments" | "statefulsets" => {
            obj["status"] = json!({});
        }
        _ => {}
    }
}

/// Namespaces every cluster has (the apiserver creates them at start).
const SYSTEM_NAMESPACES: &[&str] = &["default", "kube-system", "kube-public", "kube-node-lease"];
/// The priority classes the apiserver creates at start.
const SYSTEM_PRIORITY_CLASSES: &[(&str, i64)] = &[
    ("system-node-critical", 2_000_001_000),
    ("system-cluster-critical", 2_000_000_000),
];

/// The default admission plugins a create meets on the real server, as far
/// as the double models them: NamespaceLifecycle, Priority and
/// TaintNodesByCondition.
fn admit(st: &State, def: &ResourceDef, obj: &mut Value) -> ApiResult<()> {
    let ns = util::ns_of(obj).to_string();
    if def.namespaced && !SYSTEM_NAMESPACES.contains(&ns.as_str()) {
        match st.get("namespaces", "", &ns) {
            None => {
                let nsdef = crate::resources::lookup_kind("v1", "Namespace").expect("namespaces");
                return Err(ApiError::not_found(nsdef, &ns));
            }
            Some(n) if s(n, &["status", "phase"]) == Some("Terminating") => {
                return Err(ApiError::forbidden(
                    &def.qualified(),
                    name_of(obj),
                    &format!("unable to create new content in namespace {ns} because it is being terminated"),
                ));
            }
            Some(_) => {}
        }
    }
    match def.storage {
        "pods" => admit_priority(st, def, obj),
        "nodes" => {
            // TaintNodesByCondition: a new Node is not-ready until the node
            // lifecycle controller sees it Ready (the double has none: the
            // taint stays until a test removes it).
            let taints = util::obj_mut(obj, &["spec"])
                .entry("taints")
                .or_insert(json!([]));
            if let Some(a) = taints.as_array_mut() {
                if !a.iter().any(|t| t["key"] == "node.kubernetes.io/not-ready") {
                    a.push(json!({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}));
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// plugin/pkg/admission/priority: `spec.priority` comes from the class (the
/// global default, else 0, when none is named); a given value that differs
/// is refused, as is a class that does not exist.
fn admit_priority(st: &State, def: &ResourceDef, obj: &mut Value) -> ApiResult<()> {
    let class = s(obj, &["spec", "priorityClassName"])
        .unwrap_or("")
        .to_string();
    let name = name_of(obj).to_string();
    let forbidden = |err: String| ApiError::forbidden(&def.qualified(), &name, &err);
    let of = |pc: &Value| {
        (
            pc["value"].as_i64().unwrap_or(0),
            pc["preemptionPolicy"].clone(),
        )
    };
    let (value, policy) = if class.is_empty() {
        st.list("priorityclasses", None)
            .find(|pc| pc["globalDefault"] == json!(true))
            .map_or((0, Value::Null), of)
    } else if let Some((_, v)) = SYSTEM_PRIORITY_CLASSES.iter().find(|(n, _)| *n == class) {
        (*v, Value::Null)
    } else {
        let pc = st
            .get("priorityclasses", "", &class)
            .ok_or_else(|| forbidden(format!("no PriorityClass with name {class} was found")))?;
        of(pc)
    };
    let spec = util::obj_mut(obj, &["spec"]);
    if let Some(given) = spec.get("priority").and_then(Value::as_i64) {
        if given != value {
            return Err(forbidden(format!(
                "the integer value of priority ({given}) must not be provided in pod spec; priority admission controller computed {value} from the given PriorityClass name"
            )));
        }
    }
    spec.insert("priority".into(), json!(value));
    let policy = if policy.is_string() {
        policy
    } else {
        json!("PreemptLowerPriority")
    };
    spec.entry("preemptionPolicy").or_insert(policy);
    Ok(())
}

/// POST: create through the kind's strategy. Returns the stored object.
pub fn create(
    st: &mut State,
    def: &'static ResourceDef,
    url_ns: &str,
    body: Value,
    dry_run: bool,
    manager: &str,
) -> ApiResult<Value> {
    let mut obj = decode_body(def, body)?;
    fix_namespace(def, &mut obj, url_ns)?;
    create_decoded(st, def, obj, dry_run, manager)
}

/// The write's `managedFields` entry: operation Update of `manager` on
/// `sub`, its time now (whole seconds, as the API server stamps it). The
/// field sets themselves are not computed (`fieldsV1` is empty).
fn stamp_manager(def: &ResourceDef, obj: &mut Value, manager: &str, sub: Sub) {
    let subresource = match sub {
        Sub::Main => None,
        Sub::Status => Some("status"),
    };
    let api_version = def.api_version();
    let mut entries: Vec<Value> = get(obj, &["metadata", "managedFields"])
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    entries.retain(|e| {
        !(e["manager"] == manager
            && e["operation"] == "Update"
            && e.get("subresource").and_then(Value::as_str) == subresource)
    });
    let mut entry = json!({"manager": manager, "operation": "Update", "apiVersion": api_version,
        "time": now_time(), "fieldsType": "FieldsV1", "fieldsV1": {}});
    if let Some(s) = subresource {
        entry["subresource"] = json!(s);
    }
    entries.push(entry);
    set_meta(obj, "managedFields", Value::Array(entries));
}

fn fix_namespace(def: &ResourceDef, obj: &mut Value, url_ns: &str) -> ApiResult<()> {
    if def.namespaced {
        let body_ns = util::ns_of(obj).to_string();
        if body_ns.is_empty() {
            set_meta(obj, "namespace", json!(url_ns));
        } else if body_ns != url_ns {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
    } else {
        remove_meta(obj, "namespace");
    }
    Ok(())
}

fn create_decoded(
    st: &mut State,
    def: &'static ResourceDef,
    mut obj: Value,
    dry_run: bool,
    manager: &str,
) -> ApiResult<Value> {
    if name_of(&obj).is_empty() {
        let gen = s(&obj, &["metadata", "generateName"])
            .unwrap_or("")
            .to_string();
        if gen.is_empty() {
            return Err(ApiError::name_required(def));
        }
        set_meta(&mut obj, "name", json!(util::generate_name(&gen)));
    }
    if !rv_of(&obj).is_empty() {
        return Err(ApiError::internal(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    // rest.BeforeCreate
    remove_meta(&mut obj, "deletionTimestamp");
    remove_meta(&mut obj, "deletionGracePeriodSeconds");
    remove_meta(&mut obj, "managedFields");
    stamp_manager(def, &mut obj, manager, Sub::Main);
    remove_meta(&mut obj, "selfLink");
    set_meta(&mut obj, "uid", json!(util::new_uid()));
    set_meta(&mut obj, "creationTimestamp", json!(now_time()));
    if def.generation {
        set_meta(&mut obj, "generation", json!(1));
    } else {
        remove_meta(&mut obj, "generation");
    }
    prepare_for_create(def, &mut obj);
    admit(st, def, &mut obj)?;
    let events_v1 = def.view == crate::resources::View::EventsV1;
    let errs = validate(def, &obj, None, events_v1);
    if !errs.is_empty() {
        return Err(ApiError::invalid(def, name_of(&obj), errs));
    }
    util::drop_empty_meta_maps(&mut obj);
    let stored = def.stored_def();
    if st
        .get(stored.storage, util::ns_of(&obj), name_of(&obj))
        .is_some()
    {
        return Err(ApiError::already_exists(def, name_of(&obj)));
    }
    if dry_run {
        return Ok(obj);
    }
    Ok(st.insert(stored.storage, obj))
}

/// Seed an object directly into storage (like restoring etcd): system
/// metadata is filled in where missing, but no strategy runs, so `status`
/// is kept as given.
pub fn seed(st: &mut State, obj: Value) -> ApiResult<(&'static ResourceDef, Value)> {
    let av = s(&obj, &["apiVersion"]).unwrap_or("").to_string();
    let kind = s(&obj, &["kind"]).unwrap_or("").to_string();
    let def = crate::resources::lookup_kind(&av, &kind).ok_or_else(|| {
        ApiError::bad_request(format!(
            "no kind \"{kind}\" is registered for version \"{av}\" in the double"
        ))
    })?;
    let mut obj = def
        .normalize(def.view_to_stored(obj))
        .map_err(ApiError::bad_request)?;
    let def = def.stored_def();
    if name_of(&obj).is_empty() {
        return Err(ApiError::name_required(def));
    }
    if def.namespaced && util::ns_of(&obj).is_empty() {
        set_meta(&mut obj, "namespace", json!("default"));
    }
    if !def.namespaced {
        remove_meta(&mut obj, "namespace");
    }
    if uid_of(&obj).is_empty() {
        set_meta(&mut obj, "uid", json!(util::new_uid()));
    }
    if s(&obj, &["metadata", "creationTimestamp"]).is_none() {
        set_meta(&mut obj, "creationTimestamp", json!(now_time()));
    }
    if def.generation && generation(&obj) == 0 {
        set_meta(&mut obj, "generation", json!(1));
    }
    remove_meta(&mut obj, "resourceVersion");
    if def.storage == "poddisruptionbudgets" && obj.get("status").is_none() {
        prepare_for_create(def, &mut obj);
    }
    util::drop_empty_meta_maps(&mut obj);
    if is_deleting(&obj) {
        st.terminating_since
            .insert(uid_of(&obj).to_string(), Instant::now());
    }
    let ns = util::ns_of(&obj).to_string();
    let name = name_of(&obj).to_string();
    let out = if st.get(def.storage, &ns, &name).is_some() {
        st.replace(def.storage, obj)
    } else {
        st.insert(def.storage, obj)
    };
    Ok((def, out))
}

// ---------------------------------------------------------------- update

/// rest.BeforeUpdate: system fields, the stored managedFields (this
/// write's entry is stamped later, if it changes anything) and, through the
/// main resource, the status are not changed by updates.
fn keep_system_fields(def: &ResourceDef, sub: Sub, old: &Value, obj: &mut Value) {
    for key in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match get(old, &["metadata", key]) {
            Some(v) => set_meta(obj, key, v.clone()),
            None => remove_meta(obj, key),
        }
    }
    match get(old, &["metadata", "managedFields"]) {
        Some(v) => set_meta(obj, "managedFields", v.clone()),
        None => remove_meta(obj, "managedFields"),
    }
    remove_meta(obj, "selfLink");
    if sub == Sub::Main && def.has_status {
        match old.get("status") {
            Some(s) => obj["status"] = s.clone(),
            None => {
                if let Some(m) = obj.as_object_mut() {
                    m.remove("status");
                }
            }
        }
    }
}

/// PUT (and the tail of PATCH): `new` is in stored form, decoded.
#[allow(clippy::too_many_arguments)]
pub fn update(
    st: &mut State,
    def: &'static ResourceDef,
    url_ns: &str,
    url_name: &str,
    mut new: Value,
    sub: Sub,
    dry_run: bool,
    allow_create: bool,
    manager: &str,
) -> ApiResult<(Value, bool)> {
    fix_namespace(def, &mut new, url_ns)?;
    if name_of(&new) != url_name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({url_name})",
            name_of(&new)
        )));
    }
    let stored = def.stored_def();
    let Some(old) = st
        .get(stored.storage, url_ns_for(def, url_ns), url_name)
        .cloned()
    else {
        if allow_create && def.allow_create_on_update && sub == Sub::Main {
            if !rv_of(&new).is_empty() {
                return Err(ApiError::not_found(def, url_name));
            }
            return create_decoded(st, def, new, dry_run, manager).map(|o| (o, true));
        }
        return Err(ApiError::not_found(def, url_name));
    };
    let body_rv = rv_of(&new).to_string();
    if !body_rv.is_empty() && body_rv != rv_of(&old) {
        return Err(ApiError::conflict(def, url_name, ApiError::OPTIMISTIC_LOCK));
    }
    let body_uid = uid_of(&new).to_string();
    if !body_uid.is_empty() && body_uid != uid_of(&old) {
        return Err(ApiError::conflict(
            def,
            url_name,
            &format!(
                "Precondition failed: UID in precondition: {body_uid}, UID in object meta: {}",
                uid_of(&old)
            ),
        ));
    }
    let mut obj = match sub {
        Sub::Main => new,
        Sub::Status => status_update_merge(def, &old, &new),
    };
    keep_system_fields(def, sub, &old, &mut obj);
    if def.generation && sub == Sub::Main && old.get("spec") != obj.get("spec") {
        set_meta(&mut obj, "generation", json!(generation(&old) + 1));
    }
    let events_v1 = false;
    let errs = validate(def, &obj, Some(&old), events_v1);
    if !errs.is_empty() {
        return Err(ApiError::invalid(def, url_name, errs));
    }
    util::drop_empty_meta_maps(&mut obj);
    set_meta(&mut obj, "resourceVersion", json!(rv_of(&old)));
    if obj == old {
        // GuaranteedUpdate writes nothing for a no-op: same resourceVersion, no event.
        return Ok((old, false));
    }
    stamp_manager(def, &mut obj, manager, sub);
    if should_delete_during_update(&obj) {
        if dry_run {
            return Ok((obj, false));
        }
        st.replace(stored.storage, obj.clone());
        let last = st
            .remove(stored.storage, url_ns_for(def, url_ns), url_name)
            .unwrap_or(obj);
        return Ok((last, false));
    }
    if dry_run {
        return Ok((obj, false));
    }
    Ok((st.replace(stored.storage, obj), false))
}

fn url_ns_for<'a>(def: &ResourceDef, url_ns: &'a str) -> &'a str {
    if def.namespaced {
        url_ns
    } else {
        ""
    }
}

fn should_delete_during_update(obj: &Value) -> bool {
    is_deleting(obj)
        && finalizers_of(obj).is_empty()
        && get(obj, &["metadata", "deletionGracePeriodSeconds"])
            .and_then(Value::as_i64)
            .unwrap_or(0)
            == 0
}

/// A status-subresource update: only `.status` (and, for pods and nodes,
/// labels/annotations/finalizers) changes; everything else stays as stored.
fn status_update_merge(def: &ResourceDef, old: &Value, new: &Value) -> Value {
    let mut out = old.clone();
    match new.get("status") {
        Some(s) => out["status"] = s.clone(),
        None => {
            if let Some(m) = out.as_object_mut() {
                m.remove("status");
            }
        }
    }
    if matches!(def.storage, "pods" | "nodes") {
        for key in ["labels", "annotations", "finalizers"] {
            match get(new, &["metadata", key]) {
                Some(v) => set_meta(&mut out, key, v.clone()),
                None => remove_meta(&mut out, key),
            }
        }
    }
    if def.storage == "pods" && get(&out, &["status", "qosClass"]).is_none() {
        if let Some(q) = get(old, &["status", "qosClass"]) {
            util::obj_mut(&mut out, &["status"]).insert("qosClass".into(), q.clone());
        }
    }
    set_meta(&mut out, "resourceVersion", json!(rv_of(new)));
    out
}

// ---------------------------------------------------------------- patch

#[allow(clippy::too_many_arguments)]
pub fn patch(
    st: &mut State,
    def: &'static ResourceDef,
    url_ns: &str,
    url_name: &str,
    ptype: PatchType,
    body: &[u8],
    sub: Sub,
    dry_run: bool,
    manager: &str,
) -> ApiResult<Value> {
    if ptype == PatchType::Apply {
        return Err(ApiError::unsupported_media_type(
            "server-side apply (application/apply-patch+yaml) is not modelled by lastgasp-apidouble; use a merge, strategic merge or JSON patch",
        ));
    }
    let patch_doc: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    let stored = def.stored_def();
    let Some(old) = st
        .get(stored.storage, url_ns_for(def, url_ns), url_name)
        .cloned()
    else {
        return Err(ApiError::not_found(def, url_name));
    };
    let mut view = def.to_view(&old);
    match ptype {
        PatchType::Merge => {
            if !patch_doc.is_object() {
                return Err(ApiError::bad_request("merge patch must be a JSON object"));
            }
            patch::merge_patch(&mut view, &patch_doc);
        }
        PatchType::Strategic => patch::strategic_merge_patch(def, &mut view, &patch_doc)?,
        PatchType::Json => patch::json_patch(&mut view, &patch_doc)?,
        PatchType::Apply => unreachable!(),
    }
    // The patched object must still be this object.
    if let Some(m) = view.as_object_mut() {
        m.insert("apiVersion".into(), json!(def.api_version()));
        m.insert("kind".into(), json!(def.kind));
    }
    let new = def.normalize(def.view_to_stored(view)).map_err(|e| {
        ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: {e}",
            def.kind, def.version, def.kind
        ))
    })?;
    let (out, _) = update(st, def, url_ns, url_name, new, sub, dry_run, false, manager)?;
    Ok(out)
}

// ---------------------------------------------------------------- delete

/// podStrategy.CheckGracefulDelete.
fn pod_grace(pod: &Value, requested: Option<i64>) -> i64 {
    let mut period = requested.unwrap_or_else(|| {
        get(pod, &["spec", "terminationGracePeriodSeconds"])
            .and_then(Value::as_i64)
            .unwrap_or(30)
    });
    if s(pod, &["spec", "nodeName"]).unwrap_or("").is_empty() {
        period = 0;
    }
    if matches!(s(pod, &["status", "phase"]), Some("Failed" | "Succeeded")) {
        period = 0;
    }
    if period < 0 {
        period = 1;
    }
    period
}

/// A second delete with a shorter grace period `p` than the current `cur`:
/// the deletion moves earlier (never before now; a period cut short to now
/// becomes 1 s unless it is 0). The object and its new period.
fn shortened(old: &Value, cur: i64, p: i64) -> (Value, i64) {
    let ts = s(old, &["metadata", "deletionTimestamp"]).and_then(util::parse_time);
    let mut period = p;
    let now = jiff::Timestamp::now();
    let mut new_ts = ts
        .and_then(|t| t.checked_sub(jiff::SignedDuration::from_secs(cur)).ok())
        .and_then(|t| t.checked_add(jiff::SignedDuration::from_secs(p)).ok())
        .unwrap_or(now);
    if new_ts < now {
        new_ts = now;
        if period != 0 {
            period = 1;
        }
    }
    let mut obj = old.clone();
    set_meta(&mut obj, "deletionTimestamp", json!(util::fmt_time(new_ts)));
    set_meta(&mut obj, "deletionGracePeriodSeconds", json!(period));
    (obj, period)
}

pub fn delete(
    st: &mut State,
    def: &'static ResourceDef,
    url_ns: &str,
    name: &str,
    opts: &DeleteOpts,
) -> ApiResult<Deleted> {
    let stored = def.stored_def();
    let ns = url_ns_for(def, url_ns).to_string();
    let Some(old) = st.get(stored.storage, &ns, name).cloned() else {
        return Err(ApiError::not_found(def, name));
    };
    if let Some(why) = util::precondition_mismatch(
        opts.precond_uid.as_deref(),
        opts.precond_rv.as_deref(),
        &old,
    ) {
        return Err(ApiError::precondition_conflict(stored, name, &why));
    }
    let requested = opts.grace.map(|g| if g < 0 { 1 } else { g });
    let pending_finalizers = !finalizers_of(&old).is_empty();
    let dry = opts.dry_run;

    let write = |st: &mut State, obj: Value| -> Value {
        if dry {
            obj
        } else {
            st.replace(stored.storage, obj)
        }
    };
    let remove = |st: &mut State, last: Value| -> Deleted {
        if dry {
            Deleted::Removed(last)
        } else {
            st.remove(stored.storage, &ns, name);
            Deleted::Removed(last)
        }
    };

    if def.graceful {
        if is_deleting(&old) {
            let cur =
                get(&old, &["metadata", "deletionGracePeriodSeconds"]).and_then(Value::as_i64);
            match (cur, requested) {
                (None | Some(0), _) => {
                    if pending_finalizers {
                        return Ok(Deleted::Pending(old));
                    }
                    return Ok(remove(st, old));
                }
                (Some(cur), Some(p)) if p < cur => {
                    let (obj, period) = shortened(&old, cur, p);
                    let obj = write(st, obj);
                    if period == 0 && !pending_finalizers {
                        return Ok(remove(st, obj));
                    }
                    return Ok(Deleted::Pending(obj));
                }
                _ => return Ok(Deleted::Pending(old)),
            }
        }
        let period = pod_grace(&old, requested);
        let deadline = jiff::Timestamp::now()
            .checked_add(jiff::SignedDuration::from_secs(period))
            .unwrap_or_else(|_| jiff::Timestamp::now());
        let obj = marked_for_deletion(&old, &util::fmt_time(deadline), period);
        if !dry {
            st.terminating_since
                .insert(uid_of(&old).to_string(), Instant::now());
        }
        let obj = write(st, obj);
        if period == 0 && !pending_finalizers {
            return Ok(remove(st, obj));
        }
        return Ok(Deleted::Pending(obj));
    }

    if pending_finalizers {
        if is_deleting(&old) {
            return Ok(Deleted::Pending(old));
        }
        let obj = marked_for_deletion(&old, &now_time(), 0);
        return Ok(Deleted::Pending(write(st, obj)));
    }
    Ok(remove(st, old))
}

/// `old` with its deletion set for `at` after `period` seconds (its
/// generation moves on, where it has one).
fn marked_for_deletion(old: &Value, at: &str, period: i64) -> Value {
    let mut obj = old.clone();
    set_meta(&mut obj, "deletionTimestamp", json!(at));
    set_meta(&mut obj, "deletionGracePeriodSeconds", json!(period));
    if generation(&obj) > 0 {
        let g = generation(&obj) + 1;
        set_meta(&mut obj, "generation", json!(g));
    }
    obj
}

/// The `Status` a delete returns for kinds that do not return the object.
pub fn delete_status(def: &ResourceDef, obj: &Value) -> Value {
    let mut details = json!({ "name": name_of(obj), "kind": def.plural, "uid": uid_of(obj) });
    if !def.group.is_empty() {
        details["group"] = json!(def.group);
    }
    json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details })
}

/// `podutil.UpdatePodCondition`: returns whether anything changed.
pub fn set_pod_condition(
    pod: &mut Value,
    ctype: &str,
    status: &str,
    reason: &str,
    message: &str,
) -> bool {
    let now = now_time();
    let arr = match util::condition_mut(pod, ctype) {
        Ok(c) => {
            let same = c.get("status").and_then(Value::as_str) == Some(status)
                && c.get("reason").and_then(Value::as_str).unwrap_or("") == reason
                && c.get("message").and_then(Value::as_str).unwrap_or("") == message;
            if same {
                return false;
            }
            let cm = c.as_object_mut().expect("condition object");
            if cm.get("status").and_then(Value::as_str) != Some(status) {
                cm.insert("lastTransitionTime".into(), json!(now));
            }
            cm.insert("status".into(), json!(status));
            set_or_remove(cm, "reason", reason);
            set_or_remove(cm, "message", message);
            return true;
        }
        Err(arr) => arr,
    };
    let mut c = Map::new();
    c.insert("type".into(), json!(ctype));
    c.insert("status".into(), json!(status));
    c.insert("lastProbeTime".into(), Value::Null);
    c.insert("lastTransitionTime".into(), json!(now));
    set_or_remove(&mut c, "reason", reason);
    set_or_remove(&mut c, "message", message);
    arr.push(Value::Object(c));
    true
}

fn set_or_remove(m: &mut Map<String, Value>, k: &str, v: &str) {
    if v.is_empty() {
        m.remove(k);
    } else {
        m.insert(k.into(), json!(v));
    }
}

pub fn pod_ready(pod: &Value) -> bool {
    get(pod, &["status", "conditions"])
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Ready")
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })
        })
}

/// Write a pod's status as the status subresource would (used by the kubelet and eviction).
pub fn write_pod_status(st: &mut State, pod: &Value) -> Value {
    let def = crate::resources::lookup("", "v1", "pods").expect("pods");
    let ns = util::ns_of(pod).to_string();
    let name = name_of(pod).to_string();
    match update(
        st,
        def,
        &ns,
        &name,
        pod.clone(),
        Sub::Status,
        false,
        false,
        "kubelet",
    ) {
        Ok((v, _)) => v,
        Err(_) => pod.clone(),
    }
}
