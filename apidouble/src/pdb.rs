//! The eviction subresource (pkg/registry/core/pod/storage/eviction.go) and a
//! synchronous stand-in for the disruption controller that keeps
//! PodDisruptionBudget status in step with the pods.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::ops::{self, DeleteOpts};
use crate::resources::{lookup, ResourceDef};
use crate::selectors::LabelSelector;
use crate::status::{ApiError, ApiResult};
use crate::store::State;
use crate::util::{get, labels_of, name_of, now_time, rv_of, s, uid_of};

/// The disruption controller's DeletionTimeout for `status.disruptedPods`.
const DELETION_TIMEOUT_SECS: i64 = 120;

fn pods_def() -> &'static ResourceDef {
    lookup("", "v1", "pods").expect("pods")
}

fn matching_pdbs(st: &State, pod: &Value) -> Vec<Value> {
    let labels = labels_of(pod);
    let ns = crate::util::ns_of(pod);
    st.list("poddisruptionbudgets", Some(ns))
        .filter(|pdb| {
            LabelSelector::from_object(get(pdb, &["spec", "selector"]))
                .map(|sel| sel.matches(&labels))
                .unwrap_or(false)
        })
        .cloned()
        .collect()
}

fn can_ignore_pdb(pod: &Value) -> bool {
    matches!(
        s(pod, &["status", "phase"]),
        Some("Succeeded" | "Failed" | "Pending")
    ) || crate::util::is_deleting(pod)
}

fn should_enforce_rv(pod: &Value) -> bool {
    !(matches!(s(pod, &["status", "phase"]), Some("Succeeded" | "Failed"))
        || crate::util::is_deleting(pod))
}

fn too_many_requests_processing(pdb_name: &str) -> ApiError {
    let mut e = ApiError::too_many_requests(
        "Cannot evict pod as it would violate the pod's disruption budget.",
        10,
    );
    e.details = Some(json!({ "causes": [{
        "reason": "DisruptionBudget",
        "message": format!("The disruption budget {pdb_name} is still being processed by the server.")
    }]}));
    e
}

/// POST .../pods/{name}/eviction. Returns the success Status (201).
pub fn evict(
    st: &mut State,
    ns: &str,
    name: &str,
    body: &Value,
    query_dry_run: bool,
) -> ApiResult<Value> {
    let av = s(body, &["apiVersion"]).unwrap_or("policy/v1");
    if !matches!(av, "policy/v1" | "policy/v1beta1")
        || s(body, &["kind"]).is_some_and(|k| k != "Eviction")
    {
        return Err(ApiError::bad_request(format!(
            "not a Eviction object: {av} {}",
            s(body, &["kind"]).unwrap_or("")
        )));
    }
    if name_of(body) != name {
        return Err(ApiError::bad_request(
            "name in URL does not match name in Eviction object",
        ));
    }
    let body_ns = crate::util::ns_of(body);
    if !body_ns.is_empty() && body_ns != ns {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let mut opts = DeleteOpts {
        dry_run: query_dry_run,
        ..Default::default()
    };
    if let Some(d) = body.get("deleteOptions").filter(|v| v.is_object()) {
        opts.merge_body(d);
    }
    let pods = pods_def();
    let Some(pod) = st.get("pods", ns, name).cloned() else {
        return Err(ApiError::not_found(pods, name));
    };
    let success = json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201 });

    if can_ignore_pdb(&pod) {
        let mut o = opts.clone();
        if should_enforce_rv(&pod) && o.precond_rv.is_none() {
            o.precond_rv = Some(rv_of(&pod).to_string());
        }
        add_condition_and_delete(st, ns, name, &o)?;
        return Ok(success);
    }

    let pdbs = matching_pdbs(st, &pod);
    if pdbs.len() > 1 {
        return Err(ApiError::new(
            500,
            "",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
        ));
    }
    let mut update_delete_options = false;
    let mut pdb_name = String::new();
    if let Some(pdb) = pdbs.first() {
        pdb_name = name_of(pdb).to_string();
        let status = pdb.get("status").cloned().unwrap_or(json!({}));
        let num = |k: &str| status.get(k).and_then(Value::as_i64).unwrap_or(0);
        let skip_check = if !ops::pod_ready(&pod) {
            if s(pdb, &["spec", "unhealthyPodEvictionPolicy"]) == Some("AlwaysAllow") {
                true
            } else {
                num("currentHealthy") >= num("desiredHealthy") && num("desiredHealthy") > 0
            }
        } else {
            false
        };
        if skip_check {
            update_delete_options = true;
        } else {
            check_and_decrement(st, pdb, name, opts.dry_run)?;
        }
    }
    let mut o = opts.clone();
    if update_delete_options {
        o.precond_rv = Some(rv_of(&pod).to_string());
    }
    match add_condition_and_delete(st, ns, name, &o) {
        Err(e) if e.code == 409 && update_delete_options && opts.precond_rv.is_none() => {
            Err(too_many_requests_processing(&pdb_name))
        }
        Err(e) => Err(e),
        Ok(()) => Ok(success),
    }
}

fn check_and_decrement(
    st: &mut State,
    pdb: &Value,
    pod_name: &str,
    dry_run: bool,
) -> ApiResult<()> {
    let name = name_of(pdb).to_string();
    let status = pdb.get("status").cloned().unwrap_or(json!({}));
    let num = |k: &str| status.get(k).and_then(Value::as_i64).unwrap_or(0);
    let generation = get(pdb, &["metadata", "generation"])
        .and_then(Value::as_i64)
        .unwrap_or(0);
    if num("observedGeneration") < generation {
        return Err(too_many_requests_processing(&name));
    }
    let allowed = num("disruptionsAllowed");
    if allowed < 0 {
        return Err(ApiError::forbidden(
            "poddisruptionbudget.policy",
            &name,
            "pdb disruptions allowed is negative",
        ));
    }
    let disrupted = status
        .get("disruptedPods")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    if disrupted.len() > 2000 {
        return Err(ApiError::forbidden(
            "poddisruptionbudget.policy",
            &name,
            "DisruptedPods map too big - too many evictions not confirmed by PDB controller",
        ));
    }
    if allowed == 0 {
        let mut e = ApiError::too_many_requests(
            "Cannot evict pod as it would violate the pod's disruption budget.",
            0,
        );
        e.details = Some(json!({ "causes": [{
            "reason": "DisruptionBudget",
            "message": format!(
                "The disruption budget {name} needs {} healthy pods and has {} currently",
                num("desiredHealthy"),
                num("currentHealthy")
            )
        }]}));
        return Err(e);
    }
    if dry_run {
        return Ok(());
    }
    let mut new = pdb.clone();
    let st_map = crate::util::obj_mut(&mut new, &["status"]);
    st_map.insert("disruptionsAllowed".into(), json!(allowed - 1));
    let dp = st_map.entry("disruptedPods").or_insert_with(|| json!({}));
    if let Some(m) = dp.as_object_mut() {
        m.insert(pod_name.to_string(), json!(now_time()));
    }
    if allowed - 1 == 0 {
        let og = num("observedGeneration");
        set_disruption_condition(&mut new, 0, og);
    }
    st.replace("poddisruptionbudgets", new);
    Ok(())
}

/// Adds the DisruptionTarget condition through the status subresource, then deletes.
fn add_condition_and_delete(
    st: &mut State,
    ns: &str,
    name: &str,
    opts: &DeleteOpts,
) -> ApiResult<()> {
    let mut opts = opts.clone();
    if !opts.dry_run {
        let latest = st
            .get("pods", ns, name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(pods_def(), name))?;
        if let Some(why) = crate::util::precondition_mismatch(
            opts.precond_uid.as_deref().filter(|u| !u.is_empty()),
            opts.precond_rv.as_deref().filter(|r| !r.is_empty()),
            &latest,
        ) {
            return Err(ApiError::conflict_on("Pod", "", "Pod", name, &why));
        }
        let mut pod = latest.clone();
        if ops::set_pod_condition(
            &mut pod,
            "DisruptionTarget",
            "True",
            "EvictionByEvictionAPI",
            "Eviction API: evicting",
        ) {
            let updated = ops::write_pod_status(st, &pod);
            if opts.precond_rv.is_some() {
                opts.precond_rv = Some(rv_of(&updated).to_string());
            }
        }
    }
    ops::delete(st, pods_def(), ns, name, &opts)?;
    Ok(())
}

fn set_disruption_condition(pdb: &mut Value, allowed: i64, observed_generation: i64) {
    let (status, reason) = if allowed > 0 {
        ("True", "SufficientPods")
    } else {
        ("False", "InsufficientPods")
    };
    set_condition(
        pdb,
        "DisruptionAllowed",
        status,
        reason,
        "",
        observed_generation,
    );
}

/// `apimeta.SetStatusCondition` for a metav1.Condition list.
fn set_condition(
    obj: &mut Value,
    ctype: &str,
    status: &str,
    reason: &str,
    message: &str,
    observed_generation: i64,
) {
    match crate::util::condition_mut(obj, ctype) {
        Ok(c) => {
            if c.get("status").and_then(Value::as_str) != Some(status) {
                c["lastTransitionTime"] = json!(now_time());
            }
            c["status"] = json!(status);
            c["reason"] = json!(reason);
            c["message"] = json!(message);
            c["observedGeneration"] = json!(observed_generation);
        }
        Err(arr) => arr.push(json!({
            "type": ctype, "status": status, "reason": reason, "message": message,
            "observedGeneration": observed_generation, "lastTransitionTime": now_time()
        })),
    }
}

fn controller_ref(pod: &Value) -> Option<&Value> {
    get(pod, &["metadata", "ownerReferences"])
        .and_then(Value::as_array)?
        .iter()
        .find(|o| o.get("controller").and_then(Value::as_bool) == Some(true))
}

/// The finders of the disruption controller: ReplicaSet (or its Deployment) and StatefulSet scale.
fn find_scale(st: &State, ns: &str, cref: &Value) -> Option<(String, i64)> {
    let kind = cref.get("kind").and_then(Value::as_str)?;
    let name = cref.get("name").and_then(Value::as_str)?;
    let uid = cref.get("uid").and_then(Value::as_str)?;
    let replicas = |o: &Value| {
        get(o, &["spec", "replicas"])
            .and_then(Value::as_i64)
            .unwrap_or(1)
    };
    match kind {
        "ReplicaSet" => {
            let rs = st
                .get("replicasets", ns, name)
                .filter(|rs| uid_of(rs) == uid)?;
            if let Some(dref) = controller_ref(rs)
                .filter(|r| r.get("kind").and_then(Value::as_str) == Some("Deployment"))
            {
                let dname = dref.get("name").and_then(Value::as_str)?;
                let duid = dref.get("uid").and_then(Value::as_str)?;
                let d = st
                    .get("deployments", ns, dname)
                    .filter(|d| uid_of(d) == duid)?;
                return Some((duid.to_string(), replicas(d)));
            }
            Some((uid.to_string(), replicas(rs)))
        }
        "StatefulSet" => {
            let sts = st
                .get("statefulsets", ns, name)
                .filter(|s| uid_of(s) == uid)?;
            Some((uid.to_string(), replicas(sts)))
        }
        _ => None,
    }
}

/// One pass of the disruption controller over the budgets of `ns`.
pub fn sync_namespace(st: &mut State, ns: &str) {
    let pdbs: Vec<Value> = st.list("poddisruptionbudgets", Some(ns)).cloned().collect();
    let now = jiff::Timestamp::now();
    for pdb in pdbs {
        let sel = LabelSelector::from_object(get(&pdb, &["spec", "selector"]))
            .unwrap_or_else(|_| LabelSelector::nothing());
        let pods: Vec<Value> = st
            .list("pods", Some(ns))
            .filter(|p| sel.matches(&labels_of(p)))
            .cloned()
            .collect();
        let generation = get(&pdb, &["metadata", "generation"])
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let old_status = pdb.get("status").cloned().unwrap_or(json!({}));
        let mut new = pdb.clone();

        let expected = expected_pods(st, ns, &pdb, &pods);
        let (expected_count, desired) = match expected {
            Ok(v) => v,
            Err(msg) => {
                let st_map = crate::util::obj_mut(&mut new, &["status"]);
                st_map.insert("disruptionsAllowed".into(), json!(0));
                let og = old_status
                    .get("observedGeneration")
                    .and_then(Value::as_i64)
                    .unwrap_or(0);
                set_condition(
                    &mut new,
                    "DisruptionAllowed",
                    "False",
                    "SyncFailed",
                    &msg,
                    og,
                );
                if new != pdb {
                    st.replace("poddisruptionbudgets", new);
                }
                continue;
            }
        };
        let disrupted = disrupted_pods(&old_status, &pods, now);
        let healthy = pods
            .iter()
            .filter(|p| {
                !crate::util::is_deleting(p)
                    && !disrupted.contains_key(name_of(p))
                    && ops::pod_ready(p)
            })
            .count() as i64;
        let mut allowed = healthy - desired;
        if expected_count <= 0 || allowed <= 0 {
            allowed = 0;
        }
        let st_map = crate::util::obj_mut(&mut new, &["status"]);
        st_map.insert("observedGeneration".into(), json!(generation));
        st_map.insert("disruptionsAllowed".into(), json!(allowed));
        st_map.insert("currentHealthy".into(), json!(healthy));
        st_map.insert("desiredHealthy".into(), json!(desired));
        st_map.insert("expectedPods".into(), json!(expected_count));
        if disrupted.is_empty() {
            st_map.remove("disruptedPods");
        } else {
            st_map.insert("disruptedPods".into(), Value::Object(disrupted));
        }
        set_disruption_condition(&mut new, allowed, generation);
        if new != pdb {
            st.replace("poddisruptionbudgets", new);
        }
    }
}

/// buildDisruptedPodMap: the budget's disrupted pods still present, not
/// deleting, and within their deletion timeout.
fn disrupted_pods(old_status: &Value, pods: &[Value], now: jiff::Timestamp) -> Map<String, Value> {
    let mut disrupted = Map::new();
    if let Some(old) = old_status.get("disruptedPods").and_then(Value::as_object) {
        for (pname, t) in old {
            let Some(p) = pods.iter().find(|p| name_of(p) == pname) else {
                continue;
            };
            if crate::util::is_deleting(p) {
                continue;
            }
            let Some(ts) = t.as_str().and_then(crate::util::parse_time) else {
                continue;
            };
            let expiry = ts
                .checked_add(jiff::SignedDuration::from_secs(DELETION_TIMEOUT_SECS))
                .unwrap_or(ts);
            if expiry < now {
                continue;
            }
            disrupted.insert(pname.clone(), t.clone());
        }
    }
    disrupted
}

/// getExpectedPodCount: (expectedCount, desiredHealthy).
fn expected_pods(st: &State, ns: &str, pdb: &Value, pods: &[Value]) -> Result<(i64, i64), String> {
    let spec = pdb.get("spec").cloned().unwrap_or(json!({}));
    let max = spec.get("maxUnavailable").filter(|v| !v.is_null());
    let min = spec.get("minAvailable").filter(|v| !v.is_null());
    let scale = || -> Result<i64, String> {
        let mut controllers: BTreeMap<String, i64> = BTreeMap::new();
        for p in pods {
            let Some(cref) = controller_ref(p) else {
                continue;
            }; // unmanaged pods are ignored
            let uid = cref
                .get("uid")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            if controllers.contains_key(&uid) {
                continue;
            }
            match find_scale(st, ns, cref) {
                Some((key, n)) => {
                    controllers.insert(key, n);
                }
                None => return Err(format!("found no controllers for pod \"{}\"", name_of(p))),
            }
        }
        Ok(controllers.values().sum())
    };
    if let Some(max) = max {
        let expected = scale()?;
        let mu = ops::int_or_percent(max, expected, true).ok_or("invalid maxUnavailable")?;
        return Ok((expected, (expected - mu).max(0)));
    }
    if let Some(min) = min {
        if min.is_number() {
            return Ok((pods.len() as i64, min.as_i64().unwrap_or(0)));
        }
        let expected = scale()?;
        let ma = ops::int_or_percent(min, expected, true).ok_or("invalid minAvailable")?;
        return Ok((expected, ma));
    }
    Ok((0, 0))
}

/// Run the controller for every namespace touched since the last pass.
pub fn run_controllers(st: &mut State) {
    let dirty = std::mem::take(&mut st.dirty_ns);
    for ns in dirty {
        sync_namespace(st, &ns);
    }
    st.dirty_ns.clear();
}
