//! Observability and the node preflight, from the outside: the real agent's
//! `/metrics`, `/readyz` and `/healthz` (standalone, as root), the
//! `--metrics-listen` flag, the last-gasp histogram against the API double,
//! and `lastgasp check` (hooks loaded for real as root; API permissions
//! through SelfSubjectAccessReview against the double).
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use lastgasp::{
    act::Cluster,
    act::{
        audit::AuditLog,
        kube::graceful::{GracefulOptions, Removal},
        metrics::Metrics,
    },
    agent::Agent,
    grace::Bucket,
};
use lastgasp_apidouble::{AccessRule, ApiDouble, Fault};
use lastgasp_tests::{
    bus::{have_dbus_daemon, TestBus},
    support::*,
};
use serde_json::{json, Value};

/// A plain HTTP/1.1 GET: (status, body).
fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of one sample line (`name{labels} value`), if present.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

struct Running {
    child: std::process::Child,
    logs: Arc<Mutex<Vec<Value>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    fn logs(&self) -> Vec<Value> {
        self.logs.lock().unwrap().clone()
    }

    /// Waits for a JSON log line matching `pred`.
    fn wait_log(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        wait_log_in(&self.logs, what, pred)
    }

    /// Whether a log line so far contains `text`.
    fn says(&self, text: &str) -> bool {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .any(|v| v.to_string().contains(text))
    }

    /// Waits up to 30 s for `holds`; the logs are the failure's message.
    fn until(&self, what: &str, holds: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !holds() {
            assert!(
                Instant::now() < deadline,
                "waited 30 s for {what}: {:#?}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `lastgasp --json-logs run --no-dbus` in cluster mode as node `node`: its
/// `config` and a kubeconfig for `server` written in `dir` (made anew), the
/// audit log under `dir/audit`, no metrics listener.
fn start_cluster(dir: &std::path::Path, node: &str, server: &str, config: &str) -> Running {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let (cfg, kubeconfig) = (dir.join("config.yaml"), dir.join("kubeconfig"));
    std::fs::write(&cfg, config).unwrap();
    write_kubeconfig(&kubeconfig, server);
    let mut cmd = Command::new(agent_bin());
    cmd.args([
        "--json-logs",
        "run",
        "--no-dbus",
        "--metrics-listen",
        "off",
        "--config",
    ])
    .arg(&cfg)
    .arg("--audit-dir")
    .arg(dir.join("audit"))
    .env("KUBECONFIG", &kubeconfig)
    .env("NODE_NAME", node)
    .env_remove("POD_NAME")
    .env_remove("POD_NAMESPACE");
    Running::spawn(cmd)
}

/// The metrics endpoint's address, from the log line that announces it.
fn listen_addr(logs: &Mutex<Vec<Value>>) -> String {
    let v = wait_log_in(logs, "the endpoint's address", |v| {
        v["fields"]["listen"].is_string()
    });
    v["fields"]["listen"].as_str().unwrap().to_string()
}

/// Waits up to 30 s for a JSON log line matching `pred` in `logs`.
fn wait_log_in(logs: &Mutex<Vec<Value>>, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = logs.lock().unwrap().iter().find(|v| pred(v)) {
            return v.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no log line for {what}:\n{:#?}",
            logs.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `lastgasp --json-logs run --standalone --no-dbus ...`.
fn start_standalone(audit: &std::path::Path, extra: &[&str]) -> Running {
    let mut args = vec!["--no-dbus"];
    args.extend_from_slice(extra);
    start_run(audit, &args)
}

/// `lastgasp --json-logs run --standalone ...`: every stderr line must be JSON.
fn start_run(audit: &std::path::Path, extra: &[&str]) -> Running {
    let mut cmd = Command::new(agent_bin());
    cmd.args(["--json-logs", "run", "--standalone", "--audit-dir"])
        .arg(audit)
        .args(extra);
    Running::spawn(cmd)
}

impl Running {
    /// Starts `cmd` (stdout dropped) and collects its stderr's JSON lines (a
    /// line that is not JSON is kept as `NOT_JSON`).
    fn spawn(mut cmd: Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting lastgasp (build it with cargo xtask build)");
        let err = child.stderr.take().unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let l = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { return };
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| json!({"NOT_JSON": line, "error": e.to_string()}));
                l.lock().unwrap().push(v);
            }
        });
        Running { child, logs }
    }
}

#[test]
fn standalone_agent_serves_metrics_readiness_and_liveness() {
    if !can_load_ebpf("observe_standalone") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lastgasp-observe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let agent = start_standalone(&dir, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = listen_addr(&agent.logs);

    // Ready once armed: 503 with a reason before, 200 after.
    let body = wait_ready(&addr, "ready once armed", 30, |code, body| {
        if code != 200 {
            assert_eq!(code, 503, "{body}");
            assert!(
                !body.trim().is_empty() && body.trim().lines().count() == 1,
                "one-line reason: {body:?}"
            );
        }
        code == 200
    });
    assert_eq!(body.trim(), "ok");
    assert_eq!(get(&addr, "/healthz").unwrap(), (200, "ok\n".into()));
    assert_eq!(get(&addr, "/nope").unwrap().0, 404);

    // The start report went out as JSON log lines; the gauges say the same.
    let hooks: Vec<Value> = agent
        .logs()
        .into_iter()
        .filter(|v| v["fields"]["message"] == "hook")
        .collect();
    assert!(hooks.len() >= 7, "{hooks:#?}");
    let bad: Vec<Value> = agent
        .logs()
        .into_iter()
        .filter(|v| v.get("NOT_JSON").is_some())
        .collect();
    assert!(
        bad.is_empty(),
        "--json-logs: every stderr line is JSON: {bad:#?}"
    );
    let (code, metrics) = get(&addr, "/metrics").unwrap();
    assert_eq!(code, 200);
    for h in &hooks {
        let f = &h["fields"];
        let series = format!(
            "lastgasp_hook_armed{{hook=\"{}\",attach=\"{}\"}}",
            f["hook"].as_str().unwrap(),
            f["attach"].as_str().unwrap()
        );
        let want = if f["state"] == "unavailable" {
            0.0
        } else {
            1.0
        };
        assert_eq!(
            sample(&metrics, &series),
            Some(want),
            "{series}:\n{metrics}"
        );
    }
    for tp in ["sys_enter_reboot", "sched_process_exec", "signal_generate"] {
        assert!(
            hooks
                .iter()
                .any(|h| h["fields"]["hook"] == tp && h["fields"]["state"] == "armed"),
            "{tp}: {hooks:#?}"
        );
    }
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(
        sample(
            &metrics,
            &format!("lastgasp_boot_info{{boot_id=\"{}\"}}", boot_id.trim())
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &metrics,
            "lastgasp_ringbuf_drops_total{scope=\"node\",reason=\"full\"}"
        ),
        Some(0.0)
    );

    // A safe detection: reboot(2) with bad magic (the kernel refuses it).
    let series =
        "lastgasp_detections_total{source=\"reboot-syscall\",kind=\"poweroff\",scope=\"node\"}";
    let before = sample(&metrics, series).unwrap_or(0.0);
    let audit_only =
        sample(&metrics, "lastgasp_decisions_total{action=\"audit-only\"}").unwrap_or(0.0);
    let out = trigger(&["bad-magic-reboot", "4321fedc"]).output().unwrap();
    assert!(out.status.success(), "the kernel must refuse bad magic");
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let (_, m) = get(&addr, "/metrics").unwrap();
        if sample(&m, series).unwrap_or(0.0) > before {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the detection counter did not move:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        sample(&metrics, "lastgasp_decisions_total{action=\"audit-only\"}").unwrap() > audit_only
    );
    assert_eq!(
        sample(&metrics, "lastgasp_audit_write_failures_total"),
        Some(0.0)
    );
    assert!(metrics.contains("# TYPE graceful_shutdown_start_time_seconds gauge"));
    assert!(metrics.ends_with("# EOF\n"));
    assert_eq!(get(&addr, "/healthz").unwrap().0, 200);

    let mut agent = agent;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(agent.child.wait().unwrap().success());
    std::fs::remove_dir_all(&dir).ok();
}

/// Polls `/readyz` until `pred(status, body)`, for at most `secs`; returns the body.
fn wait_ready(addr: &str, what: &str, secs: u64, pred: impl Fn(u16, &str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let (code, body) = get(addr, "/readyz").unwrap();
        if pred(code, &body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: /readyz said {code} {body}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `start_run` on `bus` (its address and its fake's logind root), serving
/// on a free loopback port; returns the agent and that address.
fn start_on_bus(dir: &std::path::Path, bus: &TestBus, extra: &[&str]) -> (Running, String) {
    let root = bus.root.to_str().unwrap();
    let mut args = vec![
        "--logind-root",
        root,
        "--system-bus",
        &bus.address,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let agent = start_run(dir, &args);
    let addr = listen_addr(&agent.logs);
    (agent, addr)
}

/// A node whose system bus goes away: the agent it had connected to logind
/// and systemd says so on /readyz until both are back (a real dbus-daemon,
/// killed and started again on the same socket); unready meanwhile, as
/// `--unready-unless-armed` asks.
#[tokio::test]
async fn readiness_is_lost_with_the_bus_and_comes_back_with_it() {
    if !can_load_ebpf("observe_readiness_bus") || !have_dbus_daemon("observe_readiness_bus") {
        return;
    }
    let mut bus = TestBus::start("readyz", &[], &[]);
    let dir = std::env::temp_dir().join(format!("lastgasp-readyz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (agent, addr) = start_on_bus(&dir, &bus, &["--unready-unless-armed"]);
    agent.wait_log("systemd detector started", |v| {
        v["fields"]["message"] == "systemd: following shutdown jobs"
    });
    wait_ready(&addr, "ready once armed", 20, |c, _| c == 200);

    bus.stop_bus();
    let body = wait_ready(&addr, "both detectors lost", 20, |c, b| {
        c == 503 && b.contains("logind: ") && b.contains("systemd: ")
    });
    assert_eq!(body.trim().lines().count(), 1, "one line: {body:?}");
    assert!(body.contains("reconnecting every"), "{body}");
    // Alive all the while: the loop still turns, the eBPF hooks still see.
    assert_eq!(get(&addr, "/healthz").unwrap().0, 200);
    agent.wait_log("the loss logged", |v| {
        v["level"] == "WARN" && v["fields"]["part"] == "logind"
    });

    bus.start_bus().await;
    wait_ready(&addr, "ready again with the bus back", 20, |c, _| c == 200);
    agent.wait_log("the return logged", |v| {
        v["fields"]["message"] == "logind back"
    });
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

/// A node whose bus is not there when the agent starts (dbus-daemon late,
/// or a security module refusing the pod's connection): the lost graceful
/// path is loud at once (readiness says degraded, the metric, `check`
/// fails) without stopping a rollout (200), the agent keeps trying, and
/// arms when the bus comes.
#[tokio::test]
async fn a_graceful_path_not_armed_at_start_is_loud_and_armed_when_the_bus_comes() {
    if !can_load_ebpf("observe_graceful_path_not_armed")
        || !have_dbus_daemon("observe_graceful_path_not_armed")
    {
        return;
    }
    let mut bus = TestBus::start("notarmed", &[], &[]);
    bus.stop_bus();
    let root = bus.root.to_str().unwrap().to_string();

    let check = Command::new(agent_bin())
        .args([
            "check",
            "--standalone",
            "--only",
            "dbus",
            "--logind-root",
            &root,
        ])
        .args(["--system-bus", &bus.address])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert_eq!(check.status.code(), Some(1), "check must fail:\n{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("FAIL") && l.contains("system bus") && l.contains("NOT be armed")),
        "{text}"
    );

    let dir = std::env::temp_dir().join(format!("lastgasp-notarmed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let started = Instant::now();
    let (agent, addr) = start_on_bus(&dir, &bus, &[]);
    let body = wait_ready(
        &addr,
        "ready but degraded, naming the graceful path",
        10,
        |c, b| {
            c == 200
                && b.starts_with("ok, degraded: logind: ")
                && b.contains("graceful path is NOT armed")
        },
    );
    let metric_zero = loop {
        let (_, m) = get(&addr, "/metrics").unwrap();
        if m.lines().any(|l| l == "lastgasp_graceful_path_armed 0") {
            break started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{m}");
        std::thread::sleep(Duration::from_millis(50));
    };
    println!(
        "not armed: /readyz degraded and lastgasp_graceful_path_armed 0 within {metric_zero:?} of start: {}",
        body.trim()
    );
    // Alive, detecting, and trying again without a log line per try.
    assert_eq!(get(&addr, "/healthz").unwrap().0, 200);
    std::thread::sleep(Duration::from_secs(3));
    let warned = agent
        .logs()
        .iter()
        .filter(|v| v["level"] == "WARN" && v["fields"]["part"] == "logind")
        .count();
    assert_eq!(warned, 1, "one WARN for the loss, not one per try");

    bus.start_bus().await;
    wait_ready(
        &addr,
        "no longer degraded once the bus is there",
        20,
        |c, b| c == 200 && b.trim() == "ok",
    );
    let ready = Instant::now();
    loop {
        let (_, m) = get(&addr, "/metrics").unwrap();
        if m.lines().any(|l| l == "lastgasp_graceful_path_armed 1") {
            break;
        }
        assert!(
            ready.elapsed() < Duration::from_secs(5),
            "not armed once ready:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    bus.wait_event("the delay lock taken late", |e| e.is("inhibit"), 1)
        .await;
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

/// What an operator who never reads /readyz sees: a cluster-mode agent
/// whose graceful path cannot arm (no bus) shows it on its Node
/// (`LastgaspDegraded` True, a Warning Event) once the loss has held for
/// `HOLD`, while staying Ready; when the bus comes, False and a Normal Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_agent_says_so_on_its_node_and_stays_ready() {
    use k8s_openapi::api::{core::v1::Node, events::v1::Event};
    if !can_load_ebpf("observe_degraded_node") || !have_dbus_daemon("observe_degraded_node") {
        return;
    }
    let mut bus = TestBus::start("degraded", &[], &[]);
    bus.stop_bus();
    let double = ApiDouble::start().await.unwrap();
    let node = "n-degraded";
    double
        .create_value(lastgasp_tests::nodes::node(node).json())
        .unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-degraded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cfg, kubeconfig) = (dir.join("config.yaml"), dir.join("kubeconfig"));
    let url = double.url();
    std::fs::write(
        &cfg,
        format!("shutdownGracePeriod: 4s\napiServer: {{endpoint: \"{url}\"}}\n"),
    )
    .unwrap();
    write_kubeconfig(&kubeconfig, &url);
    let mut cmd = Command::new(agent_bin());
    cmd.args([
        "--json-logs",
        "run",
        "--metrics-listen",
        "127.0.0.1:0",
        "--logind-root",
    ])
    .arg(&bus.root)
    .arg("--system-bus")
    .arg(&bus.address)
    .arg("--config")
    .arg(&cfg)
    .arg("--audit-dir")
    .arg(dir.join("audit"))
    .env("KUBECONFIG", &kubeconfig)
    .env("NODE_NAME", node)
    .env_remove("POD_NAME")
    .env_remove("POD_NAMESPACE")
    .env_remove("KUBERNETES_SERVICE_HOST");
    let agent = Running::spawn(cmd);
    let logs = agent.logs.clone();
    let addr = tokio::task::spawn_blocking(move || listen_addr(&logs))
        .await
        .unwrap();
    let a = addr.clone();
    let body = tokio::task::spawn_blocking(move || {
        wait_ready(&a, "Ready but degraded", 30, |c, b| {
            c == 200 && b.starts_with("ok, degraded: logind")
        })
    })
    .await
    .unwrap();
    let degraded_at = Instant::now();

    let condition = |want: &str| {
        let n: Node = double.get("", node).unwrap();
        n.status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "LastgaspDegraded" && c.status == want)
    };
    let events = |reason: &str| -> Vec<Event> {
        double
            .list::<Event>("default")
            .into_iter()
            .chain(double.list::<Event>(""))
            .filter(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
            })
            .collect()
    };
    let wait = |what: &str, secs: u64, f: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !f() {
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "{what} not within {secs} s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait("LastgaspDegraded True", 30, &|| condition("True").is_some());
    let shown = degraded_at.elapsed();
    let c = condition("True").unwrap();
    assert_eq!(c.reason.as_deref(), Some("GracefulPathNotArmed"), "{c:?}");
    assert!(
        c.message
            .as_deref()
            .unwrap_or("")
            .contains("graceful path is NOT armed"),
        "{c:?}"
    );
    assert!(
        shown >= lastgasp::act::degraded::HOLD - Duration::from_secs(2),
        "shown after {shown:?}: a short loss must not reach the Node"
    );
    wait("a Warning Event", 10, &|| {
        !events("GracefulPathNotArmed").is_empty()
    });
    let ev = &events("GracefulPathNotArmed")[0];
    assert_eq!(ev.type_.as_deref(), Some("Warning"), "{ev:?}");
    // Ready all the while.
    assert_eq!(get(&addr, "/readyz").unwrap().0, 200);

    bus.start_bus().await;
    let back = Instant::now();
    wait("LastgaspDegraded False", 30, &|| {
        condition("False").is_some()
    });
    let cleared = back.elapsed();
    assert_eq!(condition("False").unwrap().reason.as_deref(), Some("Armed"));
    wait("a Normal Event", 10, &|| !events("Armed").is_empty());
    assert_eq!(events("Armed")[0].type_.as_deref(), Some("Normal"));
    println!("degraded: /readyz 200 {:?}; on the Node {shown:?} later; False {cleared:?} after the bus came", body.trim());
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bad_metrics_listen_fails_at_start_naming_the_flag() {
    for bad in ["localhost", "127.0.0.1", "1.2.3:99"] {
        let out = Command::new(agent_bin())
            .args(["run", "--standalone", "--metrics-listen", bad])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--metrics-listen") && err.contains(bad),
            "{err}"
        );
    }
    // A well-formed address this host does not have: refused before arming.
    let out = Command::new(agent_bin())
        .args(["run", "--standalone", "--metrics-listen", "192.0.2.1:9850"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--metrics-listen 192.0.2.1:9850"), "{err}");
    assert!(!err.contains("armed_ms"), "stopped before arming: {err}");
}

#[test]
fn cluster_mode_listens_on_the_pod_ip_or_says_what_is_missing() {
    let dir = std::env::temp_dir().join(format!("lastgasp-observe-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.yaml");
    std::fs::write(
        &cfg,
        "shutdownGracePeriod: 30s\nshutdownGracePeriodCriticalPods: 10s\n",
    )
    .unwrap();
    let out = Command::new(agent_bin())
        .args(["run", "--config"])
        .arg(&cfg)
        .env_remove("POD_IP")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("$POD_IP") && err.contains("--metrics-listen"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

const NODE: &str = "n1";

/// Cluster mode in process against the API double: a forced reboot's last
/// gasp is observed in the latency histogram; a refused one is counted.
#[tokio::test]
async fn last_gasp_latency_and_failures_are_measured() {
    let double = ApiDouble::start().await.unwrap();
    double
        .create_value(lastgasp_tests::nodes::node(NODE).json())
        .unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-observe-lg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (nc, lg) = warm_clients(&double, NODE).await;
    let cluster = Arc::new(Cluster {
        node: nc,
        lastgasp: lg,
        graceful: Arc::new(GracefulOptions {
            buckets: vec![Bucket {
                priority: 0,
                seconds: 2,
            }],
            removal: Removal::Delete,
            own_pod: None,
            state_file: dir.join("graceful_node_shutdown_state"),
            keep: Default::default(),
        }),
    });
    let metrics = Metrics::default();
    let mut agent = Agent::new(
        AuditLog::open(&dir, "b1").unwrap(),
        Some(cluster.clone()),
        None,
        metrics.clone(),
    );
    agent.handle(forced_exec()).await.unwrap();
    let text = metrics.encode();
    assert_eq!(
        sample(&text, "lastgasp_last_gasp_latency_seconds_count"),
        Some(1.0),
        "{text}"
    );
    let sum = sample(&text, "lastgasp_last_gasp_latency_seconds_sum").unwrap();
    assert!(sum > 0.0 && sum < 5.0, "{sum}");
    assert_eq!(
        sample(
            &text,
            "lastgasp_last_gasp_latency_seconds_bucket{le=\"+Inf\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "lastgasp_detections_total{source=\"exec\",kind=\"reboot\",scope=\"node\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "lastgasp_decisions_total{action=\"immediate\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "lastgasp_last_gasp_failures_total"),
        Some(0.0)
    );

    // The next boot's agent, with the API server refusing every patch (the
    // first one's audit log closed: one writer at a time).
    drop(agent);
    double.inject(Fault::status(503).method("PATCH").always());
    let metrics = Metrics::default();
    let mut agent = Agent::new(
        AuditLog::open(&dir, "b2").unwrap(),
        Some(cluster),
        None,
        metrics.clone(),
    );
    agent.handle(forced_exec()).await.unwrap();
    let text = metrics.encode();
    assert_eq!(
        sample(&text, "lastgasp_last_gasp_failures_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "lastgasp_last_gasp_latency_seconds_count"),
        Some(0.0)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `lastgasp check` with a kubeconfig for the double: (exit code, stdout).
fn check_against(double: &ApiDouble, args: &[&str]) -> (i32, String) {
    let dir = std::env::temp_dir().join(format!(
        "lastgasp-observe-kc-{}-{}",
        std::process::id(),
        double.addr().port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    write_kubeconfig(&kubeconfig, &double.url());
    // Cluster mode needs a config and a node name, as `run` does.
    let cfg = dir.join("config.yaml");
    std::fs::write(&cfg, "nodeName: n1\nshutdownGracePeriod: 30s\n").unwrap();
    let mut cmd = Command::new(agent_bin());
    cmd.arg("check").args(args);
    if !args.contains(&"--config") {
        cmd.arg("--config").arg(&cfg);
    }
    let out = cmd
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let report = String::from_utf8(out.stdout).unwrap();
    println!("{report}");
    (out.status.code().unwrap(), report)
}

// Multi-threaded: the double serves while the test waits for the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_asks_for_every_api_permission_and_fails_naming_a_denied_one() {
    let double = ApiDouble::start().await.unwrap();
    let (code, report) = check_against(&double, &["--only", "cluster"]);
    assert_eq!(code, 0, "{report}");
    for perm in [
        "get nodes",
        "list nodes",
        "watch nodes",
        "patch nodes",
        "patch nodes/status",
        "list pods",
        "watch pods",
        "delete pods",
        "create events.k8s.io/events",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.trim_start().starts_with("ok") && l.contains(&format!(" {perm} "))),
            "{perm} not ok:\n{report}"
        );
    }
    let reviews = double
        .requests()
        .iter()
        .filter(|r| r.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
        .count();
    assert_eq!(
        reviews,
        lastgasp::check::PERMISSIONS.len() - 1,
        "every permission but the eviction (podRemoval: delete)"
    );
    assert!(
        !report.contains("pods/eviction"),
        "not asked without evict:\n{report}"
    );

    double.deny_access(AccessRule::deny("patch", "", "nodes").subresource("status"));
    let (code, report) = check_against(&double, &["--only", "cluster"]);
    assert_eq!(code, 1, "{report}");
    let line = report
        .lines()
        .find(|l| l.contains("patch nodes/status"))
        .unwrap();
    assert!(
        line.trim_start().starts_with("FAIL") && line.contains("DENIED"),
        "{line}"
    );
    let fails = report
        .lines()
        .filter(|l| l.trim_start().starts_with("FAIL"))
        .count();
    assert_eq!(fails, 1, "{report}");
    assert!(
        report.contains("result: FAIL: 1 required item missing or refused"),
        "{report}"
    );

    // The Eviction API is asked for, and required, only with podRemoval: evict.
    double.set_access_rules(vec![
        AccessRule::deny("create", "", "pods").subresource("eviction")
    ]);
    let (code, report) = check_against(&double, &["--only", "cluster"]);
    assert_eq!(code, 0, "{report}");
    assert!(!report.contains("pods/eviction"), "{report}");
    let cfg = std::env::temp_dir().join(format!(
        "lastgasp-observe-evict-{}.yaml",
        std::process::id()
    ));
    std::fs::write(
        &cfg,
        "nodeName: n1\npodRemoval: evict\nshutdownGracePeriod: 30s\nshutdownGracePeriodCriticalPods: 10s\n",
    )
    .unwrap();
    let (code, report) = check_against(
        &double,
        &["--only", "cluster", "--config", cfg.to_str().unwrap()],
    );
    std::fs::remove_file(&cfg).ok();
    assert_eq!(code, 1, "{report}");
    let line = report
        .lines()
        .find(|l| l.contains("create pods/eviction"))
        .unwrap();
    assert!(line.trim_start().starts_with("FAIL"), "{line}");

    // --standalone skips the cluster: no review is asked.
    double.clear_requests();
    let (code, report) = check_against(&double, &["--only", "cluster", "--standalone"]);
    assert_eq!(code, 0, "{report}");
    assert!(report.contains("--standalone: skipped"));
    assert!(double.requests().is_empty());
}

/// `lastgasp check` without `--standalone` where cluster mode cannot start:
/// it fails and names each missing piece (it said "ok" before).
#[test]
fn check_fails_where_cluster_mode_cannot_start() {
    let home = std::env::temp_dir().join(format!("lastgasp-nohome-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let out = Command::new(agent_bin())
        .args(["check", "--only", "cluster"])
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("NODE_NAME")
        .env("HOME", &home)
        .output()
        .unwrap();
    let report = String::from_utf8(out.stdout).unwrap();
    println!("{report}");
    assert_eq!(out.status.code(), Some(1), "{report}");
    for missing in [
        "no Kubernetes configuration",
        "needs --config",
        "no node name",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.trim_start().starts_with("FAIL") && l.contains(missing)),
            "{missing}:\n{report}"
        );
    }
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn check_reports_this_node_truthfully() {
    if !can_load_ebpf("check_node") {
        return;
    }
    let out = Command::new(agent_bin())
        .args(["check", "--standalone"])
        .env(
            "DBUS_SYSTEM_BUS_ADDRESS",
            "unix:path=/nonexistent/lastgasp-test-bus",
        )
        .output()
        .unwrap();
    let report = String::from_utf8(out.stdout).unwrap();
    println!("{report}");
    let line = |what: &str| -> String {
        report
            .lines()
            .find(|l| l.split_whitespace().nth(2) == Some(what))
            .unwrap_or_else(|| panic!("no {what} line:\n{report}"))
            .to_string()
    };
    assert!(line("loaded").trim_start().starts_with("ok"), "{report}");
    for tp in ["sys_enter_reboot", "sched_process_exec", "signal_generate"] {
        let l = line(tp);
        assert!(
            l.trim_start().starts_with("ok") && l.ends_with("armed"),
            "{l}"
        );
    }
    // The kernel hooks' lines agree with the kernel's features.
    let kprobes = std::path::Path::new("/sys/bus/event_source/devices/kprobe").is_dir();
    assert_eq!(
        line("kprobes").trim_start().starts_with("ok"),
        kprobes,
        "{report}"
    );
    for f in [
        "kernel_power_off",
        "kernel_restart",
        "kernel_halt",
        "emergency_restart",
    ] {
        let l = line(f);
        if l.contains(": armed") {
            assert!(l.trim_start().starts_with("ok"), "{l}");
        } else {
            assert!(
                l.trim_start().starts_with("WARN") && l.contains("fentry") && l.contains("kprobe"),
                "{l}"
            );
            if !kprobes {
                assert!(l.contains("no kprobes"), "{l}");
            }
        }
    }
    for what in [
        "BTF",
        "task",
        "CapEff",
        "perf_paranoid",
        "CAP_BPF",
        "CAP_PERFMON",
    ] {
        line(what);
    }
    assert!(
        line("system").trim_start().starts_with("FAIL") && line("system").contains("NOT be armed"),
        "no bus is a FAIL naming the graceful path: {report}"
    );
    assert!(line("permissions").contains("--standalone: skipped"));
    let fails = report
        .lines()
        .filter(|l| l.trim_start().starts_with("FAIL"))
        .count();
    assert_eq!(out.status.code(), Some(i32::from(fails > 0)), "{report}");
}

/// The controller's metrics: the Lease held, and its actions by kind.
#[tokio::test]
async fn controller_counts_its_lease_and_actions() {
    use lastgasp::controller::{Controller, ControllerConfig};
    use lastgasp_tests::support::{kernel_poweroff, put_lease, put_record, record_of};
    let double = ApiDouble::start().await.unwrap();
    double
        .create_value(
            lastgasp_tests::nodes::node(NODE)
                .ready("False")
                .boot("b1")
                .json(),
        )
        .unwrap();
    // Powered off a minute ago: the kernel's proof, its kubelet silent since.
    let minute_ago = SystemTime::now() - Duration::from_secs(60);
    let mut off = kernel_poweroff();
    off.at = minute_ago;
    put_record(&double, NODE, &record_of("b1", &off), minute_ago);
    put_lease(&double, NODE, minute_ago);
    let cfg = ControllerConfig::new;
    let c = || async { double.client_without_retry().await };
    let mut a = Controller::start(c().await, c().await, cfg("a"))
        .await
        .unwrap();
    let mut b = Controller::start(c().await, c().await, cfg("b"))
        .await
        .unwrap();
    assert!(a.tick().await.unwrap());
    assert!(!b.tick().await.unwrap());
    let (ma, mb) = (a.metrics.encode(), b.metrics.encode());
    assert_eq!(
        sample(&ma, "lastgasp_controller_lease_held"),
        Some(1.0),
        "{ma}"
    );
    assert_eq!(
        sample(&mb, "lastgasp_controller_lease_held"),
        Some(0.0),
        "{mb}"
    );
    assert_eq!(
        sample(
            &ma,
            "lastgasp_controller_actions_total{action=\"taint-added\"}"
        ),
        Some(1.0),
        "{ma}"
    );
    assert_eq!(sample(&ma, "lastgasp_controller_nodes"), Some(1.0));

    // A failing pass is counted (the Lease cannot be read).
    double.inject(Fault::status(500).path_prefix("/apis/coordination.k8s.io/"));
    assert!(a.tick().await.is_err());
    assert_eq!(
        sample(
            &a.metrics.encode(),
            "lastgasp_controller_pass_errors_total{stage=\"pass\"}"
        ),
        Some(1.0)
    );
}

/// SIGTERM (the pod being stopped, a rollout) during a graceful run: the
/// agent finishes the run first, then exits; it does not abandon the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_waits_for_the_graceful_run_under_way() {
    if !can_load_ebpf("sigterm_waits_for_the_graceful_run_under_way") {
        return;
    }
    let node = "n-sigterm";
    let double = ApiDouble::start().await.unwrap();
    double
        .create_value(lastgasp_tests::nodes::node(node).json())
        .unwrap();
    double
        .create_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "slow", "namespace": "default"},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                     "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
    // Runs until its grace period (the bucket's 4 s) is over.
    double.kubelet().hang("default", "slow");

    let dir = std::env::temp_dir().join(format!("lastgasp-sigterm-{}", std::process::id()));
    let mut agent = start_cluster(&dir, node, &double.url(), "shutdownGracePeriod: 4s\n");
    agent.until("armed", || agent.says("\"armed\""));

    // A graceful shutdown request, as `systemctl poweroff` would exec (a stand-in).
    let tool = stand_in(&dir, "systemctl");
    assert!(Command::new(&tool)
        .arg("poweroff")
        .status()
        .unwrap()
        .success());
    agent.until("the pod's deletion", || {
        double
            .requests()
            .iter()
            .any(|r| r.method == "DELETE" && r.path.ends_with("/pods/slow"))
    });
    let termed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent exited with the drain under way: {:#?}",
        agent.logs()
    );
    assert!(agent.says("finishing the graceful run first"));
    let status = loop {
        if let Some(s) = agent.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            termed.elapsed() < Duration::from_secs(20),
            "still running 20 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let audit = std::fs::read_to_string(dir.join("audit").join("audit.jsonl")).unwrap();
    assert!(audit.contains("\"outcome\":\"graceful-done\""), "{audit}");
    println!(
        "exited {:.1} s after SIGTERM, once the graceful run was done",
        termed.elapsed().as_secs_f64()
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `apiServer.endpoint`: the agent reaches the API server directly, so a
/// last gasp does not depend on the Service VIP (kube-proxy, the CNI). Here
/// the kubeconfig's server (the "VIP") refuses every connection; the forced
/// shutdown still reaches the API server named in the config.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_last_gasp_bypasses_an_unreachable_service_vip() {
    if !can_load_ebpf("the_last_gasp_bypasses_an_unreachable_service_vip") {
        return;
    }
    let node = "n-direct";
    let double = ApiDouble::start().await.unwrap();
    double
        .create_value(lastgasp_tests::nodes::node(node).json())
        .unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-direct-{}", std::process::id()));
    // A port nobody listens on: the "VIP" refuses connections.
    let vip = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", vip.local_addr().unwrap());
    drop(vip);
    let config = format!(
        "shutdownGracePeriod: 4s\napiServer: {{endpoint: \"{}\"}}\n",
        double.url()
    );
    let agent = start_cluster(&dir, node, &dead, &config);
    agent.until("armed", || agent.says("\"armed\""));
    // `reboot -ff` as root (a stand-in): immediate, the last gasp.
    let tool = stand_in(&dir, "reboot");
    assert!(Command::new(&tool).arg("-ff").status().unwrap().success());
    agent.until("both last-gasp patches at the direct endpoint", || {
        double
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH" && r.status == 200)
            .count()
            >= 2
    });
    // The condition the last gasp set (the stand-in's end then withdraws
    // its proof: the unwinding that follows sets it False).
    let forced = double.requests().iter().any(|r| {
        r.method == "PATCH"
            && r.status == 200
            && r.path.ends_with(&format!("/nodes/{node}/status"))
            && r.body.as_ref().is_some_and(|b| {
                b["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["type"] == "ShutdownInProgress"
                            && c["status"] == "True"
                            && c["reason"] == "ForcedShutdown"
                    })
                })
            })
    });
    assert!(forced, "the last gasp's condition at the direct endpoint");
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

/// The cmd values of the marker reboot(2) calls (entries, not exits) found in
/// the audit log's files under `dir`.
fn audited_markers(dir: &std::path::Path, first: u64, n: u64) -> std::collections::BTreeSet<u64> {
    fn walk(v: &Value, first: u64, n: u64, out: &mut std::collections::BTreeSet<u64>) {
        match v {
            Value::Object(m) => {
                if let (Some(cmd), Some(0)) = (
                    m.get("cmd").and_then(Value::as_u64),
                    m.get("magic1").and_then(Value::as_u64),
                ) {
                    if (first..first + n).contains(&cmd) && m.get("ret").is_none() {
                        out.insert(cmd);
                    }
                }
                m.values().for_each(|v| walk(v, first, n, out));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, first, n, out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for line in text.lines() {
            if let Ok(v) = serde_json::from_str::<Value>(line) {
                walk(&v, first, n, &mut out);
            }
        }
    }
    out
}

/// An unprivileged flood of node-scope reboot(2) on every CPU (uid 65534:
/// EPERM) fills only its own, rate-limited ring: 100 root reboot(2) markers
/// sent meanwhile (bad magic: EINVAL) are all audited, none of the capable
/// callers' records is lost, the flood's drops are counted by scope and
/// reason, and `/healthz` answers throughout.
#[test]
fn an_unprivileged_flood_cannot_hide_a_capable_callers_reboot() {
    if !can_load_ebpf("unprivileged_flood") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lastgasp-flood-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let agent = start_standalone(&dir, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = listen_addr(&agent.logs);
    wait_ready(&addr, "ready once armed", 30, |code, _| code == 200);

    let flood = trigger(&["unprivileged-reboot-flood", "12"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let markers = trigger(&["bad-magic-reboots", "100", "100"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // /healthz while the flood runs: every answer 200, each within a bound
    // only printed (a timed assertion would measure the machine).
    let mut health = Vec::new();
    let until = Instant::now() + Duration::from_secs(11);
    while Instant::now() < until {
        let t = Instant::now();
        let code = get(&addr, "/healthz").map(|r| r.0).unwrap_or(0);
        health.push((code, t.elapsed()));
        std::thread::sleep(Duration::from_millis(200));
    }
    let m = markers.wait_with_output().unwrap();
    assert!(
        m.status.success(),
        "markers: {}",
        String::from_utf8_lossy(&m.stdout)
    );
    let f = flood.wait_with_output().unwrap();
    let f = String::from_utf8_lossy(&f.stdout).to_string();
    assert!(f.starts_with("calls "), "the flood: {f}");

    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        let seen = audited_markers(&dir, 0x1000, 100);
        if seen.len() == 100 || Instant::now() > deadline {
            break seen;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let (_, metrics) = get(&addr, "/metrics").unwrap();
    let drops = |scope: &str, reason: &str| {
        sample(
            &metrics,
            &format!("lastgasp_ringbuf_drops_total{{scope=\"{scope}\",reason=\"{reason}\"}}"),
        )
        .unwrap_or(-1.0)
    };
    let slowest = health.iter().map(|h| h.1).max().unwrap_or_default();
    println!(
        "flood: {}; markers audited {}/100; drops: capable full {}, node rate-limited {}, node full {}; /healthz {} polls, slowest {:?}",
        f.trim(),
        seen.len(),
        drops("capable", "full"),
        drops("node", "rate-limited"),
        drops("node", "full"),
        health.len(),
        slowest
    );
    assert_eq!(
        seen.len(),
        100,
        "markers missing from the audit: {:?}",
        (0x1000..0x1000 + 100)
            .filter(|c| !seen.contains(c))
            .collect::<Vec<_>>()
    );
    assert_eq!(drops("capable", "full"), 0.0, "{metrics}");
    assert!(
        drops("node", "rate-limited") > 0.0,
        "the flood was not rate-limited:\n{metrics}"
    );
    assert!(health.iter().all(|h| h.0 == 200), "{health:?}");
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

/// The agent's (or controller's) resident memory, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A TCP connection to `to` from the address `from`.
fn connect_from(from: &str, to: &str) -> std::io::Result<TcpStream> {
    let to: std::net::SocketAddr = to.parse().unwrap();
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&from.parse::<std::net::SocketAddr>().unwrap().into())?;
    s.connect_timeout(&to.into(), Duration::from_millis(200))?;
    Ok(s.into())
}

/// What a slow-header attack did: the peak RSS (KiB) and every `/healthz`
/// poll's status and latency.
struct Attack {
    rss_before: u64,
    rss_peak: u64,
    health: Vec<(u16, Duration)>,
    opened: usize,
}

/// `conns` connections to `addr` from 127.0.0.2 (a pod's own address, not
/// the prober's), each sending up to `bytes` of a request head that never
/// ends (reopened when closed), for `secs`, from 4 threads; `/healthz`
/// polled from 127.0.0.1 every 100 ms meanwhile.
fn slow_header_attack(addr: &str, pid: u32, conns: usize, bytes: usize, secs: u64) -> Attack {
    let rss_before = rss_kib(pid);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (addr, stop, opened) = (addr.to_string(), stop.clone(), opened.clone());
            std::thread::spawn(move || {
                let mut slots: Vec<Option<(TcpStream, usize)>> =
                    (0..conns / 4).map(|_| None).collect();
                let chunk = vec![b'a'; 16 * 1024];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for slot in slots.iter_mut() {
                        if slot.is_none() {
                            let Ok(s) = connect_from("127.0.0.2:0", &addr) else {
                                continue;
                            };
                            s.set_write_timeout(Some(Duration::from_millis(20))).ok();
                            let _ = (&s).write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: ");
                            opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            *slot = Some((s, 0));
                        }
                        let Some((s, sent)) = slot.as_mut() else {
                            continue;
                        };
                        if *sent < bytes {
                            match (&*s).write(&chunk[..chunk.len().min(bytes - *sent)]) {
                                Ok(n) => *sent += n,
                                Err(e)
                                    if e.kind() == std::io::ErrorKind::WouldBlock
                                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                                Err(_) => *slot = None,
                            }
                        } else {
                            // Held open; a closed one is noticed on a peek.
                            s.set_nonblocking(true).ok();
                            let mut b = [0u8; 1];
                            if s.peek(&mut b).is_ok() {
                                *slot = None;
                            } else if let Some((s, _)) = slot.as_ref() {
                                s.set_nonblocking(false).ok();
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        })
        .collect();
    let mut health = Vec::new();
    let mut rss_peak = rss_before;
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        let t = Instant::now();
        let code = get(addr, "/healthz").map(|r| r.0).unwrap_or(0);
        health.push((code, t.elapsed()));
        rss_peak = rss_peak.max(rss_kib(pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    Attack {
        rss_before,
        rss_peak,
        health,
        opened: opened.load(std::sync::atomic::Ordering::Relaxed),
    }
}

impl Attack {
    fn report(&self, who: &str) {
        let mut lat: Vec<Duration> = self.health.iter().map(|h| h.1).collect();
        lat.sort();
        let q = |p: f64| {
            lat.get(((lat.len() as f64 - 1.0) * p) as usize)
                .copied()
                .unwrap_or_default()
        };
        println!(
            "{who}: slow-header attack, {} connections opened: RSS {} -> peak {} KiB; /healthz {} polls, {} not 200, p50 {:?}, p99 {:?}, max {:?}",
            self.opened,
            self.rss_before,
            self.rss_peak,
            self.health.len(),
            self.health.iter().filter(|h| h.0 != 200).count(),
            q(0.5),
            q(0.99),
            q(1.0)
        );
    }

    /// RSS below 64 MiB, and every `/healthz` answered 200.
    fn assert_held(&self) {
        assert!(
            self.rss_peak < 64 * 1024,
            "RSS peaked at {} KiB",
            self.rss_peak
        );
        let bad: Vec<_> = self.health.iter().filter(|h| h.0 != 200).collect();
        assert!(bad.is_empty(), "/healthz failed during the attack: {bad:?}");
        assert!(
            self.opened >= 600,
            "the attack opened only {} connections",
            self.opened
        );
    }
}

/// 600 connections each sending 400 KB of an unfinished request head (the
/// attack that took the agent to 296 MiB): bounded memory, `/healthz` alive.
#[test]
fn a_slow_header_flood_cannot_exhaust_the_agent() {
    if !can_load_ebpf("slow_header_agent") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lastgasp-slowhead-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let agent = start_standalone(&dir, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = listen_addr(&agent.logs);
    wait_ready(&addr, "ready once armed", 30, |code, _| code == 200);
    let a = slow_header_attack(&addr, agent.child.id(), 600, 400 * 1024, 10);
    a.report("agent");
    a.assert_held();
    // Still serving whole requests afterwards.
    assert_eq!(get(&addr, "/metrics").unwrap().0, 200);
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

/// The same attack on the controller's endpoint (its binary, against the
/// API double).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_header_flood_cannot_exhaust_the_controller() {
    let double = ApiDouble::start().await.unwrap();
    let dir = std::env::temp_dir().join(format!("lastgasp-slowhead-ctl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    write_kubeconfig(&kubeconfig, &double.url());
    let mut cmd = Command::new(agent_bin());
    cmd.args([
        "--json-logs",
        "controller",
        "--identity",
        "slowhead",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .env("KUBECONFIG", &kubeconfig)
    .env_remove("KUBERNETES_SERVICE_HOST")
    .env_remove("KUBERNETES_SERVICE_PORT");
    let running = Running::spawn(cmd);
    let logs = running.logs.clone();
    let addr = tokio::task::spawn_blocking(move || listen_addr(&logs))
        .await
        .unwrap();
    let pid = running.child.id();
    let a = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || {
            wait_ready(&addr, "the controller's first pass", 30, |code, _| {
                code == 200
            });
            slow_header_attack(&addr, pid, 600, 400 * 1024, 10)
        }
    })
    .await
    .unwrap();
    a.report("controller");
    a.assert_held();
    drop(running);
    std::fs::remove_dir_all(&dir).ok();
}

/// Local first: a cluster-mode agent whose API server refuses connections
/// from its start takes logind's delay lock and audits every record at
/// once, says why it is not ready (alive all the while), holds a graceful
/// shutdown that logind announces; when the API server comes, the cluster
/// half joins and the held shutdown reaches the Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_down_from_the_start_blinds_nothing() {
    if !can_load_ebpf("local_first") || !have_dbus_daemon("local_first") {
        return;
    }
    let bus = TestBus::start(
        "localfirst",
        &[(
            "etc/systemd/logind.conf",
            "[Login]\nInhibitDelayMaxSec=30\n",
        )],
        &[],
    );
    let node = "n-local";
    // The agent retries this port until the double listens on it.
    let port = port_below_ephemeral_range();
    let url = format!("http://127.0.0.1:{port}");
    let dir = std::env::temp_dir().join(format!("lastgasp-localfirst-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cfg, kubeconfig) = (dir.join("config.yaml"), dir.join("kubeconfig"));
    std::fs::write(
        &cfg,
        format!("shutdownGracePeriod: 4s\napiServer: {{endpoint: \"{url}\"}}\n"),
    )
    .unwrap();
    write_kubeconfig(&kubeconfig, &url);
    let audit = dir.join("audit");
    let mut cmd = Command::new(agent_bin());
    cmd.args([
        "--json-logs",
        "run",
        "--metrics-listen",
        "127.0.0.1:0",
        "--logind-root",
    ])
    .arg(&bus.root)
    .arg("--system-bus")
    .arg(&bus.address)
    .arg("--config")
    .arg(&cfg)
    .arg("--audit-dir")
    .arg(&audit)
    .env("KUBECONFIG", &kubeconfig)
    .env("NODE_NAME", node)
    .env_remove("POD_NAME")
    .env_remove("POD_NAMESPACE")
    .env_remove("KUBERNETES_SERVICE_HOST");
    let agent = Running::spawn(cmd);
    let blocking = |f: Box<dyn FnOnce() -> Value + Send>| tokio::task::spawn_blocking(f);
    let logs = agent.logs.clone();
    let addr = tokio::task::spawn_blocking(move || listen_addr(&logs))
        .await
        .unwrap();
    let logs = agent.logs.clone();
    blocking(Box::new(move || {
        wait_log_in(&logs, "armed", |v| v["fields"]["message"] == "armed")
    }))
    .await
    .unwrap();
    let armed = Instant::now();

    // The delay lock, with nothing from the API server.
    let locked = loop {
        let locks = bus.inhibitors().await;
        if locks
            .iter()
            .any(|(what, who, mode)| what == "shutdown" && who == "lastgasp" && mode == "delay")
        {
            break armed.elapsed();
        }
        assert!(
            armed.elapsed() < Duration::from_secs(10),
            "no delay lock 10 s after arming: {locks:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Records audited as they come.
    let sent = Instant::now();
    let out = trigger(&["bad-magic-reboots", "5", "20"]).output().unwrap();
    assert!(out.status.success());
    let audited = loop {
        if audited_markers(&audit, 0x1000, 5).len() == 5 {
            break sent.elapsed();
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "markers not audited within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let a = addr.clone();
    let (ready, health) = tokio::task::spawn_blocking(move || {
        (get(&a, "/readyz").unwrap(), get(&a, "/healthz").unwrap())
    })
    .await
    .unwrap();
    println!("API server down: delay lock {locked:?} after arming; 5 markers audited {audited:?} after the first was sent; /readyz {} {:?}", ready.0, ready.1.trim());
    assert_eq!(ready.0, 503, "{ready:?}");
    assert!(ready.1.contains("api-server"), "{ready:?}");
    assert_eq!(health.0, 200);

    // logind announces a power-off: the graceful run waits for the cluster.
    bus.logind("PowerOff", &(false,)).await.unwrap();
    let logs = agent.logs.clone();
    blocking(Box::new(move || {
        wait_log_in(&logs, "the action held", |v| {
            v.to_string().contains("the action waits for it")
        })
    }))
    .await
    .unwrap();

    // The API server comes.
    let double = ApiDouble::start_on(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    double
        .create_value(lastgasp_tests::nodes::node(node).json())
        .unwrap();
    let came = Instant::now();
    let logs = agent.logs.clone();
    blocking(Box::new(move || {
        wait_log_in(&logs, "the join", |v| {
            v.to_string().contains("the cluster half joined")
        })
    }))
    .await
    .unwrap();
    let record = loop {
        let n: k8s_openapi::api::core::v1::Node = double.get("", node).unwrap();
        let rec = n
            .metadata
            .annotations
            .and_then(|a| a.get("lastgasp.dev/last-shutdown").cloned());
        if let Some(r) = rec {
            break r;
        }
        assert!(
            came.elapsed() < Duration::from_secs(40),
            "no record on the Node 40 s after the API server came"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "the API server came: the held shutdown's record on the Node {:?} later",
        came.elapsed()
    );
    let rec: Value = serde_json::from_str(&record).unwrap();
    assert_eq!(rec["episode"]["kind"], "poweroff", "{rec}");
    assert_eq!(rec["episode"]["path"], "graceful", "{rec}");
    let a = addr.clone();
    let body = tokio::task::spawn_blocking(move || {
        wait_ready(&a, "ready once joined", 30, |c, _| c == 200)
    })
    .await
    .unwrap();
    assert_eq!(body.trim(), "ok");
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
}

/// A kubeconfig at `path` for the API server at `server` (with a token the
/// double does not check, as a pod's service account has).
fn write_kubeconfig(path: &std::path::Path, server: &str) {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: d, cluster: {{server: \"{server}\"}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\ncontexts: [{{name: c, context: {{cluster: d, user: u}}}}]\n\
             current-context: c\n"
        ),
    )
    .unwrap();
}
