//! `lastgasp-vm-cluster`: the real control plane for `cargo xtask vm-test
//! --node` (a real node in the QEMU guest). It starts etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler v1.32.13 on loopback
//! (`tests/src/controlplane.rs`), writes the guest kubelet's credentials,
//! applies `deploy/` as an operator does (the kustomize render; the agent's
//! DaemonSet only with `--agent`), creates the workloads, plays a second,
//! simulated node once the guest's workloads run (so that what is replaced
//! has somewhere to go), runs the lastgasp controller (the library, with its
//! own ServiceAccount's token: its Deployment is not applied, it would land
//! on the one real node, the one that dies), and records what the API server
//! says about pods, Nodes and Events, one JSON line each, until its stdin
//! closes.
//!
//!   lastgasp-vm-cluster --out DIR --node lastgasp-guest --objects FILE [--agent]
//!
//! Prints `READY <port>` once everything is in place. Writes DIR/node/
//! (ca.crt, kubelet.crt, kubelet.key) and DIR/cluster.jsonl.
use std::{
    fs,
    io::{BufRead, Write},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context, Result};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::{api::DynamicObject, runtime::watcher, Api, Client, ResourceExt};
use lastgasp::{
    act::kube::{CONDITION, RECORD_ANNOTATION},
    apiserver::Use,
    controller::{ledger_writer, Controller, ControllerConfig},
    record::{unannounced_of, Closing, ShutdownRecord},
};
use lastgasp_tests::{
    controlplane::{self, ControlPlane},
    nodesim::Sim,
    render::{apply, kustomize, kustomize_dir, render_kustomize_dir},
    zone::{token, CONTROLLER_SA},
};
use serde_json::{json, Value};

struct Args {
    out: PathBuf,
    node: String,
    objects: PathBuf,
    agent: bool,
    /// The agent's container with `appArmorProfile: {type: Unconfined}`,
    /// as docs/security.md advises where the actor's exe matters.
    apparmor_unconfined: bool,
}

fn args() -> Result<Args> {
    let mut a = std::env::args().skip(1);
    let (mut out, mut node, mut objects, mut agent) = (None, None, None, false);
    let mut apparmor_unconfined = false;
    while let Some(x) = a.next() {
        match x.as_str() {
            "--out" => out = a.next().map(PathBuf::from),
            "--node" => node = a.next(),
            "--objects" => objects = a.next().map(PathBuf::from),
            "--agent" => agent = true,
            "--apparmor-unconfined" => apparmor_unconfined = true,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(Args {
        out: out.context("--out DIR")?,
        node: node.context("--node NAME")?,
        objects: objects.context("--objects FILE")?,
        agent,
        apparmor_unconfined,
    })
}

fn main() -> Result<()> {
    let args = args()?;
    // The controller's log (its verdicts at info), on our stderr.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,lastgasp::controller=info")
            }),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    fs::create_dir_all(args.out.join("node"))?;
    let Some(cp) = controlplane::plain("vm cluster") else {
        bail!("no control plane binaries (LASTGASP_K8S_BIN, LASTGASP_ETCD)");
    };
    let (crt, key) = cp.node_credentials(&args.node)?;
    fs::write(args.out.join("node/ca.crt"), &cp.ca_pem)?;
    fs::write(args.out.join("node/kubelet.crt"), crt)?;
    fs::write(args.out.join("node/kubelet.key"), key)?;
    let k = kustomize().context("no kustomize (LASTGASP_KUSTOMIZE)")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let log = Arc::new(Mutex::new(fs::File::create(
        args.out.join("cluster.jsonl"),
    )?));
    rt.block_on(async {
        let admin = cp.admin();
        let objs: Vec<Value> = render_kustomize_dir(&k, &kustomize_dir())
            .into_iter()
            .filter(|o| match o["kind"].as_str() {
                // The controller runs here, not on the node that dies.
                Some("Deployment" | "PodDisruptionBudget") => false,
                Some("DaemonSet") => args.agent,
                _ => true,
            })
            .map(|mut o| {
                if args.apparmor_unconfined && o["kind"] == "DaemonSet" {
                    o["spec"]["template"]["spec"]["containers"][0]["securityContext"]
                        ["appArmorProfile"] = json!({"type": "Unconfined"});
                }
                o
            })
            .collect();
        apply(&admin, &objs, false).await?;
        let extra: Vec<Value> = serde_json::from_slice(&fs::read(&args.objects)?)
            .with_context(|| format!("{}", args.objects.display()))?;
        apply(&admin, &extra, false).await?;
        // The `uninstall` scenario deletes the DaemonSet from the guest
        // with this token (its Role allows that only).
        let uninstall = token(&admin, "vm-uninstaller", None).await?;
        fs::write(args.out.join("node/uninstall.token"), uninstall)?;
        tokio::spawn(record::<Pod>(admin.clone(), log.clone(), pod));
        tokio::spawn(record::<Node>(admin.clone(), log.clone(), node));
        tokio::spawn(record::<Event>(admin.clone(), log.clone(), event));
        tokio::spawn(record_ledger(admin.clone(), log.clone()));
        tokio::spawn(controller(cp));
        tokio::spawn(second_node(admin.clone(), args.node.clone()));
        println!("READY {}", cp.port);
        std::io::stdout().flush()?;
        // Until the harness closes our stdin.
        tokio::task::spawn_blocking(|| {
            let stdin = std::io::stdin();
            for _ in stdin.lock().lines() {}
        })
        .await?;
        anyhow::Ok(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(2));
    cp.stop();
    Ok(())
}

/// The lastgasp controller with its own ServiceAccount's token.
async fn controller(cp: &'static ControlPlane) {
    let run = async {
        let tok = token(&cp.admin(), CONTROLLER_SA, None).await?;
        let cfg = ControllerConfig {
            lease_namespace: "lastgasp".into(),
            // As `lastgasp controller` runs by default (the chart's values).
            ledger: Some(ledger_writer::Retention {
                max_age: Duration::from_secs(720 * 3600),
                max_per_node: 100,
            }),
            ..ControllerConfig::new("vm-cluster")
        };
        let mut c = Controller::start(
            cp.agent_client(&tok, Use::Watch),
            cp.agent_client(&tok, Use::Requests),
            cfg,
        )
        .await?;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if let Err(e) = c.tick().await {
                eprintln!("vm-cluster: controller pass: {e:#}");
            }
        }
        #[allow(unreachable_code)]
        anyhow::Ok(())
    };
    if let Err(e) = run.await {
        eprintln!("vm-cluster: the controller did not start: {e:#}");
    }
}

/// Once every workload pod runs on the real node as the API server sees it,
/// a simulated second node (Lease, Ready, pods Running) joins, so that the
/// replacements of what the real node's shutdown ends can run there; then
/// `CLUSTER-READY` on stdout tells the harness that the guest may trigger
/// (containerd runs the containers seconds before the kubelet reports them).
async fn second_node(admin: Client, real: String) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    loop {
        let running = pods.list(&Default::default()).await.is_ok_and(|l| {
            !l.items.is_empty()
                && l.items.iter().all(|p| {
                    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(real.as_str())
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
        });
        if running {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    match Sim::start(admin).await {
        Ok(sim) => {
            match sim.add_node("sim-b").await {
                Ok(_) => {
                    println!("CLUSTER-READY");
                    let _ = std::io::stdout().flush();
                }
                Err(e) => eprintln!("vm-cluster: the second node: {e:#}"),
            }
            // The simulator lives as long as this process.
            std::mem::forget(sim);
        }
        Err(e) => eprintln!("vm-cluster: the node simulator: {e:#}"),
    }
}

/// One JSON line per watch event of `K`: the host's time, the event, and
/// what `view` keeps of the object.
async fn record<K>(client: Client, log: Arc<Mutex<fs::File>>, view: fn(&K) -> Value)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + 'static,
{
    let api: Api<K> = Api::all(client);
    let mut stream: std::pin::Pin<Box<dyn Stream<Item = _> + Send>> =
        Box::pin(watcher(api, watcher::Config::default()));
    while let Some(ev) = stream.next().await {
        let (what, obj) = match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => ("apply", o),
            Ok(watcher::Event::Delete(o)) => ("delete", o),
            Ok(_) => continue,
            Err(e) => {
                eprintln!("vm-cluster: watch: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        log_line(&log, &K::kind(&()), what, view(&obj));
    }
}

/// One line of the record: the host's time, the kind, the event, the view.
fn log_line(log: &Mutex<fs::File>, kind: &str, event: &str, obj: Value) {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let line = json!({"t": t, "kind": kind, "event": event, "obj": obj});
    let mut f = log
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Err(e) = writeln!(f, "{line}").and_then(|()| f.flush()) {
        eprintln!("vm-cluster: writing the record: {e}");
    }
}

/// One JSON line per change of a NodeShutdown (the ledger), as [`record`].
async fn record_ledger(client: Client, log: Arc<Mutex<fs::File>>) {
    let api: Api<DynamicObject> = Api::all_with(client, &ledger_writer::resource());
    let mut stream = Box::pin(watcher(api, watcher::Config::default()));
    while let Some(ev) = stream.next().await {
        let obj = match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
            Ok(_) => continue,
            Err(e) => {
                eprintln!("vm-cluster: ledger watch: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let spec = &obj.data["spec"];
        let view = json!({"name": obj.name_any(), "node": spec["node"], "bootID": spec["bootID"],
            "episode": spec["episode"], "kind": spec["kind"], "path": spec["path"],
            "ending": spec["ending"], "proof": spec["down"]["proof"], "fenced": !spec["fence"].is_null(),
            "drain": spec["agentClaims"]["drain"]});
        log_line(&log, "NodeShutdown", "apply", view);
    }
}

fn pod(p: &Pod) -> Value {
    let spec = p.spec.as_ref();
    let status = p.status.as_ref();
    let terminated: Vec<Value> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let t = c.state.as_ref()?.terminated.as_ref()?;
            Some(json!({"container": c.name, "reason": t.reason, "exitCode": t.exit_code}))
        })
        .collect();
    json!({
        "ns": p.namespace(), "name": p.name_any(), "uid": p.uid(),
        "node": spec.and_then(|s| s.node_name.clone()),
        "priority": spec.and_then(|s| s.priority),
        "owner": p.owner_references().first().map(|o| format!("{}/{}", o.kind, o.name)),
        "phase": status.and_then(|s| s.phase.clone()),
        "reason": status.and_then(|s| s.reason.clone()),
        "message": status.and_then(|s| s.message.clone()),
        "deleting": p.metadata.deletion_timestamp.is_some(),
        "ready": status.and_then(|s| s.conditions.as_ref()).is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        "terminated": terminated,
    })
}

fn node(n: &Node) -> Value {
    let conds: Vec<Value> = n
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| {
            let agents = ["DrainInProgress", "Drained", "LastgaspDegraded"];
            c.type_ == "Ready" || c.type_ == CONDITION || agents.contains(&c.type_.as_str())
        })
        .map(|c| json!({"type": c.type_, "status": c.status, "reason": c.reason}))
        .collect();
    let taints: Vec<String> = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect();
    let record = n
        .annotations()
        .get(RECORD_ANNOTATION)
        .and_then(|r| ShutdownRecord::parse(r).ok());
    json!({
        "name": n.name_any(),
        "boot": n.status.as_ref().and_then(|s| s.node_info.as_ref()).map(|i| i.boot_id.clone()),
        "conditions": conds,
        "taints": taints,
        "unschedulable": n.spec.as_ref().and_then(|s| s.unschedulable),
        "unannounced": unannounced_of(n).map(|u| u.boot_id),
        "record": record.map(|r| json!({"kind": r.kind(), "source": r.signal.as_ref().map(|s| s.source),
            "boot_id": r.boot_id, "closed": r.closed.as_ref().map(|c| c.how),
            "episode": r.episode.as_ref().map(|e| e.id),
            "back": r.closed.as_ref().is_some_and(|c| c.how == Closing::Back),
            "proof": r.death().map(|d| d.proof), "delivered_late": r.delivered_late})),
    })
}

fn event(e: &Event) -> Value {
    json!({
        "reason": e.reason, "type": e.type_, "action": e.action,
        "message": e.message,
        "object": format!("{}/{}", e.involved_object.kind.clone().unwrap_or_default(),
            e.involved_object.name.clone().unwrap_or_default()),
        "source": e.reporting_component.clone().filter(|c| !c.is_empty())
            .or_else(|| e.source.as_ref().and_then(|s| s.component.clone())),
        "count": e.count,
    })
}
