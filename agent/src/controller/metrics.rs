//! The controller's metrics (its own endpoint), each family's labels a
//! type of their own.
use std::{collections::BTreeMap, sync::Arc};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet, EncodeLabelValue},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: &'static str,
}

/// Where the controller failed (`lastgasp_controller_pass_errors_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Stage {
    /// The pass itself: the Lease, the lists.
    pass,
    /// The node Leases were not read: no fence that pass.
    leases,
    /// A fence, a pod delete or a condition write failed.
    action,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    stage: Stage,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabel {
    result: &'static str,
}

/// A ledger entry's facets (`lastgasp_controller_ledger_entries`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct EntryLabels {
    pub kind: String,
    pub path: String,
    pub ending: String,
    pub graceful: String,
}

/// The controller's metrics (`lastgasp controller`, its own endpoint).
#[derive(Clone)]
pub struct ControllerMetrics {
    registry: Arc<Registry>,
    pub lease_held: Gauge,
    actions: Family<ActionLabel, Counter>,
    pass_errors: Family<ErrorLabel, Counter>,
    pub nodes: Gauge,
    pub fenced: Gauge,
    pub pods_deleted: Counter,
    pub paused: Gauge,
    ledger_entries: Family<EntryLabels, Gauge>,
    ledger_writes: Family<WriteLabel, Counter>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let lease_held = Gauge::default();
        r.register(
            "lastgasp_controller_lease_held",
            "1 while this replica holds the Lease (the active one), else 0",
            lease_held.clone(),
        );
        let actions = Family::<ActionLabel, Counter>::default();
        r.register(
            "lastgasp_controller_actions",
            "What the controller did or held back: taint-added, taint-removed, kept-same-boot, condition-cleared, contradicted, would-fence (policy observe), held-opted-out, held-paused, held-ceiling, refused-rate-limit",
            actions.clone(),
        );
        let pass_errors = Family::<ErrorLabel, Counter>::default();
        r.register(
            "lastgasp_controller_pass_errors",
            "Controller errors by stage: pass (the pass itself: the Lease, the lists), leases (the node Leases not read: no fence that pass), action (a fence, a delete or a condition failed)",
            pass_errors.clone(),
        );
        let nodes = Gauge::default();
        r.register(
            "lastgasp_controller_nodes",
            "Nodes in the controller's watch at its last pass",
            nodes.clone(),
        );
        let fenced = Gauge::default();
        r.register(
            "lastgasp_controller_fenced_nodes",
            "Nodes that carry this controller's out-of-service taint (a node that never returns stays here)",
            fenced.clone(),
        );
        let pods_deleted = Counter::default();
        r.register(
            "lastgasp_controller_pods_deleted",
            "Pods of fenced nodes deleted with grace 0",
            pods_deleted.clone(),
        );
        let paused = Gauge::default();
        r.register(
            "lastgasp_controller_paused",
            "1 while fencing is paused (lastgasp.dev/paused on the controller's Lease), as the leader last read it",
            paused.clone(),
        );
        let ledger_entries = Family::<EntryLabels, Gauge>::default();
        r.register(
            "lastgasp_controller_ledger_entries",
            "NodeShutdowns in the ledger by kind, path, ending and graceful, as the leader holds them (read back from the cluster at start: a dead node's shutdown is counted here)",
            ledger_entries.clone(),
        );
        let ledger_writes = Family::<WriteLabel, Counter>::default();
        r.register(
            "lastgasp_controller_ledger_writes",
            "The ledger's writes by result: applied, failed, pruned (the retention's deletes)",
            ledger_writes.clone(),
        );
        crate::http::register_build_info(&mut r, "controller");
        ControllerMetrics {
            registry: Arc::new(r),
            lease_held,
            actions,
            pass_errors,
            nodes,
            fenced,
            pods_deleted,
            paused,
            ledger_entries,
            ledger_writes,
        }
    }
}

impl ControllerMetrics {
    pub fn count_ledger_write(&self, result: &'static str, n: u64) {
        self.ledger_writes
            .get_or_create(&WriteLabel { result })
            .inc_by(n);
    }

    pub fn count_error(&self, stage: Stage) {
        self.pass_errors.get_or_create(&ErrorLabel { stage }).inc();
    }

    /// The ledger's counts, replaced whole: an entry the retention dropped
    /// leaves no series behind.
    pub fn set_ledger_entries(&self, specs: impl Iterator<Item = EntryLabels>) {
        let mut counts: BTreeMap<EntryLabels, i64> = BTreeMap::new();
        for labels in specs {
            *counts.entry(labels).or_default() += 1;
        }
        self.ledger_entries.clear();
        for (l, n) in counts {
            self.ledger_entries.get_or_create(&l).set(n);
        }
    }

    pub fn count_action(&self, action: &'static str) {
        self.actions.get_or_create(&ActionLabel { action }).inc();
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
    fn names_and_labels() {
        let c = ControllerMetrics::default().encode();
        for want in [
            "component=\"controller\"} 1",
            "lastgasp_controller_lease_held 0",
        ] {
            assert!(c.contains(want), "{want} missing:\n{c}");
        }
        // The ledger's counts are replaced whole: a pruned entry's series goes.
        let c = ControllerMetrics::default();
        let entry = |ending: &str| EntryLabels {
            kind: "poweroff".into(),
            path: "immediate".into(),
            ending: ending.into(),
            graceful: "false".into(),
        };
        c.set_ledger_entries([entry("fenced"), entry("fenced"), entry("back")].into_iter());
        c.count_ledger_write("applied", 3);
        c.count_error(Stage::leases);
        let text = c.encode();
        for want in [
            "lastgasp_controller_ledger_entries{kind=\"poweroff\",path=\"immediate\",ending=\"fenced\",graceful=\"false\"} 2",
            "lastgasp_controller_ledger_entries{kind=\"poweroff\",path=\"immediate\",ending=\"back\",graceful=\"false\"} 1",
            "lastgasp_controller_ledger_writes_total{result=\"applied\"} 3",
            "lastgasp_controller_pass_errors_total{stage=\"leases\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        c.set_ledger_entries([entry("back")].into_iter());
        let text = c.encode();
        assert!(!text.contains("ending=\"fenced\""), "{text}");
    }
}
