//! WATCH: newline-delimited JSON events over a chunked (HTTP/1.1) or
//! streamed (HTTP/2) response, served from the store's event history.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::resources::ResourceDef;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use crate::store::{EvKind, State};
use crate::util::{labels_of, meta_mut, ns_of};
use crate::Shared;

/// A response body fed from a channel.
pub struct ChanBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChanBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

#[derive(Clone)]
pub struct Filter {
    pub def: &'static ResourceDef,
    pub ns: Option<String>,
    pub label: LabelSelector,
    pub field: FieldSelector,
}

impl Filter {
    pub fn matches(&self, stored: &Value) -> bool {
        if let Some(ns) = &self.ns {
            if ns_of(stored) != ns {
                return false;
            }
        }
        self.label.matches(&labels_of(stored))
            && (self.field.is_empty() || self.field.matches(&self.def.fields(stored)))
    }
}

pub struct WatchParams {
    pub filter: Filter,
    /// `None`: start with the current state (resourceVersion unset or "0").
    pub from_rv: Option<u64>,
    pub initial_events: bool,
    pub initial_events_end_bookmark: bool,
    pub bookmarks: bool,
    pub timeout: Duration,
}

fn line(kind: &str, obj: &Value) -> Bytes {
    let mut s = serde_json::to_string(&json!({ "type": kind, "object": obj })).unwrap_or_default();
    s.push('\n');
    Bytes::from(s)
}

fn bookmark(def: &ResourceDef, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({ "resourceVersion": rv.to_string(), "creationTimestamp": null });
    if initial_end {
        meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    line(
        "BOOKMARK",
        &json!({ "kind": def.kind, "apiVersion": def.api_version(), "metadata": meta }),
    )
}

pub fn error_line(e: &ApiError) -> Bytes {
    line("ERROR", &e.to_status())
}

/// Events of the history after `cursor` that this watch should see.
fn collect(st: &State, f: &Filter, cursor: u64) -> Vec<Bytes> {
    let storage = f.def.storage;
    let mut out = Vec::new();
    let start = st.history.partition_point(|e| e.rv <= cursor);
    for ev in st.history.range(start..) {
        if ev.storage != storage {
            continue;
        }
        let cur_pass = f.matches(&ev.obj);
        let prev_pass = ev.prev.as_ref().is_some_and(|p| f.matches(p));
        let emit = match ev.kind {
            EvKind::Added => cur_pass.then(|| (EvKind::Added, (*ev.obj).clone())),
            EvKind::Deleted => {
                (cur_pass || prev_pass).then(|| (EvKind::Deleted, (*ev.obj).clone()))
            }
            EvKind::Modified => match (cur_pass, prev_pass) {
                (true, true) => Some((EvKind::Modified, (*ev.obj).clone())),
                (true, false) => Some((EvKind::Added, (*ev.obj).clone())),
                (false, true) => {
                    // the previous state, with this event's resourceVersion (cacher semantics)
                    let mut prev = ev.prev.as_deref().cloned().unwrap_or(Value::Null);
                    meta_mut(&mut prev).insert("resourceVersion".into(), json!(ev.rv.to_string()));
                    Some((EvKind::Deleted, prev))
                }
                (false, false) => None,
            },
        };
        if let Some((kind, obj)) = emit {
            out.push(line(kind.as_str(), &f.def.to_view(&obj)));
        }
    }
    out
}

/// Start a watch; the returned body streams until the timeout or the client goes away.
pub fn start(shared: Arc<Shared>, p: WatchParams) -> ChanBody {
    let (tx, rx) = mpsc::channel::<Bytes>(1024);
    tokio::spawn(async move {
        let mut rv_rx = shared.rv_tx.subscribe();
        let deadline = Instant::now() + p.timeout;
        let f = p.filter.clone();
        let (initial, mut cursor, bookmark_every) = shared.read(|st| {
            let mut initial = Vec::new();
            let cursor = match p.from_rv {
                None => st.rv,
                Some(rv) => rv,
            };
            if p.initial_events {
                for obj in st.list(f.def.storage, f.ns.as_deref()) {
                    if f.matches(obj) {
                        initial.push(line("ADDED", &f.def.to_view(obj)));
                    }
                }
            }
            (initial, cursor, st.bookmark_interval)
        });
        for l in initial {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        if p.initial_events_end_bookmark && tx.send(bookmark(f.def, cursor, true)).await.is_err() {
            return;
        }
        let mut next_bookmark = Instant::now() + bookmark_every;
        loop {
            let batch = shared.read(|st| {
                if cursor < st.floor {
                    return Err(ApiError::expired(format!(
                        "too old resource version: {cursor} ({})",
                        st.floor
                    )));
                }
                let lines = collect(st, &f, cursor);
                Ok((lines, st.rv))
            });
            match batch {
                Err(e) => {
                    let _ = tx.send(error_line(&e)).await;
                    return;
                }
                Ok((lines, rv)) => {
                    for l in lines {
                        if tx.send(l).await.is_err() {
                            return;
                        }
                    }
                    cursor = rv;
                }
            }
            tokio::select! {
                r = rv_rx.changed() => { if r.is_err() { return; } }
                _ = tokio::time::sleep_until(next_bookmark), if p.bookmarks => {
                    if tx.send(bookmark(f.def, cursor, false)).await.is_err() { return; }
                    next_bookmark = Instant::now() + shared.read(|st| st.bookmark_interval);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    if p.bookmarks {
                        let _ = tx.send(bookmark(f.def, cursor, false)).await;
                    }
                    return;
                }
                _ = tx.closed() => return,
            }
        }
    });
    ChanBody { rx }
}

/// A body with a single line (a watch that fails after it was established).
pub fn single(b: Bytes) -> ChanBody {
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(b);
    ChanBody { rx }
}
