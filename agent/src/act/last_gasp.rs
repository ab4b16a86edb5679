//! The last gasp: when no time is left, tell the cluster in one round trip on
//! connections that are already open, within `LAST_GASP_BOUND`; what does
//! not get out is delivered after the next boot. logind's delay lock is
//! released once it is sent.
//!
//! One write carries the evidence the controller fences on: the record
//! annotation, alone, in one merge patch of the Node, as small as the
//! record can be. Annotations merge by key, so it needs no read and no
//! cache: nothing stands before it (no list, no discovery, no new
//! connection, no lock), and nothing in it can be stale. The condition (on
//! `nodes/NAME/status`) and the agent's NoSchedule taint (the whole taint
//! list, from a node watch kept warm since start) follow, side by side,
//! only once the evidence is answered and only while the node is expected
//! to be alive. When a whole zone goes dark at once every write counts at
//! the API server: nothing may stand in line before another node's evidence.
use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::{
    api::{Patch, PatchParams},
    runtime::{events::EventType, reflector, watcher},
    Api, Client,
};
use serde_json::{json, Value};

use super::{
    audit::Outcome,
    kube::{condition, record_params, shutdown_taint, TAINT_KEY},
    Cluster, Ctx, Hands, LAST_GASP_BOUND,
};
use crate::{
    clock,
    decide::Episode,
    record::ShutdownRecord,
    signal::{Kind, ShutdownSignal, Source},
};

/// Where the cluster stood when the last gasp was due.
pub(super) enum Reach {
    Here(Arc<Cluster>),
    /// Cluster mode, and the API server has not answered since the start.
    NotYet(Duration),
    Standalone,
}

/// The last gasp of `cx`'s episode: sent, audited, and logind's delay lock
/// released. Its outcome, in cluster mode.
pub(super) async fn last_gasp(
    cx: &Ctx,
    reach: Reach,
    s: &ShutdownSignal,
    escalated: bool,
    started: Instant,
) -> Option<Outcome> {
    let (hands, ep) = (&cx.hands, &cx.ep);
    let c = match reach {
        Reach::Here(c) => c,
        Reach::NotYet(waited) => {
            let error = format!(
                "the API server has not answered since the agent started (waited {waited:?})"
            );
            let outcome = failed(hands, ep, error).await;
            hands.release_lock();
            return Some(outcome);
        }
        Reach::Standalone => {
            hands.release_lock();
            return None;
        }
    };
    let record = ShutdownRecord::new(&hands.boot_id, s, ep);
    let (reason, message) = message(s, ep.kind, escalated);
    let bodies = c
        .lastgasp
        .bodies(reason, &message, &record, SystemTime::now());
    // The node's expected end, counted from the detection (its monotonic
    // time is not kept: from now, which is later by the handling).
    let death = Instant::now() + expected_life(s);
    let budget = LAST_GASP_BOUND.saturating_sub(started.elapsed());
    let outcome = match tokio::time::timeout(budget, c.lastgasp.send(&bodies, death)).await {
        Ok(Ok(sent)) => {
            // Delivered: the evidence was accepted (the condition may follow).
            let accepted =
                SystemTime::now() - sent.started.elapsed().saturating_sub(sent.evidence_done);
            let ms = accepted
                .duration_since(s.at)
                .map(|d| d.as_secs_f64() * 1e3)
                .unwrap_or(0.0);
            hands
                .metrics
                .last_gasp_latency
                .observe(since_detection(s, ms));
            let rest: Vec<String> = [&sent.condition, &sent.taint]
                .into_iter()
                .filter_map(|r| r.as_ref().err().cloned())
                .collect();
            if rest.is_empty() {
                tracing::info!(
                    ms = format!("{ms:.2}"),
                    tries = sent.tries,
                    "last gasp delivered"
                );
            } else {
                tracing::info!(
                    ms = format!("{ms:.2}"),
                    tries = sent.tries,
                    "last gasp delivered (the evidence; {})",
                    rest.join("; ")
                );
            }
            let outcome = Outcome::LastGaspDelivered { ms };
            hands.outcome(ep.id, outcome.clone()).await;
            outcome
        }
        Ok(Err(e)) => failed(hands, ep, e.to_string()).await,
        Err(_) => {
            let error = format!("no answer within {}s", LAST_GASP_BOUND.as_secs_f64());
            failed(hands, ep, error).await
        }
    };
    hands.release_lock();
    // The Event, like the condition, only while the node is expected to
    // live: past that, in a zone that went dark at once, it would only
    // stand in line before another node's evidence (the next boot's
    // PreviousBoot Event tells the story).
    if Instant::now() < death {
        tokio::spawn(async move {
            if let Err(e) = c.node.event(EventType::Warning, "Shutdown", message).await {
                tracing::warn!(error = format!("{e:#}"), "last gasp event");
            }
        });
    }
    Some(outcome)
}

/// Counted, logged, audited: the next boot delivers it.
async fn failed(hands: &Hands, ep: &Episode, error: String) -> Outcome {
    hands.metrics.last_gasp_failures.inc();
    tracing::error!(%error, "last gasp failed: it will be delivered after the next boot");
    let outcome = Outcome::LastGaspFailed { error };
    hands.outcome(ep.id, outcome.clone()).await;
    outcome
}

/// Seconds from the detection to now: on the kernel's boot clock when the
/// signal carries it (eBPF records are stamped in the kernel), else from the
/// wall clock (`wall_ms`, already measured).
fn since_detection(s: &ShutdownSignal, wall_ms: f64) -> f64 {
    if s.boot_ns > 0 {
        let now = clock::boottime_ns();
        if now >= s.boot_ns {
            return (now - s.boot_ns) as f64 / 1e9;
        }
    }
    wall_ms / 1e3
}

/// How long the node is expected to live after `s`, at most the last
/// gasp's own bound: none once the kernel itself is powering off (a
/// reboot(2) from the node, the kernel's power-off functions). The last
/// gasp sends nothing again past it.
pub fn expected_life(s: &ShutdownSignal) -> Duration {
    if matches!(s.source, Source::RebootSyscall | Source::KernelHook) {
        Duration::ZERO
    } else {
        LAST_GASP_BOUND
    }
}

/// How often idle connections are used, so that none is closed by the
/// server or the pool before a shutdown needs it.
const KEEP_WARM: Duration = Duration::from_secs(15);

#[derive(Clone)]
pub struct LastGasp {
    node: String,
    /// Its own client: the watches keep their connections busy, and these
    /// patches must not queue behind them.
    client: Client,
    nodes: Api<Node>,
    this_node: reflector::Store<Node>,
}

/// The writes: the evidence first, then the other two side by side.
#[derive(Debug, Clone)]
pub struct Bodies {
    /// The record annotation (`nodes/NAME`, merge patch).
    pub evidence: Value,
    /// The `ShutdownInProgress` condition (`nodes/NAME/status`).
    pub condition: Value,
    /// The agent's taint in the node's taint list (`nodes/NAME`).
    pub taint: Value,
}

#[derive(Debug, Clone)]
pub struct Sent {
    pub started: Instant,
    /// When the evidence was answered.
    pub evidence_done: Duration,
    /// How many times the evidence was sent (1: accepted on the first try).
    pub tries: u32,
    /// When the condition was answered, or why it did not go or failed.
    pub condition: Result<Duration, String>,
    /// When the taint was answered, or why it did not go or failed.
    pub taint: Result<Duration, String>,
}

/// Why one write was not accepted.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The API server answered with this status; 429 is its flow control,
    /// with the wait it asked for.
    Status {
        code: u16,
        retry_after: Option<Duration>,
        message: String,
    },
    /// No answer: the connection failed or timed out.
    Transport(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Status {
                code,
                retry_after: Some(w),
                message,
            } => write!(f, "{code} (retry after {}s): {message}", w.as_secs()),
            Refusal::Status { code, message, .. } => write!(f, "{code}: {message}"),
            Refusal::Transport(e) => write!(f, "no answer: {e}"),
        }
    }
}

/// The evidence was not accepted: the last refusal, after `tries` sends.
#[derive(Debug, Clone, thiserror::Error)]
#[error("last gasp: the evidence was not accepted after {tries} send(s): {last}; {why}")]
pub struct NotDelivered {
    pub tries: u32,
    pub last: Refusal,
    /// Why it was not sent again.
    pub why: String,
}

/// Whether a refused write is sent again before `death`, the node's
/// expected end: only when the wait the server asked for (none for a
/// connection that failed) ends before it. An answer that is not 429 is
/// final. `Err`: why not.
pub fn retry_at(r: &Refusal, now: Instant, death: Instant) -> Result<Instant, String> {
    let wait = match r {
        Refusal::Status {
            code: 429,
            retry_after,
            ..
        } => retry_after.unwrap_or(Duration::from_secs(1)),
        Refusal::Status { code, .. } => return Err(format!("{code} is final")),
        Refusal::Transport(_) => Duration::ZERO,
    };
    let at = now + wait;
    if at < death {
        Ok(at)
    } else {
        Err(format!(
            "a retry {}ms from now would leave after the node's expected end ({}ms from now): \
             delivered after the next boot",
            wait.as_millis(),
            death.saturating_duration_since(now).as_millis()
        ))
    }
}

impl LastGasp {
    /// Warms the connections and starts the node watch.
    pub async fn start(watch_client: Client, patch_client: Client, node: &str) -> Result<Self> {
        let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let store =
            crate::apiserver::warm_store(Api::all(watch_client), config, "node", |_| {}).await?;
        let lg = LastGasp {
            node: node.to_string(),
            nodes: Api::all(patch_client.clone()),
            client: patch_client,
            this_node: store,
        };
        lg.warm().await;
        let warm = lg.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(KEEP_WARM).await;
                warm.warm().await;
            }
        });
        Ok(lg)
    }

    /// Two requests at once, so that the pool keeps two open connections
    /// (HTTP/1.1); over HTTP/2 they share one.
    async fn warm(&self) {
        let (a, b) = tokio::join!(
            self.nodes.get_metadata(&self.node),
            self.nodes.get_metadata(&self.node)
        );
        if let Err(e) = a.and(b) {
            tracing::warn!(error = %e, "keeping the API connections warm");
        }
    }

    fn current_taints(&self) -> Vec<Taint> {
        self.this_node
            .state()
            .first()
            .and_then(|n| n.spec.as_ref()?.taints.clone())
            .unwrap_or_default()
    }

    /// The bodies.
    /// The node these patches are for.
    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn bodies(
        &self,
        reason: &str,
        message: &str,
        record: &ShutdownRecord,
        at: SystemTime,
    ) -> Bodies {
        let cond = condition(true, reason, message, at);
        let mut taints = self.current_taints();
        if !taints.iter().any(|t| t.key == TAINT_KEY) {
            taints.push(shutdown_taint(at));
        }
        Bodies {
            evidence: json!({ "metadata": { "annotations": record.annotations() } }),
            condition: json!({ "status": { "conditions": [cond] } }),
            taint: json!({ "spec": { "taints": taints } }),
        }
    }

    /// The evidence, sent again only while a retry can land before `death`
    /// ([`retry_at`]); then, if it was accepted before `death`, the condition
    /// and the taint side by side (once each, no retry). Returns when all
    /// that went is answered.
    pub async fn send(&self, bodies: &Bodies, death: Instant) -> Result<Sent, NotDelivered> {
        let started = Instant::now();
        let mut tries = 0;
        loop {
            tries += 1;
            match self
                .patch("", &record_params(), &Patch::Merge(&bodies.evidence))
                .await
            {
                Ok(()) => break,
                Err(last) => match retry_at(&last, Instant::now(), death) {
                    Ok(at) => tokio::time::sleep_until(at.into()).await,
                    Err(why) => return Err(NotDelivered { tries, last, why }),
                },
            }
        }
        let evidence_done = started.elapsed();
        let (condition, taint) = if Instant::now() < death {
            let (c, t) = (
                Patch::Strategic(&bodies.condition),
                Patch::Merge(&bodies.taint),
            );
            let p = PatchParams::default();
            let (c, t) = tokio::join!(
                async {
                    self.patch("status", &p, &c)
                        .await
                        .map(|()| started.elapsed())
                },
                async { self.patch("", &p, &t).await.map(|()| started.elapsed()) },
            );
            (
                c.map_err(|e| format!("condition: {e}")),
                t.map_err(|e| format!("taint: {e}")),
            )
        } else {
            let no = || Err("no time left".to_string());
            (no(), no())
        };
        Ok(Sent {
            started,
            evidence_done,
            tries,
            condition,
            taint,
        })
    }

    /// One PATCH of the Node (`sub`: "" or "status"), never sent again,
    /// read to its end so that the connection stays open; a refusal keeps
    /// the server's Retry-After (kube's typed errors drop the headers).
    pub async fn patch(
        &self,
        sub: &str,
        params: &PatchParams,
        patch: &Patch<&Value>,
    ) -> Result<(), Refusal> {
        let req = kube::core::Request::new("/api/v1/nodes");
        let req = if sub.is_empty() {
            req.patch(&self.node, params, patch)
        } else {
            req.patch_subresource(sub, &self.node, params, patch)
        }
        .map_err(|e| Refusal::Transport(e.to_string()))?;
        let resp = self
            .client
            .send(req.map(kube::client::Body::from))
            .await
            .map_err(|e| Refusal::Transport(format!("{e:#}")))?;
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(::http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| Refusal::Transport(format!("reading the answer: {e}")))?
            .to_bytes();
        if status.is_success() {
            return Ok(());
        }
        let message = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_string());
        Err(Refusal::Status {
            code: status.as_u16(),
            retry_after,
            message,
        })
    }
}

/// The last gasp's condition reason and message: how the node goes down,
/// through which path, by whom.
pub fn message(s: &ShutdownSignal, kind: Kind, escalated: bool) -> (&'static str, String) {
    let reason = if s.forced {
        "ForcedShutdown"
    } else {
        "ImmediateShutdown"
    };
    let actor = s
        .actor
        .as_ref()
        .map(|a| format!("{} ({})", a.comm, a.pid))
        .unwrap_or_default();
    let during = if escalated {
        " during a graceful shutdown"
    } else {
        ""
    };
    (
        reason,
        format!(
            "{kind} with no time left via {}{during} by {actor}",
            s.source
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: u16, after: Option<u64>) -> Refusal {
        Refusal::Status {
            code,
            retry_after: after.map(Duration::from_secs),
            message: "x".into(),
        }
    }

    #[test]
    fn no_retry_past_the_nodes_expected_end() {
        let now = Instant::now();
        let s = Duration::from_secs;
        // A 429 whose wait ends before the end is sent again then.
        assert_eq!(
            retry_at(&refused(429, Some(1)), now, now + s(2)),
            Ok(now + s(1))
        );
        // ... not when it would end after it, nor at it.
        assert!(retry_at(&refused(429, Some(3)), now, now + s(2)).is_err());
        assert!(retry_at(&refused(429, Some(1)), now, now + s(1)).is_err());
        // No Retry-After: the server's usual second.
        assert!(retry_at(&refused(429, None), now, now + Duration::from_millis(500)).is_err());
        // A dropped connection is sent again at once, while there is time.
        let t = Refusal::Transport("reset".into());
        assert_eq!(retry_at(&t, now, now + s(1)), Ok(now));
        assert!(retry_at(&t, now, now).is_err());
        // Any other answer is final.
        let why = retry_at(&refused(403, None), now, now + s(60)).unwrap_err();
        assert!(why.contains("403"), "{why}");
    }

    /// Once the kernel itself is powering off, the last gasp has no time
    /// for a retry or the condition; anything before it has its bound.
    #[test]
    fn the_node_has_no_time_once_the_kernel_powers_off() {
        let b = LAST_GASP_BOUND;
        for (source, life) in [
            (Source::RebootSyscall, Duration::ZERO),
            (Source::KernelHook, Duration::ZERO),
            (Source::Exec, b),
            (Source::SignalPid1, b),
            (Source::Logind, b),
            (Source::Systemd, b),
        ] {
            let s = ShutdownSignal::of(source, Kind::Poweroff).forced(true);
            assert_eq!(expected_life(&s), life, "{source:?}");
        }
    }
}
