//! The recovery scenario on the real control plane: a one-replica
//! StatefulSet with a ReadWriteOnce CSI volume on node A of three simulated
//! nodes; A sends the agent's own last gasp (the library's `LastGasp`, the
//! code the agent runs, with the record the agent writes), then powers off
//! at a random point of its heartbeat cycle. Used by tests/controlplane.rs
//! and `cargo xtask bench recovery`.
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Node;
use kube::{api::DeleteParams, Api, Client};
use lastgasp::{
    act::last_gasp::{self, LastGasp},
    controller::{Controller, ControllerConfig},
    signal::ShutdownSignal,
};

use crate::nodesim::{self, Sim};

/// Which cluster side runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arm {
    /// No lastgasp controller.
    Nothing,
    /// The controller with its default flags: the record's proof of death.
    Controller,
}

impl Arm {
    pub fn label(self) -> &'static str {
        match self {
            Arm::Nothing => "(a) no lastgasp controller",
            Arm::Controller => "(c) lastgasp controller, default flags",
        }
    }
}

/// The controller's defaults, with a Lease of its own per test (`id`).
pub fn controller_config(id: &str) -> ControllerConfig {
    ControllerConfig {
        lease_name: format!("lastgasp-controller-{id}"),
        ..ControllerConfig::new(id)
    }
}

/// Runs the controller's passes every second in a task (what `lastgasp
/// controller` does, default interval).
pub async fn spawn_controller(
    client: Client,
    cfg: ControllerConfig,
) -> Result<tokio::task::JoinHandle<Controller>> {
    // RUST_LOG=lastgasp=debug shows why it fenced or not.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let mut c = Controller::start(client.clone(), client, cfg).await?;
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if let Err(e) = c.tick().await {
                eprintln!("controller pass: {e:#}");
            }
        }
    }))
}

/// The agent's last gasp for `sig` (a forced power-off) of `node` in
/// `boot_id`, as the agent sends it: the record (the evidence) in one
/// write; after a reboot(2) nothing else (no time is left), after an exec
/// the condition and the taint too. How long the record took.
pub async fn last_gasp(
    client: &Client,
    node: &str,
    boot_id: &str,
    sig: ShutdownSignal,
) -> Result<Duration> {
    episode_record(client, node, boot_id, &[sig]).await
}

/// The record of the episode `signals` make, in `boot_id`, sent as the
/// agent sends it after the last of them (the last gasp's code).
pub async fn episode_record(
    client: &Client,
    node: &str,
    boot_id: &str,
    signals: &[ShutdownSignal],
) -> Result<Duration> {
    let lg = LastGasp::start(client.clone(), client.clone(), node).await?;
    let sig = signals.last().context("a signal")?;
    let record = lastgasp::record::after(boot_id, signals);
    let bodies = lg.bodies("ForcedShutdown", "poweroff (test)", &record, sig.at);
    let death = std::time::Instant::now() + last_gasp::expected_life(sig);
    let sent = lg.send(&bodies, death).await?;
    Ok(sent.evidence_done)
}

pub struct Scenario {
    pub sim: Sim,
    pub client: Client,
    pub ns: String,
    pub nodes: [String; 3],
}

pub const APP: &str = "web";

impl Scenario {
    /// Three nodes `<tag>-a/b/c`, the app Running on `<tag>-a`.
    pub async fn start(client: Client, tag: &str) -> Result<Scenario> {
        let sim = Sim::start(client.clone()).await?;
        let nodes = [format!("{tag}-a"), format!("{tag}-b"), format!("{tag}-c")];
        for n in &nodes {
            sim.add_node(n).await?;
        }
        let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
        nodesim::schedulable(&client, &names, Duration::from_secs(60)).await?;
        nodesim::namespace(&client, tag).await?;
        nodesim::stateful_app(&client, tag, APP, &nodes[0]).await?;
        let t0 = Instant::now();
        loop {
            if let Some(n) = nodesim::running_on(&client, tag, APP).await? {
                anyhow::ensure!(n == nodes[0], "the app started on {n}, not {}", nodes[0]);
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "the app was not Running on {} within 120 s",
                nodes[0]
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Scenario {
            sim,
            client,
            ns: tag.to_string(),
            nodes,
        })
    }

    pub fn a(&self) -> &str {
        &self.nodes[0]
    }

    /// Waits up to `within` after `off` for the app Running on another node
    /// and node A's VolumeAttachment gone: the time of each, if seen.
    pub async fn watch_recovery(
        &self,
        off: SystemTime,
        within: Duration,
    ) -> Result<(Option<Duration>, Option<Duration>)> {
        let (mut running, mut detached) = (None, None);
        loop {
            let since = SystemTime::now().duration_since(off).unwrap_or_default();
            if running.is_none() {
                if let Some(n) = nodesim::running_on(&self.client, &self.ns, APP).await? {
                    if n != self.a() {
                        running = Some(since);
                    }
                }
            }
            if detached.is_none()
                && !nodesim::attached_to(&self.client, &self.ns, APP, self.a()).await?
            {
                detached = Some(since);
            }
            if (running.is_some() && detached.is_some()) || since > within {
                return Ok((running, detached));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// When node A got the out-of-service taint, after `off` (the API
    /// server's `timeAdded`, whole seconds: the controller's clock).
    pub async fn fenced_after(&self, off: SystemTime) -> Result<Option<Duration>> {
        let n = Api::<Node>::all(self.client.clone()).get(self.a()).await?;
        Ok(n.spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .into_iter()
            .find(|t| t.key == lastgasp::controller::OUT_OF_SERVICE_KEY)
            .and_then(|t| t.time_added)
            .map(|t| SystemTime::from(t.0))
            .map(|t| t.duration_since(off).unwrap_or_default()))
    }

    /// Removes the scenario's nodes, so that dead ones do not pile up.
    pub async fn remove_nodes(&self) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        for n in &self.nodes {
            self.sim.power_off(n);
            let _ = nodes.delete(n, &DeleteParams::default()).await;
        }
    }
}

/// One run of one arm: (power-off → app Running elsewhere, → node A's
/// VolumeAttachment gone, → node A fenced), each `None` when not within
/// `within`.
pub async fn run_once(
    client: Client,
    arm: Arm,
    tag: &str,
    within: Duration,
) -> Result<(Option<Duration>, Option<Duration>, Option<Duration>)> {
    let scn = Scenario::start(client.clone(), tag).await?;
    let controller = match arm {
        Arm::Nothing => None,
        Arm::Controller => Some(spawn_controller(client.clone(), controller_config(tag)).await?),
    };
    let boot = scn.sim.boot_id(scn.a()).context("node A's boot")?;
    // The power-off falls at a random point of A's heartbeat cycle; its
    // last gasp goes out just before.
    let phase = nodesim::random_below(1000) as f64 / 1000.0;
    let last = scn.sim.last_beat(scn.a()).context("node A's heartbeat")?;
    tokio::time::sleep_until((last + nodesim::HEARTBEAT.mul_f64(phase)).into()).await;
    last_gasp(&client, scn.a(), &boot, crate::support::kernel_poweroff()).await?;
    let off = scn.sim.power_off(scn.a());
    let r = scn.watch_recovery(off, within).await;
    let fenced = scn.fenced_after(off).await;
    if let Some(c) = controller {
        c.abort();
    }
    scn.remove_nodes().await;
    let (running, detached) = r?;
    Ok((running, detached, fenced?))
}
