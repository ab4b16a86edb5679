//! Version skew: the previous release (`LASTGASP_PREVIOUS_BIN`, built from
//! git by `cargo xtask test`) beside this one, on the real API server with
//! this checkout's kustomize install. Each binary runs as it does on a node:
//! the agent in cluster mode with real eBPF hooks, the node a fresh PID
//! namespace whose init calls reboot(2) (never this machine's); the
//! controller as `lastgasp controller`. Each uses the bound token of its own
//! pod. SKIPPED with the reason without root, the control plane, kustomize
//! or a previous release.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use lastgasp::{
    controller::rule::has_out_of_service,
    record::{self, ShutdownRecord},
};
use lastgasp_tests::{
    controlplane::{self, running_pod_token, ControlPlane},
    nodesim::{self, Sim},
    render::{apply, kustomize, kustomize_dir, render_kustomize_dir},
    support::{agent_bin, can_load_ebpf, rt, send_signal, PidNsChild},
};

const NS: &str = "lastgasp";

/// A process of one release, killed when dropped; its stderr in `log`.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn start(mut cmd: Command, log: PathBuf) -> Proc {
        let child = cmd
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
        Proc { child, log }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `within` for a log line containing `what`.
    fn wait_for(&mut self, what: &str, within: Duration) {
        let t0 = Instant::now();
        while !self.log().contains(what) {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!(
                    "{} ended ({st}) before {what:?}:\n{}",
                    self.log.display(),
                    self.log()
                );
            }
            assert!(
                t0.elapsed() < within,
                "no {what:?} within {within:?} in {}:\n{}",
                self.log.display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A release: its agent binary and whether it is this checkout's.
#[derive(Clone)]
struct Release {
    bin: PathBuf,
    name: String,
    current: bool,
}

fn releases(test: &str) -> Option<(Release, Release)> {
    let Some(bin) = std::env::var_os("LASTGASP_PREVIOUS_BIN").map(PathBuf::from) else {
        println!("SKIPPED {test}: no previous release (LASTGASP_PREVIOUS_BIN; `cargo xtask test` builds it from git)");
        return None;
    };
    let current = agent_bin();
    if !current.is_file() {
        println!("SKIPPED {test}: no agent binary (cargo xtask test builds it)");
        return None;
    }
    let previous = Release {
        bin,
        name: std::env::var("LASTGASP_PREVIOUS_VERSION").unwrap_or_else(|_| "previous".into()),
        current: false,
    };
    let this = Release {
        bin: current,
        name: "this checkout".into(),
        current: true,
    };
    Some((previous, this))
}

fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .trim()
        .to_string()
}

/// `release`'s agent as node `node`, the node being `init`'s PID namespace; armed.
fn agent(release: &Release, dir: &Path, node: &str, kubeconfig: &Path, init: &PidNsChild) -> Proc {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).unwrap();
    let config = dir.join("config.yaml");
    fs::write(&config, "shutdownGracePeriod: 30s\n").unwrap();
    let mut cmd = Command::new(&release.bin);
    cmd.args(["--json-logs", "run", "--no-dbus", "--metrics-listen", "off"])
        .arg("--config")
        .arg(&config)
        .arg("--node-pid-ns")
        .arg(init.pidns_path())
        .arg("--audit-dir")
        .arg(dir.join("audit"))
        .arg("--run-dir")
        .arg(dir.join("run"))
        .env("KUBECONFIG", kubeconfig)
        .env("NODE_NAME", node)
        .env("RUST_LOG", "lastgasp=debug")
        .env_remove("POD_NAME");
    if release.current {
        // Only this release writes the courier's kit (its own option).
        cmd.arg("--no-courier");
    }
    let mut p = Proc::start(cmd, dir.join("agent.log"));
    p.wait_for(r#""message":"armed""#, Duration::from_secs(60));
    p
}

/// `release`'s controller, leading once the Lease is free.
fn controller(release: &Release, dir: &Path, kubeconfig: &Path, identity: &str) -> Proc {
    fs::create_dir_all(dir).unwrap();
    let mut cmd = Command::new(&release.bin);
    cmd.args(["--json-logs", "controller", "--lease-namespace", NS])
        .args([
            "--lease-name",
            "lastgasp-controller",
            "--identity",
            identity,
        ])
        .args(["--metrics-listen", "off"])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "lastgasp=debug");
    Proc::start(cmd, dir.join(format!("{identity}.log")))
}

/// The node's init calls reboot(2) (power-off) in its namespace; once the
/// agent's record shows the kernel's proof, the node's kubelet stops.
/// Returns the record.
async fn power_off(
    sim: &Sim,
    nodes: &Api<Node>,
    node: &str,
    init: PidNsChild,
    agent: &Proc,
) -> ShutdownRecord {
    send_signal(init.init_pid, libc::SIGUSR1);
    let ended = init.ended();
    assert!(
        ended.contains("SIGINT"),
        "the namespace's reboot(2) ended its init with {ended}"
    );
    let t0 = Instant::now();
    let record = loop {
        let n = nodes.get(node).await.unwrap();
        if let Some(Ok(r)) = record::of_node(&n) {
            if r.episode.as_ref().and_then(|e| e.death.as_ref()).is_some() {
                break r;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no record with a proof on {node} within 20 s; the agent said:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    sim.power_off(node);
    record
}

/// How long until `node` carries the out-of-service taint, within `within`.
async fn fenced_within(nodes: &Api<Node>, node: &str, within: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if has_out_of_service(&nodes.get(node).await.unwrap()) {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    None
}

#[test]
fn the_previous_release_and_this_one_fence_only_what_each_can_prove() {
    let test = "the_previous_release_and_this_one_fence_only_what_each_can_prove";
    let Some((previous, this)) = releases(test) else {
        return;
    };
    if !can_load_ebpf(test) {
        return;
    }
    let Some(cp) = controlplane::shared(test) else {
        return;
    };
    let Some(k) = kustomize() else {
        return println!("SKIPPED {test}: no kustomize (`cargo xtask test` installs it, or set LASTGASP_KUSTOMIZE)");
    };
    let objs = render_kustomize_dir(&k, &kustomize_dir());
    rt().block_on(skew(cp, &objs, previous, this));
}

async fn skew(cp: &ControlPlane, objs: &[serde_json::Value], previous: Release, this: Release) {
    let admin = cp.admin();
    apply(&admin, objs, false).await.unwrap();
    let sim = Sim::start(admin.clone()).await.unwrap();
    // (agent, controller) per node: the upgrade's window (the controller
    // first), the control, and a rollback of the controller alone.
    let cases = [
        ("skew-old-agent", &previous, &this),
        ("skew-new-agent", &this, &this),
        ("skew-old-controller", &this, &previous),
    ];
    // The controllers' node, never powered off: a fence deletes its node's
    // pods, and a bound token dies with its pod.
    sim.add_node("skew-ctl").await.unwrap();
    nodesim::schedulable(&admin, &["skew-ctl"], Duration::from_secs(60))
        .await
        .unwrap();
    let ctl_token = running_pod_token(&admin, NS, "controller", "skew-ctl").await;
    let boot = boot_id();
    for (node, _, _) in cases {
        sim.add_node(node).await.unwrap();
        // The agents read this machine's boot id: the node runs on it.
        sim.resume(node, &boot).await.unwrap();
    }
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    nodesim::schedulable(&admin, &names, Duration::from_secs(60))
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-skew-{}", std::process::id()));
    let nodes: Api<Node> = Api::all(admin.clone());
    let ctl_kubeconfig = cp
        .write_kubeconfig("skew-controller.kubeconfig", &ctl_token)
        .unwrap();

    let mut ctl = Some(controller(&this, &dir, &ctl_kubeconfig, "skew-this"));
    let mut leading = "skew-this";
    let mut outcomes = Vec::new();
    for (node, agent_release, ctl_release) in cases {
        if ctl_release.current != (leading == "skew-this") {
            // The other release's controller: it leads once the Lease lapses (15 s).
            drop(ctl.take());
            leading = "skew-previous";
            ctl = Some(controller(ctl_release, &dir, &ctl_kubeconfig, leading));
        }
        let token = running_pod_token(&admin, NS, "agent", node).await;
        let kubeconfig = cp
            .write_kubeconfig(&format!("skew-{node}.kubeconfig"), &token)
            .unwrap();
        let init = PidNsChild::spawn(&["reboot-init"]);
        let a = agent(agent_release, &dir.join(node), node, &kubeconfig, &init);
        let record = power_off(&sim, &nodes, node, init, &a).await;
        let proof = record
            .episode
            .as_ref()
            .and_then(|e| e.death.as_ref())
            .map(|d| d.proof);
        let fenced = fenced_within(&nodes, node, Duration::from_secs(45)).await;
        println!(
            "agent {} + controller {} on {node}: record v{} proof {proof:?}, fenced after {fenced:?}",
            agent_release.name, ctl_release.name, record.v
        );
        outcomes.push((node, fenced, a.log()));
    }
    let ctl_log = ctl.take().map(|c| c.log()).unwrap_or_default();
    let this_ctl_log = fs::read_to_string(dir.join("skew-this.log")).unwrap_or_default();
    let [(_, old_agent, old_agent_log), (_, new_agent, _), (_, old_ctl, _)] =
        <[_; 3]>::try_from(outcomes).unwrap();
    // The documented skew (docs/controller.md, version skew): this
    // controller does not fence a record without the proof annotation an
    // older agent never writes; it fences this agent's; the previous
    // controller fences this agent's kernel proof too.
    assert!(
        old_agent.is_none(),
        "this controller fenced the previous agent's record, which carries no proof annotation; the agent's log:\n{old_agent_log}"
    );
    assert!(
        this_ctl_log
            .lines()
            .any(|l| l.contains("skew-old-agent") && l.contains("not fenced") && l.contains(record::PROOF_ANNOTATION)),
        "this controller did not say why the previous agent's record is not fenced:\n{this_ctl_log}"
    );
    assert!(
        new_agent.is_some(),
        "this release did not fence its own agent's kernel proof"
    );
    assert!(
        old_ctl.is_some(),
        "the previous controller did not fence this agent's kernel proof; its log:\n{ctl_log}"
    );
    let _ = fs::remove_dir_all(&dir);
}
