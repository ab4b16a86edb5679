//! The graceful path on the agent's own node: condition, taint and Event,
//! then pods bucket by bucket (lowest priority first), with the kubelet's
//! grace-period semantics; the state file and gauges at the end.
use std::{
    fs::{self, File},
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::{
    api::policy::v1::Eviction,
    apimachinery::pkg::apis::meta::v1::{
        DeleteOptions as K8sDeleteOptions, ObjectMeta, Preconditions as K8sPreconditions,
    },
};
use kube::{
    api::{DeleteParams, PostParams, Preconditions},
    runtime::events::EventType,
    Api, ResourceExt,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{retry::retryable, NodeClient};
use crate::{
    act::metrics::Metrics,
    decide::Episode,
    grace::{bucket_index, pod_grace_seconds, Bucket},
    record::{DrainNote, SlowPod},
};

/// How pods are removed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Removal {
    /// DELETE with gracePeriodSeconds (the kubelet's own behaviour).
    #[default]
    Delete,
    /// The Eviction API, honouring PodDisruptionBudgets; DELETE once the
    /// bucket's time is nearly out.
    Evict,
    /// Announce only: the condition, the taint, the record and the Events,
    /// and no pod removed (a staged rollout's first step).
    None,
}

/// Pods the drain leaves where they are (reported as `skipped-*`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keep {
    /// Pods a DaemonSet owns (it would recreate them on the node at once).
    pub daemonsets: bool,
    /// Pods in these namespaces.
    pub namespaces: Vec<String>,
    /// Pods whose labels include all of these.
    pub labels: std::collections::BTreeMap<String, String>,
}

impl Keep {
    /// Why `pod` stays, if it does.
    pub fn why(&self, pod: &Pod) -> Option<&'static str> {
        if self.daemonsets && pod.owner_references().iter().any(|o| o.kind == "DaemonSet") {
            return Some("skipped-daemonset");
        }
        if self
            .namespaces
            .iter()
            .any(|n| Some(n.as_str()) == pod.metadata.namespace.as_deref())
        {
            return Some("skipped-namespace");
        }
        let labels = pod.labels();
        if !self.labels.is_empty() && self.labels.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            return Some("skipped-labels");
        }
        None
    }
}

/// Eviction gives way to DELETE when this share of the bucket is left.
const EVICT_FALLBACK_SHARE: f64 = 0.25;
const EVICT_RETRY: Duration = Duration::from_millis(500);
const POLL: Duration = Duration::from_millis(50);

pub struct GracefulOptions {
    pub buckets: Vec<Bucket>,
    pub removal: Removal,
    /// The agent's own pod (namespace, name): never drained.
    pub own_pod: Option<(String, String)>,
    /// The kubelet-compatible `graceful_node_shutdown_state` file.
    pub state_file: PathBuf,
    /// Pods left out of the drain.
    pub keep: Keep,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct PodOutcome {
    pub namespace: String,
    pub name: String,
    pub priority: Option<i32>,
    pub bucket: i32,
    pub grace_seconds: i64,
    /// delete, evict, delete-after-pdb, skipped-mirror, skipped-finished
    pub how: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Milliseconds after the graceful path started.
    pub requested_ms: u64,
    pub gone_ms: Option<u64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct BucketRun {
    pub priority: i32,
    pub seconds: i64,
    pub pods: usize,
    pub started_ms: u64,
    pub ended_ms: u64,
    /// Its time ran out with pods still there.
    pub timed_out: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct GracefulReport {
    #[serde(with = "humantime_serde")]
    pub started: Option<SystemTime>,
    #[serde(with = "humantime_serde")]
    pub ended: Option<SystemTime>,
    pub buckets: Vec<BucketRun>,
    pub pods: Vec<PodOutcome>,
}

impl GracefulReport {
    /// Pods the graceful path stopped and waited for (not the skipped ones,
    /// the agent's own pod among them).
    fn counted(&self) -> impl Iterator<Item = &PodOutcome> {
        self.pods.iter().filter(|p| !p.how.starts_with("skipped"))
    }
    pub fn terminated(&self) -> usize {
        self.counted().filter(|p| p.gone_ms.is_some()).count()
    }
    pub fn remaining(&self) -> usize {
        self.counted().filter(|p| p.gone_ms.is_none()).count()
    }
    /// The drain in short, as its condition and Event say it.
    pub fn note(&self) -> DrainNote {
        let slowest = self
            .counted()
            .filter_map(|p| Some((p.gone_ms?.saturating_sub(p.requested_ms), p)))
            .max_by_key(|(ms, _)| *ms)
            .map(|(ms, p)| SlowPod {
                pod: format!("{}/{}", p.namespace, p.name),
                seconds: ms as f64 / 1000.0,
            });
        DrainNote {
            gone: self.terminated() as u32,
            left: self.remaining() as u32,
            slowest,
        }
    }
}

fn is_mirror(pod: &Pod) -> bool {
    pod.annotations()
        .contains_key("kubernetes.io/config.mirror")
}

fn is_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Runs the graceful path to its end (or until the caller drops it, on a
/// cancellation or an escalation).
pub async fn run(
    nc: &NodeClient,
    opts: &GracefulOptions,
    ep: &Episode,
    record: &crate::record::ShutdownRecord,
    metrics: &Metrics,
) -> Result<GracefulReport> {
    let t0 = Instant::now();
    let ms = move || t0.elapsed().as_millis() as u64;
    let started = SystemTime::now();
    let mut report = GracefulReport {
        started: Some(started),
        ..Default::default()
    };
    state_file(opts, metrics, started, None);
    metrics.graceful_start.set(unix_secs(started));
    announce_start(nc, opts, ep, record).await;

    let (kept, by_bucket) = sort_pods(nc, opts, ms());
    report.pods = kept;
    for (bucket, pods) in opts.buckets.iter().zip(&by_bucket) {
        if pods.is_empty() {
            continue;
        }
        let started_ms = ms();
        let now = Instant::now();
        let deadline = now
            .checked_add(Duration::from_secs(bucket.seconds.max(0) as u64))
            .unwrap_or(now + Duration::from_secs(86400 * 365));
        let outcomes = join_all(
            pods.iter()
                .map(|p| terminate(nc, opts.removal, bucket, p, deadline, ms)),
        )
        .await;
        report.buckets.push(BucketRun {
            priority: bucket.priority,
            seconds: bucket.seconds,
            pods: pods.len(),
            started_ms,
            ended_ms: ms(),
            timed_out: outcomes.iter().any(|o| o.gone_ms.is_none()),
        });
        report.pods.extend(outcomes);
    }

    let ended = SystemTime::now();
    state_file(opts, metrics, started, Some(ended));
    metrics.graceful_end.set(unix_secs(ended));
    report.ended = Some(ended);
    announce_end(nc, opts, &report).await;
    Ok(report)
}

/// The kubelet-compatible state file is a record for others: a disk that
/// refuses it must not stop the drain.
fn state_file(
    opts: &GracefulOptions,
    metrics: &Metrics,
    started: SystemTime,
    ended: Option<SystemTime>,
) {
    if let Err(e) = write_state(&opts.state_file, started, ended) {
        metrics.audit_failures.inc();
        tracing::error!(
            error = format!("{e:#}"),
            "graceful shutdown state file NOT written (the drain does not wait for it)"
        );
    }
}

/// The taint and the record in one patch, then the condition (see
/// `set_taint_and_record`); the Event beside them.
async fn announce_start(
    nc: &NodeClient,
    opts: &GracefulOptions,
    ep: &Episode,
    record: &crate::record::ShutdownRecord,
) {
    let how = ep
        .timeline
        .first()
        .map(|e| e.summary.clone())
        .unwrap_or_default();
    let message = format!("graceful {} shutdown (episode {}): {how}", ep.kind, ep.id);
    let ((t, c), e) = tokio::join!(
        async {
            let t = nc.set_taint_and_record(true, Some(record)).await;
            (t, nc.set_graceful(&message, opts.removal).await)
        },
        nc.event(
            EventType::Normal,
            "Shutdown",
            format!("Shutdown manager detected shutdown event: {message}")
        ),
    );
    for r in [t, c, e] {
        if let Err(err) = r {
            tracing::error!(
                error = format!("{err:#}"),
                "graceful start not fully written"
            );
        }
    }
}

/// The drain's end: the condition says drained or not, and an Event.
async fn announce_end(nc: &NodeClient, opts: &GracefulOptions, report: &GracefulReport) {
    let note = report.note().to_string();
    // Announce-only removes nothing: no drain to report.
    let (d, e) = tokio::join!(
        async {
            match opts.removal {
                Removal::None => Ok(()),
                _ => nc.set_drained(report.remaining() == 0, &note).await,
            }
        },
        nc.event(EventType::Normal, "Shutdown", note.clone())
    );
    for r in [d, e] {
        if let Err(err) = r {
            tracing::error!(error = format!("{err:#}"), "graceful end not fully written");
        }
    }
}

/// The pods as the warm watch has them (no list at shutdown time): the ones
/// that stay, as outcomes, and the rest by bucket.
fn sort_pods(
    nc: &NodeClient,
    opts: &GracefulOptions,
    now_ms: u64,
) -> (Vec<PodOutcome>, Vec<Vec<Arc<Pod>>>) {
    let mut kept = Vec::new();
    let mut by_bucket: Vec<Vec<Arc<Pod>>> = vec![Vec::new(); opts.buckets.len()];
    for pod in nc.pods.state() {
        let b = bucket_index(&opts.buckets, pod.spec.as_ref().and_then(|s| s.priority));
        match why_kept(opts, &pod) {
            Some(how) => kept.push(PodOutcome {
                how: how.into(),
                grace_seconds: 0,
                ..PodOutcome::of(&pod, opts.buckets[b].priority, now_ms)
            }),
            None => by_bucket[b].push(pod),
        }
    }
    (kept, by_bucket)
}

fn why_kept(opts: &GracefulOptions, pod: &Pod) -> Option<&'static str> {
    let (ns, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
    // The agent's own pod stays: it must live to the kernel's end and send
    // its last word (the proof of death the controller fences on).
    if opts.own_pod.as_ref() == Some(&(ns, name)) {
        Some("skipped-self")
    } else if is_mirror(pod) {
        Some("skipped-mirror")
    } else if is_finished(pod) {
        Some("skipped-finished")
    } else if opts.removal == Removal::None {
        Some("skipped-announce-only")
    } else {
        opts.keep.why(pod)
    }
}

impl PodOutcome {
    fn of(pod: &Pod, bucket: i32, now_ms: u64) -> Self {
        PodOutcome {
            namespace: pod.namespace().unwrap_or_default(),
            name: pod.name_any(),
            priority: pod.spec.as_ref().and_then(|s| s.priority),
            bucket,
            grace_seconds: 0,
            how: "delete".into(),
            note: None,
            requested_ms: now_ms,
            gone_ms: None,
        }
    }
}

/// Removes one pod and waits until it is gone or `deadline` passes.
async fn terminate(
    nc: &NodeClient,
    removal: Removal,
    bucket: &Bucket,
    pod: &Pod,
    deadline: Instant,
    ms: impl Fn() -> u64,
) -> PodOutcome {
    let own_grace = pod
        .spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds);
    let mut out = PodOutcome {
        grace_seconds: pod_grace_seconds(bucket, own_grace),
        ..PodOutcome::of(pod, bucket.priority, ms())
    };
    let (ns, name) = (out.namespace.clone(), out.name.clone());
    let api: Api<Pod> = Api::namespaced(nc.client.clone(), &ns);
    let sent = match removal {
        // Announce only: `run` never asks; nothing is sent.
        Removal::None => {
            out.how = "skipped-announce-only".into();
            return out;
        }
        Removal::Delete => send_delete(&api, pod, out.grace_seconds).await,
        Removal::Evict => evict(&api, pod, bucket, deadline, &mut out).await,
    };
    out.requested_ms = ms();
    if let Err(e) = sent {
        tracing::error!(pod = %format!("{ns}/{name}"), error = %e, "removal failed");
        out.note = Some(format!("removal failed: {e}"));
        return out;
    }
    let key = kube::runtime::reflector::ObjectRef::<Pod>::new(&name).within(&ns);
    loop {
        let present = nc.pods.get(&key).is_some_and(|p| p.uid() == pod.uid());
        if !present {
            out.gone_ms = Some(ms());
            return out;
        }
        if Instant::now() >= deadline {
            return out;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Evicts `pod`, retrying while a disruption budget refuses, and deletes it
/// once the bucket's time is nearly out.
async fn evict(
    api: &Api<Pod>,
    pod: &Pod,
    bucket: &Bucket,
    deadline: Instant,
    out: &mut PodOutcome,
) -> Result<(), kube::Error> {
    out.how = "evict".into();
    let fallback_at =
        deadline - Duration::from_secs_f64(bucket.seconds.max(0) as f64 * EVICT_FALLBACK_SHARE);
    // Built by hand: kube 5's EvictParams serialises its delete options as
    // `delete_options`, which the API server ignores (the grace period would
    // be lost).
    let eviction = Eviction {
        metadata: ObjectMeta {
            name: Some(out.name.clone()),
            namespace: Some(out.namespace.clone()),
            ..Default::default()
        },
        delete_options: Some(K8sDeleteOptions {
            grace_period_seconds: Some(out.grace_seconds.max(0)),
            preconditions: Some(K8sPreconditions {
                uid: pod.uid(),
                resource_version: None,
            }),
            ..Default::default()
        }),
    };
    loop {
        let sent = api
            .create_subresource::<_, kube::core::Status>(
                "eviction",
                &out.name,
                &PostParams::default(),
                &eviction,
            )
            .await;
        let refusal = match sent {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            // 429: a disruption budget says no; the causes name it.
            Err(kube::Error::Api(s)) if s.code == 429 => status_text(&s),
            Err(e) if retryable(&e) => e.to_string(),
            Err(e) => return Err(e),
        };
        out.note = Some(refusal.clone());
        if Instant::now() + EVICT_RETRY >= fallback_at {
            let left = deadline.saturating_duration_since(Instant::now()).as_secs() as i64;
            out.grace_seconds = out.grace_seconds.min(left);
            out.how = "delete-after-pdb".into();
            tracing::warn!(pod = %format!("{}/{}", out.namespace, out.name), refusal = %refusal,
                "eviction still refused with the bucket's time nearly out: deleting");
            return send_delete(api, pod, out.grace_seconds).await;
        }
        tokio::time::sleep(EVICT_RETRY).await;
    }
}

/// A Status's message and its causes (where an eviction names the budget).
fn status_text(s: &kube::core::Status) -> String {
    let mut text = s.message.clone();
    for c in s.details.iter().flat_map(|d| d.causes.iter()) {
        text.push_str(&format!(" {}", c.message));
    }
    text
}

async fn send_delete(api: &Api<Pod>, pod: &Pod, grace: i64) -> Result<(), kube::Error> {
    let dp = DeleteParams {
        grace_period_seconds: Some(grace.max(0) as u32),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    let name = pod.name_any();
    match super::retry::retry("delete pod", || api.delete(&name, &dp)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Undoes the graceful start: taint off, condition False, an Event.
pub async fn cancel(nc: &NodeClient, ep: &Episode) -> Result<()> {
    let message = format!("shutdown cancelled (episode {})", ep.id);
    let ((t, c), e) = tokio::join!(
        async {
            let t = nc.set_taint(false).await;
            (
                t,
                nc.set_condition(false, "ShutdownCancelled", &message).await,
            )
        },
        nc.event(
            EventType::Normal,
            "ShutdownCancelled",
            format!("Shutdown manager detected shutdown cancellation: {message}")
        ),
    );
    c.and(t).and(e)
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The kubelet's `graceful_node_shutdown_state`: {"startTime","endTime"},
/// written atomically (temp file, fsync, rename, fsync of the directory).
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct State {
    pub start_time: String,
    pub end_time: String,
}

pub fn write_state(path: &Path, start: SystemTime, end: Option<SystemTime>) -> Result<()> {
    let fmt = |t: SystemTime| humantime::format_rfc3339_nanos(t).to_string();
    let state = State {
        start_time: fmt(start),
        end_time: end
            .map(fmt)
            .unwrap_or_else(|| "0001-01-01T00:00:00Z".into()),
    };
    let dir = path.parent().context("state file has no directory")?;
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().unwrap().to_string_lossy()
    ));
    let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(&serde_json::to_vec(&state)?)?;
    f.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    File::open(dir)?.sync_all()?;
    Ok(())
}

pub fn read_state(path: &Path) -> Result<Option<State>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(
            serde_json::from_slice(&b).with_context(|| format!("parsing {}", path.display()))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}
