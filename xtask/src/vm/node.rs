//! `cargo xtask vm-test --node`: a real Kubernetes node in the guest.
//!
//! The host runs the real control plane (`lastgasp-vm-cluster`, from the
//! tests package: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler v1.32.13, `deploy/` applied as an operator applies it,
//! the lastgasp controller, a simulated second node, and a record of every
//! pod, Node and Event change). The guest runs containerd, runc, the CNI
//! bridge and the kubelet v1.32.13, which joins through qemu's guestfwd with
//! a client certificate made by that control plane's CA; its images come
//! from OCI archives the harness builds (the agent's image, and one static
//! binary that is both the pod sandbox and the workload). The agent, where
//! the arm has it, is the DaemonSet's pod.
//!
//! Arms: `lastgasp` (the kubelet's graceful shutdown off, as the operator's
//! guide says), `kubelet` (its graceful shutdown on, 30 s and 10 s for
//! critical pods; no agent), `both`. The same shutdowns in each; what the
//! API server saw is the table (`node_matrix`).
use std::{
    fmt::Write as _,
    fs,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::qemu::{Exit, Guest, Run, Spec, POWER_CUT};

mod ledger;
mod preload;
pub use preload::preload;

/// The scenarios of the real node: (name, `tests/vm/scenarios/NAME.sh`,
/// does the guest come back on its own (a reboot)).
pub const SCENARIOS: &[(&str, &str)] = &[
    ("poweroff", "systemctl poweroff"),
    ("poweroff-force", "systemctl poweroff --force"),
    (
        "poweroff-force-agent-killed",
        "systemctl poweroff --force, the agent SIGKILLed in systemd-shutdown",
    ),
    ("poweroff-target", "systemctl start poweroff.target"),
    ("sigrtmin4", "kill -s SIGRTMIN+4 1"),
    ("shutdown-h-1", "shutdown -h +1, waited out"),
    ("logind-poweroff", "busctl call ... login1.Manager PowerOff"),
    ("reboot-ff", "reboot -ff"),
    (
        "drill",
        "the README's drill: shutdown -h +10, shutdown -c 15 s later",
    ),
    (
        "uninstall",
        "the agent's DaemonSet deleted: the host as before the install",
    ),
    (
        DRILL_UNINSTALL,
        "the README's drill, then the agent's DaemonSet deleted, in one boot",
    ),
    (
        "refused-poweroff-f",
        "kubelet stopped; poweroff -f, its reboot(2) refused by seccomp",
    ),
    (
        "killed-poweroff-f",
        "kubelet stopped; poweroff -f killed before its reboot(2)",
    ),
    (
        "slow-poweroff-f",
        "poweroff -f held 12 s before its reboot(2) (past the agent's 5 s bound)",
    ),
    (
        "apparmor-refused-poweroff-f",
        "poweroff -f refused by AppArmor at the capability check, under a flood (needs --apparmor)",
    ),
    (
        POWER_LOSS,
        "the power cut (qemu quit by the host), then switched on again",
    ),
];

/// The drill and the uninstall, each judged as on its own, in one boot.
pub const DRILL_UNINSTALL: &str = "drill-uninstall";

/// The scenario with no shutdown at all: no record, no fence; switched on
/// again whatever `--one-boot` says, for the next boot's word on it.
pub const POWER_LOSS: &str = "power-loss";

/// Scenarios whose node lives on: judged by their own checks (no fence
/// is the pass), never by CI's "fenced after the kernel's end".
pub const STAYS_UP: &[&str] = &[
    "drill",
    "uninstall",
    DRILL_UNINSTALL,
    "refused-poweroff-f",
    "killed-poweroff-f",
    "apparmor-refused-poweroff-f",
];

pub const ARMS: &[&str] = &["lastgasp", "kubelet", "both"];

/// How the node's containers are grouped (`--cgroup-driver`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CgroupDriver {
    /// Every container a systemd scope, stopped by the shutdown (kubeadm's default).
    #[default]
    Systemd,
    /// Containers outside systemd's units, ended by systemd-shutdown's final kill.
    Cgroupfs,
}

/// How the real node's network is configured (`--network`), for what still
/// reaches the API server at the last word.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Network {
    /// An address set by hand (`ip addr`): nothing deconfigures it.
    #[default]
    Static,
    /// systemd-networkd with DHCP (qemu's own server), as cloud images
    /// configure it (netplan on Ubuntu, Flatcar, COS).
    NetworkdDhcp,
    /// A unit like Debian's ifupdown `networking.service` (ordered before
    /// network.target; at stop it takes the address down, as `ifdown -a`).
    Ifupdown,
}

impl Network {
    fn name(self) -> &'static str {
        match self {
            Network::Static => "static",
            Network::NetworkdDhcp => "networkd-dhcp",
            Network::Ifupdown => "ifupdown",
        }
    }
}

/// AppArmor on the real node (`--apparmor`): containerd confines the
/// agent's container with its default profile, or the DaemonSet asks for
/// none (docs/security.md's advice).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AppArmor {
    /// containerd's `cri-containerd.apparmor.d` on the agent's container.
    Default,
    /// The agent's container with `appArmorProfile: {type: Unconfined}`.
    Unconfined,
}

impl CgroupDriver {
    fn name(self) -> &'static str {
        match self {
            CgroupDriver::Systemd => "systemd",
            CgroupDriver::Cgroupfs => "cgroupfs",
        }
    }
}

/// `cargo xtask test`'s real-node scenarios: the agent as its DaemonSet's
/// pod, the kubelet's graceful shutdown off, a forced power-off; the same
/// with the agent killed in systemd-shutdown's sweep (its courier must send
/// the last word); a shutdown through systemd under the systemd cgroup
/// driver on a read-only `/usr` (`CI_RO_USR`: the agent's scope stopped
/// before the final unit, which runs the courier with the kit left when the
/// shutdown began); the README's drill (scheduled, cancelled, nothing
/// moved), then an uninstall (the host as before the install), in one boot;
/// and a direct tool that never reaches the kernel, refused and killed, with
/// the kubelet stopped (never fenced); one boot each.
pub const CI_ARM: &str = "lastgasp";
pub const CI: &[&str] = &[
    "poweroff-force",
    "poweroff-force-agent-killed",
    DRILL_UNINSTALL,
    "refused-poweroff-f",
    "killed-poweroff-f",
    POWER_LOSS,
];

/// The CI's cell with `/usr` read-only (`--ro-usr`): a shutdown through
/// systemd under the systemd driver, its last word from the final unit. On a
/// writable `/usr` (the hook's word) it is not in CI: the two `--force`
/// cells fence through the hook, and a CI run has no room for both.
pub const CI_RO_USR: &[&str] = &["poweroff-target"];

/// The guest's memory with the kubelet, containerd and four pods (the
/// runner reports what is in use when the pods run: `mem_used_mib`).
pub const MEM_MIB: u32 = 1024;
/// After the node went down, the cluster is watched this long before the
/// guest is switched on again (or the run ends): the controller's fence
/// (the Lease silent for 10 s + 2 s) and the replacements fall in it.
const LINGER: Duration = Duration::from_secs(30);
/// Kubelet Events that say nothing about the shutdown.
const NOISE: &[&str] = &[
    "MissingClusterDNS",
    "Starting",
    "NodeHasSufficientMemory",
    "NodeHasNoDiskPressure",
    "NodeHasSufficientPID",
    "NodeAllocatableEnforced",
    "InvalidDiskCapacity",
    "RegisteredNode",
];
const NODE: &str = "lastgasp-guest";
/// Workload containers (web, cache, db, and the StatefulSet `slow`, which
/// writes for 20 s after its SIGTERM) the guest must run before the trigger;
/// the agent's is one more.
const WORKLOADS: usize = 4;
/// The StatefulSet whose every write the console times (`sleeper.c`).
const WRITER: &str = "slow";

/// What every run needs, built once.
pub struct Prepared {
    helper: PathBuf,
    apparmor: Option<AppArmor>,
    /// `--ro-usr`: the guest's /usr read-only.
    ro_usr: bool,
    network: Network,
    env: Vec<(String, PathBuf)>,
    files: Vec<(String, Vec<u8>)>,
    objects: PathBuf,
    node_dir: PathBuf,
    /// The root disk every cell boots from, its images imported (`preload`).
    preloaded: Option<PathBuf>,
}

/// The binaries, images and files of the real node: `agent_image` and
/// `sleeper` are OCI archives with their tags; `helper` the
/// `lastgasp-vm-cluster` binary; `env` what it needs to find the control
/// plane's binaries and kustomize.
pub fn prepare(
    root: &Path,
    helper: PathBuf,
    env: Vec<(String, PathBuf)>,
    agent_image: (PathBuf, String),
    sleeper: (PathBuf, String),
    kubelet: &Path,
    (apparmor, ro_usr, network): (Option<AppArmor>, bool, Network),
) -> Result<Prepared> {
    // qemu's guestfwd runs socat to reach the control plane on loopback.
    crate::setup::ensure_debs(&[("socat", "socat")])?;
    let node_dir = root.join("tests/vm/node");
    let read = |p: &Path| fs::read(p).with_context(|| format!("reading {}", p.display()));
    let mut files = vec![
        (
            "node.sh".to_string(),
            read(&root.join("tests/vm/guest/node.sh"))?,
        ),
        ("node/kubelet".into(), read(kubelet)?),
        (
            "node/containerd.toml".into(),
            read(&node_dir.join("containerd.toml"))?,
        ),
        (
            "node/cni.conflist".into(),
            read(&node_dir.join("cni.conflist"))?,
        ),
        (
            "node/kubelet.service".into(),
            read(&node_dir.join("kubelet.service"))?,
        ),
        ("node/watch.sh".into(), read(&node_dir.join("watch.sh"))?),
        ("node/images/lastgasp.tar".into(), read(&agent_image.0)?),
        ("node/images/sleeper.tar".into(), read(&sleeper.0)?),
        ("node/hold.so".into(), read(&hold(root)?)?),
    ];
    // What the DaemonSet names the image: the CRI's docker.io/library/...
    let version = agent_image.1.rsplit(':').next().unwrap_or_default();
    files.push((
        "node/tags".into(),
        format!("{} docker.io/library/lastgasp:{version}\n", agent_image.1).into_bytes(),
    ));
    Ok(Prepared {
        helper,
        apparmor,
        ro_usr,
        network,
        env,
        files,
        objects: node_dir.join("objects.json"),
        node_dir,
        preloaded: None,
    })
}

/// `tests/vm/node/hold.c` as a shared library (the guest's glibc is
/// Debian's, as the host's): what holds a tool before its own code runs.
fn hold(root: &Path) -> Result<PathBuf> {
    crate::setup::ensure_debs(&[("gcc", "gcc")])?;
    let out = crate::build::target_dir(root).join("vm/hold.so");
    fs::create_dir_all(out.parent().unwrap_or(root))?;
    crate::cmd::run(
        std::process::Command::new("gcc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&out)
            .arg(root.join("tests/vm/node/hold.c")),
    )
    .context("gcc -shared tests/vm/node/hold.c")?;
    Ok(out)
}

/// One (arm, scenario): its outcome for the table.
pub struct NodeOutcome {
    /// CI's: the record must be on the Node before it dies, and the node
    /// fenced after.
    pub strict: bool,
    pub apparmor: Option<AppArmor>,
    pub arm: &'static str,
    pub scenario: &'static str,
    pub driver: CgroupDriver,
    pub trigger: &'static str,
    pub problems: Vec<String>,
    /// Filled from the run: one string per column.
    pub ran_as: String,
    pub pods: String,
    pub replaced: String,
    pub at_death: String,
    pub after: String,
    pub agent_end: String,
    /// The fence beside the kernel's end and the writer's last write.
    pub fence: String,
    pub events: String,
    pub guest: String,
    /// The NodeShutdown objects of the Node, their endings in turn.
    pub ledger: String,
}

const TRIGGER_NEVER_RAN: &str = "the trigger never ran";

impl NodeOutcome {
    /// The guest never reached the trigger: nothing was tested.
    pub fn trigger_never_ran(&self) -> bool {
        self.problems
            .iter()
            .any(|p| p.starts_with(TRIGGER_NEVER_RAN))
    }

    pub fn failed(&self) -> bool {
        !self.problems.is_empty()
    }

    pub fn one_line(&self) -> String {
        if self.failed() {
            format!("FAIL: {}", self.problems.join("; "))
        } else {
            format!(
                "ok: {} | {} | {} | {}",
                self.fence, self.pods, self.at_death, self.agent_end
            )
        }
    }
}

/// The control plane for one run: the helper process.
struct NodeControlPlane {
    child: Child,
    port: u16,
    out: PathBuf,
}

impl NodeControlPlane {
    fn start(p: &Prepared, dir: &Path, agent: bool) -> Result<NodeControlPlane> {
        let out = dir.join("cluster");
        fs::create_dir_all(&out)?;
        let mut cmd = Command::new(&p.helper);
        cmd.arg("--out")
            .arg(&out)
            .args(["--node", NODE, "--objects"])
            .arg(&p.objects)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(fs::File::create(dir.join("cluster.log"))?);
        if agent {
            cmd.arg("--agent");
        }
        if p.apparmor == Some(AppArmor::Unconfined) {
            cmd.arg("--apparmor-unconfined");
        }
        for (k, v) in &p.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().context("starting lastgasp-vm-cluster")?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        // The guest triggers only once the API server has its pods Running
        // and the second node is up: a file on its share says so.
        let ready = dir.join("boot1/share/in/cluster-ready");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(port) = line.strip_prefix("READY ") {
                    let _ = tx.send(port.trim().parse::<u16>().ok());
                } else if line.trim() == "CLUSTER-READY" {
                    let _ = fs::write(&ready, b"");
                }
            }
        });
        let Ok(Some(port)) = rx.recv_timeout(Duration::from_secs(180)) else {
            let _ = child.kill();
            let _ = child.wait();
            let log = fs::read_to_string(dir.join("cluster.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            bail!(
                "the control plane for the real node did not come up:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        };
        Ok(NodeControlPlane { child, port, out })
    }

    /// Closes its stdin: it stops, the control plane with it.
    fn stop(mut self) {
        drop(self.child.stdin.take());
        for _ in 0..100 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The files of one run's share (`in/`), the arm's kubelet config and the
/// node's credentials from the control plane.
fn files(
    p: &Prepared,
    c: &NodeControlPlane,
    arm: &str,
    driver: CgroupDriver,
) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = p.files.clone();
    let systemd = driver == CgroupDriver::Systemd;
    let containerd = fs::read_to_string(p.node_dir.join("containerd.toml"))?.replace(
        "SystemdCgroup = true",
        &format!("SystemdCgroup = {systemd}"),
    );
    files.retain(|(n, _)| n != "node/containerd.toml");
    files.push(("node/containerd.toml".into(), containerd.into_bytes()));
    let (grace, critical) = if arm == "lastgasp" {
        ("0s", "0s")
    } else {
        ("30s", "10s")
    };
    let kubelet = fs::read_to_string(p.node_dir.join("kubelet.yaml"))?
        .replace(
            "shutdownGracePeriod: GRACE",
            &format!("shutdownGracePeriod: {grace}"),
        )
        .replace(
            "shutdownGracePeriodCriticalPods: CRITICAL",
            &format!("shutdownGracePeriodCriticalPods: {critical}"),
        )
        .replace(
            "cgroupDriver: systemd",
            &format!("cgroupDriver: {}", driver.name()),
        );
    files.push(("node/kubelet.yaml".into(), kubelet.into_bytes()));
    for f in ["ca.crt", "kubelet.crt", "kubelet.key", "uninstall.token"] {
        files.push((format!("node/{f}"), fs::read(c.out.join("node").join(f))?));
    }
    files.push((
        "node/kubeconfig".into(),
        String::from(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: vm\n  cluster:\n    server: https://10.0.2.100:6443\n    certificate-authority: /var/lib/kubelet/pki/ca.crt\nusers:\n- name: node\n  user:\n    client-certificate: /var/lib/kubelet/pki/kubelet.crt\n    client-key: /var/lib/kubelet/pki/kubelet.key\ncontexts:\n- name: vm\n  context:\n    cluster: vm\n    user: node\ncurrent-context: vm\n"
        )
        .into_bytes(),
    ));
    let agent = usize::from(arm != "kubelet");
    files.push((
        "node.env".into(),
        format!(
            "ARM={arm}\nEXPECT_TASKS={}\nRO_USR={}\nNETWORK={}\nPRELOADED={}\n",
            WORKLOADS + agent,
            u8::from(p.ro_usr),
            p.network.name(),
            u8::from(p.preloaded.is_some())
        )
        .into_bytes(),
    ));
    Ok(files)
}

/// One arm and scenario on a fresh control plane and guest; with
/// `next_boot`, a guest that powered off is switched on again to see what
/// the cluster knows once it is back.
pub fn run(
    guest: &Guest,
    p: &Prepared,
    (arm, scenario, driver): (&'static str, &'static str, CgroupDriver),
    dir: &Path,
    next_boot: bool,
    strict: bool,
) -> NodeOutcome {
    let trigger = SCENARIOS
        .iter()
        .find(|(n, _)| *n == scenario)
        .map(|(_, t)| *t)
        .unwrap_or("?");
    let mut o = NodeOutcome {
        strict,
        apparmor: p.apparmor,
        arm,
        scenario,
        driver,
        trigger,
        problems: Vec::new(),
        ran_as: format!(
            "{} ({} cgroups{}{})",
            if arm == "kubelet" {
                "no agent"
            } else {
                "DaemonSet pod"
            },
            driver.name(),
            if p.ro_usr { ", /usr read-only" } else { "" },
            match p.network {
                Network::Static => String::new(),
                n => format!(", network {}", n.name()),
            }
        ),
        pods: "-".into(),
        replaced: "-".into(),
        at_death: "-".into(),
        after: "-".into(),
        agent_end: "-".into(),
        fence: "-".into(),
        events: "-".into(),
        guest: "-".into(),
        ledger: "-".into(),
    };
    if let Err(e) = run_inner(guest, p, dir, next_boot, &mut o) {
        o.problems.push(format!("{e:#}"));
    }
    o
}

fn run_inner(
    guest: &Guest,
    p: &Prepared,
    dir: &Path,
    next_boot: bool,
    o: &mut NodeOutcome,
) -> Result<()> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    let next_boot = next_boot || o.scenario == POWER_LOSS;
    let cluster = NodeControlPlane::start(p, dir, o.arm != "kubelet")?;
    let nic = format!(
        "user,restrict=on,guestfwd=tcp:10.0.2.100:6443-cmd:socat STDIO TCP:127.0.0.1:{}",
        cluster.port
    );
    let reboots = o.scenario == "reboot-ff";
    let spec = Spec {
        scenario: o.scenario,
        dir: dir.join("boot1"),
        allow_reset: reboots && next_boot,
        boot_timeout: Duration::from_secs(240),
        timeout: Duration::from_secs(if o.scenario == "shutdown-h-1" {
            1200
        } else {
            900
        }),
        extra_in: files(p, &cluster, o.arm, o.driver)?,
        nic: Some(nic.clone()),
        disks_from: None,
        keep_overlay: next_boot,
        mem_mib: MEM_MIB,
        apparmor: o.apparmor.is_some(),
        arm_timeout: Duration::from_secs(420),
        base: p.preloaded.clone(),
    };
    let run = guest.boot(&spec);
    let run = match run {
        Ok(r) => r,
        Err(e) => {
            cluster.stop();
            return Err(e);
        }
    };
    let first_end = kernel_end(&run);
    let powered_off =
        first_end.is_some_and(|l| l.text.contains("reboot: Power down")) || power_cut(&run);
    // A reboot in the same qemu comes back by itself; otherwise it is down.
    let went_down =
        powered_off || (first_end.is_some_and(|l| l.text.contains("Restarting")) && !next_boot);
    let triggered_once = run.markers("TRIGGER ").len() == 1;
    // A power cut has nothing to fence: its next boot is the watch.
    if went_down && triggered_once && o.scenario != POWER_LOSS {
        // The final unit's word (read-only /usr) is fenced only after
        // systemd-shutdown's sweep bound (the controller's 100 s).
        let linger = if p.ro_usr {
            LINGER + Duration::from_secs(100)
        } else {
            LINGER
        };
        println!(
            "vm-test:   the node is down: the cluster watched for {} s",
            linger.as_secs()
        );
        std::thread::sleep(linger);
    }
    let run2 = if next_boot && powered_off && triggered_once {
        println!("vm-test:   the node is off: switching it on again (same disks)");
        let spec2 = Spec {
            dir: dir.join("boot2"),
            allow_reset: false,
            disks_from: Some(dir.join("boot1")),
            keep_overlay: false,
            extra_in: Vec::new(),
            ..spec
        };
        Some(guest.boot(&spec2))
    } else {
        None
    };
    let out = cluster.out.clone();
    cluster.stop();
    let run2 = run2.transpose()?;
    judge(&run, run2.as_ref(), &out, o)
}

/// An uninstall: the agent gone, the host listed as before the install,
/// and none of the agent's conditions left on the Node.
fn uninstalled(seen: &Seen, o: &mut NodeOutcome) {
    let said = |m: &str| {
        seen.run
            .markers(m)
            .first()
            .map(|l| l.text.split(m).nth(1).unwrap_or("").trim().to_string())
    };
    let (gone, diff) = (said("AGENT-GONE"), said("HOST-DIFF"));
    if gone.as_deref() != Some("yes") {
        o.problems
            .push(format!("uninstall: the agent did not stop ({gone:?})"));
    }
    // The kubelet creates the DaemonSet's DirectoryOrCreate hostPaths; the
    // agent, inside them, can empty but not remove them.
    let hostpaths = ["> /run/lastgasp", "> /etc/systemd/logind.conf.d"];
    let diff = diff.unwrap_or_default();
    let (kubelets, other): (Vec<&str>, Vec<&str>) = diff
        .split(';')
        .filter(|d| !d.is_empty() && *d != "none")
        .partition(|d| hostpaths.contains(d));
    if diff.is_empty() || !other.is_empty() {
        o.problems.push(format!(
            "uninstall: the host differs from before the install: {other:?} ({diff:?})"
        ));
    }
    let last = seen
        .lines
        .iter()
        .rev()
        .find(|l| l["kind"] == "Node" && l["obj"]["name"] == NODE);
    let left: Vec<String> = last
        .and_then(|l| l["obj"]["conditions"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| c["type"].as_str())
        .filter(|t| *t != "Ready")
        .map(str::to_string)
        .collect();
    if !left.is_empty() {
        o.problems.push(format!(
            "uninstall: the agent's conditions left on the Node: {left:?}"
        ));
    }
    o.after = format!(
        "agent gone: {}; host as before the install but {other:?} (the kubelet's empty hostPath directories: {kubelets:?}); conditions left: {left:?}",
        gone.unwrap_or_default(),
    );
}

/// The README's drill, as an operator would see it: the Node's
/// `ShutdownInProgress` True with `ScheduledShutdown`, then False with
/// `ShutdownCancelled`, an Event for each, and nothing moved, tainted or
/// fenced before the runner's own end (`STILL-UP`).
fn drill(
    run: &Run,
    lines: &[Value],
    trig: SystemTime,
    pods: &[(String, String)],
    o: &mut NodeOutcome,
) {
    let Some(up) = run
        .markers("STILL-UP")
        .first()
        .map(|l| secs_after_st(at(run, l.t), trig))
    else {
        o.problems
            .push("the drill: the node did not stay up".into());
        return;
    };
    let rel = |v: &Value| secs_after(v["t"].as_f64().unwrap_or(0.0), trig);
    let during: Vec<&Value> = lines
        .iter()
        .filter(|l| rel(l) > 0.0 && rel(l) <= up)
        .collect();
    let reasons = shutdown_condition_history(&during);
    let want = ["True/ScheduledShutdown", "False/ShutdownCancelled"];
    if !reasons.ends_with(&want.map(String::from)) {
        o.problems.push(format!(
            "the drill: ShutdownInProgress went {reasons:?}, not {want:?}"
        ));
    }
    let events: Vec<String> = during
        .iter()
        .filter(|l| l["kind"] == "Event" && l["obj"]["object"] == format!("Node/{NODE}").as_str())
        .map(|l| {
            let e = &l["obj"];
            let s = |k: &str| e[k].as_str().unwrap_or("").to_string();
            format!("{}/{}: {}", s("reason"), s("action"), s("message"))
        })
        .collect();
    for what in ["ScheduledShutdown", "ShutdownCancelled"] {
        if !events
            .iter()
            .any(|m| m.starts_with(&format!("NodeShutdown/{what}:")))
        {
            o.problems
                .push(format!("the drill: no Event says {what}: {events:?}"));
        }
    }
    let touched: Vec<String> = during
        .iter()
        .filter(|l| {
            l["kind"] == "Pod" && pods.iter().any(|(_, uid)| l["obj"]["uid"] == uid.as_str())
        })
        .filter(|l| l["event"] == "delete" || l["obj"]["deleting"] == true)
        .map(|l| l["obj"]["name"].as_str().unwrap_or("?").to_string())
        .collect();
    let marked = during.iter().any(|l| {
        l["kind"] == "Node"
            && l["obj"]["taints"].as_array().is_some_and(|t| {
                t.iter().any(|t| {
                    t.as_str().is_some_and(|t| {
                        t.starts_with("lastgasp.dev/") || t.contains("out-of-service")
                    })
                })
            })
    });
    if !touched.is_empty() || marked {
        o.problems.push(format!(
            "the drill moved something: pods {touched:?}, tainted: {marked}"
        ));
    }
    o.events = format!(
        "{}; the drill: ShutdownInProgress {}; Events: {}",
        o.events,
        reasons.join(" → "),
        events.join(" | ")
    );
}

/// A proof of death whose reboot(2) never reached the kernel, or was
/// refused there: the node stayed up, the record carried the proof on the
/// API server and was then closed as failed, and nothing fenced it. Says
/// how long the proof stood on the API server (what races the controller's
/// quiet time), by the watch's host times.
fn taken_back(seen: &Seen, o: &mut NodeOutcome) {
    if o.scenario == "apparmor-refused-poweroff-f" && o.apparmor.is_none() {
        o.problems
            .push("this scenario needs AppArmor on: vm-test --node --apparmor default".into());
    }
    let Some(up) = seen
        .run
        .markers("STILL-UP")
        .first()
        .map(|l| seen.secs(at(seen.run, l.t)))
    else {
        o.problems.push("the node did not stay up".into());
        return;
    };
    let node = |l: &&Value| l["kind"] == "Node" && l["obj"]["name"] == NODE;
    let during: Vec<&Value> = seen
        .lines
        .iter()
        .filter(node)
        .filter(|l| seen.rel(l) > 0.0 && seen.rel(l) <= up)
        .collect();
    let record = |l: &Value| l["obj"]["record"].clone();
    let open_with = |l: &&&Value, proof: Option<&str>| {
        let r = record(l);
        r["closed"].is_null()
            && proof.map_or(!r["proof"].is_null(), |p| r["proof"].as_str() == Some(p))
    };
    let first_proof = during
        .iter()
        .find(|l| open_with(l, None))
        .map(|l| seen.rel(l));
    let kernel = during
        .iter()
        .find(|l| open_with(l, Some("kernel")))
        .map(|l| seen.rel(l));
    let closed = during
        .iter()
        .find(|l| record(l)["closed"].as_str() == Some("failed"))
        .map(|l| seen.rel(l));
    let (Some(from), Some(to)) = (first_proof, closed) else {
        o.problems.push(format!(
            "the record must carry a proof, then close as failed: proof {first_proof:?}, closed {closed:?}"
        ));
        return;
    };
    let mut stood = format!("the proof stood {:.2} s on the API server", to - from);
    if let Some(k) = kernel {
        stood.push_str(&format!(" (the kernel's, {:.2} s)", to - k));
    }
    o.fence = format!("{}; {stood}, closed failed +{to:.1} s", o.fence);
}

/// The harness cut the guest's power (`POWER_CUT`).
fn power_cut(run: &Run) -> bool {
    matches!(&run.exit, Exit::Killed(why) if why == POWER_CUT)
}

/// A power cut: no record on the Node (the agent saw no shutdown), no fence
/// (no proof exists), and once back, the Node names the boot that ended
/// unannounced (the next boot's agent, from its audit log).
fn unannounced(seen: &Seen, fenced: Option<f64>, o: &mut NodeOutcome) {
    let boot1 = seen.run.markers("BOOT ").first().and_then(|l| {
        let mut w = l.text.split_whitespace().skip_while(|w| *w != "BOOT");
        w.nth(2).map(str::to_string)
    });
    let node = |l: &&Value| l["kind"] == "Node" && l["obj"]["name"] == NODE && seen.rel(l) > 0.0;
    if seen
        .lines
        .iter()
        .filter(node)
        .any(|l| !l["obj"]["record"].is_null())
    {
        o.problems.push(
            "a shutdown record on the Node: the agent claimed a shutdown in a power cut".into(),
        );
    }
    if let Some(f) = fenced {
        o.problems.push(format!(
            "FENCED ON A POWER CUT (+{f:.1} s): no proof of death exists"
        ));
    }
    let said = seen
        .lines
        .iter()
        .filter(node)
        .find(|l| l["obj"]["unannounced"].as_str().is_some())
        .map(|l| {
            (
                seen.rel(l),
                l["obj"]["unannounced"].as_str().unwrap_or_default(),
            )
        });
    match (said, &boot1) {
        (Some((t, b)), Some(b1)) if b == b1 => {
            let _ = write!(
                o.after,
                "; the Node: boot {} ended unannounced +{t:.1}",
                &b[..8.min(b.len())]
            );
        }
        _ => o.problems.push(format!(
            "the Node never said the cut boot ({boot1:?}) ended unannounced: it said {said:?}"
        )),
    }
}

/// The Node's `ShutdownInProgress` as it went (status/reason), each
/// change once.
fn shutdown_condition_history(during: &[&Value]) -> Vec<String> {
    during
        .iter()
        .filter(|l| l["kind"] == "Node" && l["obj"]["name"] == NODE)
        .flat_map(|l| {
            l["obj"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|c| c["type"] == lastgasp_common::names::CONDITION)
        .map(|c| {
            format!(
                "{}/{}",
                c["status"].as_str().unwrap_or("?"),
                c["reason"].as_str().unwrap_or("?")
            )
        })
        .fold(Vec::new(), |mut v, r| {
            if v.last() != Some(&r) {
                v.push(r);
            }
            v
        })
}

fn secs_after_st(t: SystemTime, zero: SystemTime) -> f64 {
    t.duration_since(zero)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// How the trigger ended the guest: the kernel's first last words after it
/// (a reboot that came back ends again later, with the runner's power-off).
fn kernel_end(run: &Run) -> Option<&super::qemu::Line> {
    let trig = run.markers("TRIGGER ").first()?.t;
    run.console.iter().find(|l| {
        l.t >= trig
            && (l.text.contains("reboot: Power down") || l.text.contains("reboot: Restarting"))
    })
}

/// A console line's host time.
fn at(run: &Run, t: Duration) -> SystemTime {
    run.start_wall + t
}

fn secs_after(t: f64, zero: SystemTime) -> f64 {
    let z = zero
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    t - z
}

/// `--apparmor`: AppArmor was on, the agent confined as `mode` says, and
/// what the profile refused (docs/security.md: ptrace-read of processes
/// outside it, so the actor's `exe` is lost; none unconfined).
fn apparmor(run: &Run, mode: AppArmor, o: &mut NodeOutcome) {
    let label = run.markers("LSM ").first().and_then(|l| {
        l.text
            .split_once("agent=")
            .map(|(_, a)| a.trim().to_string())
    });
    let denied = run
        .console
        .iter()
        .filter(|l| {
            l.text.contains("apparmor=\"DENIED\"")
                && l.text.contains("profile=\"cri-containerd.apparmor.d\"")
        })
        .count();
    o.guest = format!(
        "{}; AppArmor: agent {}, {denied} denial(s) of its profile",
        o.guest,
        label.as_deref().unwrap_or("?")
    );
    let Some(label) = label else {
        o.problems
            .push("AppArmor was not on in the guest (no LSM marker)".into());
        return;
    };
    match mode {
        AppArmor::Default if !label.starts_with("cri-containerd.apparmor.d") => o.problems.push(
            format!("the agent ran as {label}, not under containerd's profile"),
        ),
        AppArmor::Default if denied == 0 => o.problems.push(
            "no denial of containerd's profile: the documented ptrace-read refusal did not happen"
                .into(),
        ),
        AppArmor::Unconfined if label != "unconfined" => o
            .problems
            .push(format!("the agent ran as {label}, not unconfined")),
        AppArmor::Unconfined if denied > 0 => o.problems.push(format!(
            "{denied} denial(s) although the agent is unconfined"
        )),
        _ => {}
    }
}

/// The API server's record of a run (`cluster.jsonl`), on the trigger's clock.
struct Seen<'a> {
    run: &'a Run,
    lines: Vec<Value>,
    trig: SystemTime,
    /// The kernel's end, seconds after the trigger (`None`: it stayed up).
    end_s: Option<f64>,
}

impl Seen<'_> {
    /// A record line's seconds after the trigger.
    fn rel(&self, v: &Value) -> f64 {
        secs_after(v["t"].as_f64().unwrap_or(0.0), self.trig)
    }

    /// A host time's seconds after the trigger (negative before it).
    fn secs(&self, t: SystemTime) -> f64 {
        t.duration_since(self.trig)
            .map(|d| d.as_secs_f64())
            .unwrap_or_else(|e| -e.duration().as_secs_f64())
    }

    fn end_rel(&self) -> f64 {
        self.end_s.unwrap_or(f64::MAX)
    }

    /// When the guest saw `what` (agent, kubelet) gone.
    fn gone(&self, what: &str) -> Option<f64> {
        self.run
            .markers("GONE")
            .into_iter()
            .find(|l| l.text.contains(&format!("GONE {what}")))
            .map(|l| self.secs(at(self.run, l.t)))
    }

    /// The Node as the API server had it at `until`.
    fn node_obj_at(&self, until: f64) -> Option<&Value> {
        self.lines
            .iter()
            .rfind(|l| l["kind"] == "Node" && l["obj"]["name"] == NODE && self.rel(l) <= until)
            .map(|l| &l["obj"])
    }

    fn node_at(&self, until: f64) -> String {
        self.node_obj_at(until)
            .map(node_text)
            .unwrap_or_else(|| "-".into())
    }
}

/// Reads the run's markers and the API server's record into the columns.
fn judge(run: &Run, run2: Option<&Run>, out: &Path, o: &mut NodeOutcome) -> Result<()> {
    let fail = run.markers("FAIL");
    if let Some(f) = fail.first() {
        o.problems.push(format!("the guest: {}", f.text.trim()));
    }
    let armed = run.markers("ARMED");
    if let Some(a) = armed.first() {
        o.guest = a
            .text
            .split_whitespace()
            .filter(|w| w.starts_with("mem_used_mib=") || w.starts_with("tasks="))
            .collect::<Vec<_>>()
            .join(" ");
    }
    if let Some(mode) = o.apparmor {
        apparmor(run, mode, o);
    }
    let Some(trig) = run.markers("TRIGGER").first().map(|l| at(run, l.t)) else {
        o.problems
            .push(format!("{TRIGGER_NEVER_RAN}{}", never_registered(run, out)));
        return Ok(());
    };
    let lines: Vec<Value> = fs::read_to_string(out.join("cluster.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let mut seen = Seen {
        run,
        lines,
        trig,
        end_s: None,
    };
    seen.end_s = kernel_end(run)
        .map(|l| at(run, l.t))
        .or_else(|| power_cut(run).then(|| at(run, run.exit_t)))
        .map(|t| seen.secs(t));
    o.guest = format!(
        "{}; down at {}",
        o.guest,
        seen.end_s
            .map(|s| format!("+{s:.1} s"))
            .unwrap_or_else(|| "never (stayed up)".into())
    );
    let pods = workload_pods(&seen);
    pod_fates(&seen, &pods, o);
    o.at_death = seen.node_at(seen.end_rel());
    let fenced = fence(&seen, o);
    if o.strict {
        let agent_ran = armed
            .first()
            .is_some_and(|a| !a.text.contains("agent=none"));
        must_win(&seen, agent_ran, fenced, o);
    }
    o.after = after(&seen, run2, o.scenario);
    o.events = node_events(&seen);
    let (drilled, uninstall) = match o.scenario {
        "drill" => (true, false),
        "uninstall" => (false, true),
        DRILL_UNINSTALL => (true, true),
        _ => (false, false),
    };
    if drilled {
        drill(run, &seen.lines, trig, &pods, o);
    }
    if uninstall {
        uninstalled(&seen, o);
    }
    if !drilled && !uninstall && STAYS_UP.contains(&o.scenario) {
        taken_back(&seen, o);
    } else if o.scenario == POWER_LOSS {
        unannounced(&seen, fenced, o);
    }
    o.agent_end = agent_end(&seen, o.arm != "kubelet");
    ledger::judge(&seen, o);
    Ok(())
}

/// The Node once the guest is switched on again (and whether the runner saw
/// it back), or its last state.
fn after(seen: &Seen, run2: Option<&Run>, scenario: &str) -> String {
    match run2 {
        Some(r2) => {
            let back = r2
                .markers("REPORTED")
                .first()
                .map(|l| l.text.contains("node-back=yes"))
                .unwrap_or(false);
            format!(
                "{} (back: {})",
                seen.node_at(f64::MAX),
                if back { "yes" } else { "no" }
            )
        }
        None if scenario == "reboot-ff" => seen.node_at(f64::MAX),
        None => "not switched on again".into(),
    }
}

/// What CI's scenarios must show: the agent's pod ran, its record was on
/// the Node when the node went down, and the controller fenced it.
fn must_win(seen: &Seen, agent_ran: bool, fenced: Option<f64>, o: &mut NodeOutcome) {
    if o.arm != "kubelet" && !agent_ran {
        o.problems.push("the agent's pod was not running".into());
    }
    let recorded = seen
        .node_obj_at(seen.end_rel())
        .is_some_and(|n| !n["record"].is_null());
    if !recorded {
        o.problems
            .push("the agent's record was not on the Node when the node went down".into());
    }
    if fenced.is_none() {
        o.problems
            .push("the controller did not fence the node while the cluster was watched".into());
    }
}

/// Why the trigger never ran: the kubelet never registered the Node (qemu
/// says why), the runner's last step, and how the guest ended.
fn never_registered(run: &Run, out: &Path) -> String {
    let registered = fs::read_to_string(out.join("cluster.jsonl"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains("\"kind\":\"Node\"") && l.contains(NODE));
    let mut why = String::new();
    if !registered {
        why.push_str(": the kubelet never registered the Node");
        if let Some(l) = run.stderr.lines().rfind(|l| !l.trim().is_empty()) {
            why.push_str(&format!(" (qemu: {})", l.trim()));
        }
    }
    let last = run
        .console
        .iter()
        .rfind(|l| l.text.contains("lastgasp-vm: "));
    if let Some(l) = last {
        let step = l.text.split("lastgasp-vm: ").nth(1).unwrap_or("");
        // After the runner's clock: "<ns> STEP ...".
        let step = step.split_once(' ').map_or(step, |(_, s)| s);
        why.push_str(&format!(
            "; the runner's last step at +{:.0} s: {}",
            l.t.as_secs_f64(),
            step.trim()
        ));
    }
    let lockups = run
        .console
        .iter()
        .filter(|l| l.text.contains("soft lockup"))
        .count();
    if lockups > 0 {
        why.push_str(&format!("; {lockups} soft lockups"));
    }
    match &run.exit {
        Exit::Killed(r) => why.push_str(&format!(
            "; the harness ended it at +{:.0} s: {r}",
            run.exit_t.as_secs_f64()
        )),
        Exit::Halted => why.push_str("; the guest halted"),
        Exit::Exited(st) => why.push_str(&format!(
            "; qemu ended at +{:.0} s ({st})",
            run.exit_t.as_secs_f64()
        )),
    }
    why
}

/// The workloads that ran on the node at the trigger: (name, uid).
fn workload_pods(seen: &Seen) -> Vec<(String, String)> {
    let mut pods: Vec<(String, String)> = Vec::new();
    for l in seen
        .lines
        .iter()
        .filter(|l| l["kind"] == "Pod" && seen.rel(l) <= 0.0)
    {
        let p = &l["obj"];
        if p["ns"] == "default" && p["node"] == NODE {
            let key = (
                p["name"].as_str().unwrap_or_default().to_string(),
                p["uid"].as_str().unwrap_or_default().to_string(),
            );
            if l["event"] == "delete" {
                pods.retain(|x| x != &key);
            } else if !pods.contains(&key) {
                pods.push(key);
            }
        }
    }
    pods
}

/// How each workload ended, and its replacement elsewhere.
fn pod_fates(seen: &Seen, pods: &[(String, String)], o: &mut NodeOutcome) {
    let end_rel = seen.end_rel();
    let mut ended = Vec::new();
    let mut replaced = Vec::new();
    for (name, uid) in pods {
        let mine: Vec<&Value> = seen
            .lines
            .iter()
            .filter(|l| l["kind"] == "Pod" && l["obj"]["uid"] == uid.as_str() && seen.rel(l) > 0.0)
            .collect();
        let first = |f: &dyn Fn(&Value) -> bool| mine.iter().find(|l| f(l)).map(|l| seen.rel(l));
        let deleting = first(&|l| l["obj"]["deleting"] == true);
        // The kubelet's own shutdown ends a pod by its phase: Failed, or
        // Succeeded when its containers exit 0 on SIGTERM.
        let terminal =
            |l: &Value| l["obj"]["phase"] == "Failed" || l["obj"]["phase"] == "Succeeded";
        let failed = first(&|l| terminal(l));
        let deleted = first(&|l| l["event"] == "delete");
        let app = name.split('-').next().unwrap_or(name);
        let mut s = format!("{app}:");
        if let Some(t) = failed {
            let end = mine.iter().find(|l| terminal(l)).map(|l| &l["obj"]);
            let phase = end.and_then(|p| p["phase"].as_str()).unwrap_or("?");
            let reason = end.and_then(|p| p["reason"].as_str()).unwrap_or("");
            let _ = write!(s, " {phase} ({reason}) +{t:.1}");
        }
        if let Some(t) = deleting {
            let _ = write!(s, " deletion +{t:.1}");
        }
        if let Some(t) = deleted {
            let _ = write!(s, " gone +{t:.1}");
        }
        if failed.is_none() && deleting.is_none() && deleted.is_none() {
            s.push_str(" untouched");
        }
        // Its state when the node died (or at the end).
        let last_before = mine
            .iter()
            .rev()
            .find(|l| seen.rel(l) <= end_rel)
            .map(|l| &l["obj"]);
        match (deleted.is_some_and(|t| t <= end_rel), last_before) {
            (true, _) => s.push_str(" (gone before the node)"),
            (false, Some(p)) if p["deleting"] == true => s.push_str(" (Terminating at the end)"),
            (false, Some(p)) => {
                let _ = write!(s, " ({} at the end)", p["phase"].as_str().unwrap_or("?"));
            }
            (false, None) => s.push_str(" (Running at the end)"),
        }
        ended.push(s);
        // Its replacement: a pod of the same app Running on another node.
        let rep = seen.lines.iter().find(|l| {
            l["kind"] == "Pod"
                && seen.rel(l) > 0.0
                && l["obj"]["ns"] == "default"
                && l["obj"]["uid"] != uid.as_str()
                && l["obj"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(&format!("{app}-")))
                && l["obj"]["node"].as_str().is_some_and(|n| n != NODE)
                && l["obj"]["phase"] == "Running"
        });
        replaced.push(match rep {
            Some(l) => format!("{app} +{:.1}", seen.rel(l)),
            None => format!("{app} none"),
        });
    }
    if pods.len() < WORKLOADS {
        o.problems.push(format!(
            "{} of {WORKLOADS} workload pods were on the node at the trigger",
            pods.len()
        ));
    }
    o.pods = ended.join("; ");
    o.replaced = replaced.join("; ");
}

/// When the controller fenced the node, against the kernel's end and the
/// writer's last write: never a fence before either.
fn fence(seen: &Seen, o: &mut NodeOutcome) -> Option<f64> {
    let end_rel = seen.end_rel();
    let fenced = seen
        .lines
        .iter()
        .find(|l| {
            l["kind"] == "Node"
                && l["obj"]["name"] == NODE
                && seen.rel(l) > 0.0
                && l["obj"]["taints"].as_array().is_some_and(|t| {
                    t.iter().any(|t| {
                        t.as_str().is_some_and(|t| {
                            t.starts_with(lastgasp_common::names::OUT_OF_SERVICE_KEY)
                        })
                    })
                })
        })
        .map(|l| seen.rel(l));
    if let Some(f) = fenced {
        o.at_death
            .push_str(&format!("; fenced (out-of-service) +{f:.1}"));
    }
    // The writer's last write before the kernel's end (a reboot's next boot
    // starts it again).
    let last_write = seen
        .run
        .markers(&format!("WRITE {WRITER} "))
        .into_iter()
        .map(|l| seen.secs(at(seen.run, l.t)))
        .filter(|t| *t <= end_rel)
        .fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.max(t))));
    let show = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:+.1} s"));
    o.fence = format!(
        "fenced {}; kernel's end {}; {WRITER}'s last write {}",
        fenced.map_or("never".to_string(), |f| format!("{f:+.1} s")),
        show(seen.end_s),
        show(last_write)
    );
    if let Some(f) = fenced {
        if seen.end_s.is_none_or(|e| f < e) {
            o.problems.push(format!(
                "FENCED BEFORE THE KERNEL'S END: fenced +{f:.1} s, down {}",
                show(seen.end_s)
            ));
        }
        if last_write.is_some_and(|w| f < w) {
            o.problems.push(format!(
                "FENCED WHILE {WRITER} STILL WROTE: fenced +{f:.1} s, its last write {}",
                show(last_write)
            ));
        }
    }
    if last_write.is_none() {
        o.problems.push(format!("no write of {WRITER} was seen"));
    }
    fenced
}

/// The Node's Events after the trigger, by reason and source, noise left out.
fn node_events(seen: &Seen) -> String {
    let mut evs: Vec<String> = Vec::new();
    for l in seen
        .lines
        .iter()
        .filter(|l| l["kind"] == "Event" && seen.rel(l) > 0.0)
    {
        let e = &l["obj"];
        if !e["object"].as_str().is_some_and(|x| x.starts_with("Node/"))
            || NOISE.contains(&e["reason"].as_str().unwrap_or_default())
        {
            continue;
        }
        let s = format!(
            "{} ({}) +{:.1}",
            e["reason"].as_str().unwrap_or("?"),
            e["source"].as_str().unwrap_or("?"),
            seen.rel(l)
        );
        if !evs
            .iter()
            .any(|x| x.split(" +").next() == s.split(" +").next())
        {
            evs.push(s);
        }
    }
    if evs.is_empty() {
        "none".into()
    } else {
        evs.join("; ")
    }
}

/// Where the agent's container (and the kubelet) died, against the last
/// write the API server saw while it lived (a change to the Node or a pod
/// deletion).
fn agent_end(seen: &Seen, with_agent: bool) -> String {
    let end_rel = seen.end_rel();
    let at_or_kernel = |t: Option<f64>| {
        t.map(|t| format!("+{t:.2} s"))
            .unwrap_or_else(|| with_kernel(seen.end_s))
    };
    if !with_agent {
        return format!("kubelet gone {}", at_or_kernel(seen.gone("kubelet")));
    }
    let gone_agent = seen.gone("agent");
    let last_write = seen
        .lines
        .iter()
        .filter(|l| seen.rel(l) > 0.0 && seen.rel(l) <= gone_agent.unwrap_or(end_rel).min(end_rel))
        .filter(|l| {
            (l["kind"] == "Node" && l["obj"]["name"] == NODE)
                || (l["kind"] == "Pod" && l["obj"]["deleting"] == true)
        })
        .map(|l| seen.rel(l))
        .fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.max(t))));
    format!(
        "container gone {}; kubelet gone {}; last Node/pod change seen before it {}",
        at_or_kernel(gone_agent),
        at_or_kernel(seen.gone("kubelet")),
        last_write
            .map(|t| format!("+{t:.2} s"))
            .unwrap_or_else(|| "none".into())
    )
}

/// What ended when nothing stopped it before the kernel did.
fn with_kernel(end_s: Option<f64>) -> String {
    match end_s {
        Some(e) => format!("with the kernel (+{e:.2} s)"),
        None => "never (alive at the end)".into(),
    }
}

fn node_text(n: &Value) -> String {
    let conds: Vec<String> = n["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            format!(
                "{}={}{}",
                c["type"].as_str().unwrap_or("?"),
                c["status"].as_str().unwrap_or("?"),
                c["reason"]
                    .as_str()
                    .map(|r| format!("/{r}"))
                    .unwrap_or_default()
            )
        })
        .collect();
    let taints: Vec<&str> = n["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str())
        .collect();
    let rec = match &n["record"] {
        Value::Null => "no record".to_string(),
        r => format!(
            "record {} via {}{}{}",
            r["kind"].as_str().unwrap_or("?"),
            r["source"].as_str().unwrap_or("?"),
            r["proof"]
                .as_str()
                .map(|p| format!(", proof {p}"))
                .unwrap_or_default(),
            match r["closed"].as_str() {
                Some(how) => format!(", closed {how}"),
                None => String::new(),
            }
        ),
    };
    format!(
        "{}; taints [{}]; {rec}",
        conds.join(", "),
        taints.join(", ")
    )
}

/// The comparison table (docs/testing.md).
pub fn matrix(outcomes: &[NodeOutcome]) -> String {
    let mut m = String::new();
    let _ = writeln!(
        m,
        "| arm | scenario | the agent | the fence, the kernel's end and the slow writer's last write | workload pods on the node: how each ended, s after the trigger, and its state when the node went down | replacements Running on the other node | the Node when the node went down | after it came back | where the agent's container and the kubelet ended | Node Events | the ledger's object and its endings (s after the trigger) | guest | result |"
    );
    let _ = writeln!(m, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for o in outcomes {
        let _ = writeln!(
            m,
            "| {} | `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            o.arm,
            o.trigger,
            o.ran_as,
            o.fence,
            o.pods,
            o.replaced,
            o.at_death,
            o.after,
            o.agent_end,
            o.events,
            o.ledger,
            o.guest,
            if o.failed() {
                format!("**FAIL**: {}", o.problems.join("; "))
            } else {
                "ran".into()
            }
        );
    }
    m
}

/// Writes `text` to `path` and says so.
pub fn write_matrix(path: &Path, text: &str) -> Result<()> {
    let mut f = fs::File::create(path)?;
    f.write_all(text.as_bytes())?;
    println!("vm-test: real-node matrix written to {}", path.display());
    Ok(())
}
