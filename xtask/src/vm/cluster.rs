//! The cluster half of the harness (`--cluster`): the Kubernetes API double
//! (`lastgasp-apidouble`, crate `apidouble/`) on the host's loopback, started
//! afresh for every boot from `tests/vm/cluster/objects.json`, and the
//! guest's only route to it — qemu user networking with `restrict=on` (no
//! other traffic leaves the guest) and one `guestfwd` from 10.0.2.100:8099 in
//! the guest to the double's port on 127.0.0.1 (through `socat`). The agent
//! runs in cluster mode with `tests/vm/cluster/lastgasp.yaml` as its config
//! and a kubeconfig pointing at that address.
//!
//! What the double logged during a run (`GET /_double/log`) is the matrix's
//! "cluster got" column: which writes reached it, in order, and how many ms
//! after the trigger.
//!
//! ## One clock for the guest and the double
//!
//! The trigger time is the runner's (guest CLOCK_REALTIME, just before it
//! runs the command); the double stamps each request with the host's
//! CLOCK_REALTIME as its headers arrive. The guest's clock starts from qemu's
//! RTC (`-rtc base=utc`, whole seconds), so it is off by up to a second and
//! is related to the host's by an offset, bounded from both sides:
//! - from above by every runner marker on the serial console (guest time in
//!   the line, host time on arrival: the offset is at most their difference),
//! - from both sides by the runner's clock probes (`out/clock`): a request
//!   sent on an open connection between two guest readings, logged by the
//!   double with its host time, which lies between them.
//!
//! The offset is the middle of the tightest bracket and its half-width is
//! the error bar printed with every latency.
use std::{
    fmt, fs,
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use lastgasp_common::names::{
    CONDITION, DEGRADED, RECORD_ANNOTATION as RECORD, TAINT_KEY as TAINT,
};
use serde_json::Value;

use super::{evidence::parse_rfc3339_ns, qemu::Run, qemu::Spec};
use crate::setup;

/// Where the guest finds the API server.
pub const GUEST_ADDR: &str = "10.0.2.100:8099";
/// The guest's Node in the double (also `nodeName` in lastgasp.yaml).
pub const NODE: &str = "lastgasp-guest";
/// `Got::after_label` for a reboot or kexec.
pub const AFTER_END: &str = "after the boot ended";

pub struct Cluster {
    bin: PathBuf,
    vm_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    port: u16,
    /// The seeded pods bound to the guest's node: `ns/name` and priority.
    pub pods: Vec<(String, i64)>,
}

impl Cluster {
    /// `profile`: the agent's (`debug` or `release`); the double is built likewise.
    pub fn start(root: &Path, profile: &str) -> Result<Cluster> {
        setup::ensure_debs(&[("socat", "socat")])?;
        let bin = apidouble_binary(root, profile)?;
        let vm_dir = root.join("tests/vm");
        let objects: Value = serde_json::from_str(
            &fs::read_to_string(vm_dir.join("cluster/objects.json"))
                .context("reading tests/vm/cluster/objects.json")?,
        )
        .context("tests/vm/cluster/objects.json")?;
        let pods = seeded_pods(&objects);
        let out = crate::target_dir(root).join("vm");
        fs::create_dir_all(&out)?;
        let mut c = Cluster {
            bin,
            vm_dir,
            log: out.join("apidouble.log"),
            child: None,
            port: 0,
            pods,
        };
        // Once now, so a double that cannot start fails the run before any boot.
        c.respawn()?;
        println!(
            "vm-test: API double {} (a fresh one for every boot), reached from the guest as {GUEST_ADDR}",
            c.bin.display()
        );
        Ok(c)
    }

    /// A fresh double (seed objects only, empty request log) on a new port.
    fn respawn(&mut self) -> Result<()> {
        self.stop();
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.bin)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--objects")
            .arg(self.vm_dir.join("cluster/objects.json"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        self.child = Some(child);
        self.port = port;
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            let exited = self.child.as_mut().unwrap().try_wait()?.is_some();
            if t.elapsed() > Duration::from_secs(15) || exited {
                bail!(
                    "the API double did not listen on 127.0.0.1:{port} (see {})",
                    self.log.display()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A fresh double, the guest's NIC, the agent's cluster-mode settings
    /// (env file, config, kubeconfig).
    pub fn prepare(&mut self, spec: &mut Spec) -> Result<()> {
        self.respawn()?;
        self.attach(spec)
    }

    /// The guest's NIC and the agent's settings for the double as it is,
    /// state and request log kept: a later boot of the same machine (the
    /// harness switching a powered-off guest on again) talks to the same
    /// cluster.
    pub fn attach(&self, spec: &mut Spec) -> Result<()> {
        let (ip, gport) = GUEST_ADDR.split_once(':').unwrap();
        spec.nic = Some(format!(
            "user,model=virtio-net-pci,restrict=on,guestfwd=tcp:{ip}:{gport}-cmd:socat STDIO TCP:127.0.0.1:{}",
            self.port
        ));
        for (name, file) in [
            ("kubeconfig", "cluster/kubeconfig"),
            ("lastgasp.env", "cluster/lastgasp.env"),
            ("lastgasp.yaml", "cluster/lastgasp.yaml"),
            ("ca.crt", "cluster/ca.crt"),
        ] {
            spec.extra_in.push((
                name.into(),
                fs::read(self.vm_dir.join(file)).with_context(|| format!("tests/vm/{file}"))?,
            ));
        }
        Ok(())
    }

    /// Every request the double logged since `prepare`.
    pub fn requests(&self) -> Result<Vec<Value>> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET /_double/log HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        let json = body.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        json.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str::<Value>(l).context("the double's /_double/log line"))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

fn apidouble_binary(root: &Path, profile: &str) -> Result<PathBuf> {
    let bin = crate::target_dir(root)
        .join(profile)
        .join("lastgasp-apidouble");
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    // The same packages as `crate::build` (a no-op after it): the agent's build needs
    // LASTGASP_EBPF_OBJ, already built by then.
    cmd.current_dir(root)
        .arg("build")
        .args(crate::BINS)
        .env("LASTGASP_EBPF_OBJ", crate::ebpf_object(root));
    if profile == "release" {
        cmd.arg("--release");
    }
    let st = cmd.status()?;
    if !st.success() || !bin.is_file() {
        bail!("building the API double ({cmd:?}) failed");
    }
    Ok(bin)
}

/// Pods bound to the guest's node in the seed objects, with their priority.
fn seeded_pods(objects: &Value) -> Vec<(String, i64)> {
    let items = match objects {
        Value::Array(a) => a.clone(),
        Value::Object(o) if o.contains_key("items") => {
            o["items"].as_array().cloned().unwrap_or_default()
        }
        v => vec![v.clone()],
    };
    items
        .iter()
        .filter(|o| o["kind"] == "Pod" && o["spec"]["nodeName"] == NODE)
        .map(|o| {
            (
                format!(
                    "{}/{}",
                    o["metadata"]["namespace"].as_str().unwrap_or("default"),
                    o["metadata"]["name"].as_str().unwrap_or("?")
                ),
                o["spec"]["priority"].as_i64().unwrap_or(0),
            )
        })
        .collect()
}

/// The guest-to-host clock offset (host ns − guest ns) and its error bar.
#[derive(Clone, Debug)]
pub struct Clock {
    pub offset_ns: i128,
    /// Half the width of the bracket; `None`: bounded from above only.
    pub err_ms: Option<f64>,
    pub how: String,
}

impl Clock {
    /// See the module's documentation.
    pub fn relate(run: &Run, reqs: &[Value]) -> Option<Clock> {
        let start = run.start_wall.duration_since(UNIX_EPOCH).ok()?.as_nanos() as i128;
        let mut hi: Option<(i128, String)> = None;
        let mut lo: Option<(i128, String)> = None;
        let mut upper = |v: i128, why: String| {
            if hi.as_ref().is_none_or(|(h, _)| v < *h) {
                hi = Some((v, why));
            }
        };
        let mut boots = 0;
        for l in &run.console {
            let Some(rest) = l.text.split("lastgasp-vm: ").nth(1) else {
                continue;
            };
            let mut w = rest.split_whitespace();
            let (Some(ns), Some(word)) = (w.next().and_then(|n| n.parse::<i128>().ok()), w.next())
            else {
                continue;
            };
            // A second boot in the same qemu (reboot, kexec) sets its clock
            // from the RTC afresh: its markers say nothing of the first's.
            if word == "BOOT" {
                boots += 1;
                if boots > 1 {
                    break;
                }
            }
            upper(
                start + l.t.as_nanos() as i128 - ns,
                format!("console marker {word}"),
            );
        }
        let probes = fs::read_to_string(run.out.join("clock")).unwrap_or_default();
        let mut n = 0;
        for line in probes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [i, send, recv] = f[..] else { continue };
            let (Ok(send), Ok(recv)) = (send.parse::<i128>(), recv.parse::<i128>()) else {
                continue;
            };
            let ua = format!("lastgasp-vm-clock/{i}");
            let Some(at) = reqs
                .iter()
                .find(|r| r["userAgent"].as_str() == Some(&ua))
                .and_then(|r| r["at"].as_str())
                .and_then(parse_rfc3339_ns)
            else {
                continue;
            };
            n += 1;
            upper(at - send * 1000, format!("probe {i}"));
            let v = at - recv * 1000;
            if lo.as_ref().is_none_or(|(l, _)| v > *l) {
                lo = Some((v, format!("probe {i}")));
            }
        }
        let (hi, hi_why) = hi?;
        Some(match lo {
            Some((lo, lo_why)) => Clock {
                offset_ns: (hi + lo) / 2,
                err_ms: Some((hi - lo).abs() as f64 / 2e6),
                how: format!(
                    "{n} clock probe(s); offset bracket {:.1} ms wide ({lo_why} .. {hi_why}){}",
                    (hi - lo) as f64 / 1e6,
                    if lo > hi {
                        " — INCONSISTENT (lower > upper bound)"
                    } else {
                        ""
                    }
                ),
            },
            None => Clock {
                offset_ns: hi,
                err_ms: None,
                how: format!("no clock probe answered: upper bound only ({hi_why})"),
            },
        })
    }
}

/// What a write to the double was.
#[derive(Clone, Debug, PartialEq)]
pub enum What {
    /// The `ShutdownInProgress` condition (status patch): status and reason.
    Condition(String),
    /// A patch of the Node itself: taint set (Some(true)), removed
    /// (Some(false)) or untouched (None); the record annotation.
    NodePatch {
        taint: Option<bool>,
        record: bool,
        /// The record says `delivered_late: true` (a later boot sent it).
        late: bool,
    },
    /// Reason; for the after-boot report (action PreviousBoot) also how the
    /// previous boot ended, as its note says ("unannounced", "forced", ...).
    Event(String, Option<String>),
    /// `delete` or `evict`, `ns/name`.
    Pod(&'static str, String),
    Other(String),
}

impl What {
    fn of(r: &Value) -> Option<What> {
        let method = r["method"].as_str()?;
        if method == "GET" || r["watch"].as_bool() == Some(true) {
            return None;
        }
        let path = r["path"].as_str()?;
        let body = &r["body"];
        let node = format!("/api/v1/nodes/{NODE}");
        let seg: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let conditions = body["status"]["conditions"].as_array();
        // The agent's own health (`LastgaspDegraded`, written once 10 s after
        // it starts whatever happens) says nothing of a shutdown.
        if path == format!("{node}/status")
            && conditions.is_some_and(|cs| cs.iter().all(|c| c["type"] == DEGRADED))
        {
            return None;
        }
        Some(if path == format!("{node}/status") {
            let c = conditions.and_then(|cs| cs.iter().find(|c| c["type"] == CONDITION));
            match c {
                Some(c) => What::Condition(format!(
                    "{} {}",
                    c["status"].as_str().unwrap_or("?"),
                    c["reason"].as_str().unwrap_or("")
                )),
                None => What::Other(format!("{method} {path}")),
            }
        } else if path == node {
            let taint = body["spec"].get("taints").map(|t| {
                t.as_array()
                    .is_some_and(|a| a.iter().any(|x| x["key"] == TAINT))
            });
            let rec = body["metadata"]["annotations"].get(RECORD);
            let late = rec
                .and_then(|r| r.as_str())
                .and_then(|r| serde_json::from_str::<Value>(r).ok())
                .is_some_and(|r| r["delivered_late"] == true);
            What::NodePatch {
                taint,
                record: rec.is_some(),
                late,
            }
        } else if path.ends_with("/events") && method == "POST" {
            let previous = (body["action"] == "PreviousBoot").then(|| {
                body["note"]
                    .as_str()
                    .and_then(|n| n.split(" ended ").nth(1))
                    .and_then(|n| n.split([' ', ':', ',']).next())
                    .unwrap_or("?")
                    .to_string()
            });
            What::Event(body["reason"].as_str().unwrap_or("?").to_string(), previous)
        } else if seg.iter().rev().nth(1) == Some(&"events") && method == "PATCH" {
            // The same Event again (a series): not a new announcement.
            What::Other(format!(
                "Event {} updated",
                body["reason"].as_str().unwrap_or("?")
            ))
        } else if seg.len() >= 6 && seg[..2] == ["api", "v1"] && seg[4] == "pods" {
            let pod = format!("{}/{}", seg[3], seg[5]);
            match (method, seg.get(6)) {
                ("DELETE", None) => What::Pod("delete", pod),
                ("POST", Some(&"eviction")) => What::Pod("evict", pod),
                _ => What::Other(format!("{method} {path}")),
            }
        } else {
            What::Other(format!("{method} {path}"))
        })
    }

    /// The node-level announcement of a shutdown (not its undoing).
    pub fn announces(&self) -> bool {
        match self {
            What::Condition(s) => s.starts_with("True"),
            What::NodePatch { taint, record, .. } => *taint == Some(true) || *record,
            What::Event(r, _) => r == "NodeShutdown",
            _ => false,
        }
    }
}

impl fmt::Display for What {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            What::Condition(s) => write!(f, "condition ShutdownInProgress={}", s.trim()),
            What::NodePatch {
                taint,
                record,
                late,
            } => {
                let mut parts = Vec::new();
                match taint {
                    Some(true) => parts.push("taint"),
                    Some(false) => parts.push("taint removed"),
                    None => {}
                }
                if *record && *late {
                    parts.push("record annotation (delivered_late)");
                } else if *record {
                    parts.push("record annotation");
                }
                if parts.is_empty() {
                    parts.push("node patch");
                }
                f.write_str(&parts.join(" + "))
            }
            What::Event(r, None) => write!(f, "Event {r}"),
            What::Event(r, Some(end)) => write!(f, "Event {r} PreviousBoot ({end})"),
            What::Pod(how, p) => write!(f, "{how} {p}"),
            What::Other(s) => f.write_str(s),
        }
    }
}

/// One write the double received after the trigger.
#[derive(Clone, Debug)]
pub struct Item {
    pub what: What,
    /// Trigger (the runner's, guest clock) → received by the double, ms.
    pub ms: f64,
    pub status: u64,
    /// Received before the guest's first boot ended.
    pub before_end: bool,
}

impl Item {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// What the cluster got from one run.
#[derive(Clone, Debug)]
pub struct Got {
    pub items: Vec<Item>,
    /// Trigger → the end of the first boot (the kernel's last console line,
    /// host receipt), on the same clock as the items' ms.
    pub end_ms: Option<f64>,
    pub clock: Option<Clock>,
    pub error: Option<String>,
    /// How the summary names the writes after the end: "after the boot
    /// ended" (a reboot or kexec in the same qemu), "after the next boot"
    /// (the harness switched the powered-off guest on again).
    pub after_label: &'static str,
}

impl Got {
    /// `trig_ns`: the runner's trigger (guest clock); `end`: the end of the
    /// first boot (host time since qemu's start), none if it stayed up.
    pub fn read(reqs: &[Value], run: &Run, trig_ns: i128, end: Option<Duration>) -> Got {
        let Some(clock) = Clock::relate(run, reqs) else {
            return Got {
                items: Vec::new(),
                end_ms: None,
                clock: None,
                error: Some("no clock relation (no runner marker on the console)".into()),
                after_label: AFTER_END,
            };
        };
        let start = run
            .start_wall
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as i128)
            .unwrap_or(0);
        let trig_host = trig_ns + clock.offset_ns;
        let end_host = end.map(|e| start + e.as_nanos() as i128);
        let items = reqs
            .iter()
            .filter_map(|r| {
                let at = r["at"].as_str().and_then(parse_rfc3339_ns)?;
                // The double's clock and the estimate share the error bar: keep
                // writes up to it before the trigger (none are expected).
                let slack = clock.err_ms.map(|e| (e * 1e6) as i128).unwrap_or(0);
                if at < trig_host - slack {
                    return None;
                }
                Some(Item {
                    what: What::of(r)?,
                    ms: (at - trig_host) as f64 / 1e6,
                    status: r["status"].as_u64().unwrap_or(0),
                    before_end: end_host.is_none_or(|e| at <= e),
                })
            })
            .collect();
        Got {
            items,
            end_ms: end_host.map(|e| (e - trig_host) as f64 / 1e6),
            clock: Some(clock),
            error: None,
            after_label: AFTER_END,
        }
    }

    /// The first successful write of this sort before the end, its ms.
    pub fn first(&self, f: impl Fn(&What) -> bool) -> Option<f64> {
        self.items
            .iter()
            .find(|i| i.before_end && i.ok() && f(&i.what))
            .map(|i| i.ms)
    }

    pub fn announced(&self) -> bool {
        self.first(What::announces).is_some()
    }

    /// The after-boot report of the shut-down boot that reached the double
    /// after it ended (answered 2xx): the PreviousBoot Event and the record
    /// delivered late, in order.
    pub fn reported_after(&self) -> Vec<&Item> {
        self.items
            .iter()
            .filter(|i| !i.before_end && i.ok())
            .filter(|i| {
                matches!(
                    &i.what,
                    What::Event(_, Some(_)) | What::NodePatch { late: true, .. }
                )
            })
            .collect()
    }

    /// The last gasp's evidence: the record annotation (one Node patch).
    pub fn evidence_ms(&self) -> Option<f64> {
        self.first(|w| {
            matches!(
                w,
                What::NodePatch {
                    record: true,
                    late: false,
                    ..
                }
            )
        })
    }

    /// The agent's taint set (it follows the evidence when time remains).
    pub fn taint_ms(&self) -> Option<f64> {
        self.first(|w| {
            matches!(
                w,
                What::NodePatch {
                    taint: Some(true),
                    ..
                }
            )
        })
    }

    /// The `ShutdownInProgress` condition set True.
    pub fn condition_ms(&self) -> Option<f64> {
        self.first(|w| matches!(w, What::Condition(s) if s.starts_with("True")))
    }

    /// Pod removals before the end, in order.
    pub fn pods_removed(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = Vec::new();
        for i in self.items.iter().filter(|i| i.before_end && i.ok()) {
            if let What::Pod(_, p) = &i.what {
                if !out.iter().any(|(x, _)| x == p) {
                    out.push((p.clone(), i.ms));
                }
            }
        }
        out
    }

    pub fn summary(&self, pods: &[(String, i64)]) -> String {
        if let Some(e) = &self.error {
            return format!("unknown: {e}");
        }
        let err = self
            .clock
            .as_ref()
            .and_then(|c| c.err_ms)
            .map(|e| format!(" (±{e:.0} ms)"))
            .unwrap_or_else(|| " (clock: upper bound only)".into());
        let label = |i: &Item| {
            let prio = match &i.what {
                What::Pod(_, p) => pods
                    .iter()
                    .find(|(x, _)| x == p)
                    .map(|(_, pr)| format!(" (prio {pr})"))
                    .unwrap_or_default(),
                _ => String::new(),
            };
            format!(
                "{}{prio} +{:.0}{}",
                i.what,
                i.ms,
                if i.ok() {
                    String::new()
                } else {
                    format!(" → {}", i.status)
                }
            )
        };
        let before: Vec<String> = self
            .items
            .iter()
            .filter(|i| i.before_end)
            .map(label)
            .collect();
        let after: Vec<String> = self
            .items
            .iter()
            .filter(|i| !i.before_end)
            .map(label)
            .collect();
        let mut s = if before.is_empty() {
            "nothing".to_string()
        } else {
            before.join("; ")
        };
        if !after.is_empty() {
            s.push_str(&format!("; {}: {}", self.after_label, after.join("; ")));
        }
        s + &err
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn req(method: &str, path: &str, body: Value) -> Value {
        json!({"method": method, "path": path, "body": body, "watch": false, "status": 200})
    }

    #[test]
    fn writes_are_classified() {
        let node = format!("/api/v1/nodes/{NODE}");
        let cases = [
            (
                req(
                    "PATCH",
                    &format!("{node}/status"),
                    json!({"status": {"conditions": [{"type": "ShutdownInProgress", "status": "True", "reason": "ForcedShutdown"}]}}),
                ),
                Some("condition ShutdownInProgress=True ForcedShutdown"),
                true,
            ),
            (
                req(
                    "PATCH",
                    &node,
                    json!({"metadata": {"annotations": {RECORD: "{}"}}, "spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]}}),
                ),
                Some("taint + record annotation"),
                true,
            ),
            (
                req("PATCH", &node, json!({"spec": {"taints": []}})),
                Some("taint removed"),
                false,
            ),
            (
                req(
                    "POST",
                    "/apis/events.k8s.io/v1/namespaces/default/events",
                    json!({"reason": "NodeShutdown"}),
                ),
                Some("Event NodeShutdown"),
                true,
            ),
            (
                req("DELETE", "/api/v1/namespaces/default/pods/web-1", json!({})),
                Some("delete default/web-1"),
                false,
            ),
            (
                req(
                    "POST",
                    "/api/v1/namespaces/default/pods/web-1/eviction",
                    json!({}),
                ),
                Some("evict default/web-1"),
                false,
            ),
            (
                req(
                    "POST",
                    "/apis/events.k8s.io/v1/namespaces/default/events",
                    json!({"reason": "NodeShutdown", "action": "PreviousBoot",
                           "note": "previous boot 1234 ended unannounced: no shutdown was seen"}),
                ),
                Some("Event NodeShutdown PreviousBoot (unannounced)"),
                true,
            ),
            (
                req(
                    "PATCH",
                    &node,
                    json!({"metadata": {"annotations": {RECORD: "{\"delivered_late\":true,\"back\":true}"}}}),
                ),
                Some("record annotation (delivered_late)"),
                true,
            ),
            (req("GET", &node, Value::Null), None, false),
        ];
        for (r, want, announces) in cases {
            let got = What::of(&r);
            assert_eq!(
                got.as_ref()
                    .map(std::string::ToString::to_string)
                    .as_deref(),
                want,
                "{r}"
            );
            assert_eq!(got.is_some_and(|w| w.announces()), announces, "{r}");
        }
    }

    /// The agent's own health condition alone is no shutdown write.
    #[test]
    fn the_agents_health_is_not_a_shutdown_write() {
        let status = format!("/api/v1/nodes/{NODE}/status");
        let health = json!({"type": "LastgaspDegraded", "status": "False", "reason": "Armed"});
        let alone = req(
            "PATCH",
            &status,
            json!({"status": {"conditions": [health]}}),
        );
        assert!(What::of(&alone).is_none());
        let with = req(
            "PATCH",
            &status,
            json!({"status": {"conditions": [health,
                {"type": "ShutdownInProgress", "status": "True", "reason": "GracefulShutdown"}]}}),
        );
        assert_eq!(
            What::of(&with).map(|w| w.to_string()).as_deref(),
            Some("condition ShutdownInProgress=True GracefulShutdown")
        );
    }

    #[test]
    fn seeded_pods_of_the_node() {
        let objects: Value =
            serde_json::from_str(include_str!("../../../tests/vm/cluster/objects.json")).unwrap();
        let pods = seeded_pods(&objects);
        assert!(pods.len() >= 3, "{pods:?}");
        let mut prios: Vec<i64> = pods.iter().map(|(_, p)| *p).collect();
        prios.dedup();
        assert!(prios.len() >= 3, "several priority classes: {pods:?}");
    }
}
