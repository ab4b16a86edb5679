//! The names lastgasp writes on Nodes and reads back: annotations, the
//! taint, the conditions, labels and field managers. deploy/'s admission
//! policies spell the same names in their CEL.

/// The Node annotation that holds the record.
pub const RECORD_ANNOTATION: &str = "lastgasp.dev/last-shutdown";
/// Beside the record, in a form admission can read: `<proof>/<boot id>`
/// while the record is open with a proof of death, absent otherwise. The
/// controller's out-of-service taint is admitted only on a Node carrying
/// one for its present boot (`deploy/`'s fence policy).
pub const PROOF_ANNOTATION: &str = "lastgasp.dev/proof";
/// The field manager of every write of the record: its `managedFields`
/// time on the Node is the API server's own time of the last record write
/// (whole seconds), which the controller reads instead of any node's clock.
pub const RECORD_MANAGER: &str = "lastgasp-record";

/// After a boot whose end its agent never saw (no shutdown in the audit log:
/// a power loss, a reset, a watchdog, a panic), the next boot's agent says
/// so on its Node. The controller's ledger keeps it as an `unannounced`
/// entry; nothing fences or drains on it. Written only by the node's own
/// agent (`deploy/`'s evidence policy).
pub const UNANNOUNCED_ANNOTATION: &str = "lastgasp.dev/unannounced-end";

// The agent's, on its own Node.

/// The node condition the agent owns (the kubelet owns Ready).
pub const CONDITION: &str = "ShutdownInProgress";
/// Upstream's drain conditions (KEP-5683's reserved names), reason
/// `NodeShutdown` while and after the graceful path drains the node.
/// Never `GracefulNodeShutdownInProgress`: that one is the kubelet's own.
pub const DRAIN_IN_PROGRESS: &str = "DrainInProgress";
pub const DRAINED: &str = "Drained";
/// The agent's own health on its Node: True while part of the graceful path
/// is lost (problem polarity, as node-problem-detector's conditions).
pub const DEGRADED: &str = "LastgaspDegraded";
pub const DRAIN_REASON: &str = "NodeShutdown";
/// The agent's own NoSchedule taint while a shutdown is under way.
pub const TAINT_KEY: &str = "lastgasp.dev/shutting-down";
/// Event reason, as the kubelet's shutdown manager uses.
pub const EVENT_REASON: &str = "NodeShutdown";

// The controller's fence.

pub const OUT_OF_SERVICE_KEY: &str = "node.kubernetes.io/out-of-service";
pub const OUT_OF_SERVICE_VALUE: &str = "nodeshutdown";
/// Marks a taint as ours, so that only ours is ever removed.
pub const TAINTED_BY_ANNOTATION: &str = "lastgasp.dev/out-of-service-by";
/// The boot id the node was fenced in: the taint goes only on another boot.
pub const FENCED_BOOT_ANNOTATION: &str = "lastgasp.dev/out-of-service-boot";
/// The field manager of the controller's Node writes: its `managedFields`
/// time is the API server's time of the fence.
pub const FENCE_MANAGER: &str = "lastgasp-controller";
/// The Node condition remediators match by type and status
/// (NodeHealthCheck, MachineHealthCheck): True only while this
/// controller's fence stands on proof that the node's kernel went down,
/// `lastTransitionTime` the API server's time of that proof; False once
/// the node is back (or the fence lifted). Never written by the agent.
pub const FENCED_CONDITION: &str = "PoweredOffAndFenced";
/// A Node labelled `lastgasp.dev/fencing=disabled` is never fenced (the
/// controller says when it would have been).
pub const OPT_OUT_LABEL: &str = "lastgasp.dev/fencing";
pub const OPT_OUT_VALUE: &str = "disabled";
/// The pause switch: `lastgasp.dev/paused: "true"` on the controller's own
/// Lease stops every fence and pod delete until it is removed; the
/// controller says what it holds back.
pub const PAUSE_ANNOTATION: &str = "lastgasp.dev/paused";
/// Who paused: `uninstall` when the uninstall's lift did (written under
/// the field manager [`UNINSTALL_MANAGER`], whose server stamp says when).
/// A controller whose own Deployment was created after that stamp is a
/// reinstall, and lifts that pause; an operator's pause stays.
pub const PAUSED_BY_ANNOTATION: &str = "lastgasp.dev/paused-by";
pub const UNINSTALL_MANAGER: &str = "lastgasp-uninstall";
