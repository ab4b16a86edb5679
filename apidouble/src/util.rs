//! Small helpers: timestamps, uids, generated names, JSON accessors.

use serde_json::{Map, Value};

/// `metav1.Time`: RFC 3339, whole seconds, UTC (what the apiserver writes).
pub fn now_time() -> String {
    fmt_time(jiff::Timestamp::now())
}

pub fn fmt_time(ts: jiff::Timestamp) -> String {
    jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", ts).unwrap_or_default()
}

pub fn parse_time(s: &str) -> Option<jiff::Timestamp> {
    s.parse::<jiff::Timestamp>().ok()
}

pub fn new_uid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The apiserver's SimpleNameGenerator: 5 characters from an alphabet without vowels.
pub fn generate_name(base: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let base = if base.len() > 58 { &base[..58] } else { base };
    let bytes = uuid::Uuid::new_v4().into_bytes();
    let suffix: String = bytes[..5]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect();
    format!("{base}{suffix}")
}

pub fn s<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    get(v, path).and_then(Value::as_str)
}

pub fn get<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    if cur.is_null() {
        None
    } else {
        Some(cur)
    }
}

/// The object map at `path`, created (replacing non-objects) as needed.
pub fn obj_mut<'a>(v: &'a mut Value, path: &[&str]) -> &'a mut Map<String, Value> {
    let mut cur = v;
    for p in path {
        if !cur.is_object() {
            *cur = Value::Object(Map::new());
        }
        let m = cur.as_object_mut().expect("object");
        cur = m
            .entry(p.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    if !cur.is_object() {
        *cur = Value::Object(Map::new());
    }
    cur.as_object_mut().expect("object")
}

pub fn meta_mut(v: &mut Value) -> &mut Map<String, Value> {
    obj_mut(v, &["metadata"])
}

pub fn name_of(v: &Value) -> &str {
    s(v, &["metadata", "name"]).unwrap_or("")
}

pub fn ns_of(v: &Value) -> &str {
    s(v, &["metadata", "namespace"]).unwrap_or("")
}

pub fn uid_of(v: &Value) -> &str {
    s(v, &["metadata", "uid"]).unwrap_or("")
}

pub fn rv_of(v: &Value) -> &str {
    s(v, &["metadata", "resourceVersion"]).unwrap_or("")
}

pub fn labels_of(v: &Value) -> Map<String, Value> {
    get(v, &["metadata", "labels"])
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

pub fn finalizers_of(v: &Value) -> Vec<String> {
    get(v, &["metadata", "finalizers"])
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

pub fn is_deleting(v: &Value) -> bool {
    get(v, &["metadata", "deletionTimestamp"]).is_some()
}

/// Remove `null` members and empty objects/arrays where the apiserver's
/// `omitempty` would drop them (maps only: labels/annotations etc.).
pub fn drop_empty_meta_maps(v: &mut Value) {
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        for key in ["labels", "annotations", "finalizers", "ownerReferences"] {
            let empty = match m.get(key) {
                Some(Value::Object(o)) => o.is_empty(),
                Some(Value::Array(a)) => a.is_empty(),
                Some(Value::Null) => true,
                _ => false,
            };
            if empty {
                m.remove(key);
            }
        }
    }
}

/// The `type: ctype` entry of `obj.status.conditions` (the list made when
/// missing or not a list), or the list to push a new one onto.
pub fn condition_mut<'a>(
    obj: &'a mut Value,
    ctype: &str,
) -> Result<&'a mut Value, &'a mut Vec<Value>> {
    let conds = obj_mut(obj, &["status"])
        .entry("conditions")
        .or_insert_with(|| Value::Array(Vec::new()));
    if !conds.is_array() {
        *conds = Value::Array(Vec::new());
    }
    let arr = conds.as_array_mut().expect("array");
    match arr
        .iter()
        .position(|c| c.get("type").and_then(Value::as_str) == Some(ctype))
    {
        Some(i) => Ok(&mut arr[i]),
        None => Err(arr),
    }
}

/// Why a delete's preconditions fail on `obj` (the API server's words), if
/// they do.
pub fn precondition_mismatch(uid: Option<&str>, rv: Option<&str>, obj: &Value) -> Option<String> {
    if let Some(uid) = uid.filter(|u| *u != uid_of(obj)) {
        return Some(format!(
            "the UID in the precondition ({uid}) does not match the UID in record ({}). The object might have been deleted and then recreated",
            uid_of(obj)
        ));
    }
    rv.filter(|r| *r != rv_of(obj)).map(|rv| {
        format!(
            "the ResourceVersion in the precondition ({rv}) does not match the ResourceVersion in record ({}). The object might have been modified",
            rv_of(obj)
        )
    })
}
