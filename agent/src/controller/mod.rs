//! `lastgasp controller`: completes the non-graceful shutdown procedure
//! (KEP-2268) for nodes whose kernel is known to be down, and only for
//! them. One active replica, elected through a Lease.
//!
//! The fence is the `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`
//! taint, then, once the API server has it, a grace-0 delete of the node's
//! pods that the taint evicts (what the pod garbage collector does after
//! NotReady, without its 50 s + 20 s wait). It lands only on proof that the
//! node's kernel went down ([`rule`]), judged from what the API server
//! stores, so that any replica reaches the same verdict; each fence is
//! judged again on a live read before it is written ([`write`]). The taint
//! goes once the node is Ready again on a new boot.
//!
//! The parts: [`rule`] (the pure verdict on one node), `lead` (leader
//! election and the pause switch), `pass` (one pass over the nodes and the
//! operator's controls), `write` (the writes).
mod lead;
pub mod ledger;
pub mod ledger_writer;
pub mod lift;
pub mod metrics;
mod pass;
pub mod rule;
mod write;

use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};

pub use self::{
    lead::LeaseSeen,
    metrics::{ControllerMetrics, Stage},
    pass::Controller,
};
use crate::{
    apiserver::{client, Use},
    health::Health,
    http::{self, Listen},
};

pub use lastgasp_common::names::{
    FENCED_BOOT_ANNOTATION, FENCED_CONDITION, FENCE_MANAGER, OPT_OUT_LABEL, OPT_OUT_VALUE,
    OUT_OF_SERVICE_KEY, OUT_OF_SERVICE_VALUE, PAUSED_BY_ANNOTATION, PAUSE_ANNOTATION,
    TAINTED_BY_ANNOTATION, UNINSTALL_MANAGER,
};
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
/// The Event (and condition reason) of a node Ready again on the boot it
/// was fenced in: it never went down, the taint stays for a human.
pub const KEPT_SAME_BOOT: &str = "OutOfServiceKept";

/// Which shutdowns are fenced.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FencePolicy {
    /// Nothing is judged or written.
    Off,
    /// Judged as `poweroff-only`, and nothing is written: an Event
    /// (`OutOfServiceWouldFence`) and a metric say what would be fenced.
    Observe,
    /// Power-offs and halts.
    PoweroffOnly,
    /// Also reboots that have not come back after `reboot_timeout`.
    AlsoReboots,
}

#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub policy: FencePolicy,
    pub reboot_timeout: Duration,
    /// How long the kernel's own proof of death stands before the fence.
    pub proof_quiet: Duration,
    /// How long a direct tool's proof stands before the fence: longer than
    /// the agent keeps one whose reboot(2) never comes (its
    /// `trust.directToolWithin`), plus the time its withdrawal takes to land.
    pub direct_tool_quiet: Duration,
    /// Added to the kubelet's Lease renew interval before it counts as silent.
    pub lease_margin: Duration,
    /// Fences across the cluster per minute; 0: no limit.
    pub max_fences_per_minute: usize,
    /// Nodes fenced at once (carrying this controller's taint); 0: no ceiling.
    pub max_fenced: usize,
    pub lease_namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
    /// Writes in flight at once in a pass (fences, pod deletes, Events).
    pub concurrency: usize,
    /// This replica's Deployment, in `lease_namespace`: created after the
    /// uninstall's pause, it lifts that pause (a reinstall).
    pub deployment: Option<String>,
    /// The shutdown ledger (NodeShutdown objects) and what it keeps; None: not written.
    pub ledger: Option<ledger_writer::Retention>,
}

impl ControllerConfig {
    /// The defaults of `lastgasp controller`, for replica `identity`.
    pub fn new(identity: &str) -> Self {
        ControllerConfig {
            policy: FencePolicy::PoweroffOnly,
            reboot_timeout: Duration::from_secs(600),
            proof_quiet: Duration::from_secs(2),
            direct_tool_quiet: Duration::from_secs(8),
            lease_margin: Duration::from_secs(2),
            max_fences_per_minute: 0,
            max_fenced: 0,
            lease_namespace: "kube-system".into(),
            lease_name: "lastgasp-controller".into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            concurrency: 16,
            deployment: None,
            ledger: None,
        }
    }
}

#[derive(clap::Args)]
pub struct ControllerArgs {
    /// Which shutdowns are fenced: `off`, `observe` (say what would be
    /// fenced, write nothing), `poweroff-only`, `also-reboots`.
    #[arg(
        long,
        value_enum,
        default_value = "poweroff-only",
        env = "LASTGASP_POLICY"
    )]
    pub policy: FencePolicy,
    /// With `also-reboots`: how long a reboot may stay down before the taint.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m", env = "LASTGASP_REBOOT_TIMEOUT")]
    pub reboot_timeout: Duration,
    /// How long a record's proof that the kernel powered off (its reboot(2)
    /// or power-off function) stands before the fence (API server's clock).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s", env = "LASTGASP_PROOF_QUIET")]
    pub proof_quiet: Duration,
    /// How long a direct tool's proof (`poweroff -f`: its exec, before its
    /// reboot(2)) stands before the fence (API server's clock). Keep it
    /// above the agents' `trust.directToolWithin` (5 s) plus the time a
    /// withdrawal takes to land.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "8s", env = "LASTGASP_DIRECT_TOOL_QUIET")]
    pub direct_tool_quiet: Duration,
    /// Added to the kubelet's Lease renew interval (10 s by default) before
    /// a node counts as silent (a direct tool's proof: `poweroff -f`).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s", env = "LASTGASP_LEASE_MARGIN")]
    pub lease_margin: Duration,
    /// Fences across the cluster per minute; 0: no limit. A fence held back
    /// raises a Warning Event and is tried again.
    #[arg(long, default_value_t = 0, env = "LASTGASP_MAX_FENCES_PER_MINUTE")]
    pub max_fences_per_minute: usize,
    /// Nodes fenced at once (carrying this controller's taint); 0: no
    /// ceiling. A fence held back raises a Warning Event and is tried again.
    #[arg(long, default_value_t = 0, env = "LASTGASP_MAX_FENCED")]
    pub max_fenced: usize,
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
    /// This replica's Deployment (in --lease-namespace): one created after
    /// an uninstall paused the Lease is a reinstall, and lifts that pause.
    #[arg(long, env = "LASTGASP_DEPLOYMENT")]
    pub deployment: Option<String>,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s", env = "LASTGASP_INTERVAL")]
    pub interval: Duration,
    /// Serve /metrics, /readyz and /healthz on ADDR:PORT, or `off`
    /// (default: $POD_IP:9851).
    #[arg(long, value_name = "ADDR:PORT", env = "LASTGASP_METRICS_LISTEN")]
    pub metrics_listen: Option<Listen>,
    /// Do not write the shutdown ledger (NodeShutdown objects, one per
    /// episode; the CRD must be installed otherwise).
    #[arg(long, env = "LASTGASP_NO_LEDGER")]
    pub no_ledger: bool,
    /// Ledger entries opened longer ago are deleted.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30d", env = "LASTGASP_LEDGER_MAX_AGE")]
    pub ledger_max_age: Duration,
    /// Per node, the newest this many ledger entries are kept.
    #[arg(long, default_value_t = 100, env = "LASTGASP_LEDGER_MAX_PER_NODE")]
    pub ledger_max_per_node: usize,
    /// Pause the running replicas (the Lease's `lastgasp.dev/paused`), lift
    /// every out-of-service fence this controller set (the taint and its
    /// annotations), then exit: an uninstall's last step.
    #[arg(long, env = "LASTGASP_LIFT_FENCES")]
    pub lift_fences: bool,
}

/// `lastgasp controller`: one pass every `interval`; the holder of the
/// Lease writes.
pub async fn run(args: ControllerArgs) -> Result<()> {
    if args.lift_fences {
        let c = client(Use::Requests, None).await?;
        lift::pause(c.clone(), &args.lease_namespace, &args.lease_name).await?;
        let lifted = lift::lift_all(c).await?;
        tracing::info!(
            nodes = lifted.len(),
            "every fence this controller set is lifted"
        );
        return Ok(());
    }
    let identity = args
        .identity
        .or_else(|| std::env::var("POD_NAME").ok())
        .unwrap_or_else(|| format!("lastgasp-controller-{}", std::process::id()));
    let cfg = ControllerConfig {
        policy: args.policy,
        reboot_timeout: args.reboot_timeout,
        proof_quiet: args.proof_quiet,
        direct_tool_quiet: args.direct_tool_quiet,
        lease_margin: args.lease_margin,
        max_fences_per_minute: args.max_fences_per_minute,
        max_fenced: args.max_fenced,
        lease_namespace: args.lease_namespace,
        lease_name: args.lease_name,
        concurrency: args.concurrency,
        deployment: args.deployment,
        ledger: (!args.no_ledger).then_some(ledger_writer::Retention {
            max_age: args.ledger_max_age,
            max_per_node: args.ledger_max_per_node,
        }),
        ..ControllerConfig::new(&identity)
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
    let mut c = Controller::start(
        client(Use::Watch, None).await?,
        client(Use::Requests, None).await?,
        cfg,
    )
    .await?;
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
                    Err(e) => tracing::warn!(error = format!("{e:#}"), "controller pass"),
                }
            }
            _ = term.recv() => return Ok(()),
        }
    }
}
