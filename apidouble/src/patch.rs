//! The three patch types the apiserver accepts besides server-side apply:
//! JSON merge patch (RFC 7386), strategic merge patch, JSON patch (RFC 6902).

use serde_json::{Map, Value};

use crate::resources::{ListRule, ResourceDef};
use crate::status::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Json,
    Merge,
    Strategic,
    Apply,
}

impl PatchType {
    pub fn from_content_type(ct: &str) -> Option<Self> {
        let base = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match base.as_str() {
            "application/json-patch+json" => Some(Self::Json),
            "application/merge-patch+json" => Some(Self::Merge),
            "application/strategic-merge-patch+json" => Some(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Some(Self::Apply),
            _ => None,
        }
    }
}

/// RFC 7386.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(pm) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            let tm = target.as_object_mut().expect("object");
            for (k, v) in pm {
                if v.is_null() {
                    tm.remove(k);
                } else {
                    merge_patch(tm.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// RFC 6902; a failed `test` (or any failed operation) is a 422 as in patch.go.
pub fn json_patch(target: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let p: json_patch::Patch =
        serde_json::from_value(patch.clone()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    json_patch::patch(target, &p).map_err(|_| ApiError::unprocessable_generic())
}

fn smp_err(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg)
}

/// Strategic merge patch with the list semantics of `def`.
pub fn strategic_merge_patch(
    def: &ResourceDef,
    target: &mut Value,
    patch: &Value,
) -> Result<(), ApiError> {
    let Some(pm) = patch.as_object() else {
        return Err(smp_err("strategic merge patch must be a JSON object"));
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let tm = target.as_object_mut().expect("object");
    match merge_map(def, tm, pm, "")? {
        MapOutcome::Keep => Ok(()),
        MapOutcome::Delete => {
            tm.clear();
            Ok(())
        }
    }
}

enum MapOutcome {
    Keep,
    Delete,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(
            a.iter()
                .filter(|x| {
                    !(x.is_object()
                        && x.get("$patch").is_some()
                        && x.as_object().is_some_and(|m| m.len() == 1))
                })
                .map(strip_directives)
                .collect(),
        ),
        other => other.clone(),
    }
}

/// `$deleteFromPrimitiveList/<field>` and `$setElementOrder/<field>`.
fn list_directives(
    def: &ResourceDef,
    orig: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    path: &str,
) -> Result<(), ApiError> {
    for (k, pv) in patch {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            let Some(del) = pv.as_array() else {
                return Err(smp_err(
                    "invalid patch: $deleteFromPrimitiveList must be a list",
                ));
            };
            if let Some(Value::Array(list)) = orig.get_mut(field) {
                list.retain(|x| !del.contains(x));
            }
        } else if let Some(field) = k.strip_prefix("$setElementOrder/") {
            let Some(order) = pv.as_array() else {
                return Err(smp_err("invalid patch: $setElementOrder must be a list"));
            };
            let rule = def.list_rule(&join(path, field));
            if let Some(Value::Array(list)) = orig.get_mut(field) {
                reorder(list, order, rule);
            }
        }
    }
    Ok(())
}

fn merge_map(
    def: &ResourceDef,
    orig: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    path: &str,
) -> Result<MapOutcome, ApiError> {
    if let Some(directive) = patch.get("$patch") {
        match directive.as_str() {
            Some("replace") => {
                *orig = strip_directives(&Value::Object(patch.clone()))
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                return Ok(MapOutcome::Keep);
            }
            Some("delete") => return Ok(MapOutcome::Delete),
            Some("merge") => {}
            _ => return Err(smp_err(format!("Unknown patch type: {directive}"))),
        }
    }
    let retain: Option<Vec<String>> = match patch.get("$retainKeys") {
        None => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect(),
        ),
        Some(_) => {
            return Err(smp_err(
                "invalid patch: $retainKeys must be a list of strings",
            ))
        }
    };
    for (k, pv) in patch {
        if k.starts_with('$') {
            continue;
        }
        let sub = join(path, k);
        if pv.is_null() {
            orig.remove(k);
            continue;
        }
        match pv {
            Value::Object(pvm) => {
                let entry = orig
                    .entry(k.clone())
                    .or_insert_with(|| Value::Object(Map::new()));
                if !entry.is_object() {
                    *entry = Value::Object(Map::new());
                }
                let em = entry.as_object_mut().expect("object");
                if let MapOutcome::Delete = merge_map(def, em, pvm, &sub)? {
                    orig.remove(k);
                }
            }
            Value::Array(pa) => {
                let rule = def.list_rule(&sub);
                let existing = orig
                    .get(k)
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                let merged = merge_list(def, existing, pa, rule, &sub)?;
                orig.insert(k.clone(), Value::Array(merged));
            }
            other => {
                orig.insert(k.clone(), other.clone());
            }
        }
    }
    list_directives(def, orig, patch, path)?;
    if let Some(keep) = retain {
        orig.retain(|k, _| keep.iter().any(|r| r == k));
    }
    Ok(MapOutcome::Keep)
}

fn item_key<'a>(item: &'a Value, key: &str) -> Option<&'a Value> {
    item.get(key)
}

fn reorder(list: &mut [Value], order: &[Value], rule: ListRule) {
    let pos = |item: &Value| -> Option<usize> {
        order.iter().position(|o| match rule {
            ListRule::MergeByKey(k) => item_key(item, k).is_some() && item_key(item, k) == o.get(k),
            _ => o == item,
        })
    };
    // stable: listed items by their order index, the rest keep their relative order after them
    let mut indexed: Vec<(usize, usize, Value)> = list
        .iter()
        .enumerate()
        .map(|(i, v)| (pos(v).unwrap_or(usize::MAX), i, v.clone()))
        .collect();
    indexed.sort_by_key(|(p, i, _)| (*p, *i));
    for (slot, (_, _, v)) in list.iter_mut().zip(indexed) {
        *slot = v;
    }
}

fn merge_list(
    def: &ResourceDef,
    mut orig: Vec<Value>,
    patch: &[Value],
    rule: ListRule,
    path: &str,
) -> Result<Vec<Value>, ApiError> {
    let replace = patch.iter().any(|x| {
        x.get("$patch").and_then(Value::as_str) == Some("replace")
            && x.as_object().is_some_and(|m| m.len() == 1)
    });
    if replace {
        return Ok(patch
            .iter()
            .filter(|x| x.get("$patch").is_none())
            .map(strip_directives)
            .collect());
    }
    match rule {
        ListRule::Replace => Ok(patch.iter().map(strip_directives).collect()),
        ListRule::MergePrimitive => {
            for p in patch {
                if p.is_object() {
                    return Err(smp_err(format!(
                        "invalid patch for {path}: expected a list of primitives"
                    )));
                }
                if !orig.contains(p) {
                    orig.push(p.clone());
                }
            }
            Ok(orig)
        }
        ListRule::MergeByKey(key) => {
            for p in patch {
                let Some(pm) = p.as_object() else {
                    return Err(smp_err(format!(
                        "invalid patch for {path}: expected a list of maps"
                    )));
                };
                let Some(kv) = pm.get(key) else {
                    return Err(smp_err(format!(
                        "map: {p} does not contain declared merge key: {key}"
                    )));
                };
                let directive = pm.get("$patch").and_then(Value::as_str);
                if directive == Some("delete") {
                    orig.retain(|o| o.get(key) != Some(kv));
                    continue;
                }
                if let Some(existing) = orig.iter_mut().find(|o| o.get(key) == Some(kv)) {
                    if !existing.is_object() {
                        *existing = Value::Object(Map::new());
                    }
                    let em = existing.as_object_mut().expect("object");
                    if let MapOutcome::Delete = merge_map(def, em, pm, path)? {
                        orig.retain(|o| o.get(key) != Some(kv));
                    }
                } else {
                    let mut fresh = Map::new();
                    if let MapOutcome::Keep = merge_map(def, &mut fresh, pm, path)? {
                        orig.push(Value::Object(fresh));
                    }
                }
            }
            Ok(orig)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::lookup;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
        let mut t = json!({"l": [1, 2]});
        merge_patch(&mut t, &json!({"l": [3]}));
        assert_eq!(t, json!({"l": [3]}));
    }

    #[test]
    fn smp_conditions_merge_taints_replace() {
        let node = lookup("", "v1", "nodes").unwrap();
        let mut t = json!({
            "spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "DiskPressure", "status": "False"}]}
        });
        let p = json!({
            "spec": {"taints": [{"key": "b", "effect": "NoExecute"}]},
            "status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "X", "status": "True"}]}
        });
        strategic_merge_patch(node, &mut t, &p).unwrap();
        assert_eq!(
            t["spec"]["taints"],
            json!([{"key": "b", "effect": "NoExecute"}])
        );
        assert_eq!(
            t["status"]["conditions"],
            json!([{"type": "Ready", "status": "False"}, {"type": "DiskPressure", "status": "False"}, {"type": "X", "status": "True"}])
        );
    }

    #[test]
    fn smp_directives() {
        let pod = lookup("", "v1", "pods").unwrap();
        let mut t = json!({"metadata": {"finalizers": ["a"], "labels": {"x": "1", "y": "2"}},
            "spec": {"containers": [{"name": "c1", "image": "i1"}, {"name": "c2", "image": "i2"}]}});
        let p = json!({
            "metadata": {"finalizers": ["b"], "labels": {"y": null}, "$deleteFromPrimitiveList/finalizers": ["a"]},
            "spec": {"containers": [{"name": "c1", "$patch": "delete"}, {"name": "c2", "image": "new"}]}
        });
        strategic_merge_patch(pod, &mut t, &p).unwrap();
        assert_eq!(t["metadata"]["finalizers"], json!(["b"]));
        assert_eq!(t["metadata"]["labels"], json!({"x": "1"}));
        assert_eq!(
            t["spec"]["containers"],
            json!([{"name": "c2", "image": "new"}])
        );
        let p = json!({"metadata": {"labels": {"$patch": "replace", "z": "3"}},
                       "spec": {"containers": [{"$patch": "replace"}, {"name": "only", "image": "i"}]}});
        strategic_merge_patch(pod, &mut t, &p).unwrap();
        assert_eq!(t["metadata"]["labels"], json!({"z": "3"}));
        assert_eq!(
            t["spec"]["containers"],
            json!([{"name": "only", "image": "i"}])
        );
        assert!(strategic_merge_patch(
            pod,
            &mut t,
            &json!({"spec": {"containers": [{"image": "nokey"}]}})
        )
        .is_err());
    }
}
