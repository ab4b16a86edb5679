//! `/_double/...`: control calls for a harness that runs the binary.
//!
//! | call | effect |
//! |---|---|
//! | `GET /_double/log` | the request log as JSON lines |
//! | `DELETE /_double/log` | clear the log |
//! | `POST /_double/faults` | inject a fault (`FaultSpec` JSON) → `{"id": N}` |
//! | `DELETE /_double/faults[/ID]` | remove one or all faults |
//! | `POST /_double/objects` | seed an object, a JSON list of objects, or a `List` |
//! | `POST /_double/pods/NS/NAME/finish` | the kubelet finishes a terminating pod now |
//! | `PUT /_double/kubelet` | `{"autoFinish": b, "autoStart": b, "defaultTerminationMs": n}` |
//! | `PUT /_double/kubelet/pods/NS/NAME` | `{"terminationMs": n, "hang": b}` |
//! | `PUT /_double/kubelet/nodes/NAME` | `{"running": b}` |
//! | `PUT /_double/access` | `{"deny": [{"verb", "group", "resource", "subresource", "namespace", "reason"}]}`: SelfSubjectAccessReviews matching a rule are denied (empty/absent field: any) |
//! | `GET /_double/access` | the deny list |
//! | `POST /_double/compact` | drop the watch history (old resourceVersions get 410) |
//! | `GET /_double/rv` | the current resourceVersion |

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Response};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::faults::FaultSpec;
use crate::response::{error_response, Body};
use crate::status::ApiError;
use crate::Shared;

fn ok(v: Value) -> Response<Body> {
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("response")
}

fn bad(msg: impl Into<String>) -> Response<Body> {
    error_response(&ApiError::bad_request(msg))
}

fn body_json(body: &Bytes) -> Result<Value, Box<Response<Body>>> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| Box::new(bad(format!("invalid JSON: {e}"))))
}

pub async fn handle(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    body: &Bytes,
) -> Response<Body> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').skip(1).collect();
    let double = crate::ApiDouble::handle_for(shared.clone());
    match (method.clone(), segs.as_slice()) {
        (Method::GET, ["log"]) => request_log(&double),
        (Method::DELETE, ["log"]) => {
            double.clear_requests();
            ok(json!({}))
        }
        (Method::POST, ["faults"]) => {
            let spec: FaultSpec = match serde_json::from_slice(body) {
                Ok(s) => s,
                Err(e) => return bad(format!("invalid fault: {e}")),
            };
            match spec.into_fault() {
                Ok(f) => ok(json!({ "id": double.inject(f).0 })),
                Err(e) => bad(e),
            }
        }
        (Method::DELETE, ["faults"]) => {
            double.clear_faults();
            ok(json!({}))
        }
        (Method::DELETE, ["faults", id]) => match id.parse() {
            Ok(n) => ok(json!({ "removed": double.remove_fault(crate::FaultId(n)) })),
            Err(_) => bad("invalid fault id"),
        },
        (Method::POST, ["objects"]) => {
            let v = match body_json(body) {
                Ok(v) => v,
                Err(r) => return *r,
            };
            match double.create_all(v) {
                Ok(objs) => ok(json!({ "created": objs.len() })),
                Err(e) => error_response(&e),
            }
        }
        (Method::POST, ["pods", ns, name, "finish"]) => {
            ok(json!({ "finished": double.finish_pod(ns, name) }))
        }
        (Method::PUT, ["kubelet", rest @ ..]) => {
            let v = match body_json(body) {
                Ok(v) => v,
                Err(r) => return *r,
            };
            kubelet(&double, rest, &v)
        }
        (Method::PUT, ["access"]) => {
            let v = match body_json(body) {
                Ok(v) => v,
                Err(r) => return *r,
            };
            let deny = v.get("deny").cloned().unwrap_or(Value::Array(vec![]));
            match serde_json::from_value::<Vec<crate::AccessRule>>(deny) {
                Ok(rules) => {
                    let n = rules.len();
                    double.set_access_rules(rules);
                    ok(json!({ "deny": n }))
                }
                Err(e) => bad(format!("invalid access rules: {e}")),
            }
        }
        (Method::GET, ["access"]) => ok(json!({ "deny": double.access_rules() })),
        (Method::POST, ["compact"]) => {
            double.compact();
            ok(json!({ "resourceVersion": double.resource_version().to_string() }))
        }
        (Method::GET, ["rv"]) => {
            ok(json!({ "resourceVersion": double.resource_version().to_string() }))
        }
        _ => error_response(&ApiError::path_not_found()),
    }
}

/// `PUT /control/kubelet[/pods/NS/NAME | /nodes/NODE]`: the simulated
/// kubelet's settings.
fn kubelet(double: &crate::ApiDouble, rest: &[&str], v: &Value) -> Response<Body> {
    let k = double.kubelet();
    match rest {
        [] => {
            if let Some(b) = v.get("autoFinish").and_then(Value::as_bool) {
                k.set_auto_finish(b);
            }
            if let Some(b) = v.get("autoStart").and_then(Value::as_bool) {
                k.set_auto_start(b);
            }
            if let Some(ms) = v.get("defaultTerminationMs").and_then(Value::as_u64) {
                k.set_default_termination(Duration::from_millis(ms));
            }
            ok(json!({}))
        }
        ["pods", ns, name] => {
            if let Some(ms) = v.get("terminationMs").and_then(Value::as_u64) {
                k.set_termination(ns, name, Duration::from_millis(ms));
            }
            if v.get("hang").and_then(Value::as_bool) == Some(true) {
                k.hang(ns, name);
            }
            ok(json!({}))
        }
        ["nodes", node] => {
            k.set_node_running(
                node,
                v.get("running").and_then(Value::as_bool).unwrap_or(true),
            );
            ok(json!({}))
        }
        _ => error_response(&ApiError::path_not_found()),
    }
}

/// `GET /control/log`: every request seen, one JSON line each.
fn request_log(double: &crate::ApiDouble) -> Response<Body> {
    let mut out = String::new();
    for r in double.requests() {
        out.push_str(&r.to_json().to_string());
        out.push('\n');
    }
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Full::new(Bytes::from(out)).boxed_unsync())
        .expect("response")
}
