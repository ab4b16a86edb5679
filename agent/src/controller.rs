//! `lastgasp controller`: completes the non-graceful shutdown procedure
//! (KEP-2268) by itself. One active replica, elected through a Lease.
//!
//! A node is gone when two things hold: its agent's record of a power-off
//! or halt is current (this boot, newer than its last Ready, neither
//! abandoned nor back), and its kubelet has gone silent: the node's Lease
//! in `kube-node-lease` has not been written for longer than its renew
//! interval plus a margin, both times on the API server's clock. Then the
//! controller fences it and recovers at once: the
//! `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute` taint first,
//! then, once the API server has it, a grace-0 delete of the pods bound to
//! the node (what the pod garbage collector does after NotReady, without
//! its 50 s + 20 s wait). A reboot is never fenced unless the policy says
//! so. The taint goes once the node is Ready again on a new boot, checked on
//! a live read. `--gone-when not-ready` keeps the older, slower rule: taint
//! only, once Ready is not True.
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::Result;
use futures::StreamExt;
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::{Node, NodeCondition, ObjectReference, Pod, Taint},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    jiff::Timestamp,
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions},
    runtime::{
        events::{Event, EventType, Recorder, Reporter},
        reflector, watcher,
    },
    Api, Client, ResourceExt,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{
    act::{
        kube::{client, Use, RECORD_ANNOTATION},
        metrics::ControllerMetrics,
    },
    health::Health,
    http::{self, Listen},
    signal::Kind,
};

pub const OUT_OF_SERVICE_KEY: &str = "node.kubernetes.io/out-of-service";
pub const OUT_OF_SERVICE_VALUE: &str = "nodeshutdown";
/// Marks a taint as ours, so that only ours is ever removed.
pub const TAINTED_BY_ANNOTATION: &str = "lastgasp.dev/out-of-service-by";
/// The boot id the node was fenced in: the taint goes only on another boot.
pub const FENCED_BOOT_ANNOTATION: &str = "lastgasp.dev/out-of-service-boot";
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// When a node with a current record counts as gone.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum GoneWhen {
    /// Its kubelet's Lease is silent (server clock): taint, then delete its pods.
    LeaseSilent,
    /// Its Ready condition is not True (the node lifecycle controller's
    /// 50 s): taint only.
    NotReady,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    Off,
    PoweroffOnly,
    /// Also reboots that have not come back after `reboot_timeout`.
    AlsoReboots,
}

#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub policy: Policy,
    pub reboot_timeout: Duration,
    pub gone_when: GoneWhen,
    /// Added to the Lease's renew interval before a node counts as silent.
    pub lease_margin: Duration,
    /// Fences across the cluster per minute; 0: no limit.
    pub max_fences_per_minute: usize,
    pub lease_namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
    /// Writes in flight at once in a pass (fences, pod deletes, Events).
    pub concurrency: usize,
}

/// What the agent's record says, as far as the controller needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeRecord {
    pub kind: Kind,
    pub at: SystemTime,
    /// The boot the record was written in.
    pub boot_id: Option<String>,
    /// The agent saw the node come back after this record.
    pub back: bool,
    /// The agent gave the episode up: no shutdown came.
    pub abandoned: bool,
}

pub fn parse_record(node: &Node) -> Option<NodeRecord> {
    let raw = node.annotations().get(RECORD_ANNOTATION)?;
    let v: serde_json::Value = serde_json::from_str(raw).ok()?;
    let signal = v.get("signal")?;
    let kind: Kind = serde_json::from_value(signal.get("kind")?.clone()).ok()?;
    let at = v
        .get("at")
        .or_else(|| signal.get("at"))
        .and_then(|a| a.as_str())
        .and_then(|a| humantime::parse_rfc3339_weak(a).ok())?;
    Some(NodeRecord {
        kind,
        at,
        boot_id: v
            .get("boot_id")
            .and_then(|b| b.as_str())
            .map(str::to_string),
        back: v.get("back").and_then(|b| b.as_bool()).unwrap_or(false),
        abandoned: v
            .get("abandoned")
            .and_then(|b| b.as_bool())
            .unwrap_or(false),
    })
}

/// Why a record is no evidence that the node is down now, if it is not.
pub fn stale(rec: &NodeRecord, node: &Node, ready_since: Option<SystemTime>) -> Option<String> {
    if rec.back {
        return Some("the node came back after it".into());
    }
    if rec.abandoned {
        return Some("the agent abandoned it: no shutdown came".into());
    }
    let current = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.boot_id.as_str())
        .filter(|b| !b.is_empty());
    match (rec.boot_id.as_deref(), current) {
        (None, _) => return Some("it names no boot".into()),
        (_, None) => return Some("the Node reports no bootID".into()),
        (Some(r), Some(c)) if r != c => {
            return Some(format!("it is of boot {r}, the node's is {c}"))
        }
        _ => {}
    }
    match ready_since {
        Some(t) if rec.at <= t => Some(format!(
            "it is older than the node's last Ready ({})",
            humantime::format_rfc3339_seconds(t)
        )),
        _ => None,
    }
}

/// The kubelet's Ready condition, if reported.
fn ready_condition(node: &Node) -> Option<&NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// The kubelet's Ready status ("True", "False", "Unknown"), if reported.
fn ready(node: &Node) -> Option<String> {
    ready_condition(node).map(|c| c.status.clone())
}

/// When the out-of-service taint was added (whole seconds).
fn fenced_at(node: &Node) -> Option<SystemTime> {
    node.spec
        .as_ref()?
        .taints
        .as_ref()?
        .iter()
        .find(|t| t.key == OUT_OF_SERVICE_KEY)?
        .time_added
        .as_ref()
        .map(|t| SystemTime::from(t.0))
}

fn has_out_of_service(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_KEY))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Taint the node; with `recover`, then delete its pods with grace 0.
    Fence {
        why: String,
        recover: bool,
    },
    /// A current record: gone if its Lease is silent (a live read decides).
    Candidate {
        why: String,
    },
    Untaint,
    /// Ours, Ready again, but on the boot it was fenced in: it never went
    /// down. The taint stays for a human (its volumes may have been detached).
    BackOnSameBoot,
    /// Ours, on the boot it was fenced in, its Ready from before the fence:
    /// back only if its Lease is written again (the live read decides).
    Fenced,
    /// Would fence, but the cluster-wide limit is reached.
    RateLimited,
    /// A current record, but the node renewed its Lease after it: not fenced.
    Contradicted {
        why: String,
    },
    Nothing,
}

impl Verdict {
    /// The variant's name, without its reason.
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Fence { .. } => "Fence",
            Verdict::Candidate { .. } => "Candidate",
            Verdict::Untaint => "Untaint",
            Verdict::BackOnSameBoot => "BackOnSameBoot",
            Verdict::Fenced => "Fenced",
            Verdict::RateLimited => "RateLimited",
            Verdict::Contradicted { .. } => "Contradicted",
            Verdict::Nothing => "Nothing",
        }
    }
}

/// Whether a node's kubelet still writes its Lease, on the API server's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Not written for this long (counted so that it can only be late).
    Silent(Duration),
    /// Written this long ago: within its renew interval plus the margin.
    Renewing(Duration),
    /// Written after the controller first saw the record: the node lived on.
    Contradicted,
    /// No answer either way (no Lease, no server time): never fenced on.
    Unknown(String),
}

fn boot_id(node: &Node) -> Option<&str> {
    node.status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.boot_id.as_str())
        .filter(|b| !b.is_empty())
}

/// The Lease's liveness at `server_now` (a response's `Date`, whole
/// seconds, so up to 1 s early). The last write is the newest
/// `managedFields` time: the API server stamps it, in whole seconds (up to
/// 1 s early), so a renewal's age is at least `server_now - last - 1 s`; a
/// node is silent only when that exceeds the renew interval (a quarter of
/// `leaseDurationSeconds`, as the kubelet renews) plus `margin`. The
/// kubelet's own `renewTime` is its clock, not the server's, and is not
/// used. `record_seen` is the server time at which the controller first
/// read the Lease for this record: a write 2 s or more after it contradicts
/// the record.
pub fn liveness(
    lease: &Lease,
    server_now: SystemTime,
    record_seen: SystemTime,
    margin: Duration,
) -> Liveness {
    let Some(last) = lease
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.time.as_ref())
        .map(|t| SystemTime::from(t.0))
        .max()
    else {
        return Liveness::Unknown("the Lease carries no server time (managedFields)".into());
    };
    let Some(dur) = lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_duration_seconds)
        .filter(|d| *d > 0)
    else {
        return Liveness::Unknown("the Lease has no leaseDurationSeconds".into());
    };
    if last >= record_seen + Duration::from_secs(2) {
        return Liveness::Contradicted;
    }
    let age = server_now
        .duration_since(last)
        .unwrap_or_default()
        .saturating_sub(Duration::from_secs(1));
    let interval = Duration::from_secs(dur as u64) / 4;
    if age > interval + margin {
        Liveness::Silent(age)
    } else {
        Liveness::Renewing(age)
    }
}

/// When the Ready condition last turned True, while it is True.
pub fn ready_transition(node: &Node) -> Option<SystemTime> {
    let c = ready_condition(node).filter(|c| c.status == "True")?;
    c.last_transition_time
        .as_ref()
        .map(|t| SystemTime::from(t.0))
}

/// The pure rule, for one node at time `now`; `ready_since`, when the
/// controller last saw its Ready turn True. Only a current record counts:
/// of the node's present boot, newer than its last Ready, neither
/// abandoned nor back. With `GoneWhen::LeaseSilent` it answers `Candidate`,
/// and the Lease decides ([`liveness`]).
pub fn judge(
    node: &Node,
    cfg: &ControllerConfig,
    now: SystemTime,
    ready_since: Option<SystemTime>,
) -> Verdict {
    let tainted = has_out_of_service(node);
    let ours = node.annotations().contains_key(TAINTED_BY_ANNOTATION);
    let status = ready(node).unwrap_or_else(|| "Unknown".into());
    if tainted {
        if !(ours && status == "True") {
            return Verdict::Nothing;
        }
        let same_boot = matches!(node.annotations().get(FENCED_BOOT_ANNOTATION),
            Some(b) if Some(b.as_str()) == boot_id(node));
        if !same_boot {
            return Verdict::Untaint;
        }
        // Ready on the boot it was fenced in. A Ready that turned True before
        // the fence is stale (the node lifecycle controller marks a silent
        // node Unknown only after 50 s): the node came back only if Ready
        // turned True since, or its Lease is written again.
        return match (ready_transition(node), fenced_at(node)) {
            (Some(r), Some(f)) if r >= f => Verdict::BackOnSameBoot,
            _ => Verdict::Fenced,
        };
    }
    if cfg.policy == Policy::Off || (cfg.gone_when == GoneWhen::NotReady && status == "True") {
        return Verdict::Nothing;
    }
    let Some(rec) = parse_record(node) else {
        return Verdict::Nothing;
    };
    if let Some(why) = stale(&rec, node, ready_since) {
        tracing::debug!(node = %node.name_any(), "record not acted on: {why}");
        return Verdict::Nothing;
    }
    let why = match rec.kind {
        Kind::Poweroff | Kind::Halt => format!(
            "{} recorded at {}",
            rec.kind,
            humantime::format_rfc3339_seconds(rec.at)
        ),
        Kind::Reboot | Kind::Kexec | Kind::SoftReboot | Kind::Unknown
            if cfg.policy == Policy::AlsoReboots =>
        {
            let waited = now.duration_since(rec.at).unwrap_or_default();
            if waited < cfg.reboot_timeout {
                return Verdict::Nothing;
            }
            format!(
                "{} recorded {}s ago never came back",
                rec.kind,
                waited.as_secs()
            )
        }
        _ => return Verdict::Nothing,
    };
    match cfg.gone_when {
        GoneWhen::NotReady => Verdict::Fence {
            why: format!("{why}; node {status}"),
            recover: false,
        },
        GoneWhen::LeaseSilent => Verdict::Candidate { why },
    }
}

/// Leader election over a coordination.k8s.io Lease: take it when free or
/// expired, renew while held. Conflicts (409) mean someone else won.
/// Another holder's Lease as this replica last saw it: (holder, renewTime,
/// when that pair was first seen, on the local monotonic clock). A Lease is
/// judged expired when the pair has not changed for its whole duration on
/// this clock: neither clock skew nor the holder's clock can make a live
/// lease look dead or a dead one look alive (the API server's `Date` header
/// has 1 s resolution; this needs no clock but our own).
#[derive(Clone, Debug, Default)]
pub struct LeaseSeen(Option<(String, String, std::time::Instant)>);

impl LeaseSeen {
    /// Whether the lease (holder, renew) has gone unrenewed for `dur`.
    pub fn expired(
        &mut self,
        holder: &str,
        renew: &str,
        dur: Duration,
        now: std::time::Instant,
    ) -> bool {
        match &self.0 {
            Some((h, r, since)) if h == holder && r == renew => now.duration_since(*since) > dur,
            _ => {
                self.0 = Some((holder.to_string(), renew.to_string(), now));
                false
            }
        }
    }
}

pub async fn try_lead(
    leases: &Api<Lease>,
    cfg: &ControllerConfig,
    now: SystemTime,
    seen: &mut LeaseSeen,
) -> Result<bool> {
    let micro =
        |t: SystemTime| MicroTime(Timestamp::try_from(t).unwrap_or_else(|_| Timestamp::now()));
    let spec = |transitions: i32, acquire: Option<MicroTime>| LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(cfg.lease_duration.as_secs() as i32),
        acquire_time: acquire,
        renew_time: Some(micro(now)),
        lease_transitions: Some(transitions),
        ..Default::default()
    };
    match leases.get_opt(&cfg.lease_name).await? {
        None => {
            let lease = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(cfg.lease_name.clone()),
                    ..Default::default()
                },
                spec: Some(spec(0, Some(micro(now)))),
            };
            match leases.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e.into()),
            }
        }
        Some(mut lease) => {
            let cur = lease.spec.clone().unwrap_or_default();
            let mine = cur.holder_identity.as_deref() == Some(cfg.identity.as_str());
            let dur = Duration::from_secs(cur.lease_duration_seconds.unwrap_or(15).max(1) as u64);
            let holder = cur.holder_identity.clone().unwrap_or_default();
            let renew = cur
                .renew_time
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default();
            let expired =
                holder.is_empty() || seen.expired(&holder, &renew, dur, std::time::Instant::now());
            if !mine && !expired {
                return Ok(false);
            }
            let transitions = cur.lease_transitions.unwrap_or(0) + i32::from(!mine);
            let acquire = if mine {
                cur.acquire_time
            } else {
                Some(micro(now))
            };
            lease.spec = Some(spec(transitions, acquire));
            // The resourceVersion read above makes a concurrent writer fail.
            match leases
                .replace(&cfg.lease_name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e.into()),
            }
        }
    }
}

pub struct Controller {
    cfg: ControllerConfig,
    client: Client,
    leases: Api<Lease>,
    store: reflector::Store<Node>,
    writer: Writer,
    /// Fences in the last minute, across the cluster.
    fences: VecDeque<SystemTime>,
    /// Nodes refused by the limit (one Warning each until fenced).
    refused: BTreeSet<String>,
    /// Per node, when its Ready last turned True (as last seen True).
    ready_since: BTreeMap<String, SystemTime>,
    /// Per node: the record (raw) and the server time the controller first
    /// read the node's Lease for it.
    record_seen: BTreeMap<String, (String, SystemTime)>,
    /// Fenced nodes whose pods are not all deleted yet.
    unrecovered: BTreeSet<String>,
    /// Whether the last pass led: a new leader looks for fences an earlier
    /// one left without deleting the node's pods.
    leading: bool,
    lease_seen: LeaseSeen,
    pub actions: Vec<(String, Verdict)>,
    /// Lease held, actions by kind, failed passes (served by `lastgasp controller`).
    pub metrics: ControllerMetrics,
}

/// A GET whose answer also says the API server's time (its `Date` header).
async fn get_with_date<K: serde::de::DeserializeOwned>(
    client: &Client,
    path: &str,
) -> Result<(Option<K>, SystemTime)> {
    use http_body_util::BodyExt;
    let req = ::http::Request::get(path).body(kube::client::Body::empty())?;
    let resp = client.send(req).await?;
    let date = resp
        .headers()
        .get(::http::header::DATE)
        .and_then(|d| d.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .ok_or_else(|| anyhow::anyhow!("the API server's answer has no Date header"))?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status == ::http::StatusCode::NOT_FOUND {
        return Ok((None, date));
    }
    if !status.is_success() {
        anyhow::bail!("GET {path}: {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok((Some(serde_json::from_slice(&body)?), date))
}

/// One write the pass decided on, carried out beside the others.
#[derive(Clone, Debug)]
enum Work {
    Fence {
        why: String,
        recover: bool,
    },
    Untaint,
    /// Delete the pods of a node fenced earlier (a failed delete, or an
    /// earlier leader's fence).
    Recover,
    /// A Warning Event only (a refused fence, a contradicted record, a node
    /// back on the boot it was fenced in).
    Warn {
        reason: &'static str,
        note: String,
    },
}

/// What a [`Work`] came to.
enum Done {
    Fenced {
        recovered: Result<u64>,
    },
    Untainted,
    /// The live read no longer says so: nothing written.
    NotUntainted,
    Recovered(Result<u64>),
    Warned,
}

/// The controller's writes, cloned into each concurrent task.
#[derive(Clone)]
struct Writer {
    client: Client,
    nodes: Api<Node>,
    recorder: Recorder,
    cfg: ControllerConfig,
}

impl Controller {
    pub async fn start(client: Client, cfg: ControllerConfig) -> Result<Self> {
        let store = crate::act::kube::warm_store(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            "node",
        )
        .await?;
        let reporter = Reporter {
            controller: "lastgasp-controller".into(),
            instance: Some(cfg.identity.clone()),
        };
        Ok(Controller {
            leases: Api::namespaced(client.clone(), &cfg.lease_namespace),
            writer: Writer {
                nodes: Api::all(client.clone()),
                recorder: Recorder::new(client.clone(), reporter),
                client: client.clone(),
                cfg: cfg.clone(),
            },
            client,
            store,
            cfg,
            fences: VecDeque::new(),
            refused: BTreeSet::new(),
            ready_since: BTreeMap::new(),
            record_seen: BTreeMap::new(),
            unrecovered: BTreeSet::new(),
            leading: false,
            lease_seen: LeaseSeen::default(),
            actions: Vec::new(),
            metrics: ControllerMetrics::default(),
        })
    }

    /// One pass: lead or stand by; if leading, judge every node.
    pub async fn tick(&mut self) -> Result<bool> {
        let r = self.pass().await;
        if r.is_err() {
            self.metrics.pass_errors.inc();
        }
        r
    }

    /// Judges every node from the watch cache (and, when a record is
    /// current, the Leases from one LIST), then carries out the writes
    /// `cfg.concurrency` at a time. One node's failure never stops the others.
    async fn pass(&mut self) -> Result<bool> {
        let now = SystemTime::now();
        // An error leaves the gauge as it was (`tick` counts the failed pass).
        let leading = try_lead(&self.leases, &self.cfg, now, &mut self.lease_seen).await?;
        self.metrics.lease_held.set(i64::from(leading));
        let newly = leading && !self.leading;
        self.leading = leading;
        if !leading {
            return Ok(false);
        }
        let nodes = self.store.state();
        self.metrics.nodes.set(nodes.len() as i64);
        while self
            .fences
            .front()
            .is_some_and(|t| now.duration_since(*t).unwrap_or_default() > Duration::from_secs(60))
        {
            self.fences.pop_front();
        }
        let mut fenced = 0;
        let mut judged = Vec::with_capacity(nodes.len());
        for node in nodes {
            let name = node.name_any();
            let ours =
                has_out_of_service(&node) && node.annotations().contains_key(TAINTED_BY_ANNOTATION);
            if ours {
                fenced += 1;
            }
            // A fence of the node's present boot, by an earlier leader (or
            // this one before it lost the Lease): its pods may not all be
            // deleted. The taint stands, so its pods go (one LIST each).
            if newly
                && ours
                && node
                    .annotations()
                    .get(FENCED_BOOT_ANNOTATION)
                    .map(String::as_str)
                    == boot_id(&node)
            {
                self.unrecovered.insert(name.clone());
            }
            if let Some(t) = ready_transition(&node) {
                self.ready_since.insert(name.clone(), t);
            }
            let ready_since = self.ready_since.get(&name).copied();
            let verdict = judge(&node, &self.cfg, now, ready_since);
            if !matches!(verdict, Verdict::Candidate { .. }) {
                self.record_seen.remove(&name);
            }
            judged.push((node, name, verdict));
        }
        self.metrics.fenced.set(fenced);
        if judged
            .iter()
            .any(|(_, _, v)| matches!(v, Verdict::Candidate { .. } | Verdict::Fenced))
        {
            match self.leases_now().await {
                Ok((leases, date)) => {
                    for (node, name, v) in judged.iter_mut() {
                        let lease = leases.get(name.as_str());
                        match v.clone() {
                            Verdict::Candidate { why } => {
                                *v = self.lease_verdict(node, name, why, lease, date);
                            }
                            // Its kubelet writes again on the boot it was fenced in.
                            Verdict::Fenced => {
                                let live =
                                    lease.map(|l| liveness(l, date, date, self.cfg.lease_margin));
                                if matches!(live, Some(Liveness::Renewing(_))) {
                                    *v = Verdict::BackOnSameBoot;
                                }
                            }
                            _ => {}
                        }
                    }
                }
                Err(e) => {
                    self.metrics.pass_errors.inc();
                    tracing::warn!("reading the node Leases: {e:#}; no fence this pass");
                }
            }
        }
        // Decide each node's write in order (the limit counts them), then
        // carry them out side by side.
        let mut work: Vec<(Arc<Node>, String, Work)> = Vec::new();
        for (node, name, verdict) in judged {
            let w = match &verdict {
                Verdict::Fence { why, recover } => {
                    let limit = self.cfg.max_fences_per_minute;
                    if limit > 0 && self.fences.len() >= limit {
                        self.metrics.count_action("refused-rate-limit");
                        self.actions.push((name.clone(), Verdict::RateLimited));
                        if !self.refused.insert(name.clone()) {
                            continue;
                        }
                        tracing::warn!(node = %name, "not fenced yet: {limit} fences in the last minute (--max-fences-per-minute)");
                        Work::Warn {
                            reason: "OutOfServiceRateLimited",
                            note: format!("{why}; not fenced yet: {limit} fences in the last minute across the cluster"),
                        }
                    } else {
                        self.fences.push_back(now);
                        self.refused.remove(&name);
                        Work::Fence {
                            why: why.clone(),
                            recover: *recover,
                        }
                    }
                }
                Verdict::Untaint => Work::Untaint,
                Verdict::BackOnSameBoot => {
                    if !self.refused.insert(format!("same-boot/{name}")) {
                        continue;
                    }
                    self.metrics.count_action("kept-same-boot");
                    tracing::warn!(node = %name, "Ready again on the boot it was fenced in: it never went down; the out-of-service taint stays for a human");
                    self.actions.push((name.clone(), verdict.clone()));
                    Work::Warn {
                        reason: "OutOfServiceKept",
                        note: "Ready again on the boot it was fenced in: it did not go down. Check its workloads and storage, then remove the taint by hand".into(),
                    }
                }
                Verdict::Contradicted { why } => {
                    if !self.refused.insert(format!("contradicted/{name}")) {
                        continue;
                    }
                    tracing::warn!(node = %name, "its Lease was renewed after its shutdown record: not fenced on that record");
                    Work::Warn {
                        reason: "ShutdownRecordContradicted",
                        note: format!(
                            "{why}, but the node renewed its Lease afterwards: not fenced"
                        ),
                    }
                }
                Verdict::RateLimited
                | Verdict::Nothing
                | Verdict::Candidate { .. }
                | Verdict::Fenced => {
                    if self.unrecovered.contains(&name) && has_out_of_service(&node) {
                        Work::Recover
                    } else {
                        continue;
                    }
                }
            };
            work.push((node, name, w));
        }
        let writer = self.writer.clone();
        let done: Vec<(String, Work, Result<Done>)> = futures::stream::iter(work)
            .map(|(node, name, w)| {
                let writer = writer.clone();
                async move {
                    let r = writer.execute(&node, &name, &w).await;
                    (name, w, r)
                }
            })
            .buffer_unordered(self.cfg.concurrency.max(1))
            .collect()
            .await;
        for (name, w, r) in done {
            self.settle(name, w, r);
        }
        Ok(true)
    }

    /// Folds one write's result into the state, the metrics and `actions`.
    fn settle(&mut self, name: String, w: Work, r: Result<Done>) {
        let recovered = |c: &mut Controller, name: &str, r: Result<u64>| match r {
            Ok(deleted) => {
                c.metrics.pods_deleted.inc_by(deleted);
                c.unrecovered.remove(name);
                tracing::info!(node = %name, deleted, "the fenced node's pods deleted with grace 0");
            }
            Err(e) => {
                c.unrecovered.insert(name.to_string());
                tracing::warn!(node = %name, "deleting the fenced node's pods: {e:#}");
            }
        };
        match (w, r) {
            (Work::Fence { why, recover }, Ok(Done::Fenced { recovered: r })) => {
                self.metrics.count_action("taint-added");
                if recover {
                    recovered(self, &name, r);
                }
                let v = Verdict::Fence { why, recover };
                tracing::info!(node = %name, verdict = ?v, "controller action");
                self.actions.push((name, v));
            }
            (Work::Untaint, Ok(Done::Untainted)) => {
                self.unrecovered.remove(&name);
                self.metrics.count_action("taint-removed");
                tracing::info!(node = %name, "controller action: out-of-service taint removed");
                self.actions.push((name, Verdict::Untaint));
            }
            (Work::Recover, Ok(Done::Recovered(r))) => recovered(self, &name, r),
            (_, Ok(_)) => {}
            (w, Err(e)) => {
                self.metrics.pass_errors.inc();
                if let Work::Fence { .. } = w {
                    // Not fenced: it counts against nobody's limit.
                    self.fences.pop_back();
                }
                tracing::warn!(node = %name, work = ?w, "controller action failed: {e:#}");
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

    /// A candidate's Lease, as the LIST answered at `date` (server clock).
    fn lease_verdict(
        &mut self,
        node: &Node,
        name: &str,
        why: String,
        lease: Option<&Lease>,
        date: SystemTime,
    ) -> Verdict {
        let raw = node
            .annotations()
            .get(RECORD_ANNOTATION)
            .cloned()
            .unwrap_or_default();
        let seen = match self.record_seen.get(name) {
            Some((r, t)) if *r == raw => *t,
            _ => {
                self.record_seen.insert(name.to_string(), (raw, date));
                date
            }
        };
        let live = match lease {
            Some(l) => liveness(l, date, seen, self.cfg.lease_margin),
            None => Liveness::Unknown(format!("no Lease {NODE_LEASE_NAMESPACE}/{name}")),
        };
        tracing::debug!(node = %name, ?live, "a current record; the node's Lease");
        match live {
            Liveness::Silent(age) => Verdict::Fence {
                why: format!(
                    "{why}; its kubelet's Lease unwritten for over {}s (API server's clock)",
                    age.as_secs()
                ),
                recover: true,
            },
            Liveness::Contradicted => Verdict::Contradicted { why },
            Liveness::Unknown(reason) => {
                tracing::warn!(node = %name, "not fenced: {reason}");
                Verdict::Nothing
            }
            Liveness::Renewing(_) => Verdict::Nothing,
        }
    }
}

fn is_conflict(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref::<kube::Error>(), Some(kube::Error::Api(s)) if s.code == 409)
}

impl Writer {
    async fn execute(&self, node: &Node, name: &str, w: &Work) -> Result<Done> {
        match w {
            Work::Fence { why, recover } => {
                match self.set_taint(node, true).await {
                    // Written since the cache saw it (the agent's condition or
                    // taint, say): once more on a live read.
                    Err(e) if is_conflict(&e) => {
                        let live = self.nodes.get(name).await?;
                        if !matches!(
                            judge(&live, &self.cfg, SystemTime::now(), None),
                            Verdict::Candidate { .. } | Verdict::Fence { .. }
                        ) {
                            anyhow::bail!(
                                "changed since the cache saw it, and no longer a candidate"
                            );
                        }
                        self.set_taint(&live, true).await?;
                    }
                    r => r?,
                }
                self.event(
                    name,
                    EventType::Warning,
                    "OutOfServiceTaintAdded",
                    why.clone(),
                )
                .await;
                // The API server has the taint: the replacements cannot land
                // on this node, and its volumes may detach.
                let recovered = if *recover {
                    self.recover(name).await
                } else {
                    Ok(0)
                };
                Ok(Done::Fenced { recovered })
            }
            Work::Untaint => {
                // The cache said Ready on a new boot; a live read must agree.
                let live = self.nodes.get(name).await?;
                if judge(&live, &self.cfg, SystemTime::now(), None) != Verdict::Untaint {
                    return Ok(Done::NotUntainted);
                }
                self.set_taint(&live, false).await?;
                self.event(
                    name,
                    EventType::Normal,
                    "OutOfServiceTaintRemoved",
                    format!(
                        "node is Ready again on boot {}",
                        boot_id(&live).unwrap_or("?")
                    ),
                )
                .await;
                Ok(Done::Untainted)
            }
            Work::Recover => Ok(Done::Recovered(self.recover(name).await)),
            Work::Warn { reason, note } => {
                self.event(name, EventType::Warning, reason, note.clone())
                    .await;
                Ok(Done::Warned)
            }
        }
    }

    /// Deletes the pods bound to a fenced node with grace 0, as the pod
    /// garbage collector would once the node is NotReady; how many.
    async fn recover(&self, name: &str) -> Result<u64> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let lp = ListParams::default().fields(&format!("spec.nodeName={name}"));
        let mut failed = 0;
        let mut deleted = 0;
        for pod in pods.list(&lp).await? {
            let ns = pod.namespace().unwrap_or_default();
            let dp = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    uid: pod.uid(),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match Api::<Pod>::namespaced(self.client.clone(), &ns)
                .delete(&pod.name_any(), &dp)
                .await
            {
                Ok(_) => deleted += 1,
                // Gone already, or replaced by a pod of the same name.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => {
                    failed += 1;
                    tracing::warn!(node = %name, pod = %pod.name_any(), "grace-0 delete: {e}");
                }
            }
        }
        if failed > 0 {
            anyhow::bail!("{failed} of the node's pods could not be deleted (retried next pass)");
        }
        Ok(deleted)
    }

    /// Sets or removes the taint with the cache's resourceVersion: a node
    /// written since gives 409, and the next pass (newer cache) tries again.
    async fn set_taint(&self, node: &Node, present: bool) -> Result<()> {
        let mut taints: Vec<Taint> = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        taints.retain(|t| t.key != OUT_OF_SERVICE_KEY);
        if present {
            taints.push(Taint {
                key: OUT_OF_SERVICE_KEY.into(),
                value: Some(OUT_OF_SERVICE_VALUE.into()),
                effect: "NoExecute".into(),
                time_added: Some(Time(Timestamp::now())),
            });
        }
        let (marker, boot) = if present {
            (json!(self.cfg.identity), json!(boot_id(node)))
        } else {
            (serde_json::Value::Null, serde_json::Value::Null)
        };
        let patch = json!({
            "metadata": { "resourceVersion": node.resource_version(), "annotations": {
                TAINTED_BY_ANNOTATION: marker, FENCED_BOOT_ANNOTATION: boot } },
            "spec": { "taints": taints },
        });
        self.nodes
            .patch(
                &node.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    async fn event(&self, node: &str, type_: EventType, reason: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            ..Default::default()
        };
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::warn!("controller event: {e}");
        }
    }
}

#[derive(clap::Args)]
pub struct ControllerArgs {
    /// When to apply node.kubernetes.io/out-of-service.
    #[arg(
        long,
        value_enum,
        default_value = "poweroff-only",
        env = "LASTGASP_POLICY"
    )]
    pub policy: Policy,
    /// With `also-reboots`: how long a reboot may stay down before the taint.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m", env = "LASTGASP_REBOOT_TIMEOUT")]
    pub reboot_timeout: std::time::Duration,
    /// When a node with a current record is gone: `lease-silent` (its
    /// kubelet's Lease unwritten past its renew interval + the margin; then
    /// taint and delete its pods) or `not-ready` (taint once Ready is not True).
    #[arg(
        long,
        value_enum,
        default_value = "lease-silent",
        env = "LASTGASP_GONE_WHEN"
    )]
    pub gone_when: GoneWhen,
    /// Added to the kubelet's Lease renew interval (10 s by default) before a node counts as silent.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s", env = "LASTGASP_LEASE_MARGIN")]
    pub lease_margin: std::time::Duration,
    /// Fences across the cluster per minute; 0: no limit. A refused fence
    /// raises a Warning Event and is retried.
    #[arg(long, default_value_t = 0, env = "LASTGASP_MAX_FENCES_PER_MINUTE")]
    pub max_fences_per_minute: usize,
    /// Writes in flight at once during a pass (fences, their pods' grace-0
    /// deletes, Events): the nodes of a zone that went dark are fenced side
    /// by side, not one after another.
    #[arg(long, default_value_t = 16, env = "LASTGASP_CONCURRENCY")]
    pub concurrency: usize,
    #[arg(long, default_value = "kube-system", env = "LASTGASP_LEASE_NAMESPACE")]
    pub lease_namespace: String,
    #[arg(
        long,
        default_value = "lastgasp-controller",
        env = "LASTGASP_LEASE_NAME"
    )]
    pub lease_name: String,
    /// This replica's name in the Lease (default: $POD_NAME).
    #[arg(long, env = "LASTGASP_IDENTITY")]
    pub identity: Option<String>,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s", env = "LASTGASP_INTERVAL")]
    pub interval: std::time::Duration,
    /// Serve /metrics, /readyz and /healthz on ADDR:PORT, or `off`
    /// (default: $POD_IP:9851).
    #[arg(long, value_name = "ADDR:PORT", env = "LASTGASP_METRICS_LISTEN")]
    pub metrics_listen: Option<Listen>,
}

/// `lastgasp controller`: one pass every `interval` while it holds the Lease.
pub async fn run(args: ControllerArgs) -> Result<()> {
    let identity = args
        .identity
        .or_else(|| std::env::var("POD_NAME").ok())
        .unwrap_or_else(|| format!("lastgasp-controller-{}", std::process::id()));
    let cfg = ControllerConfig {
        policy: args.policy,
        reboot_timeout: args.reboot_timeout,
        gone_when: args.gone_when,
        lease_margin: args.lease_margin,
        max_fences_per_minute: args.max_fences_per_minute,
        lease_namespace: args.lease_namespace,
        lease_name: args.lease_name,
        identity,
        lease_duration: std::time::Duration::from_secs(15),
        concurrency: args.concurrency,
    };
    let listen = http::resolve(
        args.metrics_listen,
        false,
        http::CONTROLLER_PORT,
        std::env::var("POD_IP").ok().as_deref(),
    )?;
    let health = Health::new("starting: the node watch has not listed yet");
    let metrics = ControllerMetrics::default();
    let m = metrics.clone();
    let _endpoint = http::start(listen, true, move || m.encode(), health.clone()).await?;
    let mut c = Controller::start(client(Use::Watch, None).await?, cfg).await?;
    c.metrics = metrics;
    health.not_ready("the first controller pass has not finished");
    let mut tick = tokio::time::interval(args.interval);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                health.beat();
                match c.tick().await {
                    Ok(_) => health.ready(),
                    Err(e) => tracing::warn!("controller pass: {e:#}"),
                }
            }
            _ = term.recv() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo};

    use super::*;

    fn cfg(policy: Policy) -> ControllerConfig {
        ControllerConfig {
            policy,
            reboot_timeout: Duration::from_secs(600),
            gone_when: GoneWhen::NotReady,
            lease_margin: Duration::from_secs(2),
            max_fences_per_minute: 0,
            concurrency: 16,
            lease_namespace: "kube-system".into(),
            lease_name: "lastgasp-controller".into(),
            identity: "a".into(),
            lease_duration: Duration::from_secs(15),
        }
    }

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn node(ready: &str, kind: Option<&str>, at: u64, tainted_by_us: bool) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n1".into());
        let mut ann = BTreeMap::new();
        if let Some(k) = kind {
            let rec = json!({"boot_id": "b1", "signal": {"kind": k, "at": humantime::format_rfc3339(t(at)).to_string()}});
            ann.insert(RECORD_ANNOTATION.to_string(), rec.to_string());
        }
        if tainted_by_us {
            ann.insert(TAINTED_BY_ANNOTATION.to_string(), "a".into());
            n.spec = Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: OUT_OF_SERVICE_KEY.into(),
                    effect: "NoExecute".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            });
        }
        n.metadata.annotations = Some(ann);
        n.status = Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: ready.into(),
                ..Default::default()
            }]),
            node_info: Some(NodeSystemInfo {
                boot_id: "b1".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        n
    }

    /// `node` with its record's JSON changed by `f`.
    fn with_record(mut n: Node, f: impl FnOnce(&mut serde_json::Value)) -> Node {
        let ann = n.metadata.annotations.as_mut().unwrap();
        let mut rec: serde_json::Value = serde_json::from_str(&ann[RECORD_ANNOTATION]).unwrap();
        f(&mut rec);
        ann.insert(RECORD_ANNOTATION.into(), rec.to_string());
        n
    }

    fn short(v: Verdict) -> &'static str {
        match v {
            Verdict::Fence { .. } => "taint",
            Verdict::Candidate { .. } => "candidate",
            Verdict::Untaint => "untaint",
            Verdict::BackOnSameBoot => "kept",
            Verdict::Fenced => "fenced",
            Verdict::RateLimited => "limited",
            Verdict::Contradicted { .. } => "contradicted",
            Verdict::Nothing => "-",
        }
    }

    #[test]
    fn the_rules() {
        let p = cfg(Policy::PoweroffOnly);
        let r = cfg(Policy::AlsoReboots);
        let cases = [
            (
                "poweroff then NotReady",
                node("False", Some("poweroff"), 0, false),
                &p,
                10,
                0,
                "taint",
            ),
            (
                "halt then Unknown",
                node("Unknown", Some("halt"), 0, false),
                &p,
                10,
                0,
                "taint",
            ),
            (
                "poweroff but still Ready",
                node("True", Some("poweroff"), 0, false),
                &p,
                10,
                0,
                "-",
            ),
            (
                "reboot then NotReady",
                node("False", Some("reboot"), 0, false),
                &p,
                10_000,
                0,
                "-",
            ),
            (
                "reboot, policy allows, not yet timed out",
                node("False", Some("reboot"), 0, false),
                &r,
                100,
                0,
                "-",
            ),
            (
                "reboot that never came back",
                node("False", Some("reboot"), 0, false),
                &r,
                700,
                0,
                "taint",
            ),
            (
                "no record: a partition, not a shutdown",
                node("Unknown", None, 0, false),
                &p,
                10,
                0,
                "-",
            ),
            (
                "Ready again: our taint goes",
                node("True", Some("poweroff"), 0, true),
                &p,
                10,
                0,
                "untaint",
            ),
            (
                "policy off",
                node("False", Some("poweroff"), 0, false),
                &cfg(Policy::Off),
                10,
                0,
                "-",
            ),
            (
                "already tainted",
                node("False", Some("poweroff"), 0, true),
                &p,
                10,
                0,
                "-",
            ),
        ];
        for (name, n, c, now, _recent, want) in cases {
            assert_eq!(short(judge(&n, c, t(now), None)), want, "{name}");
        }
    }

    /// Only current evidence fences: the node's present boot, newer than its
    /// last Ready, neither abandoned nor back.
    #[test]
    fn only_a_current_record_fences() {
        let p = cfg(Policy::PoweroffOnly);
        let down = || node("False", Some("poweroff"), 100, false);
        let cases = [
            ("current", down(), None, "taint"),
            ("newer than the last Ready", down(), Some(t(50)), "taint"),
            ("older than the last Ready", down(), Some(t(100)), "-"),
            (
                "another boot's record",
                with_record(down(), |r| r["boot_id"] = json!("b0")),
                None,
                "-",
            ),
            (
                "a record naming no boot",
                with_record(down(), |r| {
                    r.as_object_mut().unwrap().remove("boot_id");
                }),
                None,
                "-",
            ),
            (
                "abandoned",
                with_record(down(), |r| r["abandoned"] = json!(true)),
                None,
                "-",
            ),
            (
                "back",
                with_record(down(), |r| r["back"] = json!(true)),
                None,
                "-",
            ),
            (
                "the record's own time wins over the signal's",
                with_record(down(), |r| {
                    r["at"] = json!(humantime::format_rfc3339(t(200)).to_string())
                }),
                Some(t(150)),
                "taint",
            ),
        ];
        for (name, n, ready_since, want) in cases {
            assert_eq!(short(judge(&n, &p, t(300), ready_since)), want, "{name}");
        }
        let mut no_boot = down();
        no_boot.status.as_mut().unwrap().node_info = None;
        assert_eq!(
            short(judge(&no_boot, &p, t(300), None)),
            "-",
            "the Node reports no bootID"
        );
    }

    /// A Lease is expired only when this replica has watched it go unrenewed
    /// for its whole duration, whatever the clocks say.
    #[test]
    fn a_lease_expires_by_what_this_replica_saw() {
        let d = Duration::from_secs(15);
        let t0 = std::time::Instant::now();
        let mut seen = LeaseSeen::default();
        // A renewTime far in the past (a skewed holder) is not expiry: first sight.
        assert!(!seen.expired("b", "2001-01-01T00:00:00Z", d, t0));
        assert!(!seen.expired("b", "2001-01-01T00:00:00Z", d, t0 + Duration::from_secs(10)));
        assert!(seen.expired("b", "2001-01-01T00:00:00Z", d, t0 + Duration::from_secs(16)));
        // Renewed (a new renewTime, even one in our past): alive again.
        assert!(!seen.expired("b", "2001-01-01T00:00:05Z", d, t0 + Duration::from_secs(17)));
        assert!(!seen.expired("b", "2001-01-01T00:00:05Z", d, t0 + Duration::from_secs(31)));
        // A new holder starts a new watch.
        assert!(!seen.expired("c", "2001-01-01T00:00:05Z", d, t0 + Duration::from_secs(40)));
    }

    #[test]
    fn a_record_marked_back_is_stale() {
        let mut n = node("False", None, 0, false);
        let rec = json!({"boot_id": "b1", "signal": {"kind": "poweroff", "at": humantime::format_rfc3339(t(0)).to_string()}, "back": true});
        n.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(RECORD_ANNOTATION.into(), rec.to_string());
        assert_eq!(
            judge(&n, &cfg(Policy::PoweroffOnly), t(10), None),
            Verdict::Nothing
        );
    }

    /// With the Lease rule a current record makes a candidate whatever
    /// Ready says (the lifecycle controller takes 50 s to change it); the
    /// taint goes only on a new boot.
    #[test]
    fn the_lease_rule() {
        let mut c = cfg(Policy::PoweroffOnly);
        c.gone_when = GoneWhen::LeaseSilent;
        let ready = node("True", Some("poweroff"), 0, false);
        assert_eq!(short(judge(&ready, &c, t(10), None)), "candidate");
        let unknown = node("Unknown", Some("poweroff"), 0, false);
        assert_eq!(short(judge(&unknown, &c, t(10), None)), "candidate");
        let reboot = node("True", Some("reboot"), 0, false);
        assert_eq!(
            short(judge(&reboot, &c, t(10_000), None)),
            "-",
            "a reboot is not fenced"
        );
        let none = node("True", None, 0, false);
        assert_eq!(
            short(judge(&none, &c, t(10), None)),
            "-",
            "no record: nothing"
        );
        // Fenced in boot b1 and Ready again.
        let mut same = node("True", Some("poweroff"), 0, true);
        same.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(FENCED_BOOT_ANNOTATION.into(), "b1".into());
        // Its Ready from before the fence is stale: the Lease decides.
        assert_eq!(short(judge(&same, &c, t(10), None)), "fenced");
        let at = |n: &mut Node, fenced: u64, ready: u64| {
            n.spec.as_mut().unwrap().taints.as_mut().unwrap()[0].time_added =
                Some(Time(Timestamp::try_from(t(fenced)).unwrap()));
            n.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].last_transition_time =
                Some(Time(Timestamp::try_from(t(ready)).unwrap()));
        };
        at(&mut same, 5, 3);
        assert_eq!(short(judge(&same, &c, t(10), None)), "fenced");
        // Ready turned True since the fence: it never went down.
        at(&mut same, 5, 8);
        assert_eq!(short(judge(&same, &c, t(10), None)), "kept");
        let mut new_boot = same.clone();
        new_boot
            .status
            .as_mut()
            .unwrap()
            .node_info
            .as_mut()
            .unwrap()
            .boot_id = "b2".into();
        assert_eq!(short(judge(&new_boot, &c, t(10), None)), "untaint");
        let mut still_down = same.clone();
        still_down
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()[0]
            .status = "Unknown".into();
        assert_eq!(short(judge(&still_down, &c, t(10), None)), "-");
    }

    fn lease(written: u64, dur: Option<i32>) -> Lease {
        let mut l = Lease::default();
        l.metadata.managed_fields = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
                manager: Some("kubelet".into()),
                time: Some(Time(Timestamp::try_from(t(written)).unwrap())),
                ..Default::default()
            },
            k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
                manager: Some("other".into()),
                time: Some(Time(Timestamp::try_from(t(0)).unwrap())),
                ..Default::default()
            },
        ]);
        l.spec = Some(LeaseSpec {
            lease_duration_seconds: dur,
            ..Default::default()
        });
        l
    }

    /// Silence is counted on the server's clock so that it can only be late:
    /// both stamps are whole seconds, so a second is taken off the age.
    #[test]
    fn a_lease_is_silent_only_past_its_interval_and_margin() {
        let m = Duration::from_secs(2);
        let seen = t(100);
        // Written at 100, duration 40: renew interval 10 s, + 2 s margin.
        let l = lease(100, Some(40));
        assert_eq!(
            liveness(&l, t(110), seen, m),
            Liveness::Renewing(Duration::from_secs(9))
        );
        assert_eq!(
            liveness(&l, t(113), seen, m),
            Liveness::Renewing(Duration::from_secs(12))
        );
        assert_eq!(
            liveness(&l, t(114), seen, m),
            Liveness::Silent(Duration::from_secs(13))
        );
        // The newest write of any manager counts.
        let mut older_first = lease(100, Some(40));
        older_first
            .metadata
            .managed_fields
            .as_mut()
            .unwrap()
            .reverse();
        assert_eq!(
            liveness(&older_first, t(110), seen, m),
            Liveness::Renewing(Duration::from_secs(9))
        );
        // Written 2 s or more after the controller first saw the record.
        assert_eq!(
            liveness(&lease(102, Some(40)), t(130), seen, m),
            Liveness::Contradicted
        );
        assert!(matches!(
            liveness(&lease(101, Some(40)), t(130), seen, m),
            Liveness::Silent(_)
        ));
        // No duration, no server time: never silent.
        assert!(matches!(
            liveness(&lease(100, None), t(200), seen, m),
            Liveness::Unknown(_)
        ));
        let mut bare = lease(100, Some(40));
        bare.metadata.managed_fields = None;
        assert!(matches!(
            liveness(&bare, t(200), seen, m),
            Liveness::Unknown(_)
        ));
    }
}
