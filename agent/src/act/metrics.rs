//! Prometheus metrics (prometheus-client). The HTTP endpoint serves
//! `Metrics::encode`.
use std::sync::{atomic::AtomicU64, Arc};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::report::BootEnd;

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// The kubelet-compatible gauges (unix seconds; 0 = never).
    pub graceful_start: Gauge<f64, AtomicU64>,
    pub graceful_end: Gauge<f64, AtomicU64>,
    /// Past boots in the audit log, by how they ended.
    pub boots_ended: Family<Vec<(String, String)>, Counter>,
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
        let boots_ended = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "lastgasp_previous_boots_ended",
            "Past boots recorded in the audit log, by how they ended",
            boots_ended.clone(),
        );
        Metrics { registry: Arc::new(registry), graceful_start, graceful_end, boots_ended }
    }
}

impl Metrics {
    pub fn count_boot_end(&self, end: BootEnd) {
        self.boots_ended.get_or_create(&vec![("end".to_string(), end.as_str().to_string())]).inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("encoding metrics into a String");
        out
    }
}
