//! The object store: one global resourceVersion counter like etcd's revision,
//! objects by (namespace, name) in key order, and a bounded event history that
//! serves watches and exact-resourceVersion lists.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{meta_mut, name_of, ns_of};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvKind {
    Added,
    Modified,
    Deleted,
}

impl EvKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EvKind::Added => "ADDED",
            EvKind::Modified => "MODIFIED",
            EvKind::Deleted => "DELETED",
        }
    }
}

#[derive(Debug, Clone)]
pub struct HistEvent {
    pub rv: u64,
    pub storage: &'static str,
    pub kind: EvKind,
    /// The object after the change (for DELETED: the last state, with the deletion's RV).
    pub obj: Arc<Value>,
    /// The object before the change.
    pub prev: Option<Arc<Value>>,
}

type Key = (String, String);

pub struct State {
    pub rv: u64,
    objects: HashMap<&'static str, BTreeMap<Key, Value>>,
    pub history: VecDeque<HistEvent>,
    /// The oldest resourceVersion a watch may resume from (`oldest-1` in the watch cache).
    pub floor: u64,
    pub history_limit: usize,
    pub kubelet: KubeletState,
    pub bookmark_interval: Duration,
    /// Namespaces whose PodDisruptionBudgets need a disruption-controller pass.
    pub dirty_ns: BTreeSet<String>,
    /// When a pod (by uid) got its deletionTimestamp, on the monotonic clock.
    pub terminating_since: HashMap<String, Instant>,
}

pub const INITIAL_RV: u64 = 1000;

impl State {
    pub fn new() -> Self {
        Self {
            rv: INITIAL_RV,
            objects: HashMap::new(),
            history: VecDeque::new(),
            floor: INITIAL_RV,
            history_limit: 10_000,
            kubelet: KubeletState::default(),
            bookmark_interval: Duration::from_secs(60),
            dirty_ns: BTreeSet::new(),
            terminating_since: HashMap::new(),
        }
    }

    pub fn get(&self, storage: &str, ns: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(storage)?
            .get(&(ns.to_string(), name.to_string()))
    }

    /// Objects of a storage in key order; `ns = None` for all namespaces.
    pub fn list<'a>(
        &'a self,
        storage: &str,
        ns: Option<&'a str>,
    ) -> Box<dyn Iterator<Item = &'a Value> + 'a> {
        match self.objects.get(storage) {
            None => Box::new(std::iter::empty()),
            Some(m) => match ns {
                None => Box::new(m.values()),
                Some(ns) => Box::new(
                    m.range((ns.to_string(), String::new())..)
                        .take_while(move |((n, _), _)| n == ns)
                        .map(|(_, v)| v),
                ),
            },
        }
    }

    fn mark(&mut self, storage: &str, ns: &str) {
        if matches!(
            storage,
            "pods" | "poddisruptionbudgets" | "replicasets" | "deployments" | "statefulsets"
        ) {
            self.dirty_ns.insert(ns.to_string());
        }
    }

    fn record(&mut self, ev: HistEvent) {
        self.history.push_back(ev);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.floor = old.rv;
            }
        }
    }

    pub fn insert(&mut self, storage: &'static str, mut obj: Value) -> Value {
        self.rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), Value::String(self.rv.to_string()));
        let key = (ns_of(&obj).to_string(), name_of(&obj).to_string());
        self.mark(storage, &key.0);
        self.objects
            .entry(storage)
            .or_default()
            .insert(key, obj.clone());
        self.record(HistEvent {
            rv: self.rv,
            storage,
            kind: EvKind::Added,
            obj: Arc::new(obj.clone()),
            prev: None,
        });
        obj
    }

    pub fn replace(&mut self, storage: &'static str, mut obj: Value) -> Value {
        self.rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), Value::String(self.rv.to_string()));
        let key = (ns_of(&obj).to_string(), name_of(&obj).to_string());
        self.mark(storage, &key.0);
        let prev = self
            .objects
            .entry(storage)
            .or_default()
            .insert(key, obj.clone());
        let kind = if prev.is_some() {
            EvKind::Modified
        } else {
            EvKind::Added
        };
        self.record(HistEvent {
            rv: self.rv,
            storage,
            kind,
            obj: Arc::new(obj.clone()),
            prev: prev.map(Arc::new),
        });
        obj
    }

    pub fn remove(&mut self, storage: &'static str, ns: &str, name: &str) -> Option<Value> {
        let prev = self
            .objects
            .get_mut(storage)?
            .remove(&(ns.to_string(), name.to_string()))?;
        self.rv += 1;
        self.mark(storage, ns);
        let mut last = prev.clone();
        meta_mut(&mut last).insert("resourceVersion".into(), Value::String(self.rv.to_string()));
        if let Some(uid) = crate::util::s(&prev, &["metadata", "uid"]) {
            self.terminating_since.remove(uid);
        }
        self.record(HistEvent {
            rv: self.rv,
            storage,
            kind: EvKind::Deleted,
            obj: Arc::new(last),
            prev: Some(Arc::new(prev.clone())),
        });
        Some(prev)
    }

    /// Drop all history: every watch or list from an older resourceVersion now gets 410.
    pub fn compact(&mut self) {
        self.history.clear();
        self.floor = self.rv;
    }

    /// The storage's objects as they were at resourceVersion `at` (None if compacted away).
    pub fn snapshot(&self, storage: &str, at: u64) -> Option<BTreeMap<Key, Value>> {
        if at < self.floor {
            return None;
        }
        let mut m = self.objects.get(storage).cloned().unwrap_or_default();
        for ev in self.history.iter().rev() {
            if ev.rv <= at {
                break;
            }
            if ev.storage != storage {
                continue;
            }
            let key = (ns_of(&ev.obj).to_string(), name_of(&ev.obj).to_string());
            match (&ev.kind, &ev.prev) {
                (EvKind::Added, _) => {
                    m.remove(&key);
                }
                (_, Some(prev)) => {
                    m.insert(key, (**prev).clone());
                }
                (_, None) => {}
            }
        }
        Some(m)
    }
}

impl Default for State {
    fn default() -> Self {
        Self::new()
    }
}

/// What the simulated kubelet (`crate::kubelet`) is set to do, kept with the
/// objects it acts on.
#[derive(Debug, Clone, Default)]
pub struct PodKnobs {
    pub termination: Option<Duration>,
    pub hang: bool,
}

#[derive(Debug, Clone)]
pub struct KubeletState {
    pub auto_finish: bool,
    pub auto_start: bool,
    pub default_termination: Duration,
    pub pods: HashMap<(String, String), PodKnobs>,
    pub nodes_down: HashSet<String>,
}

impl Default for KubeletState {
    fn default() -> Self {
        Self {
            auto_finish: true,
            auto_start: true,
            default_termination: Duration::from_millis(50),
            pods: HashMap::new(),
            nodes_down: HashSet::new(),
        }
    }
}
