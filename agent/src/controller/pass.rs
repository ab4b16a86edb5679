//! One pass: renew the Lease, judge every node from the watch cache and one
//! LIST of the kubelets' Leases, apply the operator's controls (observe,
//! pause, opt-out, the ceiling and the rate), then carry out the writes
//! side by side. One node's failure never stops the others.
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    time::{Duration, SystemTime},
};

use anyhow::Result;
use futures::StreamExt;
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node};
use kube::{
    runtime::{
        events::{EventType, Recorder, Reporter},
        reflector, watcher,
    },
    Api, Client, ResourceExt,
};

use super::metrics::{ControllerMetrics, Stage};
use super::{
    lead::Leadership,
    rule::{self, boot_id, fenced_by_us, judge, Verdict},
    write::{get_with_date, Done, Recovery, Work, Writer},
    ControllerConfig, FencePolicy, FENCED_BOOT_ANNOTATION, FENCED_CONDITION, KEPT_SAME_BOOT,
    NODE_LEASE_NAMESPACE, OPT_OUT_LABEL, OPT_OUT_VALUE,
};

/// How many of its last actions a controller keeps (tests and debugging).
const ACTIONS_KEPT: usize = 256;
/// One write (a fence: live reads, the taint, the pods) may take this long.
const WORK_BUDGET: Duration = Duration::from_secs(30);

pub struct Controller {
    cfg: ControllerConfig,
    client: Client,
    store: reflector::Store<Node>,
    lead: Leadership,
    writer: Writer,
    /// Fences in the last minute, across the cluster.
    fences: VecDeque<SystemTime>,
    /// Per node, the Event last told about it: told once until its
    /// verdict moves on.
    told: BTreeMap<String, &'static str>,
    /// Fenced nodes whose pods are not all deleted yet.
    unrecovered: BTreeSet<String>,
    /// Whether the last pass led: a new leader looks for fences an earlier
    /// one left without deleting the node's pods.
    leading: bool,
    /// The same, for the ledger's writer (its own task).
    leading_now: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The ledger's writer, until the first tick starts it.
    ledger: Option<super::ledger_writer::Writer>,
    /// The last actions (newest last), at most [`ACTIONS_KEPT`].
    pub actions: VecDeque<(String, Verdict)>,
    /// Lease held, actions by kind, failed passes (served by `lastgasp controller`).
    pub metrics: ControllerMetrics,
}

/// What the controller never reads of a Node, not kept in its cache: the
/// image list and the managed fields' field sets, most of a busy Node's
/// bytes (`cargo xtask bench sizing`). Of the field sets only whether one
/// owns the Ready condition is kept (`rule::ready_written` reads it); every
/// entry keeps its manager and time (`record::written_at`).
pub(super) fn trim_node(node: &mut Node) {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1;
    if let Some(st) = node.status.as_mut() {
        st.images = None;
    }
    for m in node.metadata.managed_fields.iter_mut().flatten() {
        let ready = m.fields_v1.as_ref().is_some_and(|f| {
            f.0.pointer("/f:status/f:conditions")
                .and_then(|c| c.get(READY_KEY))
                .is_some()
        });
        m.fields_v1 = ready
            .then(|| FieldsV1(serde_json::json!({"f:status": {"f:conditions": {READY_KEY: {}}}})));
    }
}

/// The Ready condition's key in a field set.
const READY_KEY: &str = r#"k:{"type":"Ready"}"#;

impl Controller {
    /// `watch` serves the node watch (long reads), `client` every other
    /// request (short, bounded reads).
    pub async fn start(watch: Client, client: Client, cfg: ControllerConfig) -> Result<Self> {
        let store = crate::apiserver::warm_store(
            Api::<Node>::all(watch),
            watcher::Config::default(),
            "node",
            trim_node,
        )
        .await?;
        let reporter = Reporter {
            controller: "lastgasp-controller".into(),
            instance: Some(cfg.identity.clone()),
        };
        let installed = match &cfg.deployment {
            Some(d) => installed(&client, &cfg.lease_namespace, d).await,
            None => None,
        };
        let lead = Leadership::new(
            Api::namespaced(client.clone(), &cfg.lease_namespace),
            cfg.clone(),
            installed,
        );
        let leading_now = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ledger = cfg.ledger.map(|retention| {
            super::ledger_writer::Writer::new(
                client.clone(),
                store.clone(),
                leading_now.clone(),
                retention,
            )
        });
        Ok(Controller {
            writer: Writer {
                nodes: Api::all(client.clone()),
                recorder: Recorder::new(client.clone(), reporter),
                client: client.clone(),
                cfg: cfg.clone(),
                lead: lead.clone(),
            },
            lead,
            client,
            store,
            cfg,
            fences: VecDeque::new(),
            told: BTreeMap::new(),
            unrecovered: BTreeSet::new(),
            leading: false,
            leading_now,
            ledger,
            actions: VecDeque::new(),
            metrics: ControllerMetrics::default(),
        })
    }

    /// One pass: lead or stand by; if leading, judge every node.
    pub async fn tick(&mut self) -> Result<bool> {
        // Started here, not in `start`: it counts into the metrics the
        // caller set after `start`.
        if let Some(w) = self.ledger.take() {
            tokio::spawn(w.run(self.metrics.clone()));
        }
        let r = self.pass().await;
        if r.is_err() {
            self.metrics.count_error(Stage::pass);
        }
        r
    }

    async fn pass(&mut self) -> Result<bool> {
        let now = SystemTime::now();
        // An error leaves the gauges as they were (`tick` counts the failed pass).
        let term = self.lead.renew(now).await?;
        self.metrics.lease_held.set(i64::from(term.leading));
        let newly = term.leading && !self.leading;
        self.leading = term.leading;
        // The ledger is written while fencing is paused too.
        self.leading_now
            .store(term.leading, std::sync::atomic::Ordering::Relaxed);
        if !term.leading {
            return Ok(false);
        }
        self.metrics.paused.set(i64::from(term.paused));
        let nodes = self.store.state();
        self.metrics.nodes.set(nodes.len() as i64);
        while self
            .fences
            .front()
            .is_some_and(|t| now.duration_since(*t).unwrap_or_default() > Duration::from_secs(60))
        {
            self.fences.pop_front();
        }
        let (leases, server_now) = self.leases_if_wanted(&nodes, now).await;
        let mut fenced = nodes.iter().filter(|n| fenced_by_us(n)).count();
        self.metrics.fenced.set(fenced as i64);
        let present: BTreeSet<String> = nodes.iter().map(|n| n.name_any()).collect();
        self.told.retain(|n, _| present.contains(n));
        self.unrecovered.retain(|n| present.contains(n));
        let mut work: Vec<(String, Work)> = Vec::new();
        for node in nodes {
            let name = node.name_any();
            if newly && left_unrecovered(&node) {
                self.unrecovered.insert(name.clone());
            }
            let verdict = judge(&node, leases.get(name.as_str()), server_now, &self.cfg);
            let down = verdict == Verdict::Fenced;
            let w = self.work_for(&node, verdict, term.paused, now, &mut fenced);
            let w = w
                .or_else(|| {
                    (self.unrecovered.contains(&name) && down && !term.paused)
                        .then_some(Work::Recover)
                })
                .or_else(|| rule::stale_condition(&node).map(|reason| Work::Clear { reason }));
            if let Some(w) = w {
                work.push((name, w));
            }
        }
        self.execute(work).await;
        Ok(true)
    }

    /// The kubelets' Leases and the server's time, when some node's verdict
    /// needs them; none (so no fence) when they cannot be read.
    async fn leases_if_wanted(
        &mut self,
        nodes: &[std::sync::Arc<Node>],
        now: SystemTime,
    ) -> (BTreeMap<String, Lease>, SystemTime) {
        if !nodes.iter().any(|n| rule::wants_lease(n)) {
            return (BTreeMap::new(), now);
        }
        match self.leases_now().await {
            Ok(l) => l,
            Err(e) => {
                self.metrics.count_error(Stage::leases);
                tracing::warn!(
                    error = format!("{e:#}"),
                    "node Leases not read: no fence this pass"
                );
                (BTreeMap::new(), now)
            }
        }
    }

    /// What one node's verdict asks of the writer, or tells in an Event.
    fn work_for(
        &mut self,
        node: &Node,
        verdict: Verdict,
        paused: bool,
        now: SystemTime,
        fenced: &mut usize,
    ) -> Option<Work> {
        let name = node.name_any();
        match verdict {
            Verdict::Fence { why } => self.control(node, why, paused, now, fenced),
            Verdict::Untaint => Some(Work::Untaint),
            Verdict::BackOnSameBoot => {
                self.metrics.count_action("kept-same-boot");
                self.record(&name, Verdict::BackOnSameBoot);
                self.tell(&name, EventType::Warning, KEPT_SAME_BOOT,
                    "Ready again on the boot it was fenced in: it did not go down. Check its workloads and storage, then remove the taint by hand".into())
            }
            Verdict::Contradicted { why } => {
                self.metrics.count_action("contradicted");
                self.tell(
                    &name,
                    EventType::Warning,
                    "ShutdownRecordContradicted",
                    format!("{why}: not fenced on that record"),
                )
            }
            Verdict::Nothing { why } => {
                if !why.is_empty() {
                    tracing::debug!(node = %name, "not fenced: {why}");
                }
                self.told.remove(&name);
                None
            }
            Verdict::Wait { .. } | Verdict::Fenced => {
                self.told.remove(&name);
                None
            }
        }
    }

    /// The writes, side by side (at most `concurrency`), each within
    /// [`WORK_BUDGET`].
    async fn execute(&mut self, work: Vec<(String, Work)>) {
        let writer = self.writer.clone();
        let done: Vec<(String, Work, Result<Done>)> = futures::stream::iter(work)
            .map(|(name, w)| {
                let writer = writer.clone();
                async move {
                    let r = match tokio::time::timeout(WORK_BUDGET, writer.execute(&name, &w)).await
                    {
                        Ok(r) => r,
                        Err(_) => Err(anyhow::anyhow!("no answer within {WORK_BUDGET:?}")),
                    };
                    (name, w, r)
                }
            })
            .buffer_unordered(self.cfg.concurrency.max(1))
            .collect()
            .await;
        for (name, w, r) in done {
            self.settle(name, w, r);
        }
    }

    /// A fence the rule allows, through the operator's controls: what is
    /// done, or said instead.
    fn control(
        &mut self,
        node: &Node,
        why: String,
        paused: bool,
        now: SystemTime,
        fenced: &mut usize,
    ) -> Option<Work> {
        let name = node.name_any();
        let held =
            |reason: &'static str, action: &'static str, note: String| (reason, action, note);
        let limit = self.cfg.max_fences_per_minute;
        let ceiling = self.cfg.max_fenced;
        let hold = if self.cfg.policy == FencePolicy::Observe {
            Some(held(
                "OutOfServiceWouldFence",
                "would-fence",
                format!("{why}; policy observe: not fenced"),
            ))
        } else if node.labels().get(OPT_OUT_LABEL).map(String::as_str) == Some(OPT_OUT_VALUE) {
            Some(held(
                "OutOfServiceOptedOut",
                "held-opted-out",
                format!("{why}; the node is labelled {OPT_OUT_LABEL}={OPT_OUT_VALUE}: not fenced"),
            ))
        } else if paused {
            Some(held("OutOfServicePaused", "held-paused", format!("{why}; fencing is paused (the controller's Lease is annotated lastgasp.dev/paused=true): not fenced")))
        } else if ceiling > 0 && *fenced >= ceiling {
            Some(held("OutOfServiceCeiling", "held-ceiling", format!("{why}; {fenced} nodes are fenced already, the ceiling is {ceiling} (--max-fenced): not fenced yet")))
        } else if limit > 0 && self.fences.len() >= limit {
            Some(held(
                "OutOfServiceRateLimited",
                "refused-rate-limit",
                format!(
                    "{why}; {limit} fences in the last minute across the cluster: not fenced yet"
                ),
            ))
        } else {
            None
        };
        match hold {
            Some((reason, action, note)) => {
                if self.told.get(&name) != Some(&reason) {
                    self.metrics.count_action(action);
                    tracing::warn!(node = %name, "{note}");
                }
                let type_ = if reason == "OutOfServiceWouldFence" {
                    EventType::Normal
                } else {
                    EventType::Warning
                };
                self.tell(&name, type_, reason, note)
            }
            None => {
                self.fences.push_back(now);
                *fenced += 1;
                self.told.remove(&name);
                Some(Work::Fence { why })
            }
        }
    }

    /// An Event about `node`, once until its verdict moves on.
    fn tell(
        &mut self,
        node: &str,
        type_: EventType,
        reason: &'static str,
        note: String,
    ) -> Option<Work> {
        if self.told.insert(node.to_string(), reason) == Some(reason) {
            return None;
        }
        Some(Work::Tell {
            type_,
            reason,
            note,
        })
    }

    fn record(&mut self, node: &str, v: Verdict) {
        if self.actions.len() == ACTIONS_KEPT {
            self.actions.pop_front();
        }
        self.actions.push_back((node.to_string(), v));
    }

    /// Folds one write's result into the state, the metrics and `actions`.
    fn settle(&mut self, name: String, w: Work, r: Result<Done>) {
        match (w, r) {
            (Work::Fence { why }, Ok(Done::Fenced { recovered })) => {
                self.metrics.count_action("taint-added");
                tracing::info!(node = %name, "fenced: {why}");
                self.recovered(&name, recovered);
                self.record(&name, Verdict::Fence { why });
            }
            (Work::Fence { .. }, Ok(Done::NotFenced(now))) => {
                self.fences.pop_back();
                tracing::info!(node = %name, "not fenced: the live read says {now}");
            }
            (Work::Untaint, Ok(Done::Untainted)) => {
                self.unrecovered.remove(&name);
                self.metrics.count_action("taint-removed");
                tracing::info!(node = %name, "out-of-service taint removed");
                self.record(&name, Verdict::Untaint);
            }
            (Work::Recover, Ok(Done::Recovered(r))) => self.recovered(&name, r),
            (Work::Recover, Ok(Done::NotRecovered(now))) => {
                self.unrecovered.remove(&name);
                tracing::info!(node = %name, "its pods NOT deleted: the live read says {now}");
            }
            (Work::Clear { reason }, Ok(_)) => {
                self.metrics.count_action("condition-cleared");
                tracing::info!(node = %name, reason, "{FENCED_CONDITION} set False: the fence it reported is gone");
            }
            (_, Ok(_)) => {}
            (w, Err(e)) => {
                self.metrics.count_error(Stage::action);
                if let Work::Fence { .. } = w {
                    // Not fenced: it counts against nobody's limit.
                    self.fences.pop_back();
                }
                tracing::warn!(node = %name, work = ?w, error = format!("{e:#}"), "controller action failed");
            }
        }
    }

    fn recovered(&mut self, name: &str, r: Result<Recovery>) {
        match r {
            Ok(Recovery { deleted, waiting }) => {
                self.metrics.pods_deleted.inc_by(deleted);
                if waiting > 0 {
                    self.unrecovered.insert(name.to_string());
                    tracing::info!(node = %name, deleted, waiting, "fenced node: pods not marked for deletion yet (next pass)");
                } else {
                    self.unrecovered.remove(name);
                    tracing::info!(node = %name, deleted, "the fenced node's pods deleted with grace 0");
                }
            }
            Err(e) => {
                self.unrecovered.insert(name.to_string());
                tracing::warn!(node = %name, error = format!("{e:#}"), "the fenced node's pods NOT all deleted");
            }
        }
    }

    /// Every node Lease in one LIST, with the API server's time of the answer.
    async fn leases_now(&self) -> Result<(BTreeMap<String, Lease>, SystemTime)> {
        let path = format!("/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases");
        let (list, date) = get_with_date::<k8s_openapi::List<Lease>>(&self.client, &path).await?;
        let leases = list
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .map(|l| (l.name_any(), l))
            .collect();
        Ok((leases, date))
    }
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("identity", &self.cfg.identity)
            .field("leading", &self.leading)
            .finish()
    }
}

/// The API server's creation time of this replica's Deployment, or none
/// (said in the log: an uninstall's pause then stays).
async fn installed(client: &Client, ns: &str, name: &str) -> Option<SystemTime> {
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), ns);
    match deployments.get(name).await {
        Ok(d) => d.metadata.creation_timestamp.map(|t| SystemTime::from(t.0)),
        Err(e) => {
            tracing::warn!(deployment = name, error = %e, "this replica's Deployment not read: a pause an uninstall left stays");
            None
        }
    }
}

/// An earlier leader's fence of this boot: its pods may not all be deleted.
fn left_unrecovered(node: &Node) -> bool {
    fenced_by_us(node)
        && node
            .annotations()
            .get(FENCED_BOOT_ANNOTATION)
            .map(String::as_str)
            == boot_id(node)
}
