//! The simulated kubelet: starts pods bound to a node, and finishes
//! terminating pods after their termination time (capped by the grace period)
//! or, for "hanging" pods, kills them when the grace period runs out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::ops::{self, DeleteOpts};
use crate::resources::lookup;
use crate::store::{KubeletState, State};
use crate::util::{get, is_deleting, name_of, now_time, ns_of, s, uid_of};
use crate::Shared;

/// Knobs of the simulated kubelet (one for all nodes), from [`crate::ApiDouble::kubelet`].
#[derive(Clone)]
pub struct Kubelet {
    pub(crate) shared: Arc<Shared>,
}

impl Kubelet {
    fn with<R>(&self, f: impl FnOnce(&mut KubeletState) -> R) -> R {
        let r = self.shared.write(|st| f(&mut st.kubelet));
        self.shared.kubelet_wake.notify_one();
        r
    }

    /// How long a terminating pod takes to exit after its deletionTimestamp is set
    /// (default 50 ms), always capped by its grace period.
    pub fn set_default_termination(&self, d: Duration) {
        self.with(|k| k.default_termination = d);
    }

    pub fn set_termination(&self, ns: &str, name: &str, d: Duration) {
        self.with(|k| {
            k.pods
                .entry((ns.into(), name.into()))
                .or_default()
                .termination = Some(d);
        });
    }

    /// A hanging pod ignores SIGTERM: it is killed when its grace period runs out.
    pub fn hang(&self, ns: &str, name: &str) {
        self.with(|k| k.pods.entry((ns.into(), name.into())).or_default().hang = true);
    }

    /// Whether terminating pods are finished automatically (off: they stay terminating
    /// until [`crate::ApiDouble::finish_pod`], as with a dead kubelet).
    pub fn set_auto_finish(&self, on: bool) {
        self.with(|k| k.auto_finish = on);
    }

    /// Whether Pending pods bound to a node are started (Running, Ready) automatically.
    pub fn set_auto_start(&self, on: bool) {
        self.with(|k| k.auto_start = on);
    }

    /// Stop (false) or restart (true) the kubelet of one node: its pods are neither started nor finished.
    pub fn set_node_running(&self, node: &str, running: bool) {
        self.with(|k| {
            if running {
                k.nodes_down.remove(node);
            } else {
                k.nodes_down.insert(node.into());
            }
        });
    }
}

fn pods_def() -> &'static crate::resources::ResourceDef {
    lookup("", "v1", "pods").expect("pods")
}

/// Finish a terminating pod now: terminal status, then the kubelet's final
/// delete (gracePeriodSeconds=0 with a UID precondition). `killed` marks a
/// SIGKILL at the end of the grace period.
pub fn finish(st: &mut State, ns: &str, name: &str, killed: bool) -> bool {
    let Some(pod) = st.get("pods", ns, name).cloned() else {
        return false;
    };
    if !is_deleting(&pod) {
        return false;
    }
    let mut p = pod.clone();
    let (phase, code, reason) = if killed {
        ("Failed", 137, "Error")
    } else {
        ("Succeeded", 0, "Completed")
    };
    if s(&p, &["status", "phase"]) != Some(phase)
        && !matches!(s(&p, &["status", "phase"]), Some("Failed" | "Succeeded"))
    {
        let now = now_time();
        let statuses: Vec<Value> = containers(&p)
            .map(|c| {
                let started = get(&pod, &["status", "containerStatuses"])
                    .and_then(Value::as_array)
                    .and_then(|a| a.iter().find(|cs| cs.get("name") == c.get("name")))
                    .and_then(|cs| get(cs, &["state", "running", "startedAt"]).cloned())
                    .unwrap_or_else(|| json!(now));
                json!({
                    "name": c.get("name").cloned().unwrap_or(json!("")),
                    "image": c.get("image").cloned().unwrap_or(json!("")),
                    "imageID": "",
                    "ready": false,
                    "started": false,
                    "restartCount": 0,
                    "state": { "terminated": { "exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now } }
                })
            })
            .collect();
        let st_map = crate::util::obj_mut(&mut p, &["status"]);
        st_map.insert("phase".into(), json!(phase));
        st_map.insert("containerStatuses".into(), json!(statuses));
        ops::set_pod_condition(&mut p, "Ready", "False", "PodCompleted", "");
        ops::set_pod_condition(&mut p, "ContainersReady", "False", "PodCompleted", "");
        ops::write_pod_status(st, &p);
    }
    let opts = DeleteOpts {
        grace: Some(0),
        precond_uid: Some(uid_of(&pod).to_string()),
        ..Default::default()
    };
    let _ = ops::delete(st, pods_def(), ns, name, &opts);
    true
}

fn start(st: &mut State, pod: &Value) {
    let now = now_time();
    let mut p = pod.clone();
    let statuses: Vec<Value> = containers(&p)
        .map(|c| {
            json!({
                "name": c.get("name").cloned().unwrap_or(json!("")),
                "image": c.get("image").cloned().unwrap_or(json!("")),
                "imageID": "",
                "containerID": format!("containerd://{}", uid_of(pod).replace('-', "")),
                "ready": true,
                "started": true,
                "restartCount": 0,
                "state": { "running": { "startedAt": now } }
            })
        })
        .collect();
    let st_map = crate::util::obj_mut(&mut p, &["status"]);
    st_map.insert("phase".into(), json!("Running"));
    st_map.entry("startTime").or_insert(json!(now));
    st_map.insert("containerStatuses".into(), json!(statuses));
    for c in [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ] {
        ops::set_pod_condition(&mut p, c, "True", "", "");
    }
    ops::write_pod_status(st, &p);
}

/// One pass: start and finish what is due; returns the next deadline.
fn tick(st: &mut State) -> Option<Instant> {
    let now = Instant::now();
    let k = st.kubelet.clone();
    let mut next: Option<Instant> = None;
    let mut to_finish = Vec::new();
    let mut to_start = Vec::new();
    for pod in st.list("pods", None) {
        let node = s(pod, &["spec", "nodeName"]).unwrap_or("");
        if node.is_empty() || k.nodes_down.contains(node) {
            continue;
        }
        let key = (ns_of(pod).to_string(), name_of(pod).to_string());
        if is_deleting(pod) {
            if !k.auto_finish {
                continue;
            }
            let grace = get(pod, &["metadata", "deletionGracePeriodSeconds"])
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if grace <= 0 {
                continue; // waiting for finalizers
            }
            let Some(since) = st.terminating_since.get(uid_of(pod)).copied() else {
                to_finish.push((key, false, true));
                continue;
            };
            let knobs = k.pods.get(&key).cloned().unwrap_or_default();
            let grace_d = Duration::from_secs(grace as u64);
            let (due, killed) = if knobs.hang {
                (since + grace_d, true)
            } else {
                let t = knobs.termination.unwrap_or(k.default_termination);
                if t >= grace_d {
                    (since + grace_d, true)
                } else {
                    (since + t, false)
                }
            };
            if due <= now {
                to_finish.push((key, killed, false));
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        } else if k.auto_start && matches!(s(pod, &["status", "phase"]), None | Some("Pending")) {
            to_start.push(pod.clone());
        }
    }
    for ((ns, name), killed, unseen) in to_finish {
        if unseen {
            // A seeded pod that was already terminating: start its clock now.
            if let Some(uid) = st.get("pods", &ns, &name).map(|p| uid_of(p).to_string()) {
                st.terminating_since.insert(uid, now);
            }
            next = Some(now);
            continue;
        }
        finish(st, &ns, &name, killed);
    }
    for pod in to_start {
        start(st, &pod);
    }
    next
}

pub(crate) async fn run(shared: Arc<Shared>) {
    let mut rv_rx = shared.rv_tx.subscribe();
    loop {
        let next = shared.write(tick);
        let sleep = async {
            match next {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            r = rv_rx.changed() => { if r.is_err() { return; } }
            _ = shared.kubelet_wake.notified() => {}
            _ = sleep => {}
        }
    }
}

/// The pod's containers (none when the spec lists none).
fn containers(pod: &Value) -> impl Iterator<Item = &Value> {
    get(pod, &["spec", "containers"])
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}
