//! Prometheus metrics (prometheus-client). The HTTP endpoint serves
//! `Metrics::encode`.
use std::sync::{atomic::AtomicU64, Arc};

use prometheus_client::{encoding::text::encode, metrics::gauge::Gauge, registry::Registry};

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// The kubelet-compatible gauges (unix seconds; 0 = never).
    pub graceful_start: Gauge<f64, AtomicU64>,
    pub graceful_end: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let graceful_start = Gauge::<f64, AtomicU64>::default();
        let graceful_end = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "graceful_shutdown_start_time_seconds",
            "Last graceful shutdown start time since unix epoch in seconds",
            graceful_start.clone(),
        );
        registry.register(
            "graceful_shutdown_end_time_seconds",
            "Last graceful shutdown end time since unix epoch in seconds",
            graceful_end.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            graceful_start,
            graceful_end,
        }
    }
}

impl Metrics {
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("encoding metrics into a String");
        out
    }
}
