//! `lastgasp controller`: completes the non-graceful shutdown procedure
//! (KEP-2268) by itself. One active replica, elected through a Lease.
//!
//! A node whose agent recorded a power-off or halt, and which then goes
//! NotReady/Unknown, is really down: it gets
//! `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`, so that its
//! StatefulSet pods and volumes move on. A reboot is never tainted, unless it
//! has not come back after a configured time. Once the node is Ready again,
//! the taint goes (the docs leave that to a human). Flapping nodes are
//! tainted at most `max_taints_per_hour` times an hour.
use std::{
    collections::{BTreeMap, VecDeque},
    time::{Duration, SystemTime},
};

use anyhow::Result;
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::{Node, NodeCondition, ObjectReference, Taint},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    jiff::Timestamp,
};
use kube::{
    api::{Patch, PatchParams, PostParams},
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
    pub max_taints_per_hour: usize,
    pub lease_namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
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

fn has_out_of_service(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_KEY))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Taint {
        why: String,
    },
    Untaint,
    /// Would taint, but the node flaps too often.
    RateLimited,
    Nothing,
}

impl Verdict {
    /// The variant's name, without its reason.
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Taint { .. } => "Taint",
            Verdict::Untaint => "Untaint",
            Verdict::RateLimited => "RateLimited",
            Verdict::Nothing => "Nothing",
        }
    }
}

/// When the Ready condition last turned True, while it is True.
pub fn ready_transition(node: &Node) -> Option<SystemTime> {
    let c = ready_condition(node).filter(|c| c.status == "True")?;
    c.last_transition_time
        .as_ref()
        .map(|t| SystemTime::from(t.0))
}

/// The pure rule, for one node at time `now`. `recent` is how many times
/// this node was tainted in the last hour; `ready_since`, when the
/// controller last saw its Ready turn True. Only a current record counts:
/// of the node's present boot, newer than its last Ready, neither
/// abandoned nor back.
pub fn judge(
    node: &Node,
    cfg: &ControllerConfig,
    now: SystemTime,
    recent: usize,
    ready_since: Option<SystemTime>,
) -> Verdict {
    let tainted = has_out_of_service(node);
    let ours = node.annotations().contains_key(TAINTED_BY_ANNOTATION);
    let status = ready(node).unwrap_or_else(|| "Unknown".into());
    if status == "True" {
        return if tainted && ours {
            Verdict::Untaint
        } else {
            Verdict::Nothing
        };
    }
    if tainted || cfg.policy == Policy::Off {
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
            "{} recorded at {}; node {status}",
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
                "{} recorded {}s ago never came back; node {status}",
                rec.kind,
                waited.as_secs()
            )
        }
        _ => return Verdict::Nothing,
    };
    if recent >= cfg.max_taints_per_hour {
        return Verdict::RateLimited;
    }
    Verdict::Taint { why }
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
    nodes: Api<Node>,
    leases: Api<Lease>,
    store: reflector::Store<Node>,
    recorder: Recorder,
    /// Per node, when it was last tainted (the last hour).
    history: BTreeMap<String, VecDeque<SystemTime>>,
    /// Per node, when its Ready last turned True (as last seen True).
    ready_since: BTreeMap<String, SystemTime>,
    lease_seen: LeaseSeen,
    pub actions: Vec<(String, Verdict)>,
    /// Lease held, actions by kind, failed passes (served by `lastgasp controller`).
    pub metrics: ControllerMetrics,
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
            nodes: Api::all(client.clone()),
            recorder: Recorder::new(client, reporter),
            store,
            cfg,
            history: BTreeMap::new(),
            ready_since: BTreeMap::new(),
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

    async fn pass(&mut self) -> Result<bool> {
        let now = SystemTime::now();
        // An error leaves the gauge as it was (`tick` counts the failed pass).
        let leading = try_lead(&self.leases, &self.cfg, now, &mut self.lease_seen).await?;
        self.metrics.lease_held.set(i64::from(leading));
        if !leading {
            return Ok(false);
        }
        let nodes = self.store.state();
        self.metrics.nodes.set(nodes.len() as i64);
        for node in nodes {
            let name = node.name_any();
            let hist = self.history.entry(name.clone()).or_default();
            while hist.front().is_some_and(|t| {
                now.duration_since(*t).unwrap_or_default() > Duration::from_secs(3600)
            }) {
                hist.pop_front();
            }
            if let Some(t) = ready_transition(&node) {
                self.ready_since.insert(name.clone(), t);
            }
            let ready_since = self.ready_since.get(&name).copied();
            let verdict = judge(&node, &self.cfg, now, hist.len(), ready_since);
            // One node's failure never stops the pass for the others.
            if let Err(e) = self.act(&node, &name, &verdict, now).await {
                self.metrics.pass_errors.inc();
                tracing::warn!(node = %name, ?verdict, "controller action failed: {e:#}");
                continue;
            }
            if verdict == Verdict::Nothing {
                continue;
            }
            tracing::info!(node = %name, ?verdict, "controller action");
            self.actions.push((name, verdict));
        }
        Ok(true)
    }

    async fn act(
        &mut self,
        node: &Node,
        name: &str,
        verdict: &Verdict,
        now: SystemTime,
    ) -> Result<()> {
        let name = name.to_string();
        {
            match verdict {
                Verdict::Taint { why } => {
                    self.set_taint(node, true).await?;
                    self.metrics.count_action("taint-added");
                    self.history.entry(name.clone()).or_default().push_back(now);
                    self.event(
                        &name,
                        EventType::Warning,
                        "OutOfServiceTaintAdded",
                        why.clone(),
                    )
                    .await;
                }
                Verdict::Untaint => {
                    self.set_taint(node, false).await?;
                    self.metrics.count_action("taint-removed");
                    self.event(
                        &name,
                        EventType::Normal,
                        "OutOfServiceTaintRemoved",
                        "node is Ready again".into(),
                    )
                    .await;
                }
                Verdict::RateLimited => {
                    self.metrics.count_action("skipped-flap-limit");
                    tracing::warn!(node = %name, "not tainting: the node flaps more than the configured rate");
                }
                Verdict::Nothing => {}
            }
        }
        Ok(())
    }

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
        let marker = if present {
            json!(self.cfg.identity)
        } else {
            serde_json::Value::Null
        };
        let patch = json!({
            "metadata": { "resourceVersion": node.resource_version(), "annotations": { TAINTED_BY_ANNOTATION: marker } },
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
    #[arg(long, default_value_t = 3, env = "LASTGASP_MAX_TAINTS_PER_HOUR")]
    pub max_taints_per_hour: usize,
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
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s", env = "LASTGASP_INTERVAL")]
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
        max_taints_per_hour: args.max_taints_per_hour,
        lease_namespace: args.lease_namespace,
        lease_name: args.lease_name,
        identity,
        lease_duration: std::time::Duration::from_secs(15),
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
            max_taints_per_hour: 3,
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
            Verdict::Taint { .. } => "taint",
            Verdict::Untaint => "untaint",
            Verdict::RateLimited => "limited",
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
                "flapping",
                node("False", Some("poweroff"), 0, false),
                &p,
                10,
                3,
                "limited",
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
        for (name, n, c, now, recent, want) in cases {
            assert_eq!(short(judge(&n, c, t(now), recent, None)), want, "{name}");
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
            assert_eq!(short(judge(&n, &p, t(300), 0, ready_since)), want, "{name}");
        }
        let mut no_boot = down();
        no_boot.status.as_mut().unwrap().node_info = None;
        assert_eq!(
            short(judge(&no_boot, &p, t(300), 0, None)),
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
            judge(&n, &cfg(Policy::PoweroffOnly), t(10), 0, None),
            Verdict::Nothing
        );
    }
}
