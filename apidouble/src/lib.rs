//! A faithful Kubernetes API server double (see README.md).
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use lastgasp_apidouble::{ApiDouble, Fault};
//! let double = ApiDouble::start().await?;
//! let client = double.client().await; // kube::Client for http://127.0.0.1:PORT
//! double.inject(Fault::status(503).times(2).path_prefix("/api/v1/nodes"));
//! # Ok(()) }
//! ```
#![warn(clippy::too_many_lines)]

mod access;
mod control;
mod discovery;
mod faults;
mod kubelet;
mod ops;
mod patch;
mod pdb;
mod reqlog;
mod resources;
mod response;
mod selectors;
mod server;
mod status;
mod store;
mod taints;
mod util;
mod watch;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Notify;

pub use access::AccessRule;
pub use faults::{Fault, FaultId, FaultKind};
pub use kubelet::Kubelet;
pub use reqlog::RequestRecord;
pub use status::ApiError;
pub use store::INITIAL_RV;

use store::State;

/// Errors of the handle's direct store calls.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the double does not serve {0}")]
    UnsupportedKind(String),
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

pub(crate) struct Shared {
    state: Mutex<State>,
    pub(crate) rv_tx: tokio::sync::watch::Sender<u64>,
    pub(crate) kubelet_wake: Notify,
    faults: Mutex<Vec<(FaultId, Fault)>>,
    /// SelfSubjectAccessReviews matching one of these are denied.
    pub(crate) access: Mutex<Vec<access::AccessRule>>,
    next_fault: AtomicU64,
    log: Mutex<Vec<RequestRecord>>,
    seq: AtomicU64,
    pub(crate) started: Instant,
    pub(crate) addr: SocketAddr,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Run a write under the store lock, then the disruption controller, then wake watchers.
    pub(crate) fn write<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut st = lock(&self.state);
        let r = f(&mut st);
        taints::run(&mut st);
        pdb::run_controllers(&mut st);
        let rv = st.rv;
        drop(st);
        self.rv_tx.send_if_modified(|cur| {
            if *cur != rv {
                *cur = rv;
                true
            } else {
                false
            }
        });
        r
    }

    pub(crate) fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&lock(&self.state))
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }

    pub(crate) fn log(&self, r: RequestRecord) {
        let mut log = lock(&self.log);
        let pos = log.partition_point(|x| x.seq < r.seq);
        log.insert(pos, r);
    }

    /// Total latency of matching latency faults, and the first matching status/drop fault (consumed).
    pub(crate) fn take_faults(
        &self,
        method: &str,
        path: &str,
    ) -> (Duration, Option<FaultKind>, Option<String>) {
        let mut faults = lock(&self.faults);
        let mut latency = Duration::ZERO;
        let mut action = None;
        let mut descr: Vec<String> = Vec::new();
        for (_, f) in faults.iter_mut() {
            if !f.matches(method, path) {
                continue;
            }
            match &f.kind {
                FaultKind::Latency(d) => {
                    latency += *d;
                }
                _ if action.is_some() => continue,
                k => action = Some(k.clone()),
            }
            descr.push(f.describe());
            if let Some(n) = f.times.as_mut() {
                *n -= 1;
            }
        }
        faults.retain(|(_, f)| f.times != Some(0));
        (
            latency,
            action,
            if descr.is_empty() {
                None
            } else {
                Some(descr.join(", "))
            },
        )
    }
}

struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// A running API server double. Dropping it stops the server.
pub struct ApiDouble {
    shared: Arc<Shared>,
    _tasks: Option<Arc<Tasks>>,
}

impl ApiDouble {
    /// Start on 127.0.0.1 with an ephemeral port.
    pub async fn start() -> Result<Self, Error> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Start on a given address (the binary uses this for `--listen`).
    pub async fn start_on(addr: SocketAddr) -> Result<Self, Error> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (rv_tx, _) = tokio::sync::watch::channel(INITIAL_RV);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new()),
            rv_tx,
            kubelet_wake: Notify::new(),
            faults: Mutex::new(Vec::new()),
            access: Mutex::new(Vec::new()),
            next_fault: AtomicU64::new(1),
            log: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
            started: Instant::now(),
            addr,
        });
        let server = tokio::spawn(server::serve(listener, shared.clone()));
        let kubelet = tokio::spawn(kubelet::run(shared.clone()));
        Ok(Self {
            shared,
            _tasks: Some(Arc::new(Tasks(vec![server, kubelet]))),
        })
    }

    pub(crate) fn handle_for(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            _tasks: None,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    /// A `kube::Config` for the double (plain HTTP, namespace `default`, kube's defaults otherwise).
    #[cfg(feature = "client")]
    pub fn config(&self) -> kube::Config {
        let uri: http::Uri = self.url().parse().expect("url");
        kube::Config::new(uri)
    }

    /// A `kube::Client` for the double with kube's default configuration.
    ///
    /// Note that kube 5's default client retries 429, 503 and 504 answers (up to 15
    /// times, exponential backoff from 5 ms, honouring `Retry-After`); use
    /// [`ApiDouble::client_without_retry`] to see each answer.
    #[cfg(feature = "client")]
    pub async fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config()).expect("kube client for the double")
    }

    /// A `kube::Client` with `default_retry = false`.
    #[cfg(feature = "client")]
    pub async fn client_without_retry(&self) -> kube::Client {
        let mut c = self.config();
        c.default_retry = false;
        kube::Client::try_from(c).expect("kube client for the double")
    }

    /// Seed any supported object directly into the store (like restoring etcd):
    /// uid, creationTimestamp and resourceVersion are filled in, `status` is kept
    /// as given, no admission or strategy runs. An existing object of that name is replaced.
    pub fn create<K: Serialize + DeserializeOwned>(&self, obj: &K) -> Result<K, Error> {
        let v = serde_json::to_value(obj)?;
        let out = self.create_value(v)?;
        Ok(serde_json::from_value(out)?)
    }

    /// [`ApiDouble::create`] for a JSON object (with `apiVersion` and `kind`).
    pub fn create_value(&self, v: Value) -> Result<Value, Error> {
        let (def, out) = self.shared.write(|st| ops::seed(st, v))?;
        self.shared.kubelet_wake.notify_one();
        Ok(def.to_view(&out))
    }

    /// Seed an object, a JSON array of objects, or a `*List` with `items`.
    pub fn create_all(&self, v: Value) -> Result<Vec<Value>, ApiError> {
        let items = match v {
            Value::Array(a) => a,
            Value::Object(ref m) if m.get("items").is_some_and(Value::is_array) => m
                .get("items")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            other => vec![other],
        };
        let mut out = Vec::new();
        for item in items {
            match self.create_value(item) {
                Ok(v) => out.push(v),
                Err(Error::Api(e)) => return Err(e),
                Err(e) => return Err(ApiError::bad_request(e.to_string())),
            }
        }
        Ok(out)
    }

    fn def_of<K: k8s_openapi::Resource>() -> Result<&'static resources::ResourceDef, Error> {
        resources::lookup_kind(K::API_VERSION, K::KIND)
            .ok_or_else(|| Error::UnsupportedKind(format!("{}/{}", K::API_VERSION, K::KIND)))
    }

    /// Read an object straight from the store (`ns` is `""` for cluster-scoped kinds).
    pub fn get<K: k8s_openapi::Resource + DeserializeOwned>(
        &self,
        ns: &str,
        name: &str,
    ) -> Option<K> {
        let def = Self::def_of::<K>().ok()?;
        let v = self
            .shared
            .read(|st| st.get(def.storage, ns, name).cloned())?;
        serde_json::from_value(def.to_view(&v)).ok()
    }

    /// All objects of a kind in a namespace (`""`: every namespace), in key order.
    pub fn list<K: k8s_openapi::Resource + DeserializeOwned>(&self, ns: &str) -> Vec<K> {
        let Ok(def) = Self::def_of::<K>() else {
            return vec![];
        };
        let ns = if ns.is_empty() { None } else { Some(ns) };
        let vals: Vec<Value> = self
            .shared
            .read(|st| st.list(def.storage, ns).map(|o| def.to_view(o)).collect());
        vals.into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect()
    }

    /// Change an object directly in the store (as a controller or kubelet would, with
    /// no strategy or validation): bumps the resourceVersion and emits MODIFIED.
    pub fn modify<K, F>(&self, ns: &str, name: &str, f: F) -> Result<K, Error>
    where
        K: k8s_openapi::Resource + Serialize + DeserializeOwned,
        F: FnOnce(&mut K),
    {
        let def = Self::def_of::<K>()?;
        self.shared.write(|st| {
            let cur = st
                .get(def.storage, ns, name)
                .cloned()
                .ok_or_else(|| ApiError::not_found(def, name))?;
            let mut typed: K = serde_json::from_value(def.to_view(&cur))?;
            f(&mut typed);
            let mut v = def.view_to_stored(serde_json::to_value(&typed)?);
            let meta = util::meta_mut(&mut v);
            meta.insert("name".into(), Value::String(name.into()));
            if def.namespaced {
                meta.insert("namespace".into(), Value::String(ns.into()));
            }
            let out = st.replace(def.stored_def().storage, v);
            Ok(serde_json::from_value(def.to_view(&out))?)
        })
    }

    /// Remove an object from the store at once (no graceful deletion, finalizers ignored).
    pub fn remove<K: k8s_openapi::Resource>(&self, ns: &str, name: &str) -> Result<(), Error> {
        let def = Self::def_of::<K>()?;
        self.shared
            .write(|st| st.remove(def.stored_def().storage, ns, name))
            .map(|_| ())
            .ok_or_else(|| ApiError::not_found(def, name).into())
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.read(|st| st.rv)
    }

    /// Forget the watch history, as an etcd compaction does: a watch or exact list
    /// from any older resourceVersion now gets 410 Gone (`Expired`).
    pub fn compact(&self) {
        self.shared.write(store::State::compact);
    }

    /// How many events the history keeps (default 10000).
    pub fn set_history_limit(&self, n: usize) {
        self.shared.write(|st| st.history_limit = n.max(1));
    }

    /// How often a watch with `allowWatchBookmarks=true` gets a BOOKMARK (default 60 s, like the apiserver).
    pub fn set_bookmark_interval(&self, d: Duration) {
        self.shared.write(|st| st.bookmark_interval = d);
    }

    /// The request log so far, in arrival order (`/_double/...` control calls are not logged).
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.log).clear();
    }

    pub fn inject(&self, f: Fault) -> FaultId {
        let id = FaultId(self.shared.next_fault.fetch_add(1, Ordering::SeqCst));
        lock(&self.shared.faults).push((id, f));
        id
    }

    /// Remove a fault; false if it was already used up or removed.
    pub fn remove_fault(&self, id: FaultId) -> bool {
        let mut f = lock(&self.shared.faults);
        let before = f.len();
        f.retain(|(i, _)| *i != id);
        f.len() != before
    }

    pub fn clear_faults(&self) {
        lock(&self.shared.faults).clear();
    }

    /// Deny SelfSubjectAccessReviews that match `rule` (the double has no
    /// RBAC: everything else is allowed, as it is for real requests).
    pub fn deny_access(&self, rule: AccessRule) {
        lock(&self.shared.access).push(rule);
    }

    /// Replace the deny list.
    pub fn set_access_rules(&self, rules: Vec<AccessRule>) {
        *lock(&self.shared.access) = rules;
    }

    pub fn access_rules(&self) -> Vec<AccessRule> {
        lock(&self.shared.access).clone()
    }

    /// The simulated kubelet's knobs.
    pub fn kubelet(&self) -> Kubelet {
        Kubelet {
            shared: self.shared.clone(),
        }
    }

    /// The simulated kubelet finishes a terminating pod now (terminal status, then
    /// removal). False if the pod does not exist or is not terminating.
    pub fn finish_pod(&self, ns: &str, name: &str) -> bool {
        self.shared.write(|st| kubelet::finish(st, ns, name, false))
    }
}
