//! The HTTP front: hyper (HTTP/1.1 and h2c), fault injection, the request
//! log, routing and the REST handlers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::faults::FaultKind;
use crate::ops::{self, DeleteOpts, Deleted, Sub};
use crate::patch::PatchType;
use crate::resources::{lookup, ResourceDef};
use crate::response::{error_response, full, json_response, text_response, Body};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::{ApiError, ApiResult, FieldErr};
use crate::util::{name_of, uid_of};
use crate::watch::{self, Filter, WatchParams};
use crate::{discovery, reqlog::RequestRecord, Shared};

/// Returned by the service to make hyper close the connection without a response.
#[derive(Debug)]
pub struct DroppedByFault;

impl std::fmt::Display for DroppedByFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by an injected fault")
    }
}

impl std::error::Error for DroppedByFault {}

pub async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        conns.spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(shared.clone(), req));
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

type Query = HashMap<String, String>;

fn parse_query(q: &str) -> Query {
    form_urlencoded::parse(q.as_bytes()).into_owned().collect()
}

/// The request routed, its answer as `PartialObjectMetadata` when the
/// client asked for that (a GET that is not a watch).
async fn answer(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    req: &Req<'_>,
    accept: Option<&str>,
) -> Response<Body> {
    let resp = route(shared, method, path, req).await;
    let watch = req.q.contains_key("watch") || path.contains("/watch/");
    if as_partial_metadata(accept) && *method == Method::GET && !watch && resp.status() == 200 {
        return partial_metadata(resp).await;
    }
    resp
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, DroppedByFault> {
    let instant = Instant::now();
    let at = SystemTime::now();
    let (parts, incoming) = req.into_parts();
    let path = parts.uri.path().to_string();
    let query_raw = parts.uri.query().unwrap_or("").to_string();
    let method = parts.method.as_str().to_string();
    let text = |name| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let (ct, accept, ua) = (
        text(header::CONTENT_TYPE),
        text(header::ACCEPT),
        text(header::USER_AGENT),
    );
    let body = match incoming.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Err(DroppedByFault),
    };

    if path == "/_double" || path.starts_with("/_double/") {
        return Ok(crate::control::handle(&shared, &parts.method, &path, &body).await);
    }

    let query = parse_query(&query_raw);
    let is_watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"))
        || path.contains("/watch/");
    let mut record = RequestRecord {
        seq: 0,
        method: method.clone(),
        path: path.clone(),
        query: query_raw.clone(),
        content_type: ct.clone(),
        body: (!body.is_empty()).then(|| {
            serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into()))
        }),
        status: 0,
        fault: None,
        watch: is_watch,
        user_agent: ua.clone(),
        at,
        instant,
        since_start: instant.duration_since(shared.started),
        elapsed: Duration::ZERO,
    };
    record.seq = shared.next_seq();

    // Faults: latency first (all matching), then the first status/drop fault.
    let (latency, action, descr) = shared.take_faults(&method, &path);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    record.fault = descr;
    let resp = match action {
        Some(FaultKind::Drop) => {
            record.elapsed = instant.elapsed();
            shared.log(record);
            return Err(DroppedByFault);
        }
        Some(FaultKind::Status { code, retry_after }) => {
            let mut e = ApiError::for_code(code, None);
            e.retry_after = retry_after;
            error_response(&e)
        }
        _ => {
            let req = Req {
                q: &query,
                ct: ct.as_deref(),
                body: &body,
                manager: manager(&query, ua.as_deref()),
            };
            answer(&shared, &parts.method, &path, &req, accept.as_deref()).await
        }
    };
    record.status = resp.status().as_u16();
    record.elapsed = instant.elapsed();
    shared.log(record);
    Ok(resp)
}

/// `Accept: application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1`
/// (kube's `get_metadata`): the object's metadata only.
fn as_partial_metadata(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').next().is_some_and(|first| {
            first
                .split(';')
                .any(|p| p.trim() == "as=PartialObjectMetadata")
        })
    })
}

async fn partial_metadata(resp: Response<Body>) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes);
    let Ok(v) = serde_json::from_slice::<Value>(&bytes) else {
        return Response::from_parts(parts, full(bytes.to_vec()));
    };
    json_response(
        parts.status.as_u16(),
        &json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": v["metadata"]}),
    )
}

/// What a request brings beside its method and path.
struct Req<'a> {
    q: &'a Query,
    ct: Option<&'a str>,
    body: &'a Bytes,
    /// Its field manager: `?fieldManager=`, else the User-Agent up to its
    /// first `/`, as the API server derives it.
    manager: String,
}

fn manager(q: &Query, ua: Option<&str>) -> String {
    q.get("fieldManager")
        .cloned()
        .or_else(|| ua.and_then(|u| u.split('/').next()).map(String::from))
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

async fn route(shared: &Arc<Shared>, method: &Method, path: &str, req: &Req<'_>) -> Response<Body> {
    let (ct, body) = (req.ct, req.body);
    let segs: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let get_only = |v: Option<Value>| -> Response<Body> {
        if method != Method::GET {
            return error_response(&ApiError::method_not_allowed());
        }
        match v {
            Some(v) => json_response(200, &v),
            None => error_response(&ApiError::path_not_found()),
        }
    };
    match segs.as_slice() {
        [] => get_only(Some(
            json!({ "paths": ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version"] }),
        )),
        ["version"] => get_only(Some(discovery::version())),
        ["healthz" | "livez" | "readyz"] => text_response(200, "ok"),
        ["api"] => get_only(Some(discovery::api_versions(&shared.addr.to_string()))),
        ["apis"] => get_only(Some(discovery::api_group_list())),
        ["api", "v1"] => get_only(discovery::resource_list("", "v1")),
        ["apis", g] => get_only(discovery::api_group(g)),
        ["apis", g, v] => get_only(discovery::resource_list(g, v)),
        ["apis", "authorization.k8s.io", "v1", "selfsubjectaccessreviews"] => {
            if method != Method::POST {
                return error_response(&ApiError::method_not_allowed());
            }
            let v = match parse_json_body(body, ct) {
                Ok(v) => v,
                Err(e) => return error_response(&e),
            };
            let rules = crate::lock(&shared.access).clone();
            match crate::access::review(&v, &rules) {
                Ok(out) => json_response(201, &out),
                Err(e) => error_response(&e),
            }
        }
        ["api", "v1", rest @ ..] => resource(shared, method, "", "v1", rest, req).await,
        ["apis", g, v, rest @ ..] => resource(shared, method, g, v, rest, req).await,
        _ => error_response(&ApiError::path_not_found()),
    }
}

struct Target<'a> {
    def: &'static ResourceDef,
    ns: Option<&'a str>,
    name: Option<&'a str>,
    sub: Option<&'a str>,
    legacy_watch: bool,
}

fn resolve<'a>(group: &str, version: &str, rest: &'a [&'a str]) -> Option<Target<'a>> {
    let (legacy_watch, rest) = match rest.split_first() {
        Some((&"watch", r)) => (true, r),
        _ => (false, rest),
    };
    let (ns, rest) = if rest.len() >= 3
        && rest[0] == "namespaces"
        && lookup(group, version, rest[2]).is_some()
    {
        (Some(rest[1]), &rest[2..])
    } else {
        (None, rest)
    };
    let def = lookup(group, version, rest.first()?)?;
    if rest.len() > 3 {
        return None;
    }
    let name = rest.get(1).copied();
    let sub = rest.get(2).copied();
    if def.namespaced != ns.is_some() && (name.is_some() || ns.is_some()) {
        return None;
    }
    Some(Target {
        def,
        ns,
        name,
        sub,
        legacy_watch,
    })
}

fn dry_run(q: &Query) -> bool {
    q.get("dryRun").is_some_and(|v| v == "All")
}

fn parse_json_body(body: &Bytes, ct: Option<&str>) -> ApiResult<Value> {
    let base = ct
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if base != "application/json" {
        return Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format - accepted media types include: application/json (content type \"{}\" is not modelled by the double)",
            ct.unwrap_or("")
        )));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
    })
}

async fn resource(
    shared: &Arc<Shared>,
    method: &Method,
    group: &str,
    version: &str,
    rest: &[&str],
    req: &Req<'_>,
) -> Response<Body> {
    let Some(t) = resolve(group, version, rest) else {
        return error_response(&ApiError::path_not_found());
    };
    match do_resource(shared, method, &t, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

async fn do_resource(
    shared: &Arc<Shared>,
    method: &Method,
    t: &Target<'_>,
    req: &Req<'_>,
) -> ApiResult<Response<Body>> {
    let (q, ct, body, manager) = (req.q, req.ct, req.body, req.manager.as_str());
    let def = t.def;
    let ns = t.ns.unwrap_or("");
    let sub = match (t.sub, t.name) {
        (None, _) => Sub::Main,
        (Some("status"), Some(_)) if def.has_status => Sub::Status,
        (Some("eviction" | "binding"), Some(_))
            if def.storage == "pods" && *method == Method::POST =>
        {
            Sub::Main
        }
        _ => return Err(ApiError::path_not_found()),
    };
    let watch = t.legacy_watch || matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    if watch {
        if *method != Method::GET || t.sub.is_some() {
            return Err(ApiError::method_not_allowed());
        }
        return start_watch(shared, def, t.ns, t.name, q).await;
    }
    match (method.clone(), t.name, t.sub) {
        (Method::GET, Some(name), _) => {
            let stored = def.stored_def();
            let obj = shared
                .read(|st| st.get(stored.storage, ns, name).cloned())
                .ok_or_else(|| ApiError::not_found(def, name))?;
            Ok(json_response(200, &def.to_view(&obj)))
        }
        (Method::GET, None, _) => list(shared, def, t.ns, q).await,
        (Method::POST, None, _) => {
            let v = parse_json_body(body, ct)?;
            let dry = dry_run(q);
            let out = shared.write(|st| ops::create(st, def, ns, v, dry, manager))?;
            Ok(json_response(201, &def.to_view(&out)))
        }
        (Method::POST, Some(name), Some("eviction")) => {
            let v = parse_json_body(body, ct)?;
            let dry = dry_run(q);
            let out = shared.write(|st| crate::pdb::evict(st, ns, name, &v, dry))?;
            Ok(json_response(201, &out))
        }
        (Method::POST, Some(name), Some("binding")) => {
            let v = parse_json_body(body, ct)?;
            let dry = dry_run(q);
            let out = shared.write(|st| bind(st, ns, name, &v, dry))?;
            Ok(json_response(201, &out))
        }
        (Method::PUT, Some(name), _) => {
            let v = parse_json_body(body, ct)?;
            let obj = ops::decode_body(def, v)?;
            let dry = dry_run(q);
            let (out, created) =
                shared.write(|st| ops::update(st, def, ns, name, obj, sub, dry, true, manager))?;
            Ok(json_response(
                if created { 201 } else { 200 },
                &def.to_view(&out),
            ))
        }
        (Method::PATCH, Some(name), _) => {
            let ptype = PatchType::from_content_type(ct.unwrap_or("")).ok_or_else(|| {
                ApiError::unsupported_media_type(format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got \"{}\")",
                    ct.unwrap_or("")
                ))
            })?;
            let dry = dry_run(q);
            let out =
                shared.write(|st| ops::patch(st, def, ns, name, ptype, body, sub, dry, manager))?;
            Ok(json_response(200, &def.to_view(&out)))
        }
        (Method::DELETE, Some(name), None) => {
            let opts = delete_opts(q, body, ct)?;
            let res = shared.write(|st| ops::delete(st, def, ns, name, &opts))?;
            Ok(delete_response(def, res, &opts))
        }
        (Method::DELETE, None, None) => delete_collection(shared, def, t.ns, q, body, ct),
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn delete_opts(q: &Query, body: &Bytes, ct: Option<&str>) -> ApiResult<DeleteOpts> {
    let mut opts = DeleteOpts {
        dry_run: dry_run(q),
        ..Default::default()
    };
    if let Some(g) = q.get("gracePeriodSeconds") {
        opts.grace = Some(
            g.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid gracePeriodSeconds: {g}")))?,
        );
    }
    if let Some(p) = q.get("propagationPolicy") {
        opts.propagation = Some(p.clone());
    }
    if let Some(o) = q.get("orphanDependents") {
        opts.orphan_dependents = Some(o == "true");
    }
    if !body.is_empty() {
        let v = parse_json_body(body, ct.or(Some("application/json")))?;
        opts.merge_body(&v);
    }
    Ok(opts)
}

fn delete_response(def: &'static ResourceDef, res: Deleted, opts: &DeleteOpts) -> Response<Body> {
    match res {
        Deleted::Removed(obj) => {
            if def.return_deleted_object {
                json_response(200, &def.to_view(&obj))
            } else {
                json_response(200, &ops::delete_status(def, &obj))
            }
        }
        Deleted::Pending(obj) => {
            let code = if opts.orphan_dependents == Some(false) {
                202
            } else {
                200
            };
            json_response(code, &def.to_view(&obj))
        }
    }
}

fn delete_collection(
    shared: &Arc<Shared>,
    def: &'static ResourceDef,
    ns: Option<&str>,
    q: &Query,
    body: &Bytes,
    ct: Option<&str>,
) -> ApiResult<Response<Body>> {
    let filter = make_filter(def, ns, q)?;
    let opts = delete_opts(q, body, ct)?;
    let items = shared.write(|st| {
        let targets: Vec<(String, String)> = st
            .list(def.stored_def().storage, filter.ns.as_deref())
            .filter(|o| filter.matches(o))
            .map(|o| (crate::util::ns_of(o).to_string(), name_of(o).to_string()))
            .collect();
        let mut out = Vec::new();
        for (n, name) in targets {
            if let Ok(Deleted::Removed(o) | Deleted::Pending(o)) =
                ops::delete(st, def, &n, &name, &opts)
            {
                out.push(strip_type(def.to_view(&o)));
            }
        }
        out
    });
    let rv = shared.read(|st| st.rv);
    Ok(json_response(
        200,
        &json!({ "kind": def.list_kind(), "apiVersion": def.api_version(), "metadata": { "resourceVersion": rv.to_string() }, "items": items }),
    ))
}

fn strip_type(mut v: Value) -> Value {
    if let Some(m) = v.as_object_mut() {
        m.remove("apiVersion");
        m.remove("kind");
    }
    v
}

fn make_filter(def: &'static ResourceDef, ns: Option<&str>, q: &Query) -> ApiResult<Filter> {
    let label = match q.get("labelSelector") {
        Some(s) => LabelSelector::parse(s).map_err(ApiError::bad_request)?,
        None => LabelSelector::everything(),
    };
    let field = match q.get("fieldSelector") {
        Some(s) => FieldSelector::parse(s).map_err(ApiError::bad_request)?,
        None => FieldSelector::default(),
    };
    let supported: Vec<&str> = def.fields(&json!({})).iter().map(|(k, _)| *k).collect();
    if let Some(bad) = field.keys().find(|k| !supported.contains(k)) {
        return Err(ApiError::bad_request(format!(
            "field label not supported: {bad}"
        )));
    }
    let mut ns = ns.map(String::from);
    if ns.is_none() && def.namespaced {
        if let Some(n) = field.required("metadata.namespace") {
            ns = Some(n.to_string());
        }
    }
    Ok(Filter {
        def,
        ns,
        label,
        field,
    })
}

fn list_options_invalid(errs: Vec<FieldErr>) -> ApiError {
    ApiError::invalid_kind(
        "ListOptions.meta.k8s.io",
        "meta.k8s.io",
        "ListOptions",
        "",
        errs,
    )
}

fn parse_rv(s: &str) -> ApiResult<u64> {
    s.parse::<u64>()
        .map_err(|e| ApiError::bad_request(format!("invalid resource version: {e}")))
}

/// Wait (up to 3 s, as the watch cache does) until the store reaches `rv`.
async fn wait_for_rv(shared: &Arc<Shared>, rv: u64) -> ApiResult<()> {
    let mut rx = shared.rv_tx.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let cur = shared.read(|st| st.rv);
        if cur >= rv {
            return Ok(());
        }
        tokio::select! {
            r = rx.changed() => { if r.is_err() { break; } }
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    let cur = shared.read(|st| st.rv);
    let mut e = ApiError::timeout(
        &format!("Too large resource version: {rv}, current: {cur}"),
        1,
    );
    e.details = Some(
        json!({ "causes": [{ "reason": "ResourceVersionTooLarge", "message": "Too large resource version" }], "retryAfterSeconds": 1 }),
    );
    e.retry_after = None;
    Err(e)
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Continue {
    v: String,
    rv: u64,
    start: String,
}

const CONTINUE_TOO_OLD: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

/// A list's paging and consistency options, once validated.
struct ListOptions {
    rv: Option<String>,
    rv_match: Option<String>,
    cont: Option<String>,
    limit: Option<usize>,
}

/// ValidateListOptions: the list's options, or why they are refused.
fn list_options(q: &Query) -> ApiResult<ListOptions> {
    let rv = q.get("resourceVersion").filter(|s| !s.is_empty()).cloned();
    let rv_match = q
        .get("resourceVersionMatch")
        .filter(|s| !s.is_empty())
        .cloned();
    let cont = q.get("continue").filter(|s| !s.is_empty()).cloned();
    let limit: Option<usize> = match q.get("limit") {
        Some(l) => Some(
            l.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid limit: {l}")))?,
        )
        .filter(|n| *n > 0),
        None => None,
    };
    if rv_match.is_some() && rv.is_none() {
        return Err(list_options_invalid(vec![FieldErr::forbidden(
            "resourceVersionMatch",
            "resourceVersionMatch is forbidden unless resourceVersion is provided",
        )]));
    }
    if cont.is_some() && rv.is_some() {
        return Err(list_options_invalid(vec![FieldErr::forbidden(
            "resourceVersion",
            "specifying resource version is not allowed when using continue",
        )]));
    }
    if let Some(m) = &rv_match {
        if m != "NotOlderThan" && m != "Exact" {
            return Err(list_options_invalid(vec![FieldErr {
                field: "resourceVersionMatch".into(),
                kind: "FieldValueNotSupported",
                detail: format!("\"{m}\": supported values: \"Exact\", \"NotOlderThan\", \"\""),
            }]));
        }
        if m == "Exact" && rv.as_deref() == Some("0") {
            return Err(list_options_invalid(vec![FieldErr::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
            )]));
        }
    }
    Ok(ListOptions {
        rv,
        rv_match,
        cont,
        limit,
    })
}

/// One page of `filtered` (at most `limit` items) and the list's metadata:
/// a continue token when more follow, and how many (`unfiltered` lists only).
fn page(
    def: &ResourceDef,
    filtered: &[(String, Value)],
    limit: Option<usize>,
    list_rv: u64,
    unfiltered: bool,
) -> (Value, Vec<Value>) {
    use base64::Engine;
    let mut meta = json!({ "resourceVersion": list_rv.to_string() });
    let page: Vec<Value> = match limit {
        Some(l) if filtered.len() > l => {
            let next = filtered[l].0.clone();
            let tok = Continue {
                v: "meta.k8s.io/v1".into(),
                rv: list_rv,
                start: next,
            };
            meta["continue"] = json!(base64::engine::general_purpose::STANDARD
                .encode(serde_json::to_vec(&tok).unwrap_or_default()));
            if unfiltered {
                meta["remainingItemCount"] = json!(filtered.len() - l);
            }
            filtered[..l]
                .iter()
                .map(|(_, o)| strip_type(def.to_view(o)))
                .collect()
        }
        _ => filtered
            .iter()
            .map(|(_, o)| strip_type(def.to_view(o)))
            .collect(),
    };
    (meta, page)
}

async fn list(
    shared: &Arc<Shared>,
    def: &'static ResourceDef,
    ns: Option<&str>,
    q: &Query,
) -> ApiResult<Response<Body>> {
    use base64::Engine;
    let filter = make_filter(def, ns, q)?;
    let ListOptions {
        rv,
        rv_match,
        cont,
        limit,
    } = list_options(q)?;
    // (snapshot rv or None for "current", start key)
    let mut at: Option<u64> = None;
    let mut start_key = String::new();
    if let Some(c) = &cont {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(c)
            .map_err(|_| ApiError::bad_request("continue key is not valid: illegal base64 data"))?;
        let tok: Continue = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("continue key is not valid: {e}")))?;
        at = Some(tok.rv);
        start_key = tok.start;
    } else if let Some(r) = &rv {
        let n = parse_rv(r)?;
        if rv_match.as_deref() == Some("Exact") {
            let cur = shared.read(|st| st.rv);
            if n > cur {
                wait_for_rv(shared, n).await?;
            }
            at = Some(n);
        } else if n > 0 {
            wait_for_rv(shared, n).await?;
        }
    }
    let stored = def.stored_def().storage;
    let (items, list_rv): (Vec<(String, Value)>, u64) = shared.read(|st| match at {
        None => {
            let items = st
                .list(stored, filter.ns.as_deref())
                .map(|o| {
                    (
                        format!("{}/{}", crate::util::ns_of(o), name_of(o)),
                        o.clone(),
                    )
                })
                .collect();
            Ok((items, st.rv))
        }
        Some(at) => match st.snapshot(stored, at) {
            None => Err(if cont.is_some() {
                ApiError::expired(CONTINUE_TOO_OLD)
            } else {
                ApiError::expired("The resourceVersion for the provided list is too old.")
            }),
            Some(m) => Ok((
                m.into_iter()
                    .filter(|((n, _), _)| filter.ns.as_deref().is_none_or(|f| f == n))
                    .map(|((n, name), o)| (format!("{n}/{name}"), o))
                    .collect(),
                at,
            )),
        },
    })?;
    let filtered: Vec<(String, Value)> = items
        .into_iter()
        .filter(|(k, o)| (start_key.is_empty() || *k >= start_key) && filter.matches(o))
        .collect();
    let (meta, page) = page(
        def,
        &filtered,
        limit,
        list_rv,
        filter.label.is_empty() && filter.field.is_empty(),
    );
    Ok(json_response(
        200,
        &json!({ "kind": def.list_kind(), "apiVersion": def.api_version(), "metadata": meta, "items": page }),
    ))
}

/// `sendInitialEvents`, when asked, and whether the watch's options allow it.
fn watch_initial_events(q: &Query, bookmarks: bool) -> ApiResult<Option<bool>> {
    let send_initial = q.get("sendInitialEvents").map(|v| v == "true" || v == "1");
    let rv_match = q
        .get("resourceVersionMatch")
        .filter(|s| !s.is_empty())
        .cloned();
    if send_initial.is_some() {
        let mut errs = Vec::new();
        if rv_match.as_deref() != Some("NotOlderThan") {
            errs.push(FieldErr::forbidden(
                "resourceVersionMatch",
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        if send_initial == Some(true) && !bookmarks {
            errs.push(FieldErr::forbidden(
                "allowWatchBookmarks",
                "allowWatchBookmarks must be set to true when sendInitialEvents is true",
            ));
        }
        if !errs.is_empty() {
            return Err(list_options_invalid(errs));
        }
    } else if rv_match.is_some() {
        return Err(list_options_invalid(vec![FieldErr::forbidden(
            "resourceVersionMatch",
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        )]));
    }
    Ok(send_initial)
}

async fn start_watch(
    shared: &Arc<Shared>,
    def: &'static ResourceDef,
    ns: Option<&str>,
    name: Option<&str>,
    q: &Query,
) -> ApiResult<Response<Body>> {
    let mut filter = make_filter(def, ns, q)?;
    if let Some(n) = name {
        let fs = format!("metadata.name={n}");
        let mut f = FieldSelector::parse(&fs).map_err(ApiError::bad_request)?;
        if !filter.field.is_empty() {
            f = FieldSelector::parse(&format!(
                "{},{}",
                q.get("fieldSelector").cloned().unwrap_or_default(),
                fs
            ))
            .map_err(ApiError::bad_request)?;
        }
        filter.field = f;
    }
    let rv = q.get("resourceVersion").filter(|s| !s.is_empty()).cloned();
    let bookmarks = matches!(
        q.get("allowWatchBookmarks").map(String::as_str),
        Some("true" | "1")
    );
    let send_initial = watch_initial_events(q, bookmarks)?;
    let timeout = match q.get("timeoutSeconds") {
        Some(t) => Duration::from_secs(
            t.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds: {t}")))?,
        ),
        None => Duration::from_secs(1800),
    };
    let (from_rv, initial) = match (rv.as_deref(), send_initial) {
        (None | Some("0"), Some(false)) => (None, false),
        (None | Some("0"), _) => (None, true),
        (Some(r), Some(true)) => {
            let n = parse_rv(r)?;
            wait_for_rv(shared, n).await?;
            (None, true)
        }
        (Some(r), _) => (Some(parse_rv(r)?), false),
    };
    let ok = |b: watch::ChanBody| -> ApiResult<Response<Body>> {
        Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CACHE_CONTROL, "no-cache, private")
            .body(b.boxed_unsync())
            .expect("response"))
    };
    if let Some(n) = from_rv {
        let cur = shared.read(|st| st.rv);
        if n > cur {
            if let Err(e) = wait_for_rv(shared, n).await {
                return ok(watch::single(watch::error_line(&e)));
            }
        }
        let floor = shared.read(|st| st.floor);
        if n < floor {
            return ok(watch::single(watch::error_line(&ApiError::expired(
                format!("too old resource version: {n} ({floor})"),
            ))));
        }
    }
    let params = WatchParams {
        filter,
        from_rv,
        initial_events: initial,
        initial_events_end_bookmark: send_initial == Some(true),
        bookmarks,
        timeout,
    };
    ok(watch::start(shared.clone(), params))
}

/// POST pods/{name}/binding (the scheduler's bind).
fn bind(
    st: &mut crate::store::State,
    ns: &str,
    name: &str,
    body: &Value,
    dry: bool,
) -> ApiResult<Value> {
    let pods = lookup("", "v1", "pods").expect("pods");
    if name_of(body) != name {
        return Err(ApiError::bad_request(
            "name in URL does not match name in Binding object",
        ));
    }
    let target = body
        .get("target")
        .and_then(|t| t.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("");
    if target.is_empty() {
        return Err(ApiError::invalid_kind(
            "Binding",
            "",
            "Binding",
            name,
            vec![FieldErr::required("target.name", "")],
        ));
    }
    let pod = st
        .get("pods", ns, name)
        .cloned()
        .ok_or_else(|| ApiError::not_found(pods, name))?;
    if let Some(uid) = body
        .get("metadata")
        .and_then(|m| m.get("uid"))
        .and_then(Value::as_str)
    {
        if uid != uid_of(&pod) {
            return Err(ApiError::conflict(
                pods,
                name,
                "Precondition failed: UID in precondition",
            ));
        }
    }
    if crate::util::is_deleting(&pod) {
        return Err(ApiError::conflict(
            pods,
            name,
            &format!("pod {name} is being deleted, cannot be assigned to a host"),
        ));
    }
    let cur = crate::util::s(&pod, &["spec", "nodeName"]).unwrap_or("");
    if !cur.is_empty() {
        return Err(ApiError::conflict(
            pods,
            name,
            &format!("pod {name} is already assigned to node \"{cur}\""),
        ));
    }
    if !dry {
        let mut p = pod.clone();
        crate::util::obj_mut(&mut p, &["spec"]).insert("nodeName".into(), json!(target));
        ops::set_pod_condition(&mut p, "PodScheduled", "True", "", "");
        st.replace("pods", p);
    }
    Ok(
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201 }),
    )
}
