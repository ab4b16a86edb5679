//! The ledger's writer: a task beside the controller's passes (not in
//! their queue: a fence never waits for an entry; on the API server it
//! paces itself, see [`MAX_PER_ROUND`]), writing while this replica leads. Every few seconds it reads the node cache,
//! applies each episode's entry that changed (server-side apply, field
//! manager [`LEDGER_MANAGER`]), prints it as one JSON line on stdout for
//! log pipelines, and now and then deletes what the retention leaves out.
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::{
    api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams},
    runtime::reflector,
    Api, Client, ResourceExt,
};
use serde_json::json;

use super::metrics::ControllerMetrics;

use super::ledger::{self, merge, Spec, GROUP, KIND, PLURAL, VERSION};

pub const LEDGER_MANAGER: &str = "lastgasp-ledger";
const EVERY: Duration = Duration::from_secs(2);
/// Applies per round at most (25/s): a zone's thousand new entries are
/// written over 40 s instead of crowding its last gasps and fences on the
/// API server (measured: `cargo xtask bench zone`, docs/ledger.md). What
/// waits is written with its newest state.
const MAX_PER_ROUND: usize = 50;
const RETAIN_EVERY: Duration = Duration::from_secs(300);

/// How long and how many entries are kept.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    /// Entries opened longer ago are deleted.
    pub max_age: Duration,
    /// Per node, the newest this many are kept.
    pub max_per_node: usize,
}

pub fn resource() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: KIND.into(),
        plural: PLURAL.into(),
    }
}

/// The labels `kubectl get nodeshutdowns -l ...` filters by.
pub const LABEL_KEYS: [&str; 6] = [
    "lastgasp.dev/node",
    "lastgasp.dev/kind",
    "lastgasp.dev/path",
    "lastgasp.dev/ending",
    "lastgasp.dev/graceful",
    "lastgasp.dev/unannounced",
];

/// An entry's labels: [`LABEL_KEYS`].
fn labels(spec: &Spec) -> serde_json::Value {
    let mut l = serde_json::Map::new();
    l.insert(
        "lastgasp.dev/node".into(),
        json!(spec
            .node
            .chars()
            .take(63)
            .collect::<String>()
            .trim_end_matches(['.', '-'])),
    );
    for (k, v) in spec.facets() {
        l.insert(format!("lastgasp.dev/{k}"), json!(v));
    }
    l.insert(
        "lastgasp.dev/unannounced".into(),
        json!((spec.ending == ledger::Ending::Unannounced).to_string()),
    );
    serde_json::Value::Object(l)
}

/// The object of an entry, as applied and exported.
pub fn object(name: &str, spec: &Spec) -> serde_json::Value {
    json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": KIND,
        "metadata": {"name": name, "labels": labels(spec)},
        "spec": spec,
    })
}

pub struct Writer {
    api: Api<DynamicObject>,
    store: reflector::Store<Node>,
    leading: Arc<AtomicBool>,
    retention: Retention,
    /// What the ledger holds, by name (read back at start: no memory needed).
    held: BTreeMap<String, Spec>,
}

impl Writer {
    pub fn new(
        client: Client,
        store: reflector::Store<Node>,
        leading: Arc<AtomicBool>,
        retention: Retention,
    ) -> Self {
        Writer {
            api: Api::all_with(client, &resource()),
            store,
            leading,
            retention,
            held: BTreeMap::new(),
        }
    }

    /// Runs until the process ends; a failed round is logged and tried again.
    pub async fn run(mut self, metrics: ControllerMetrics) {
        let mut loaded = false;
        let mut last_retain: Option<tokio::time::Instant> = None;
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tick.tick().await;
            if !self.leading.load(Ordering::Relaxed) {
                loaded = false;
                continue;
            }
            if !loaded {
                match self.load().await {
                    Ok(()) => loaded = true,
                    Err(e) => {
                        tracing::warn!(error = format!("{e:#}"), "ledger: not read");
                        continue;
                    }
                }
            }
            match self.round().await {
                Ok((applied, failed)) => {
                    metrics.count_ledger_write("applied", applied);
                    metrics.count_ledger_write("failed", failed);
                }
                Err(e) => tracing::warn!(error = format!("{e:#}"), "ledger round"),
            }
            if last_retain.is_none_or(|t| t.elapsed() >= RETAIN_EVERY) {
                last_retain = Some(tokio::time::Instant::now());
                match self.retain(SystemTime::now()).await {
                    Ok(0) => {}
                    Ok(n) => {
                        metrics.count_ledger_write("pruned", n as u64);
                        tracing::info!(deleted = n, "ledger: retention");
                    }
                    Err(e) => tracing::warn!(error = format!("{e:#}"), "ledger retention"),
                }
            }
            metrics.set_ledger_entries(self.held.values().map(Spec::labels));
        }
    }

    async fn load(&mut self) -> Result<()> {
        let list = self
            .api
            .list(&ListParams::default())
            .await
            .context("listing NodeShutdowns")?;
        self.held = list
            .items
            .into_iter()
            .filter_map(|o| {
                let spec: Spec = serde_json::from_value(o.data.get("spec")?.clone()).ok()?;
                Some((o.name_any(), spec))
            })
            .collect();
        Ok(())
    }

    /// Applies every entry that changed; returns how many were applied
    /// and how many failed (tried again next round).
    pub async fn round(&mut self) -> Result<(u64, u64)> {
        let mut changed = Vec::new();
        for node in self.store.state() {
            for (name, spec) in ledger::entries(&node) {
                let spec = match self.held.get(&name) {
                    Some(old) => merge(old, spec),
                    None => spec,
                };
                if self.held.get(&name) != Some(&spec) {
                    changed.push((name, spec));
                }
            }
        }
        changed.truncate(MAX_PER_ROUND);
        let api = self.api.clone();
        let results: Vec<_> = futures::stream::iter(changed)
            .map(|(name, spec)| {
                let api = api.clone();
                async move {
                    let obj = object(&name, &spec);
                    let r = api
                        .patch(
                            &name,
                            &PatchParams::apply(LEDGER_MANAGER).force(),
                            &Patch::Apply(&obj),
                        )
                        .await;
                    (name, spec, obj, r)
                }
            })
            .buffer_unordered(4)
            .collect()
            .await;
        let (mut applied, mut failed) = (0, 0);
        for (name, spec, obj, r) in results {
            match r {
                Ok(_) => {
                    println!("{}", json!({ "nodeShutdown": obj }));
                    self.held.insert(name, spec);
                    applied += 1;
                }
                Err(e) => {
                    tracing::warn!(%name, error = %e, "ledger: entry not written");
                    failed += 1;
                }
            }
        }
        Ok((applied, failed))
    }

    /// Deletes entries older than the retention's age, and per node all but
    /// the newest `max_per_node`; returns how many went.
    pub async fn retain(&mut self, now: SystemTime) -> Result<usize> {
        let doomed = expired(&self.held, self.retention, now);
        for name in &doomed {
            match self.api.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e).context("deleting a NodeShutdown"),
            }
            self.held.remove(name);
        }
        Ok(doomed.len())
    }
}

/// The names the retention leaves out: too old, or beyond the newest
/// `max_per_node` of their node.
pub fn expired(held: &BTreeMap<String, Spec>, r: Retention, now: SystemTime) -> Vec<String> {
    let mut by_node: BTreeMap<&str, Vec<(&String, &Spec)>> = BTreeMap::new();
    for (name, spec) in held {
        by_node
            .entry(spec.node.as_str())
            .or_default()
            .push((name, spec));
    }
    let mut out = Vec::new();
    for (_, mut entries) in by_node {
        entries.sort_by_key(|(_, s)| std::cmp::Reverse(s.opened_at));
        for (i, (name, spec)) in entries.into_iter().enumerate() {
            let old = now.duration_since(spec.opened_at).unwrap_or_default() > r.max_age;
            if old || i >= r.max_per_node {
                out.push(name.clone());
            }
        }
    }
    out
}

/// `lastgasp history --cluster`: the ledger's summary of the last `since`.
pub async fn print_history(since: Duration) -> Result<()> {
    let client = crate::apiserver::client(crate::apiserver::Use::Requests, None).await?;
    let api: Api<DynamicObject> = Api::all_with(client, &resource());
    let list = api
        .list(&ListParams::default())
        .await
        .context("listing NodeShutdowns (is the ledger's CRD installed, and may you list it?)")?;
    let entries: Vec<(String, Spec)> = list
        .items
        .into_iter()
        .filter_map(|o| {
            let spec = serde_json::from_value(o.data.get("spec")?.clone()).ok()?;
            Some((o.name_any(), spec))
        })
        .collect();
    let from = SystemTime::now()
        .checked_sub(since)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    print!("{}", ledger::summary(&entries, from));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        controller::ledger::{Claims, Ending, Path},
        signal::Kind,
    };

    fn spec(node: &str, opened_h_ago: u64, now: SystemTime) -> Spec {
        Spec {
            node: node.into(),
            boot_id: "b".into(),
            episode: 1,
            kind: Kind::Poweroff,
            path: Path::Immediate,
            graceful: false,
            forced: true,
            opened_at: now - Duration::from_secs(opened_h_ago * 3600),
            ending: Ending::Fenced,
            delivered_late: false,
            agent_claims: Claims::default(),
            down: None,
            fence: None,
            back: None,
            closed: None,
        }
    }

    #[test]
    fn an_entry_carries_every_label_and_no_other() {
        let now = SystemTime::now();
        let l = labels(&spec("worker-3", 1, now));
        let keys: Vec<&str> = l.as_object().unwrap().keys().map(String::as_str).collect();
        let mut want = LABEL_KEYS.to_vec();
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(l["lastgasp.dev/ending"], "fenced");
        assert_eq!(l["lastgasp.dev/unannounced"], "false");
    }

    #[test]
    fn retention_keeps_the_newest_per_node_within_the_age() {
        let now = SystemTime::now();
        let held: BTreeMap<String, Spec> = [
            ("a1", spec("a", 1, now)),
            ("a2", spec("a", 2, now)),
            ("a3", spec("a", 3, now)),
            ("b1", spec("b", 50, now)),
            ("b2", spec("b", 5, now)),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect();
        let r = Retention {
            max_age: Duration::from_secs(48 * 3600),
            max_per_node: 2,
        };
        let mut gone = expired(&held, r, now);
        gone.sort();
        assert_eq!(gone, ["a3", "b1"]);
    }
}
