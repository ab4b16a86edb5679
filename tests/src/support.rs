use std::{
    collections::VecDeque,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    time::Duration,
};

use lastgasp::{
    detect::ebpf::EbpfDetector,
    node::NodePidNs,
    signal::{Actor, Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};

/// Tests that need root (to load eBPF) call this first; without it they print
/// why they are skipped and return `false`. They never pass silently.
pub fn can_load_ebpf(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED {test}: needs root to load eBPF programs");
        return false;
    }
    true
}

/// `lastgasp-trigger`, built beside the test or bench binary that calls this.
pub fn trigger_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join("lastgasp-trigger")
}

/// The agent binary built by `cargo xtask` (LASTGASP_BIN), else the default
/// debug build.
pub fn agent_bin() -> PathBuf {
    std::env::var_os("LASTGASP_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/debug/lastgasp"
            ))
        })
}

pub fn trigger(args: &[&str]) -> Command {
    let mut cmd = Command::new(trigger_bin());
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// A trigger that runs something as PID 1 of a fresh PID namespace: its
/// global pid (the "init N" line), and the rest of its output.
pub struct PidNsChild {
    pub child: Child,
    pub init_pid: u32,
    out: BufReader<ChildStdout>,
}

impl PidNsChild {
    pub fn spawn(args: &[&str]) -> PidNsChild {
        let mut child = trigger(args).spawn().expect("spawn lastgasp-trigger");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let init_pid = line
            .trim()
            .strip_prefix("init ")
            .unwrap_or_else(|| panic!("trigger said {line:?}"))
            .parse()
            .unwrap();
        PidNsChild {
            child,
            init_pid,
            out,
        }
    }

    /// How the namespace's init ended ("signal SIGINT", "exit 0"...).
    pub fn ended(mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        self.child.wait().unwrap();
        line.trim()
            .strip_prefix("ended ")
            .unwrap_or(line.trim())
            .to_string()
    }

    pub fn pidns_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/pid", self.init_pid))
    }
}

pub fn load(node: NodePidNs) -> Signals {
    Signals::new(EbpfDetector::load(node).expect("loading the eBPF detector"))
}

/// Reads a detector's signals in order, keeping those not yet asked for.
pub struct Signals {
    pub det: EbpfDetector,
    pending: VecDeque<ShutdownSignal>,
}

impl Signals {
    pub fn new(det: EbpfDetector) -> Signals {
        Signals {
            det,
            pending: VecDeque::new(),
        }
    }

    /// The first signal matching `pred` within 5 s (earlier ones are
    /// dropped); panics with what was seen.
    pub async fn wait_for(
        &mut self,
        what: &str,
        pred: impl Fn(&ShutdownSignal) -> bool,
    ) -> ShutdownSignal {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            while let Some(s) = self.pending.pop_front() {
                if pred(&s) {
                    return s;
                }
                seen.push(s);
            }
            match tokio::time::timeout_at(deadline, self.det.next_batch()).await {
                Ok(batch) => self.pending.extend(batch.expect("ring buffer")),
                Err(_) => panic!("no signal for {what} within 5 s; saw {seen:#?}"),
            }
        }
    }
}

/// Copies /usr/bin/true under a tool's name into `dir`: a harmless stand-in
/// whose exec looks like the tool's.
pub fn stand_in(dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    if !path.exists() {
        std::fs::copy("/usr/bin/true", &path).expect("copying /usr/bin/true");
    }
    path
}

/// A `systemctl poweroff` as logind announces it (PrepareForShutdown), with
/// 30 s of delay lock.
pub fn logind_signal() -> ShutdownSignal {
    ShutdownSignal {
        source: Source::Logind,
        kind: Kind::Poweroff,
        forced: false,
        bypasses_logind: false,
        calls_reboot: false,
        scope: Scope::Node,
        effect: Effect::Now,
        actor: None,
        sender: None,
        at: std::time::SystemTime::now(),
        boot_ns: 0,
        deadline: Some(std::time::SystemTime::now() + Duration::from_secs(30)),
        detail: Detail::Dbus {
            member: "PrepareForShutdown".into(),
            unit: None,
        },
    }
}

/// A two-worker runtime for the tests on the real control plane.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A `reboot -ff` as the exec hook reports it: forced, node scope, now.
pub fn forced_exec() -> ShutdownSignal {
    ShutdownSignal {
        source: Source::Exec,
        kind: Kind::Reboot,
        forced: true,
        bypasses_logind: true,
        calls_reboot: false,
        scope: Scope::Node,
        effect: Effect::Now,
        actor: Some(Actor {
            pid: 1,
            comm: "reboot".into(),
            ..Default::default()
        }),
        sender: None,
        at: std::time::SystemTime::now(),
        boot_ns: 0,
        deadline: None,
        detail: Detail::Exec {
            path: "/sbin/reboot".into(),
            argv: vec!["reboot".into(), "-ff".into()],
            raw: String::new(),
            truncated: false,
        },
    }
}

/// The agent's cluster clients as `run` starts them against the API double:
/// the node's warm watches and the last gasp's two warm connections.
pub async fn warm_clients(
    double: &lastgasp_apidouble::ApiDouble,
    node: &str,
) -> (
    lastgasp::act::kube::NodeClient,
    lastgasp::act::kube::lastgasp::LastGasp,
) {
    let nc = lastgasp::act::kube::NodeClient::start(double.client_without_retry().await, node)
        .await
        .expect("node client");
    let lg = lastgasp::act::kube::lastgasp::LastGasp::start(
        double.client_without_retry().await,
        double.client_without_retry().await,
        node,
    )
    .await
    .expect("last gasp clients");
    (nc, lg)
}

/// An agent of boot `boot` with its audit log in `dir` (default metrics, no
/// logind, not printing).
pub fn agent_at(
    dir: &Path,
    boot: &str,
    cluster: Option<std::sync::Arc<lastgasp::agent::Cluster>>,
) -> lastgasp::agent::Agent {
    lastgasp::agent::Agent::new(
        lastgasp::act::audit::AuditLog::open(dir, boot).unwrap(),
        cluster,
        None,
        lastgasp::act::metrics::Metrics::default(),
        false,
    )
}
