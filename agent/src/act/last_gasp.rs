//! The last gasp: the record, with the proof when there is one, sent at
//! once within `LAST_GASP_BOUND` (on the warm connections of
//! `kube::lastgasp`); what does not get out is delivered after the next
//! boot. logind's delay lock is released once it is sent.
use std::time::{Instant, SystemTime};

use kube::runtime::events::EventType;

use super::{audit::Outcome, kube::lastgasp, Actuator, LAST_GASP_BOUND};
use crate::{
    decide::{self, Episode},
    detect::clock,
    signal::ShutdownSignal,
};

impl Actuator {
    pub(super) async fn last_gasp(&mut self, s: &ShutdownSignal, ep: &Episode, escalated: bool) {
        let started = Instant::now();
        let coming = self.link.coming.is_some();
        let Some(c) = self.cluster_within(LAST_GASP_BOUND).await else {
            if coming {
                let error = format!(
                    "the API server has not answered since the agent started (waited {:?})",
                    started.elapsed()
                );
                self.failed(ep, error).await;
            }
            self.hands.release_lock();
            return;
        };
        // Sent now: nothing is left for the join.
        self.link.unsent = None;
        let record = self.hands.record(s, ep);
        let (reason, message) = lastgasp::message(s, ep.kind, escalated);
        let bodies = c
            .lastgasp
            .bodies(reason, &message, &record, SystemTime::now());
        // The node's expected end, counted from the detection (its monotonic
        // time is not kept: from now, which is later by the handling).
        let death = Instant::now() + decide::expected_life(s, LAST_GASP_BOUND);
        let budget = LAST_GASP_BOUND.saturating_sub(started.elapsed());
        match tokio::time::timeout(budget, c.lastgasp.send(&bodies, death)).await {
            Ok(Ok(sent)) => {
                // Delivered: the evidence was accepted (the condition may follow).
                let accepted =
                    SystemTime::now() - sent.started.elapsed().saturating_sub(sent.evidence_done);
                let ms = accepted
                    .duration_since(s.at)
                    .map(|d| d.as_secs_f64() * 1e3)
                    .unwrap_or(0.0);
                let metrics = &self.hands.metrics;
                metrics.last_gasp_latency.observe(since_detection(s, ms));
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
                self.last_delivery = Some(outcome.clone());
                self.hands.outcome(ep.id, outcome).await;
            }
            Ok(Err(e)) => self.failed(ep, e.to_string()).await,
            Err(_) => {
                let error = format!("no answer within {}s", LAST_GASP_BOUND.as_secs_f64());
                self.failed(ep, error).await;
            }
        }
        self.hands.release_lock();
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
    }

    /// Counted, logged, audited: the next boot delivers it.
    async fn failed(&mut self, ep: &Episode, error: String) {
        self.hands.metrics.last_gasp_failures.inc();
        tracing::error!("last gasp failed: {error}; it will be delivered after the next boot");
        let outcome = Outcome::LastGaspFailed { error };
        self.last_delivery = Some(outcome.clone());
        self.hands.outcome(ep.id, outcome).await;
    }
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
