//! A zone loses power, on the real control plane: N nodes, each
//! with its agent's own last-gasp code (the library's `LastGasp`: its warm
//! connections, its node watch, its ServiceAccount token bound to its own
//! Node, so that the admission policy and the FlowSchema see the agent as
//! deployed), send their evidence at the same instant; their kubelets'
//! Leases stop at that instant; the controller (`Controller`, its own
//! token) fences what it can. Used by `cargo xtask bench zone` and
//! tests/realserver.rs.
//!
//! What the nodes are: Node objects (Ready, a boot id) and Leases renewed
//! every 10 s (duration 40 s), spread over the cycle, written as the admin
//! (the exempt priority level; real kubelets are in `system`). No pods and
//! no kubelets: only the last gasp, the Leases and the fence are played.
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use futures::{stream, StreamExt};
use k8s_openapi::{
    api::{authentication::v1::TokenRequest, coordination::v1::Lease, core::v1::Node},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    Api, Client, ResourceExt,
};
use lastgasp::{
    act::{
        kube::record_params,
        last_gasp::{LastGasp, NotDelivered, Refusal},
    },
    apiserver::Use,
    controller::{Controller, ControllerConfig, OUT_OF_SERVICE_KEY},
    record::ShutdownRecord,
    signal::ShutdownSignal,
};
use serde_json::{json, Value};

use crate::{
    controlplane::{cpu_of, ControlPlane},
    nodesim::random_below,
    support::record_of,
};

pub const NS: &str = "lastgasp";
pub const AGENT_SA: &str = "lastgasp-agent";
pub const CONTROLLER_SA: &str = "lastgasp-controller";
const READER_SA: &str = "lastgasp-bench-reader";
const LEASE_SECONDS: i32 = 40;
const RENEW: Duration = Duration::from_secs(10);
/// The label that marks a zone's nodes (and their Leases).
const ZONE_LABEL: &str = "bench.lastgasp.dev/zone";

/// How the agents send, and what the cluster has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arm {
    /// The agent's earlier last gasp: two writes at once (condition; taint and
    /// the full record), the default FlowSchemas.
    Before,
    /// One write of evidence, then the condition if time remains; the
    /// default FlowSchemas (`flowControl.enabled=false`).
    OneWrite,
    /// One write, and lastgasp's own priority level (the default).
    PriorityLevel,
}

impl Arm {
    pub fn label(self) -> &'static str {
        match self {
            Arm::Before => "before: two writes, default APF",
            Arm::OneWrite => "one write, default APF",
            Arm::PriorityLevel => "one write, lastgasp's priority level",
        }
    }
}

/// One node's last gasp, as its agent saw it (times from the instant the
/// zone went dark).
#[derive(Clone, Debug)]
pub struct Gasp {
    /// When the evidence was accepted, and whether on the first try.
    pub accepted: Option<(Duration, bool)>,
    /// The last refusal when not accepted (429, another status, no answer).
    pub refused: Option<Refusal>,
    /// Writes the agent sent (evidence tries and the condition).
    pub writes: u32,
}

#[derive(Clone, Debug)]
pub struct Burst {
    pub arm: Arm,
    /// The evidence level's shares, when not the manifests'.
    pub shares: Option<i64>,
    pub n: usize,
    pub background: bool,
    pub gasps: Vec<Gasp>,
    /// The API server's and etcd's CPU per last gasp, above their idle rate.
    pub apiserver_cpu_ms: f64,
    pub etcd_cpu_ms: f64,
    /// The bench's own (the N agents') CPU per last gasp, above its idle rate.
    pub agents_cpu_ms: f64,
    /// Nodes whose evidence was accepted, fenced within the wait; and when
    /// the last of them was fenced.
    pub fenced: usize,
    pub last_fenced: Option<Duration>,
    pub fence_wait: Duration,
    /// With the ledger: the fenced nodes' NodeShutdowns that say so, and
    /// when the last of them did (after the dark).
    pub ledger: Option<(usize, Option<Duration>)>,
}

impl Burst {
    pub fn accepted(&self) -> usize {
        self.gasps.iter().filter(|g| g.accepted.is_some()).count()
    }

    pub fn first_try_within(&self, d: Duration) -> usize {
        self.gasps
            .iter()
            .filter(|g| matches!(g.accepted, Some((t, true)) if t <= d))
            .count()
    }

    pub fn refused(&self, code: u16) -> usize {
        self.gasps
            .iter()
            .filter(|g| matches!(g.refused, Some(Refusal::Status { code: c, .. }) if c == code))
            .count()
    }

    /// Not accepted, and not answered 429: another status or no answer.
    pub fn failed(&self) -> usize {
        self.gasps
            .iter()
            .filter(|g| {
                g.accepted.is_none()
                    && !matches!(g.refused, Some(Refusal::Status { code: 429, .. }))
            })
            .count()
    }

    pub fn unanswered(&self) -> usize {
        self.gasps
            .iter()
            .filter(|g| matches!(g.refused, Some(Refusal::Transport(_))))
            .count()
    }

    /// The refusals other than 429, by kind, with a count.
    pub fn failures(&self) -> String {
        let mut by: std::collections::BTreeMap<String, usize> = Default::default();
        for g in self.gasps.iter().filter(|g| g.accepted.is_none()) {
            let why = match &g.refused {
                Some(Refusal::Status { code: 429, .. }) => continue,
                Some(Refusal::Status { code, message, .. }) => format!("{code}: {message}"),
                Some(Refusal::Transport(e)) => format!("no answer: {e}"),
                None => "?".into(),
            };
            *by.entry(why.chars().take(160).collect()).or_default() += 1;
        }
        by.into_iter()
            .map(|(w, n)| format!("{n} × {w}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub fn latencies_ms(&self) -> Vec<f64> {
        self.gasps
            .iter()
            .filter_map(|g| g.accepted.map(|(t, _)| t.as_secs_f64() * 1e3))
            .collect()
    }

    pub fn writes(&self) -> u32 {
        self.gasps.iter().map(|g| g.writes).sum()
    }
}

/// The control plane with lastgasp's manifests (RBAC, admission policy and,
/// per arm, its FlowSchemas), the controller running, and optional list load.
///
/// The controller runs on a runtime of its own; each burst on a fresh one,
/// dropped with everything it started (the agents' watches, their
/// keep-warm requests and connections), so that no zone outlives its burst.
pub struct Bench {
    pub cp: &'static ControlPlane,
    /// The admin's client on the runtime in use.
    admin: Client,
    /// The kustomize render's APF objects, applied or deleted per arm.
    flowcontrol: Vec<Value>,
    controller: Option<tokio::runtime::Runtime>,
    rounds: usize,
    /// The controller writes the shutdown ledger.
    ledger: bool,
    /// The evidence level's nominalConcurrencyShares instead of the
    /// manifests' (to compare settings).
    pub shares: Option<i64>,
}

impl Drop for Bench {
    fn drop(&mut self) {
        if let Some(rt) = self.controller.take() {
            rt.shutdown_background();
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// A zone: its name, Nodes, Lease renewers and agents (node, boot id, the
/// agent's last gasp, its client).
type Zone = (
    String,
    Vec<Node>,
    Vec<tokio::task::JoinHandle<()>>,
    Vec<(String, String, LastGasp, Client)>,
);

/// A token of `sa` in lastgasp, bound to `node` when given (v1.32 puts the
/// node in the token: the admission policy and the agent's own-node rule
/// read it), else unbound.
pub async fn token(admin: &Client, sa: &str, node: Option<&Node>) -> Result<String> {
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(admin.clone(), NS);
    let mut spec = json!({"audiences": ["https://kubernetes.default.svc.cluster.local"],
        "expirationSeconds": 3600});
    if let Some(n) = node {
        spec["boundObjectRef"] =
            json!({"apiVersion": "v1", "kind": "Node", "name": n.name_any(), "uid": n.uid()});
    }
    let req: TokenRequest =
        serde_json::from_value(json!({"apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest", "spec": spec}))?;
    let answer = sas
        .create_token_request(sa, &PostParams::default(), &req)
        .await
        .with_context(|| format!("a token of {sa}"))?;
    answer
        .status
        .and_then(|s| s.token)
        .context("the TokenRequest answered no token")
}

impl Bench {
    /// Applies `objs` (the kustomize render) but the workloads (the agents
    /// and the controller are played here), and starts the controller with
    /// its own token and `concurrency`. Not from within a runtime.
    pub fn start(
        cp: &'static ControlPlane,
        objs: &[Value],
        concurrency: usize,
        ledger: bool,
    ) -> Result<Bench> {
        let rt = runtime()?;
        let (admin, flowcontrol) = rt.block_on(Self::prepare(cp, objs, concurrency, ledger))?;
        Ok(Bench {
            cp,
            admin,
            flowcontrol,
            controller: Some(rt),
            rounds: 0,
            ledger,
            shares: None,
        })
    }

    async fn prepare(
        cp: &'static ControlPlane,
        objs: &[Value],
        concurrency: usize,
        ledger: bool,
    ) -> Result<(Client, Vec<Value>)> {
        let admin = cp.admin();
        let kinds_played = [
            "DaemonSet",
            "Deployment",
            "PodDisruptionBudget",
            "ConfigMap",
        ];
        let (flowcontrol, rest): (Vec<Value>, Vec<Value>) = objs
            .iter()
            .filter(|o| !kinds_played.contains(&o["kind"].as_str().unwrap_or_default()))
            .cloned()
            .partition(|o| {
                o["apiVersion"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("flowcontrol.apiserver.k8s.io/"))
            });
        if flowcontrol.is_empty() {
            bail!("the render carries no FlowSchema or PriorityLevelConfiguration");
        }
        crate::render::apply(&admin, &rest, false).await?;
        // A reader for the background list load (workload-low, as any
        // ServiceAccount).
        let reader = json!([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": READER_SA, "namespace": NS}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": READER_SA},
             "rules": [{"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["list"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": READER_SA},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": READER_SA},
             "subjects": [{"kind": "ServiceAccount", "name": READER_SA, "namespace": NS}]}
        ]);
        crate::render::apply(&admin, reader.as_array().unwrap(), false).await?;
        let ctl_token = token(&admin, CONTROLLER_SA, None).await?;
        let client = cp.agent_client(&ctl_token, Use::Watch);
        let cfg = ControllerConfig {
            concurrency,
            lease_namespace: NS.into(),
            // The chart's defaults.
            ledger: ledger.then_some(lastgasp::controller::ledger_writer::Retention {
                max_age: Duration::from_secs(720 * 3600),
                max_per_node: 100,
            }),
            ..ControllerConfig::new("bench-controller")
        };
        let mut c = Controller::start(client.clone(), client, cfg).await?;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                if let Err(e) = c.tick().await {
                    eprintln!("zone bench: controller pass: {e:#}");
                }
            }
        });
        Ok((admin, flowcontrol))
    }

    /// Stops the controller and frees its leader Lease, for a controller
    /// that starts after this one.
    pub fn stop(mut self) -> Result<()> {
        let rt = runtime()?;
        if let Some(c) = self.controller.take() {
            c.shutdown_background();
        }
        let cp = self.cp;
        rt.block_on(async move {
            let leases: Api<Lease> = Api::namespaced(cp.admin(), NS);
            match leases
                .delete("lastgasp-controller", &DeleteParams::default())
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
    }

    /// lastgasp's APF objects on (applied) or off (deleted).
    pub async fn flow_control(&self, on: bool) -> Result<()> {
        if on {
            let mut objs = self.flowcontrol.clone();
            if let Some(shares) = self.shares {
                for o in objs.iter_mut().filter(|o| {
                    o["kind"] == "PriorityLevelConfiguration"
                        && o["metadata"]["name"] == "lastgasp-evidence"
                }) {
                    o["spec"]["limited"]["nominalConcurrencyShares"] = json!(shares);
                }
            }
            return crate::render::apply(&self.admin, &objs, false).await;
        }
        for o in &self.flowcontrol {
            let kind = o["kind"].as_str().unwrap_or_default();
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            let path = match kind {
                "FlowSchema" => "flowschemas",
                "PriorityLevelConfiguration" => "prioritylevelconfigurations",
                _ => bail!("unexpected {kind}"),
            };
            let req = http::Request::delete(format!(
                "/apis/flowcontrol.apiserver.k8s.io/v1/{path}/{name}"
            ))
            .body(Vec::new())?;
            match self.admin.request_text(req).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e).context(format!("deleting {kind} {name}")),
            }
        }
        Ok(())
    }

    /// The priority level the API server put an agent's evidence write in,
    /// by its answer's `X-Kubernetes-PF-PriorityLevel-UID` (an empty patch
    /// of its own Node: nothing changes).
    async fn evidence_level(&self, agent: &Client, node: &str) -> Result<String> {
        let req = kube::core::Request::new("/api/v1/nodes").patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({})),
        )?;
        let resp = agent.send(req.map(kube::client::Body::from)).await?;
        let uid = resp
            .headers()
            .get("X-Kubernetes-PF-PriorityLevel-UID")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if !resp.status().is_success() {
            bail!("the agent's probe patch of {node}: {}", resp.status());
        }
        let levels: Api<k8s_openapi::api::flowcontrol::v1::PriorityLevelConfiguration> =
            Api::all(self.admin.clone());
        for l in levels.list(&ListParams::default()).await? {
            if l.uid().as_deref() == Some(uid.as_str()) {
                return Ok(l.name_any());
            }
        }
        bail!("no priority level has uid {uid:?}")
    }

    /// One zone of `n` nodes goes dark under `arm`; with `background`,
    /// four ServiceAccount clients list pods and nodes throughout. Waits up
    /// to `fence_wait` for the controller to fence every node whose
    /// evidence was accepted, then removes the zone.
    pub fn burst(
        &mut self,
        arm: Arm,
        n: usize,
        background: bool,
        fence_wait: Duration,
    ) -> Result<Burst> {
        let rt = runtime()?;
        let r = rt.block_on(self.burst_in(arm, n, background, fence_wait));
        rt.shutdown_background();
        r
    }

    async fn burst_in(
        &mut self,
        arm: Arm,
        n: usize,
        background: bool,
        fence_wait: Duration,
    ) -> Result<Burst> {
        let (zone, _, leases, agents) = self.zone_up(arm, n).await?;
        let load = if background {
            self.list_load(4).await?
        } else {
            Vec::new()
        };
        // The API server's idle rate (Leases, controllers, the load), then the burst.
        let idle = Duration::from_secs(3);
        let me = std::process::id();
        let (a0, e0, b0) = (
            self.cp.cpu("kube-apiserver")?,
            self.cp.cpu("etcd")?,
            cpu_of(me)?,
        );
        tokio::time::sleep(idle).await;
        let (a1, e1, b1) = (
            self.cp.cpu("kube-apiserver")?,
            self.cp.cpu("etcd")?,
            cpu_of(me)?,
        );
        let dark = Instant::now() + Duration::from_millis(300);
        let sig = crate::support::direct_poweroff();
        let tasks: Vec<_> = agents
            .into_iter()
            .map(|(name, boot, lg, client)| {
                let sig = sig.clone();
                tokio::spawn(async move {
                    let g = gasp(&lg, &client, &name, &boot, &sig, arm, dark).await;
                    (name, g)
                })
            })
            .collect();
        tokio::time::sleep_until(dark.into()).await;
        for l in &leases {
            l.abort();
        }
        let mut gasps = Vec::with_capacity(n);
        let mut accepted = Vec::new();
        for t in tasks {
            let (name, g) = t.await.context("an agent's task")?;
            if g.accepted.is_some() {
                accepted.push(name);
            }
            gasps.push(g);
        }
        let answered = dark.elapsed();
        let (a2, e2, b2) = (
            self.cp.cpu("kube-apiserver")?,
            self.cp.cpu("etcd")?,
            cpu_of(me)?,
        );
        for l in load {
            l.abort();
        }
        let per = |busy: Duration, idle_used: Duration| {
            let idle_rate = idle_used.as_secs_f64() / idle.as_secs_f64();
            ((busy.as_secs_f64() - idle_rate * answered.as_secs_f64()).max(0.0) * 1e3) / n as f64
        };
        let (fenced, last_fenced) = self.wait_fenced(&zone, &accepted, dark, fence_wait).await?;
        let ledger = if self.ledger {
            Some(self.wait_ledger(&zone, fenced, dark, fence_wait).await?)
        } else {
            None
        };
        self.remove(&zone).await?;
        Ok(Burst {
            arm,
            shares: self.shares.filter(|_| arm == Arm::PriorityLevel),
            n,
            background,
            gasps,
            apiserver_cpu_ms: per(a2 - a1, a1 - a0),
            etcd_cpu_ms: per(e2 - e1, e1 - e0),
            agents_cpu_ms: per(b2 - b1, b1 - b0),
            fenced,
            last_fenced,
            fence_wait,
            ledger,
        })
    }

    /// A zone of `n` Ready nodes with their Leases renewed, and their
    /// agents warm, the APF objects as `arm` has them (checked on the
    /// server's own answer).
    async fn zone_up(&mut self, arm: Arm, n: usize) -> Result<Zone> {
        self.admin = self.cp.admin();
        self.rounds += 1;
        let zone = format!("z{}", self.rounds);
        self.flow_control(arm == Arm::PriorityLevel).await?;
        let nodes = self.add_nodes(&zone, n).await?;
        let leases = self.renew_leases(&zone, &nodes);
        // The agents: a node-bound token each, their own clients, warm.
        let agents: Vec<(String, String, LastGasp, Client)> = stream::iter(nodes.clone())
            .map(|node| {
                let (admin, cp) = (self.admin.clone(), self.cp);
                async move {
                    let tok = token(&admin, AGENT_SA, Some(&node)).await?;
                    let patch = cp.agent_client(&tok, Use::Requests);
                    let lg = LastGasp::start(
                        cp.agent_client(&tok, Use::Watch),
                        patch.clone(),
                        &node.name_any(),
                    )
                    .await?;
                    let boot = node
                        .status
                        .as_ref()
                        .and_then(|s| s.node_info.as_ref())
                        .map(|i| i.boot_id.clone())
                        .unwrap_or_default();
                    anyhow::Ok((node.name_any(), boot, lg, patch))
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        // Which level the evidence lands in, from the server's own answer
        // (a change of the APF objects takes effect within moments).
        let want_ours = arm == Arm::PriorityLevel;
        let mut tries = 0;
        loop {
            let level = self.evidence_level(&agents[0].3, &agents[0].0).await?;
            if (level == "lastgasp-evidence") == want_ours {
                break;
            }
            tries += 1;
            if tries > 50 {
                bail!("{}: the evidence is classified into {level}", arm.label());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok((zone, nodes, leases, agents))
    }

    /// The API server's and etcd's CPU per last gasp without a burst: each
    /// of `n` nodes sends what `arm` sends for its evidence, 4 at a time (no
    /// queue, no refusal; nothing after the evidence), above the idle rate.
    pub fn cost(&mut self, arm: Arm, n: usize) -> Result<(f64, f64)> {
        let rt = runtime()?;
        let r = rt.block_on(self.cost_in(arm, n));
        rt.shutdown_background();
        r
    }

    async fn cost_in(&mut self, arm: Arm, n: usize) -> Result<(f64, f64)> {
        let (zone, _, leases, agents) = self.zone_up(arm, n).await?;
        let idle = Duration::from_secs(3);
        let (a0, e0) = (self.cp.cpu("kube-apiserver")?, self.cp.cpu("etcd")?);
        tokio::time::sleep(idle).await;
        let (a1, e1) = (self.cp.cpu("kube-apiserver")?, self.cp.cpu("etcd")?);
        let t = Instant::now();
        let sig = crate::support::direct_poweroff();
        let sent: Vec<Result<()>> = stream::iter(agents)
            .map(|(_, boot, lg, _)| {
                let sig = sig.clone();
                async move {
                    let rec = record_of(&boot, &sig);
                    let bodies =
                        lg.bodies("ForcedShutdown", "poweroff -f (zone bench)", &rec, sig.at);
                    if arm == Arm::Before {
                        let mut spec = bodies.taint.clone();
                        spec["metadata"]["annotations"] = rec.annotations();
                        let (status, spec) =
                            (Patch::Strategic(&bodies.condition), Patch::Merge(&spec));
                        let (plain, rp) = (PatchParams::default(), record_params());
                        let (a, b) = tokio::join!(
                            lg.patch("status", &plain, &status),
                            lg.patch("", &rp, &spec)
                        );
                        a.and(b).map_err(|e| anyhow::anyhow!("{e}"))
                    } else {
                        lg.send(&bodies, Instant::now())
                            .await
                            .map(drop)
                            .map_err(Into::into)
                    }
                }
            })
            .buffer_unordered(4)
            .collect()
            .await;
        let took = t.elapsed();
        let (a2, e2) = (self.cp.cpu("kube-apiserver")?, self.cp.cpu("etcd")?);
        for l in &leases {
            l.abort();
        }
        let failed = sent.iter().filter(|r| r.is_err()).count();
        self.remove(&zone).await?;
        if failed > 0 {
            bail!("{failed} of {n} last gasps failed while measuring their cost");
        }
        let per = |busy: Duration, idle_used: Duration| {
            let idle_rate = idle_used.as_secs_f64() / idle.as_secs_f64();
            ((busy.as_secs_f64() - idle_rate * took.as_secs_f64()).max(0.0) * 1e3) / n as f64
        };
        Ok((per(a2 - a1, a1 - a0), per(e2 - e1, e1 - e0)))
    }

    async fn add_nodes(&self, zone: &str, n: usize) -> Result<Vec<Node>> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        stream::iter(0..n)
            .map(|i| {
                let nodes = nodes.clone();
                let name = format!("{zone}-n{i:04}");
                let zone = zone.to_string();
                async move {
                    let node: Node = serde_json::from_value(json!({
                        "apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": name, "labels": {ZONE_LABEL: zone,
                            "kubernetes.io/hostname": name, "topology.kubernetes.io/zone": zone}},
                    }))?;
                    nodes.create(&PostParams::default(), &node).await?;
                    let boot = format!("boot-{name}-{:x}", random_below(u64::MAX));
                    let now = Timestamp::now().to_string();
                    let status = json!({"status": {
                        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "simulated", "lastHeartbeatTime": now, "lastTransitionTime": now}],
                        "nodeInfo": {"bootID": boot, "machineID": name, "systemUUID": name,
                            "kernelVersion": "6.1.0", "osImage": "zone bench", "containerRuntimeVersion": "sim://1",
                            "kubeletVersion": "v1.32.13", "kubeProxyVersion": "", "operatingSystem": "linux",
                            "architecture": "amd64"}}});
                    let node = nodes
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                        .await?;
                    anyhow::Ok(node)
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
    }

    /// Each node's Lease, renewed every 10 s from a random point of the cycle.
    fn renew_leases(&self, zone: &str, nodes: &[Node]) -> Vec<tokio::task::JoinHandle<()>> {
        let leases: Api<Lease> = Api::namespaced(self.admin.clone(), "kube-node-lease");
        nodes
            .iter()
            .map(|node| {
                let (leases, name, zone) = (leases.clone(), node.name_any(), zone.to_string());
                tokio::spawn(async move {
                    let first = renew(&leases, &name, &zone).await;
                    if let Err(e) = first {
                        eprintln!("zone bench: Lease of {name}: {e:#}");
                    }
                    let phase = Duration::from_millis(random_below(RENEW.as_millis() as u64));
                    let mut tick =
                        tokio::time::interval_at(tokio::time::Instant::now() + phase, RENEW);
                    loop {
                        tick.tick().await;
                        if let Err(e) = renew(&leases, &name, &zone).await {
                            eprintln!("zone bench: Lease of {name}: {e:#}");
                        }
                    }
                })
            })
            .collect()
    }

    /// `k` ServiceAccount clients listing every pod and node, over and over.
    async fn list_load(&self, k: usize) -> Result<Vec<tokio::task::JoinHandle<()>>> {
        let tok = token(&self.admin, READER_SA, None).await?;
        Ok((0..k)
            .map(|_| {
                let c = self.cp.agent_client(&tok, Use::Requests);
                tokio::spawn(async move {
                    let (pods, nodes): (Api<k8s_openapi::api::core::v1::Pod>, Api<Node>) =
                        (Api::all(c.clone()), Api::all(c));
                    loop {
                        let _ = pods.list(&ListParams::default()).await;
                        let _ = nodes.list(&ListParams::default()).await;
                    }
                })
            })
            .collect())
    }

    /// Polls the zone's Nodes until each of `accepted` carries the
    /// out-of-service taint: how many did within `wait`, and when the last did.
    async fn wait_fenced(
        &self,
        zone: &str,
        accepted: &[String],
        dark: Instant,
        wait: Duration,
    ) -> Result<(usize, Option<Duration>)> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let lp = ListParams::default().labels(&format!("{ZONE_LABEL}={zone}"));
        let mut fenced_at: std::collections::BTreeMap<String, Duration> = Default::default();
        loop {
            for n in nodes.list(&lp).await? {
                let tainted = n
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_KEY));
                if tainted {
                    fenced_at
                        .entry(n.name_any())
                        .or_insert_with(|| dark.elapsed());
                }
            }
            let done = accepted
                .iter()
                .filter(|a| fenced_at.contains_key(*a))
                .count();
            if done == accepted.len() || dark.elapsed() > wait {
                let last = accepted
                    .iter()
                    .filter_map(|a| fenced_at.get(a))
                    .max()
                    .copied();
                return Ok((done, last));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits up to `wait` after the dark for `fenced` of the zone's
    /// NodeShutdowns to say `fenced`; how many did, and when the last did.
    async fn wait_ledger(
        &self,
        zone: &str,
        fenced: usize,
        dark: Instant,
        wait: Duration,
    ) -> Result<(usize, Option<Duration>)> {
        let api: Api<kube::api::DynamicObject> = Api::all_with(
            self.admin.clone(),
            &lastgasp::controller::ledger_writer::resource(),
        );
        let prefix = format!("{zone}-");
        let lp = ListParams::default().labels("lastgasp.dev/ending=fenced");
        let mut seen: std::collections::BTreeMap<String, Duration> = Default::default();
        loop {
            for o in api.list(&lp).await? {
                let name = o.name_any();
                if name.starts_with(&prefix) {
                    seen.entry(name).or_insert_with(|| dark.elapsed());
                }
            }
            if seen.len() >= fenced || dark.elapsed() > wait {
                return Ok((seen.len(), seen.values().max().copied()));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Deletes the zone's Nodes and Leases.
    async fn remove(&self, zone: &str) -> Result<()> {
        let lp = ListParams::default().labels(&format!("{ZONE_LABEL}={zone}"));
        let nodes: Api<Node> = Api::all(self.admin.clone());
        nodes
            .delete_collection(&DeleteParams::default(), &lp)
            .await
            .context("deleting the zone's Nodes")?;
        let leases: Api<Lease> = Api::namespaced(self.admin.clone(), "kube-node-lease");
        leases
            .delete_collection(&DeleteParams::default(), &lp)
            .await
            .context("deleting the zone's Leases")?;
        Ok(())
    }
}

async fn renew(leases: &Api<Lease>, name: &str, zone: &str) -> Result<()> {
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease", "labels": {ZONE_LABEL: zone}},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": MicroTime(Timestamp::now())}
    });
    leases
        .patch(
            name,
            &PatchParams::apply("kubelet").force(),
            &Patch::Apply(&lease),
        )
        .await?;
    Ok(())
}

/// One node's last gasp at `dark`, as its agent sends it under `arm`; the
/// node is expected to die 200-400 ms later (the condition goes only
/// before that, and nothing is sent again past it).
async fn gasp(
    lg: &LastGasp,
    client: &Client,
    node: &str,
    boot: &str,
    sig: &ShutdownSignal,
    arm: Arm,
    dark: Instant,
) -> Gasp {
    let death = dark + Duration::from_millis(200 + random_below(200));
    let mut sig = sig.clone();
    // Each agent builds its writes on its own node's CPU: here, before the
    // instant, so that the bench's CPU does not stand in for theirs.
    sig.at = SystemTime::now() + dark.saturating_duration_since(Instant::now());
    let rec = record_of(boot, &sig);
    let bodies = lg.bodies("ForcedShutdown", "poweroff -f (zone bench)", &rec, sig.at);
    tokio::time::sleep_until(dark.into()).await;
    let (sent, event) = if arm == Arm::Before {
        // Its Event went after the two writes, always.
        (Err(before(lg, &rec, &bodies, dark).await), true)
    } else {
        let sent = lg.send(&bodies, death).await;
        // As the agent does: its Warning Event, only while it is expected to live.
        let event = sent.is_ok() && Instant::now() < death;
        (Ok(sent), event)
    };
    if event {
        let ev = kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: "NodeShutdown".into(),
            note: Some("poweroff with no time left via exec (zone bench)".into()),
            action: "Shutdown".into(),
            secondary: None,
        };
        let reporter = kube::runtime::events::Reporter {
            controller: "lastgasp".into(),
            instance: Some(node.into()),
        };
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            uid: Some(node.into()),
            ..Default::default()
        };
        let _ = kube::runtime::events::Recorder::new(client.clone(), reporter)
            .publish(&ev, &reference)
            .await;
    }
    let sent = match sent {
        Err(mut g) => {
            g.writes += 1;
            return g;
        }
        Ok(sent) => sent,
    };
    match sent {
        Ok(sent) => Gasp {
            accepted: Some((
                dark.elapsed() - sent.started.elapsed() + sent.evidence_done,
                sent.tries == 1,
            )),
            refused: None,
            writes: sent.tries
                + u32::from(sent.condition.is_ok())
                + u32::from(sent.taint.is_ok())
                + u32::from(event),
        },
        Err(NotDelivered { tries, last, .. }) => Gasp {
            accepted: None,
            refused: Some(last),
            writes: tries,
        },
    }
}

/// The agent's earlier last gasp: the condition and (taint, full record) at
/// once, on its two warm connections; kube's typed errors (no retry).
async fn before(
    lg: &LastGasp,
    rec: &ShutdownRecord,
    bodies: &lastgasp::act::last_gasp::Bodies,
    dark: Instant,
) -> Gasp {
    let mut evidence = bodies.taint.clone();
    evidence["metadata"]["annotations"] = rec.annotations();
    let (status, spec) = (Patch::Strategic(&bodies.condition), Patch::Merge(&evidence));
    // The record (with the taint) is the evidence; the condition beside it
    // only competes with it.
    let (plain, rp) = (PatchParams::default(), record_params());
    let (_, m) = tokio::join!(lg.patch("status", &plain, &status), async {
        let r = lg.patch("", &rp, &spec).await;
        (r, dark.elapsed())
    });
    match m {
        (Ok(()), at) => Gasp {
            accepted: Some((at, true)),
            refused: None,
            writes: 2,
        },
        (Err(e), _) => Gasp {
            accepted: None,
            refused: Some(e),
            writes: 2,
        },
    }
}

/// One line of a burst's figures.
pub fn summary(b: &Burst) -> String {
    format!("{}{}", b.label(), summary_figures(b))
}

impl Burst {
    /// The arm, with the shares when they are not the manifests'.
    pub fn label(&self) -> String {
        match self.shares {
            Some(s) => format!("{} ({s} shares)", self.arm.label()),
            None => self.arm.label().to_string(),
        }
    }
}

fn summary_figures(b: &Burst) -> String {
    format!(
        " N={}{}: accepted {} (first try ≤200 ms {}, ≤500 ms {}, ≤1 s {}), 429 {}, failed {}, unanswered {}, fenced {}/{} (last at {:?}){}{}",
        b.n,
        if b.background { " +list load" } else { "" },
        b.accepted(),
        b.first_try_within(Duration::from_millis(200)),
        b.first_try_within(Duration::from_millis(500)),
        b.first_try_within(Duration::from_secs(1)),
        b.refused(429),
        b.failed(),
        b.unanswered(),
        b.fenced,
        b.accepted(),
        b.last_fenced,
        match b.ledger {
            Some((n, last)) => format!("; ledger: {n} fenced entries (last at {last:?})"),
            None => String::new(),
        },
        if b.failed() > 0 {
            format!("; failures: {}", b.failures())
        } else {
            String::new()
        }
    )
}
