//! `lastgasp check`: the node preflight. Prints one table (kernel, hooks,
//! BTF, privileges, D-Bus and logind, API permissions) and exits 1 when
//! something required is missing; warnings say what works with less.
//!
//! It changes nothing that lasts: the eBPF programs are loaded with the real
//! loader and dropped again (which detaches them), the logind delay lock is
//! closed at once, the SelfSubjectAccessReviews are not stored by the API
//! server. Only tracefs is mounted if it was not, as `lastgasp run` would.
use std::{fmt, path::Path, time::Duration};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use zbus::Connection;

use crate::{
    act::kube::graceful::Removal,
    detect::{
        dbus::{self, DbusArgs, LOGIND, SYSTEMD, SYSTEMD_MANAGER, SYSTEMD_PATH},
        ebpf::{EbpfDetector, HookState},
        logind::{self, secs, Setting, DROPIN_NAME},
    },
    node::{self, CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Info,
    /// Works, with less (a hook, a detector or a detail missing).
    Warn,
    /// Required and missing: the check exits 1.
    Fail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Section {
    Kernel,
    Hooks,
    Privileges,
    Dbus,
    Cluster,
}

impl Section {
    fn name(self) -> &'static str {
        match self {
            Section::Kernel => "kernel",
            Section::Hooks => "hooks",
            Section::Privileges => "privileges",
            Section::Dbus => "dbus",
            Section::Cluster => "cluster",
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct CheckArgs {
    /// The node runs the agent standalone: skip the cluster permissions.
    #[arg(long, env = "LASTGASP_STANDALONE")]
    pub standalone: bool,
    /// Only these sections (comma-separated): kernel, hooks, privileges,
    /// dbus, cluster.
    #[arg(long, value_enum, value_delimiter = ',', env = "LASTGASP_ONLY")]
    pub only: Vec<Section>,
    /// Do not load the eBPF programs: predict the hooks from tracefs, the
    /// kprobe PMU and BTF only.
    #[arg(long, env = "LASTGASP_NO_LOAD")]
    pub no_load: bool,
    /// The agent's configuration: the logind delay its grace periods need
    /// (unless --inhibit-delay is given).
    #[arg(long, env = "LASTGASP_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub dbus: DbusArgs,
}

#[derive(Clone, Debug)]
pub struct Line {
    pub section: &'static str,
    pub status: Status,
    pub what: String,
    pub text: String,
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub lines: Vec<Line>,
    section: &'static str,
}

impl Report {
    fn push(&mut self, status: Status, what: impl Into<String>, text: impl Into<String>) {
        self.lines.push(Line {
            section: self.section,
            status,
            what: what.into(),
            text: text.into(),
        });
    }

    pub fn failures(&self) -> usize {
        self.count(Status::Fail)
    }

    pub fn count(&self, s: Status) -> usize {
        self.lines.iter().filter(|l| l.status == s).count()
    }

    pub fn line(&self, what: &str) -> Option<&Line> {
        self.lines.iter().find(|l| l.what == what)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "lastgasp check: node preflight (FAIL: required and missing; WARN: works with less)"
        )?;
        let w = self
            .lines
            .iter()
            .map(|l| l.what.len())
            .max()
            .unwrap_or(0)
            .max(14);
        writeln!(f, "  {:<5} {:<10} {:<w$} detail", "", "section", "check")?;
        for l in &self.lines {
            let status = match l.status {
                Status::Ok => "ok",
                Status::Info => "info",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            writeln!(
                f,
                "  {status:<5} {:<10} {:<w$} {}",
                l.section, l.what, l.text
            )?;
        }
        let warns = self.count(Status::Warn);
        match self.failures() {
            0 if warns == 0 => writeln!(f, "result: ok"),
            0 => writeln!(f, "result: ok, with {warns} warning{}", plural(warns)),
            n => writeln!(
                f,
                "result: FAIL: {n} required item{} missing or refused",
                plural(n)
            ),
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// Prints the report; the exit code is 1 when something required is missing.
pub async fn main(args: &CheckArgs) -> i32 {
    let report = check_node(args).await;
    print!("{report}");
    i32::from(report.failures() > 0)
}

pub async fn check_node(args: &CheckArgs) -> Report {
    let mut r = Report::default();
    let want = |s: Section| args.only.is_empty() || args.only.contains(&s);
    let caps = node::effective_caps().ok();
    let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    let config = args.config.as_ref().map(|p| crate::config::Config::load(p));
    if let Some(Err(e)) = &config {
        r.section = "config";
        r.push(Status::Fail, "file", format!("{e:#}"));
    }
    let config = config.and_then(|c| c.ok());
    if let Some(c) = &config {
        r.section = "config";
        match c.kubelet_graceful_shutdown() {
            Ok(Some(on)) => r.push(Status::Fail, "kubelet", on),
            Ok(None) if c.kubelet_config_path.is_some() => r.push(
                Status::Ok,
                "kubelet",
                "the kubelet's graceful node shutdown is off",
            ),
            Ok(None) => {}
            Err(e) => r.push(Status::Fail, "kubelet", format!("{e:#}")),
        }
    }
    if want(Section::Kernel) {
        r.section = Section::Kernel.name();
        kernel_checks(&mut r);
    }
    if want(Section::Privileges) {
        r.section = Section::Privileges.name();
        privilege_checks(&mut r, caps, paranoid);
    }
    if want(Section::Hooks) {
        r.section = Section::Hooks.name();
        hook_checks(&mut r, args.no_load, caps);
    }
    if want(Section::Dbus) {
        r.section = Section::Dbus.name();
        if args.dbus.no_dbus {
            r.push(Status::Info, "system bus", "--no-dbus: skipped");
        } else {
            let mut dbus = args.dbus.clone();
            if dbus.inhibit_delay.is_none() {
                if let Some(c) = &config {
                    match c.buckets() {
                        Ok(b) => dbus.inhibit_delay = Some(crate::grace::requested_delay(&b)),
                        Err(e) => r.push(Status::Fail, "config", format!("{e:#}")),
                    }
                }
            }
            dbus_checks(&mut r, &dbus).await;
        }
    }
    if want(Section::Cluster) {
        r.section = Section::Cluster.name();
        if args.standalone {
            r.push(Status::Info, "permissions", "--standalone: skipped");
        } else {
            match kube::Config::infer().await {
                Ok(mut c) => {
                    c.default_retry = false;
                    let url = c.cluster_url.to_string();
                    match kube::Client::try_from(c) {
                        Ok(client) => {
                            let evict = config.as_ref().is_some_and(|c| c.pod_removal == Removal::Evict);
                            permission_checks(&mut r, &client, &url, evict).await
                        }
                        Err(e) => r.push(Status::Fail, "permissions", format!("a client for {url}: {e}")),
                    }
                }
                Err(e) => r.push(
                    Status::Fail,
                    "cluster",
                    format!(
                        "cluster mode cannot start: no Kubernetes configuration (not in a pod, no $KUBECONFIG or ~/.kube/config): {e}; \
                         run with --standalone for a node without a cluster"
                    ),
                ),
            }
            if args.config.is_none() {
                r.push(
                    Status::Fail,
                    "config",
                    "cluster mode cannot start: it needs --config (the grace periods, at least)",
                );
            }
            let node = config
                .as_ref()
                .and_then(|c| c.node_name.clone())
                .or_else(|| std::env::var("NODE_NAME").ok());
            if node.is_none() {
                r.push(
                    Status::Fail,
                    "node name",
                    "cluster mode cannot start: no node name (nodeName in the config, or $NODE_NAME)",
                );
            }
        }
    }
    r
}

/// The graceful-shutdown part alone (D-Bus and logind), as before.
pub async fn check(args: &DbusArgs) -> Report {
    let mut r = Report {
        section: Section::Dbus.name(),
        ..Report::default()
    };
    dbus_checks(&mut r, args).await;
    r
}

const TRACEPOINTS: &[(&str, &str, bool)] = &[
    ("syscalls", "sys_enter_reboot", true),
    ("sched", "sched_process_exec", false),
    ("signal", "signal_generate", false),
];

fn tracefs() -> Option<&'static str> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .find(|p| Path::new(p).join("events").is_dir())
}

/// Where tracefs is mounted (from /proc/self/mounts), readable or not:
/// tracefs is root-only, so without privileges it cannot be looked into.
fn tracefs_mounted() -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_, at, fstype) = (f.next()?, f.next()?, f.next()?);
        (fstype == "tracefs").then(|| at.to_string())
    })
}

fn kernel_checks(r: &mut Report) {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    match read("/proc/sys/kernel/osrelease") {
        Ok(rel) => r.push(
            Status::Info,
            "version",
            format!(
                "Linux {rel} {} ({})",
                std::env::consts::ARCH,
                read("/proc/sys/kernel/version").unwrap_or_default()
            ),
        ),
        Err(e) => r.push(
            Status::Warn,
            "version",
            format!("/proc/sys/kernel/osrelease: {e}"),
        ),
    }
    let mut fs = tracefs();
    let unreadable = if fs.is_none() {
        tracefs_mounted()
    } else {
        None
    };
    if let Some(at) = &unreadable {
        r.push(
            Status::Warn,
            "tracefs",
            format!("mounted at {at} but not readable here (root only): the tracepoints cannot be looked up"),
        );
    } else if fs.is_none() {
        match node::ensure_tracefs() {
            Ok(_) => {
                fs = tracefs();
                r.push(
                    Status::Ok,
                    "tracefs",
                    "was not mounted: mounted it at /sys/kernel/tracing, as `lastgasp run` does",
                );
            }
            Err(e) => r.push(Status::Fail, "tracefs", format!("{e:#}")),
        }
    } else {
        r.push(Status::Ok, "tracefs", fs.unwrap_or_default());
    }
    if let Some(fs) = fs {
        for (cat, name, required) in TRACEPOINTS {
            let dir = Path::new(fs).join("events").join(cat).join(name);
            let what = format!("tracepoint {cat}/{name}");
            if dir.is_dir() {
                r.push(Status::Ok, what, "present");
            } else if *required {
                r.push(
                    Status::Fail,
                    what,
                    format!("missing ({}): lastgasp cannot see reboot(2)", dir.display()),
                );
            } else {
                r.push(Status::Warn, what, format!("missing ({})", dir.display()));
            }
        }
    }
    // aya attaches kprobes through the perf `kprobe` PMU.
    let pmu = Path::new("/sys/bus/event_source/devices/kprobe");
    let events = fs.map(|f| Path::new(f).join("kprobe_events"));
    if pmu.is_dir() {
        r.push(
            Status::Ok,
            "kprobes",
            format!("supported ({} present)", pmu.display()),
        );
    } else {
        r.push(
            Status::Warn,
            "kprobes",
            format!(
                "not supported: no {}{} (CONFIG_KPROBES off?); the kernel power-off hooks need fentry",
                pmu.display(),
                match &events {
                    Some(e) if !e.exists() => format!(", no {}", e.display()),
                    _ => String::new(),
                }
            ),
        );
    }
    let btf = Path::new("/sys/kernel/btf/vmlinux");
    match std::fs::metadata(btf) {
        Ok(m) => r.push(
            Status::Ok,
            "BTF",
            format!("{} ({} KiB)", btf.display(), m.len() / 1024),
        ),
        Err(e) => r.push(
            Status::Warn,
            "BTF",
            format!(
                "{}: {e}: no fentry, no argv at exec, no parents in the kernel",
                btf.display()
            ),
        ),
    }
    match crate::detect::ebpf::TaskOffsets::from_btf(&btf.to_string_lossy()) {
        Ok(o) => r.push(
            Status::Ok,
            "task offsets",
            format!(
                "task_struct.mm +{}, .real_parent +{}, .tgid +{}, .comm +{}; mm_struct.arg_start +{}, .arg_end +{}",
                o.task_mm, o.task_real_parent, o.task_tgid, o.task_comm, o.mm_arg_start, o.mm_arg_end
            ),
        ),
        Err(e) => r.push(
            Status::Warn,
            "task offsets",
            format!("not resolved ({e:#}): exec signals without argv, actors without parent"),
        ),
    }
    match std::fs::read_to_string("/sys/kernel/security/lockdown") {
        Ok(l) => r.push(Status::Info, "lockdown", l.trim().to_string()),
        Err(_) => r.push(
            Status::Info,
            "lockdown",
            "unknown (securityfs not mounted or no lockdown LSM)",
        ),
    }
}

const CAPS: &[(u32, &str)] = &[
    (CAP_BPF, "CAP_BPF"),
    (CAP_PERFMON, "CAP_PERFMON"),
    (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"),
];

fn privilege_checks(r: &mut Report, caps: Option<u64>, paranoid: Option<i32>) {
    let Some(caps) = caps else {
        r.push(
            Status::Fail,
            "CapEff",
            "cannot read CapEff from /proc/self/status",
        );
        return;
    };
    let held: Vec<&str> = CAPS
        .iter()
        .filter(|(c, _)| node::has_cap(caps, *c))
        .map(|(_, n)| *n)
        .collect();
    r.push(
        Status::Info,
        "CapEff",
        format!(
            "{caps:016x} (of those needed: {})",
            if held.is_empty() {
                "none".into()
            } else {
                held.join(", ")
            }
        ),
    );
    match paranoid {
        Some(p) => r.push(
            Status::Info,
            "perf_paranoid",
            format!(
                "kernel.perf_event_paranoid = {p}{}",
                if p >= 3 {
                    ": attaching tracepoints needs CAP_SYS_ADMIN"
                } else {
                    ""
                }
            ),
        ),
        None => r.push(
            Status::Warn,
            "perf_paranoid",
            "cannot read /proc/sys/kernel/perf_event_paranoid",
        ),
    }
    let has = |c| node::has_cap(caps, c);
    let admin = has(CAP_SYS_ADMIN);
    for (cap, name, why) in [
        (CAP_BPF, "CAP_BPF", "loading the eBPF programs and maps"),
        (CAP_PERFMON, "CAP_PERFMON", "attaching tracing programs"),
    ] {
        if has(cap) {
            r.push(Status::Ok, name, format!("held: {why}"));
        } else if admin {
            r.push(
                Status::Warn,
                name,
                format!("missing, CAP_SYS_ADMIN stands in (kernels before 5.8): {why}"),
            );
        } else {
            r.push(Status::Fail, name, format!("missing: needed for {why}"));
        }
    }
    let need_admin = paranoid.is_some_and(|p| p >= 3);
    match (admin, need_admin) {
        (true, _) => r.push(Status::Ok, "CAP_SYS_ADMIN", "held: tracepoint attach where perf_event_paranoid >= 3, mounting tracefs"),
        (false, true) => r.push(
            Status::Fail,
            "CAP_SYS_ADMIN",
            "missing, and perf_event_paranoid >= 3: the kernel refuses the tracepoint attach (EACCES) without it",
        ),
        (false, false) => r.push(
            Status::Warn,
            "CAP_SYS_ADMIN",
            "missing: fine with perf_event_paranoid <= 2, but tracefs must then be mounted already",
        ),
    }
    if has(CAP_SYS_PTRACE) {
        r.push(
            Status::Ok,
            "CAP_SYS_PTRACE",
            "held: the exe of other users' processes",
        );
    } else {
        r.push(
            Status::Warn,
            "CAP_SYS_PTRACE",
            "missing: actors of other users are reported without exe",
        );
    }
}

fn hook_checks(r: &mut Report, no_load: bool, caps: Option<u64>) {
    let permitted = caps.is_some_and(|c| {
        node::has_cap(c, CAP_SYS_ADMIN)
            || (node::has_cap(c, CAP_BPF) && node::has_cap(c, CAP_PERFMON))
    });
    if no_load || !permitted {
        let why = if no_load {
            "--no-load"
        } else {
            "no CAP_BPF+CAP_PERFMON to load them"
        };
        r.push(
            Status::Warn,
            "loaded",
            format!("not loaded ({why}): predicted from tracefs, the kprobe PMU and BTF"),
        );
        let fs = tracefs();
        for (cat, name, required) in TRACEPOINTS {
            if fs.is_none() && tracefs_mounted().is_some() {
                r.push(
                    Status::Info,
                    *name,
                    format!("tracepoint {cat}/{name}: cannot tell (tracefs not readable here)"),
                );
                continue;
            }
            let present =
                fs.is_some_and(|f| Path::new(f).join("events").join(cat).join(name).is_dir());
            let status = match (present, required) {
                (true, _) => Status::Ok,
                (false, true) => Status::Fail,
                (false, false) => Status::Warn,
            };
            r.push(
                status,
                *name,
                format!(
                    "tracepoint {cat}/{name}: {}",
                    if present {
                        "should arm"
                    } else {
                        "will not arm"
                    }
                ),
            );
        }
        let kprobes = Path::new("/sys/bus/event_source/devices/kprobe").is_dir();
        let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
        r.push(
            if kprobes || btf {
                Status::Info
            } else {
                Status::Warn
            },
            "kernel hooks",
            format!(
                "fentry {} (BTF {}; lockdown can still refuse it), kprobe {}",
                if btf { "possible" } else { "impossible" },
                if btf { "present" } else { "missing" },
                if kprobes {
                    "possible"
                } else {
                    "impossible (no kprobe PMU)"
                }
            ),
        );
        return;
    }
    let node = match node::NodePidNs::initial() {
        Ok(n) => n,
        Err(e) => {
            r.push(Status::Fail, "loaded", format!("{e:#}"));
            return;
        }
    };
    let started = std::time::Instant::now();
    match EbpfDetector::load(node) {
        Ok(det) => {
            let ms = started.elapsed().as_secs_f64() * 1e3;
            r.push(
                Status::Ok,
                "loaded",
                format!("the real loader armed and dropped the programs in {ms:.0} ms"),
            );
            for h in &det.report {
                let required = h.hook == "sys_enter_reboot";
                let (status, state) = match &h.state {
                    HookState::Armed => (Status::Ok, "armed".to_string()),
                    HookState::Degraded(why) => (Status::Warn, format!("armed, degraded: {why}")),
                    HookState::Unavailable(why) if required => {
                        (Status::Fail, format!("refused: {why}"))
                    }
                    HookState::Unavailable(why) => (Status::Warn, format!("refused: {why}")),
                };
                r.push(status, h.hook.clone(), format!("{}: {state}", h.attach));
            }
            let fentry = det
                .report
                .iter()
                .any(|h| h.attach.starts_with("fentry ") && h.state == HookState::Armed);
            let kprobe = det
                .report
                .iter()
                .any(|h| h.attach.starts_with("kprobe ") && h.state == HookState::Armed);
            // Why each attach method was refused, as the loader said (the
            // first kernel hook's reason: they share their cause).
            let refused = det.report.iter().find_map(|h| match &h.state {
                HookState::Unavailable(why) if h.attach.starts_with("fentry|kprobe") => {
                    Some(why.clone())
                }
                _ => None,
            });
            let part = |method: &str| -> Option<String> {
                let why = refused.as_deref()?;
                why.split("; ")
                    .find_map(|p| p.strip_prefix(&format!("{method}: ")).map(String::from))
            };
            for (method, works) in [("fentry", fentry), ("kprobe", kprobe)] {
                match (works, part(method)) {
                    (true, _) => r.push(Status::Ok, method, "the kernel accepted it"),
                    (false, Some(why)) => r.push(Status::Warn, method, format!("refused: {why}")),
                    (false, None) => r.push(
                        Status::Info,
                        method,
                        "not needed (the other method armed the kernel hooks)",
                    ),
                }
            }
            r.push(
                if fentry || kprobe { Status::Ok } else { Status::Warn },
                "kernel hooks",
                match (fentry, kprobe) {
                    (true, _) => "fentry works: the kernel's own power-off paths are seen".to_string(),
                    (false, true) => "kprobes work (fentry refused): the kernel's own power-off paths are seen".into(),
                    (false, false) => "neither fentry nor kprobes: only the tracepoints (reboot(2), exec, signals to PID 1) see a shutdown".into(),
                },
            );
            // Dropping the detector detaches and unloads everything.
            drop(det);
        }
        Err(e) => r.push(
            Status::Fail,
            "loaded",
            format!("the real loader failed: {e:#}"),
        ),
    }
}

/// What the agent asks of the API server (see `act/kube`, `report.rs`):
/// (verb, group, resource, subresource, namespace, why).
pub const PERMISSIONS: &[(&str, &str, &str, &str, &str, &str)] = &[
    ("get", "", "nodes", "", "", "the node's taints and record"),
    (
        "list",
        "",
        "nodes",
        "",
        "",
        "the warm watch of its own node",
    ),
    (
        "watch",
        "",
        "nodes",
        "",
        "",
        "the warm watch of its own node",
    ),
    ("patch", "", "nodes", "", "", "taint and record (last gasp)"),
    (
        "patch",
        "",
        "nodes",
        "status",
        "",
        "the ShutdownInProgress condition",
    ),
    (
        "list",
        "",
        "pods",
        "",
        "",
        "the warm watch of the node's pods",
    ),
    (
        "watch",
        "",
        "pods",
        "",
        "",
        "the warm watch of the node's pods",
    ),
    ("delete", "", "pods", "", "", "graceful termination"),
    (
        "create",
        "",
        "pods",
        "eviction",
        "",
        "podRemoval: evict (asked only with it)",
    ),
    (
        "create",
        "events.k8s.io",
        "events",
        "",
        "default",
        "NodeShutdown Events",
    ),
    (
        "patch",
        "events.k8s.io",
        "events",
        "",
        "default",
        "repeated Events (kube's recorder patches the series)",
    ),
];

/// `evict`: the config says `podRemoval: evict`, so the Eviction API is
/// needed and asked about (otherwise it is not granted, and not asked).
async fn permission_checks(r: &mut Report, client: &kube::Client, url: &str, evict: bool) {
    let api: kube::Api<SelfSubjectAccessReview> = kube::Api::all(client.clone());
    r.push(Status::Info, "API server", url.to_string());
    for (verb, group, resource, sub, ns, why) in PERMISSIONS {
        if *sub == "eviction" && !evict {
            continue;
        }
        let name = format!(
            "{verb} {}{resource}{}",
            if group.is_empty() {
                String::new()
            } else {
                format!("{group}/")
            },
            if sub.is_empty() {
                String::new()
            } else {
                format!("/{sub}")
            }
        );
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.to_string()),
                    group: Some(group.to_string()),
                    resource: Some(resource.to_string()),
                    subresource: (!sub.is_empty()).then(|| sub.to_string()),
                    namespace: (!ns.is_empty()).then(|| ns.to_string()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            api.create(&kube::api::PostParams::default(), &review),
        )
        .await;
        match answer {
            Ok(Ok(rev)) => {
                let st = rev.status.unwrap_or_default();
                if st.allowed {
                    r.push(Status::Ok, name, format!("allowed: {why}"));
                } else {
                    let reason = st
                        .reason
                        .filter(|s| !s.is_empty())
                        .or(st.evaluation_error)
                        .unwrap_or_default();
                    r.push(
                        Status::Fail,
                        name,
                        format!(
                            "DENIED: needed for {why}{}",
                            if reason.is_empty() {
                                String::new()
                            } else {
                                format!(" ({reason})")
                            }
                        ),
                    );
                }
            }
            Ok(Err(e)) => {
                r.push(
                    Status::Fail,
                    name,
                    format!("SelfSubjectAccessReview failed: {e}"),
                );
                return;
            }
            Err(_) => {
                r.push(
                    Status::Fail,
                    name,
                    "SelfSubjectAccessReview: no answer within 10 s",
                );
                return;
            }
        }
    }
}

async fn dbus_checks(r: &mut Report, args: &DbusArgs) {
    let address = args
        .system_bus
        .clone()
        .or_else(|| std::env::var("DBUS_SYSTEM_BUS_ADDRESS").ok())
        .unwrap_or_else(|| "unix:path=/run/dbus/system_bus_socket (default)".into());
    let conn = match dbus::connect(args.system_bus.as_deref()).await {
        Ok(c) => {
            r.push(Status::Ok, "system bus", address);
            c
        }
        Err(e) => {
            // `run` goes on without it: the eBPF hooks still see every shutdown.
            r.push(
                Status::Warn,
                "system bus",
                format!("cannot connect to {address}: {e}: no logind delay lock, no systemd jobs (eBPF hooks only)"),
            );
            return;
        }
    };
    match dbus::name_owner(&conn, LOGIND).await {
        Ok(Some(owner)) => {
            let who = match dbus::peer_pid_uid(&conn, &owner).await {
                Some((pid, _)) => {
                    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                    format!(" (pid {pid} {})", comm.trim())
                }
                None => String::new(),
            };
            r.push(Status::Ok, "logind", format!("{LOGIND} is {owner}{who}"));
            logind_checks(r, &conn, args).await;
        }
        Ok(None) => r.push(
            Status::Warn,
            "logind",
            format!("nobody owns {LOGIND}: no delay lock can hold a shutdown (only the eBPF hooks will see it)"),
        ),
        Err(e) => r.push(Status::Fail, "logind", format!("asking the bus for {LOGIND}: {e}")),
    }
    systemd_check(r, &conn).await;
}

async fn logind_checks(r: &mut Report, conn: &Connection, args: &DbusArgs) {
    let root = &args.logind_root;
    let ours = logind::dropin_path(root);
    let settings = logind::inhibit_delay_settings(root);
    match logind::inhibit_delay_max(conn).await {
        Ok(have) => delay_check(r, have, args.inhibit_delay, &settings, &ours),
        Err(e) => r.push(
            Status::Fail,
            "inhibit delay",
            format!("reading InhibitDelayMaxUSec: {e}"),
        ),
    }
    let order = if settings.is_empty() {
        format!(
            "no file under {} sets InhibitDelayMaxSec (logind's default: 5s)",
            root.display()
        )
    } else {
        let n = settings.len();
        settings
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let win = if i + 1 == n { " (wins)" } else { "" };
                format!("{}: {}{win}", s.file.display(), s.value)
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    r.push(Status::Info, "drop-ins", order);

    // Listed before the check takes (and closes) a lock of its own.
    type Inhibitor = (String, String, String, String, u32, u32);
    if let Ok(m) = conn
        .call_method(
            Some(LOGIND),
            dbus::LOGIND_PATH,
            Some(dbus::LOGIND_MANAGER),
            "ListInhibitors",
            &(),
        )
        .await
    {
        if let Ok(list) = m.body().deserialize::<Vec<Inhibitor>>() {
            // The kubelet's graceful node shutdown holds its own lock: two
            // drains would race for the same pods.
            for (what, who, why, mode, _, pid) in &list {
                if mode == "delay"
                    && what.split(':').any(|w| w == "shutdown")
                    && (who.to_lowercase().contains("kubelet")
                        || why.to_lowercase().contains("kubelet"))
                {
                    r.push(
                        Status::Fail,
                        "kubelet lock",
                        format!(
                            "the kubelet (pid {pid}) holds a shutdown delay lock: its graceful node shutdown is on; \
                             set shutdownGracePeriod and shutdownGracePeriodCriticalPods to 0 in its KubeletConfiguration and restart it"
                        ),
                    );
                }
            }
            let held: Vec<String> = list
                .iter()
                .filter(|(what, _, _, mode, _, _)| {
                    mode == "delay" && what.split(':').any(|w| w == "shutdown")
                })
                .map(|(_, who, _, _, _, pid)| format!("{who} (pid {pid})"))
                .collect();
            if !held.is_empty() {
                r.push(
                    Status::Info,
                    "held locks",
                    format!("shutdown delay locks held now: {}", held.join(", ")),
                );
            }
        }
    }
    match logind::take_lock(conn).await {
        Ok(fd) => {
            drop(fd);
            r.push(
                Status::Ok,
                "delay lock",
                "Inhibit(shutdown, delay) gave a lock fd; closed again",
            );
        }
        Err(e) => r.push(
            Status::Fail,
            "delay lock",
            format!("logind refused Inhibit(shutdown, delay): {e}"),
        ),
    }
    if let Ok(true) = dbus::logind_property::<bool>(conn, "PreparingForShutdown").await {
        r.push(
            Status::Warn,
            "shutdown",
            "logind is preparing a shutdown right now",
        );
    }
    if let Ok((t, usec)) = dbus::logind_property::<(String, u64)>(conn, "ScheduledShutdown").await {
        if !t.is_empty() && usec > 0 {
            let at = humantime::format_rfc3339_seconds(dbus::wall_usec(usec));
            r.push(
                Status::Warn,
                "shutdown",
                format!("a {t} is scheduled for {at}"),
            );
        }
    }
}

/// Whether logind allows the delay, or will once `run` writes its drop-in.
fn delay_check(
    r: &mut Report,
    have: Duration,
    want: Option<Duration>,
    settings: &[Setting],
    ours: &Path,
) {
    let Some(want) = want else {
        r.push(
            Status::Info,
            "inhibit delay",
            format!(
                "logind allows {} (InhibitDelayMaxUSec); nothing requested (--inhibit-delay)",
                secs(have)
            ),
        );
        return;
    };
    if have >= want {
        r.push(
            Status::Ok,
            "inhibit delay",
            format!(
                "logind allows {}, lastgasp needs {}",
                secs(have),
                secs(want)
            ),
        );
        return;
    }
    // Drop-ins are read by file name: one named after ours overrides it.
    let after_ours = settings.iter().rfind(|s| {
        s.file
            .parent()
            .and_then(|d| d.file_name())
            .is_some_and(|d| d == "logind.conf.d")
            && s.file
                .file_name()
                .is_some_and(|n| n.to_string_lossy().as_ref() > DROPIN_NAME)
    });
    match after_ours {
        Some(s) if s.delay.is_none_or(|d| d < want) => r.push(
            Status::Fail,
            "inhibit delay",
            format!(
                "logind allows {}, lastgasp needs {}: {} sets InhibitDelayMaxSec={} and is read after {}, so it wins; raise it there or remove it",
                secs(have),
                secs(want),
                s.file.display(),
                s.value,
                ours.display()
            ),
        ),
        _ => {
            let dir = ours.parent().expect("drop-in dir");
            let writable = nix::unistd::access(
                dir.ancestors().find(|d| d.exists()).unwrap_or(dir),
                nix::unistd::AccessFlags::W_OK,
            )
            .is_ok();
            if writable {
                r.push(
                    Status::Warn,
                    "inhibit delay",
                    format!(
                        "logind allows {}, lastgasp needs {}: `lastgasp run` will write {} and reload logind",
                        secs(have),
                        secs(want),
                        ours.display()
                    ),
                );
            } else {
                r.push(
                    Status::Fail,
                    "inhibit delay",
                    format!(
                        "logind allows {}, lastgasp needs {}, and {} is not writable",
                        secs(have),
                        secs(want),
                        dir.display()
                    ),
                );
            }
        }
    }
}

async fn systemd_check(r: &mut Report, conn: &Connection) {
    let call = |m: &'static str| async move {
        conn.call_method(Some(SYSTEMD), SYSTEMD_PATH, Some(SYSTEMD_MANAGER), m, &())
            .await
    };
    match dbus::name_owner(conn, SYSTEMD).await {
        Ok(Some(_)) => match call("Subscribe").await {
            Ok(_) => {
                let _ = call("Unsubscribe").await;
                r.push(
                    Status::Ok,
                    "systemd",
                    "Subscribe works: shutdown jobs that bypass logind are seen",
                );
            }
            Err(e) => r.push(Status::Warn, "systemd", format!("Subscribe failed: {e}")),
        },
        _ => r.push(
            Status::Warn,
            "systemd",
            format!("nobody owns {SYSTEMD}: shutdown jobs are seen by the eBPF hooks only"),
        ),
    }
}
