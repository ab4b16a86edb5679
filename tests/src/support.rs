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
    signal::{Actor, Detail, Kind, ShutdownSignal, Source},
};

/// Tests that need root (to load eBPF) call this first; without it they print
/// why they are skipped and return `false`. They never pass silently.
/// A free loopback port below the kernel's ephemeral range, for a server
/// that starts after its clients already try it: a client retrying an
/// ephemeral port where nothing listens can connect to itself (TCP's
/// simultaneous open on loopback) and hold the port.
pub fn port_below_ephemeral_range() -> u16 {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000)).max(1);
    let start = 10_000 + (std::process::id() % span) as u16;
    (0..span)
        .map(|i| 10_000 + ((u32::from(start - 10_000) + i) % span) as u16)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free loopback port below the ephemeral range")
}

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
    let now = std::time::SystemTime::now();
    ShutdownSignal::of(Source::Logind, Kind::Poweroff)
        .without_sender()
        .at(now)
        .deadline(now + Duration::from_secs(30))
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
    ShutdownSignal::of(Source::Exec, Kind::Reboot)
        .forced(true)
        .at(std::time::SystemTime::now())
        .by(Actor {
            pid: 1,
            comm: "reboot".into(),
            borrowed: Some(false),
            ..Default::default()
        })
        .detail(Detail::Exec {
            path: "/sbin/reboot".into(),
            binary: None,
            argv: vec!["reboot".into(), "-ff".into()],
            raw: String::new(),
            truncated: false,
        })
}

/// The agent's cluster clients as `run` starts them against the API double:
/// the node's warm watches and the last gasp's two warm connections.
pub async fn warm_clients(
    double: &lastgasp_apidouble::ApiDouble,
    node: &str,
) -> (
    lastgasp::act::kube::NodeClient,
    lastgasp::act::last_gasp::LastGasp,
) {
    let nc = lastgasp::act::kube::NodeClient::start(double.client_without_retry().await, node)
        .await
        .expect("node client");
    (nc, last_gasp_clients(double, node).await)
}

/// The last gasp's two warm connections to the API double, as `run` opens
/// them.
pub async fn last_gasp_clients(
    double: &lastgasp_apidouble::ApiDouble,
    node: &str,
) -> lastgasp::act::last_gasp::LastGasp {
    lastgasp::act::last_gasp::LastGasp::start(
        double.client_without_retry().await,
        double.client_without_retry().await,
        node,
    )
    .await
    .expect("last gasp clients")
}

/// An agent of boot `boot` with its audit log in `dir` (default metrics, no
/// logind, not printing).
pub fn agent_at(
    dir: &Path,
    boot: &str,
    cluster: Option<std::sync::Arc<lastgasp::act::Cluster>>,
) -> lastgasp::agent::Agent {
    lastgasp::agent::Agent::new(
        lastgasp::act::audit::AuditLog::open(dir, boot).unwrap(),
        cluster,
        None,
        lastgasp::act::metrics::Metrics::default(),
    )
}

/// The agent's record of `sig` in `boot`, as `Agent::record` writes it (its
/// episode, with the proof of death `sig` carries, from the decision core).
pub fn record_of(boot: &str, sig: &ShutdownSignal) -> lastgasp::record::ShutdownRecord {
    lastgasp::record::after(boot, std::slice::from_ref(sig))
}

/// A caller that can reboot: uid 0 with CAP_SYS_BOOT, in the node's PID
/// namespace.
pub fn capable(pid: u32, comm: &str) -> Actor {
    Actor {
        pid,
        ns_pid: pid,
        comm: comm.into(),
        uid: 0,
        euid: Some(0),
        cap_sys_boot: Some(true),
        borrowed: Some(false),
        ..Default::default()
    }
}

/// The kernel's power-off as the reboot(2) hook reports it, from PID 1
/// (systemd-shutdown's last step): the proof of death.
pub fn kernel_poweroff() -> ShutdownSignal {
    ShutdownSignal::of(Source::RebootSyscall, Kind::Poweroff)
        .at(std::time::SystemTime::now())
        .by(capable(1, "systemd-shutdow"))
}

/// `poweroff -f` by root: the tool calls reboot(2) itself (a direct tool's
/// proof: fenced once the kubelet is silent).
pub fn direct_poweroff() -> ShutdownSignal {
    ShutdownSignal::of(Source::Exec, Kind::Poweroff)
        .forced(true)
        .calling_reboot()
        .at(std::time::SystemTime::now())
        .by(capable(4242, "poweroff"))
        .detail(Detail::Exec {
            path: "/usr/sbin/poweroff".into(),
            binary: None,
            argv: vec!["poweroff".into(), "-f".into()],
            raw: "poweroff\\0-f\\0".into(),
            truncated: false,
        })
}

/// Sets `rec` as `node`'s record in the double, as if the agent had written
/// it at server time `written` (the record's managedFields entry), the
/// Node's boot `boot` and its Ready `ready`.
pub fn put_record(
    double: &lastgasp_apidouble::ApiDouble,
    node: &str,
    rec: &lastgasp::record::ShutdownRecord,
    written: std::time::SystemTime,
) {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};
    let stamp = Time(k8s_openapi::jiff::Timestamp::try_from(written).unwrap());
    double
        .modify::<k8s_openapi::api::core::v1::Node, _>("", node, |n| {
            let ann = n.metadata.annotations.get_or_insert_with(Default::default);
            ann.insert(lastgasp::record::RECORD_ANNOTATION.into(), rec.to_json());
            match rec.proof_mark() {
                Some(p) => ann.insert(lastgasp::record::PROOF_ANNOTATION.into(), p),
                None => ann.remove(lastgasp::record::PROOF_ANNOTATION),
            };
            let mf = n
                .metadata
                .managed_fields
                .get_or_insert_with(Default::default);
            mf.retain(|m| m.manager.as_deref() != Some(lastgasp::record::RECORD_MANAGER));
            mf.push(ManagedFieldsEntry {
                manager: Some(lastgasp::record::RECORD_MANAGER.into()),
                operation: Some("Update".into()),
                api_version: Some("v1".into()),
                time: Some(stamp),
                ..Default::default()
            });
        })
        .unwrap();
}

/// The kubelet's Lease of `node` in `kube-node-lease`, last written at
/// server time `written` (created, or rewritten).
pub fn put_lease(
    double: &lastgasp_apidouble::ApiDouble,
    node: &str,
    written: std::time::SystemTime,
) {
    let time = humantime::format_rfc3339_seconds(written).to_string();
    let _ = double.create_value(serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "kube-node-lease"}}));
    let lease = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": node, "namespace": "kube-node-lease",
            "managedFields": [{"manager": "kubelet", "operation": "Update",
                "apiVersion": "coordination.k8s.io/v1", "time": time}]},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": 40}
    });
    let want: k8s_openapi::api::coordination::v1::Lease =
        serde_json::from_value(lease.clone()).unwrap();
    if double
        .get::<k8s_openapi::api::coordination::v1::Lease>("kube-node-lease", node)
        .is_some()
    {
        double
            .modify::<k8s_openapi::api::coordination::v1::Lease, _>("kube-node-lease", node, |l| {
                l.metadata.managed_fields = want.metadata.managed_fields.clone();
            })
            .unwrap();
    } else {
        double.create_value(lease).unwrap();
    }
}

/// kill(2): `sig` to `pid` (real-time signals included, which nix's
/// `Signal` does not name).
#[allow(unsafe_code)] // plain FFI; no safe wrapper takes a real-time signal
pub fn send_signal(pid: impl TryInto<i32>, sig: i32) {
    let pid = pid.try_into().ok().expect("a pid fits an i32");
    // SAFETY: kill(2) takes plain integers.
    unsafe { libc::kill(pid, sig) };
}
