//! Prometheus metrics (prometheus-client), served by `crate::http` on
//! `/metrics`. Names are `lastgasp_*` with their unit; counters get
//! `_total` from the encoder. The kubelet-compatible
//! `graceful_shutdown_{start,end}_time_seconds` keep the kubelet's names.
use std::sync::{atomic::AtomicU64, Arc};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

use crate::{decide::Decision, signal::ShutdownSignal};

/// `lastgasp_previous_boots_ended_total`: a `report::BootEnd` name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndLabel {
    pub end: &'static str,
}

/// `lastgasp_detections_total`: the signal's summary, as serde names it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectionLabels {
    pub source: String,
    pub kind: String,
    pub scope: String,
}

/// `lastgasp_decisions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: &'static str,
}

/// `lastgasp_ringbuf_drops_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    pub scope: &'static str,
    pub reason: &'static str,
}

/// `lastgasp_hook_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HookLabel {
    pub hook: &'static str,
}

/// `lastgasp_hook_armed`: a hook of the start report and how it attached.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HookStateLabels {
    pub hook: String,
    pub attach: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BootLabel {
    pub boot_id: String,
}

/// `lastgasp_last_word_armed`: the shutdown hook, the courier...
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartLabel {
    pub part: &'static str,
}

/// Buckets of the last-gasp latency (seconds): 1 ms to 1 s.
pub const LAST_GASP_BUCKETS: &[f64] = &[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0];

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// The kubelet-compatible gauges (unix seconds; 0 = never).
    pub graceful_start: Gauge<f64, AtomicU64>,
    pub graceful_end: Gauge<f64, AtomicU64>,
    /// Past boots in the audit log, by how they ended.
    pub boots_ended: Family<EndLabel, Counter>,
    pub detections: Family<DetectionLabels, Counter>,
    pub decisions: Family<ActionLabel, Counter>,
    pub last_gasp_latency: Histogram,
    pub last_gasp_failures: Counter,
    /// An earlier boot's last gasp that never reached the API server,
    /// delivered by this boot: counted where it survives the node's death.
    pub last_gasps_delivered_late: Counter,
    /// Kernel records lost, by scope and cause.
    pub ringbuf_drops: Family<DropLabels, Counter>,
    pub hook_errors: Family<HookLabel, Counter>,
    pub hooks: Family<HookStateLabels, Gauge>,
    pub boot_info: Family<BootLabel, Gauge>,
    pub audit_failures: Counter,
    /// 1 while logind's delay lock is held and its signals are followed.
    pub graceful_path_armed: Gauge,
    /// The shutdown hook and the courier, 1 installed, 0 not.
    pub last_word_armed: Family<PartLabel, Gauge>,
}

fn label(v: impl serde::Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "unknown".into(),
    }
}

impl Default for Metrics {
    #[allow(clippy::too_many_lines)] // a table: one registration per metric
    fn default() -> Self {
        let mut r = Registry::default();
        let graceful_start = Gauge::<f64, AtomicU64>::default();
        let graceful_end = Gauge::<f64, AtomicU64>::default();
        r.register(
            "graceful_shutdown_start_time_seconds",
            "Last graceful shutdown start time since unix epoch in seconds",
            graceful_start.clone(),
        );
        r.register(
            "graceful_shutdown_end_time_seconds",
            "Last graceful shutdown end time since unix epoch in seconds",
            graceful_end.clone(),
        );
        let boots_ended = Family::default();
        r.register(
            "lastgasp_previous_boots_ended",
            "Past boots recorded in the audit log, by how they ended (graceful, forced, interrupted, unannounced)",
            boots_ended.clone(),
        );
        let detections = Family::default();
        r.register(
            "lastgasp_detections",
            "Shutdown signals seen, by detector (source), kind and scope (node or container)",
            detections.clone(),
        );
        let decisions = Family::default();
        r.register(
            "lastgasp_decisions",
            "Decisions taken on shutdown signals, by action (audit-only, pending, warn, graceful, immediate, last-word, cancel, abandon, expire, join)",
            decisions.clone(),
        );
        let last_gasp_latency = Histogram::new(LAST_GASP_BUCKETS.iter().copied());
        r.register_with_unit(
            "lastgasp_last_gasp_latency",
            "From the detection (kernel boot clock) to the last gasp's evidence (the record annotation) acknowledged by the API server",
            Unit::Seconds,
            last_gasp_latency.clone(),
        );
        let last_gasp_failures = Counter::default();
        r.register(
            "lastgasp_last_gasp_failures",
            "Last gasps the API server did not acknowledge (the record waits in the audit log for the next boot)",
            last_gasp_failures.clone(),
        );
        let last_gasps_delivered_late = Counter::default();
        r.register(
            "lastgasp_last_gasps_delivered_late",
            "Last gasps of an earlier boot that did not reach the API server before the node went down, delivered by this boot (the failure counted where it survives)",
            last_gasps_delivered_late.clone(),
        );
        let ringbuf_drops = Family::default();
        r.register(
            "lastgasp_ringbuf_drops",
            "Kernel records lost before the agent read them, by scope (node, container) and reason (full: the ring buffer; rate-limited: over the containers' rate in the kernel)",
            ringbuf_drops.clone(),
        );
        let hook_errors = Family::default();
        r.register(
            "lastgasp_hook_errors",
            "Kernel records a hook failed to write (a helper or a read that failed in the eBPF program), by hook",
            hook_errors.clone(),
        );
        let hooks = Family::default();
        r.register(
            "lastgasp_hook_armed",
            "Kernel hooks by attach method: 1 armed (possibly degraded), 0 refused by this kernel",
            hooks.clone(),
        );
        let boot_info = Family::default();
        r.register(
            "lastgasp_boot_info",
            "The node's current boot id (/proc/sys/kernel/random/boot_id), always 1",
            boot_info.clone(),
        );
        let audit_failures = Counter::default();
        r.register(
            "lastgasp_audit_write_failures",
            "Audit records (signals or outcomes) that could not be written and fsync'd",
            audit_failures.clone(),
        );
        let graceful_path_armed = Gauge::default();
        r.register(
            "lastgasp_graceful_path_armed",
            "1 while the graceful path is armed (logind's delay lock held, its signals followed); 0 without it: shutdowns are still seen and the last gasp sent, but nothing holds a shutdown for the pods to leave",
            graceful_path_armed.clone(),
        );
        let last_word_armed = Family::default();
        r.register(
            "lastgasp_last_word_armed",
            "1 while the part of the last word is installed (shutdown-hook: systemd-shutdown's hook; final-unit: lastgasp's unit systemd runs right before its final service, where the hook cannot be installed; courier: the binary either runs without the agent); 0 when it could not be: the last word then races the kernel's power-off",
            last_word_armed.clone(),
        );
        crate::http::register_build_info(&mut r, "agent");
        Metrics {
            registry: Arc::new(r),
            graceful_path_armed,
            last_word_armed,
            graceful_start,
            graceful_end,
            boots_ended,
            detections,
            decisions,
            last_gasp_latency,
            last_gasp_failures,
            last_gasps_delivered_late,
            ringbuf_drops,
            hook_errors,
            hooks,
            boot_info,
            audit_failures,
        }
    }
}

impl Metrics {
    /// How a boot ended: `end` is a `report::BootEnd` name.
    pub fn count_boot_end(&self, end: &'static str) {
        self.boots_ended.get_or_create(&EndLabel { end }).inc();
    }

    pub fn count_detection(&self, s: &ShutdownSignal) {
        let labels = DetectionLabels {
            source: label(s.source),
            kind: label(s.kind),
            scope: label(s.scope),
        };
        self.detections.get_or_create(&labels).inc();
    }

    pub fn count_decision(&self, d: &Decision) {
        let action = d.action.name();
        self.decisions.get_or_create(&ActionLabel { action }).inc();
    }

    /// One gauge per hook of the start report (not the BTF offsets line).
    /// One hook's state at start (the BTF offsets line is not a hook).
    pub fn set_hook(&self, hook: &str, attach: &str, armed: bool) {
        if hook == "task offsets" {
            return;
        }
        let labels = HookStateLabels {
            hook: hook.to_string(),
            attach: attach.to_string(),
        };
        self.hooks.get_or_create(&labels).set(i64::from(armed));
    }

    pub fn set_last_word(&self, part: &'static str, armed: bool) {
        self.last_word_armed
            .get_or_create(&PartLabel { part })
            .set(i64::from(armed));
    }

    pub fn set_boot(&self, boot_id: &str) {
        let boot_id = boot_id.to_string();
        self.boot_info.get_or_create(&BootLabel { boot_id }).set(1);
    }

    /// Records lost in the kernel, as it counts them (monotonic).
    /// `totals`: (scope, reason, records lost so far).
    pub fn set_ringbuf_drops(&self, totals: &[(&'static str, &'static str, u64)]) {
        for &(scope, reason, total) in totals {
            let c = self
                .ringbuf_drops
                .get_or_create(&DropLabels { scope, reason });
            let have = c.get();
            if total > have {
                c.inc_by(total - have);
            }
        }
    }

    /// Records the hooks failed to write, as the kernel counts them
    /// (monotonic): (hook, failures so far).
    pub fn set_hook_errors(&self, totals: impl IntoIterator<Item = (&'static str, u64)>) {
        for (hook, total) in totals {
            let c = self.hook_errors.get_or_create(&HookLabel { hook });
            let have = c.get();
            if total > have {
                c.inc_by(total - have);
            }
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("encoding metrics into a String");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_units_and_labels() {
        let m = Metrics::default();
        m.set_boot("abc");
        m.last_gasp_latency.observe(0.004);
        let d = |n| [("node", "full", 0), ("container", "rate-limited", n)];
        m.set_ringbuf_drops(&d(3));
        m.set_ringbuf_drops(&d(2));
        m.count_decision(&Decision {
            action: crate::decide::Action::AuditOnly { why: "x".into() },
            episode: None,
        });
        m.count_boot_end("unannounced");
        m.set_last_word("courier", true);
        let text = m.encode();
        for want in [
            "lastgasp_boot_info{boot_id=\"abc\"} 1",
            "lastgasp_last_gasp_latency_seconds_bucket{le=\"0.005\"} 1",
            "lastgasp_last_gasp_latency_seconds_count 1",
            "lastgasp_ringbuf_drops_total{scope=\"container\",reason=\"rate-limited\"} 3",
            "lastgasp_ringbuf_drops_total{scope=\"node\",reason=\"full\"} 0",
            "lastgasp_decisions_total{action=\"audit-only\"} 1",
            "lastgasp_previous_boots_ended_total{end=\"unannounced\"} 1",
            "lastgasp_last_word_armed{part=\"courier\"} 1",
            "lastgasp_audit_write_failures_total 0",
            "lastgasp_last_gasp_failures_total 0",
            "lastgasp_last_gasps_delivered_late_total 0",
            "# TYPE graceful_shutdown_start_time_seconds gauge",
            "lastgasp_graceful_path_armed 0",
            concat!(
                "lastgasp_build_info{version=\"",
                env!("CARGO_PKG_VERSION"),
                "\",component=\"agent\"} 1"
            ),
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
    }
}
