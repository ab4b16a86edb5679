//! The taint eviction controller (`pkg/controller/tainteviction`), run
//! after every write like the disruption controller: a pod bound to a node
//! with a `NoExecute` taint it does not tolerate gets the `DisruptionTarget`
//! condition (reason `DeletionByTaintManager`), then a graceful delete (its
//! own grace period). Tolerations with `tolerationSeconds` are not timed:
//! such a pod is left alone.
use serde_json::Value;

use crate::ops::{self, DeleteOpts};
use crate::resources::lookup;
use crate::store::State;
use crate::util::{get, is_deleting, name_of, ns_of, s};

pub fn run(st: &mut State) {
    let tainted: Vec<(String, Vec<Value>)> = st
        .list("nodes", None)
        .filter_map(|n| {
            let taints: Vec<Value> = get(n, &["spec", "taints"])?
                .as_array()?
                .iter()
                .filter(|t| t["effect"] == "NoExecute")
                .cloned()
                .collect();
            (!taints.is_empty()).then(|| (name_of(n).to_string(), taints))
        })
        .collect();
    if tainted.is_empty() {
        return;
    }
    let evict: Vec<Value> = st
        .list("pods", None)
        .filter(|p| !is_deleting(p))
        .filter(|p| {
            let node = s(p, &["spec", "nodeName"]).unwrap_or("");
            tainted
                .iter()
                .any(|(n, ts)| n == node && ts.iter().any(|t| !tolerated(p, t)))
        })
        .cloned()
        .collect();
    let Some(def) = lookup("", "v1", "pods") else {
        return;
    };
    for mut pod in evict {
        if ops::set_pod_condition(
            &mut pod,
            "DisruptionTarget",
            "True",
            "DeletionByTaintManager",
            "Taint manager: deleting due to NoExecute taint",
        ) {
            ops::write_pod_status(st, &pod);
        }
        let (ns, name) = (ns_of(&pod).to_string(), name_of(&pod).to_string());
        let _ = ops::delete(st, def, &ns, &name, &DeleteOpts::default());
    }
}

/// `v1helper.TolerationsTolerateTaint` for one taint, without the seconds.
fn tolerated(pod: &Value, taint: &Value) -> bool {
    let Some(ts) = get(pod, &["spec", "tolerations"]).and_then(Value::as_array) else {
        return false;
    };
    ts.iter().any(|t| {
        let exists = t["operator"] == "Exists";
        let key = t["key"].as_str().unwrap_or("");
        let key_ok = if key.is_empty() {
            exists
        } else {
            t["key"] == taint["key"]
        };
        let effect = t["effect"].as_str().unwrap_or("");
        let effect_ok = effect.is_empty() || t["effect"] == taint["effect"];
        let value_ok =
            exists || t["value"].as_str().unwrap_or("") == taint["value"].as_str().unwrap_or("");
        key_ok && effect_ok && value_ok
    })
}
