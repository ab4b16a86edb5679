//! What the cluster sees: the node's condition and taint, Events, and the
//! graceful termination of the node's pods.
pub mod graceful;
pub(crate) mod preflight;
pub(crate) mod retry;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::Result;
use k8s_openapi::{
    api::core::v1::{Node, NodeCondition, ObjectReference, Pod, Taint},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    api::{Patch, PatchParams},
    runtime::{
        events::{Event, EventType, Recorder, Reporter},
        reflector::Store,
        watcher,
    },
    Api, Client,
};
use serde_json::json;

use self::retry::retry;
use crate::record::{
    self, Closing, EpisodeKey, ShutdownRecord, UnannouncedEnd, RECORD_MANAGER,
    UNANNOUNCED_ANNOTATION,
};

pub use lastgasp_common::names::{
    CONDITION, DEGRADED, DRAINED, DRAIN_IN_PROGRESS, DRAIN_REASON, EVENT_REASON, TAINT_KEY,
};
/// The `ShutdownInProgress` reason of the graceful path's start.
const GRACEFUL_REASON: &str = "GracefulShutdown";
pub use crate::record::RECORD_ANNOTATION;

/// By (type, action): the last note and the Recorder that published it.
type Recorders = HashMap<(EventType, String), (String, Recorder)>;

/// The agent's view of its own node: the Node API, a watch of the node's pods
/// (kept warm so that nothing is listed at shutdown time), and Events.
#[derive(Clone)]
pub struct NodeClient {
    pub client: Client,
    pub node: String,
    pub nodes: Api<Node>,
    pub pods: Store<Pod>,
    reporter: Reporter,
    recorders: Arc<Mutex<Recorders>>,
}

impl NodeClient {
    /// Starts the pod watch (field selector on spec.nodeName) and waits for
    /// its first list.
    pub async fn start(client: Client, node: &str) -> Result<Self> {
        Self::start_with(client.clone(), client, node).await
    }

    /// As `start`, the watch on `watch` (long reads) and every other request
    /// on `client` (short timeouts).
    pub async fn start_with(watch: Client, client: Client, node: &str) -> Result<Self> {
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let pods = crate::apiserver::warm_store(Api::all(watch), config, "pod", |_| {}).await?;
        let reporter = Reporter {
            controller: "lastgasp".into(),
            instance: Some(node.to_string()),
        };
        Ok(NodeClient {
            nodes: Api::all(client.clone()),
            reporter,
            recorders: Arc::default(),
            client,
            node: node.to_string(),
            pods,
        })
    }

    fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node.clone()),
            uid: Some(self.node.clone()),
            ..Default::default()
        }
    }

    pub async fn event(&self, type_: EventType, action: &str, note: String) -> Result<()> {
        self.event_because(type_, EVENT_REASON, action, note).await
    }

    pub async fn event_because(
        &self,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) -> Result<()> {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        let reference = self.reference();
        // kube's Recorder merges Events by a key without the note: a second,
        // different note under the same action would only count up the first
        // Event. A new note gets a new Recorder (a new Event); the same note
        // again stays a series on the old one.
        let recorder = {
            let mut recorders = self
                .recorders
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let key = (ev.type_, ev.action.clone());
            match recorders.get(&key) {
                Some((last, r)) if Some(last) == ev.note.as_ref() => r.clone(),
                _ => {
                    let r = Recorder::new(self.client.clone(), self.reporter.clone());
                    recorders.insert(key, (ev.note.clone().unwrap_or_default(), r.clone()));
                    r
                }
            }
        };
        retry("event", || recorder.publish(&ev, &reference)).await?;
        Ok(())
    }

    /// Sets the `ShutdownInProgress` condition (status subresource; the
    /// strategic merge keeps the kubelet's conditions, merged by type); when
    /// it goes False, upstream's drain conditions go False with it.
    pub async fn set_condition(&self, status: bool, reason: &str, message: &str) -> Result<()> {
        let now = SystemTime::now();
        let mut conds = vec![condition(status, reason, message, now)];
        if !status {
            for t in [DRAIN_IN_PROGRESS, DRAINED] {
                conds.push(named_condition(t, false, reason, message, now));
            }
        }
        self.patch_conditions(conds).await
    }

    /// The graceful path's start: `ShutdownInProgress` True (reason
    /// `GracefulShutdown`) and, when it removes pods (not announce-only),
    /// `DrainInProgress` True, in one patch.
    pub async fn set_graceful(&self, message: &str, removal: graceful::Removal) -> Result<()> {
        let now = SystemTime::now();
        let mut conds = vec![condition(true, GRACEFUL_REASON, message, now)];
        if removal != graceful::Removal::None {
            conds.push(named_condition(
                DRAIN_IN_PROGRESS,
                true,
                DRAIN_REASON,
                message,
                now,
            ));
        }
        self.patch_conditions(conds).await
    }

    /// The graceful path's end: `DrainInProgress` False, `Drained` True
    /// when every pod it had to remove is gone (else False), reason
    /// `NodeShutdown`.
    pub async fn set_drained(&self, drained: bool, message: &str) -> Result<()> {
        let now = SystemTime::now();
        self.patch_conditions(vec![
            named_condition(DRAIN_IN_PROGRESS, false, DRAIN_REASON, message, now),
            named_condition(DRAINED, drained, DRAIN_REASON, message, now),
        ])
        .await
    }

    /// `LastgaspDegraded`: True with `reason` while a part of the graceful
    /// path is lost, False (`Armed`) once it is back.
    pub async fn set_degraded(&self, degraded: Option<(&str, &str)>) -> Result<()> {
        let (status, reason, message) = match degraded {
            Some((reason, why)) => (true, reason, why),
            None => (false, "Armed", "the graceful path is armed"),
        };
        let cond = named_condition(DEGRADED, status, reason, message, SystemTime::now());
        self.patch_conditions(vec![cond]).await
    }

    /// An uninstall: the agent's own conditions leave the Node's status
    /// (the kubelet's stay; the admission policy allows nothing else).
    pub async fn remove_own_conditions(&self) -> Result<()> {
        let gone: Vec<_> = [CONDITION, DRAIN_IN_PROGRESS, DRAINED, DEGRADED]
            .iter()
            .map(|t| json!({"type": t, "$patch": "delete"}))
            .collect();
        self.patch_conditions(gone).await
    }

    /// One strategic-merge patch of the status' conditions (keyed by type).
    async fn patch_conditions<C: serde::Serialize>(&self, conds: Vec<C>) -> Result<()> {
        let body = json!({ "status": { "conditions": conds } });
        let (params, patch) = (PatchParams::default(), Patch::Strategic(&body));
        retry("condition", || {
            self.nodes.patch_status(&self.node, &params, &patch)
        })
        .await?;
        Ok(())
    }

    /// Adds or removes the agent's NoSchedule taint. Taints are replaced as a
    /// list, so this reads the node and writes the whole list with its
    /// resourceVersion: a concurrent change gives 409, and a retry.
    pub async fn set_taint(&self, present: bool) -> Result<()> {
        self.set_taint_and_record(present, None).await
    }

    /// The taint, and with it the record annotation when given: one
    /// read-modify-write patch guarded by the resourceVersion, so that a
    /// concurrent writer's taint is never lost. Send the condition (a status
    /// write, which moves the resourceVersion too) after it, not beside it:
    /// side by side they conflict and the retry costs its backoff.
    pub async fn set_taint_and_record(
        &self,
        present: bool,
        record: Option<&ShutdownRecord>,
    ) -> Result<()> {
        retry("taint", || async {
            let node = self.nodes.get(&self.node).await?;
            let mut taints: Vec<Taint> = node.spec.and_then(|s| s.taints).unwrap_or_default();
            let had = taints.iter().any(|t| t.key == TAINT_KEY);
            if had == present && record.is_none() {
                return Ok(());
            }
            if had != present {
                taints.retain(|t| t.key != TAINT_KEY);
                if present {
                    taints.push(shutdown_taint(SystemTime::now()));
                }
            }
            let mut patch = json!({
                "metadata": { "resourceVersion": node.metadata.resource_version },
                "spec": { "taints": taints },
            });
            let params = match record {
                Some(r) => {
                    patch["metadata"]["annotations"] = r.annotations();
                    record_params()
                }
                None => PatchParams::default(),
            };
            self.nodes
                .patch(&self.node, &params, &Patch::Merge(&patch))
                .await
                .map(|_| ())
        })
        .await?;
        Ok(())
    }
}

impl NodeClient {
    /// Writes the shutdown record annotation (merge patch on metadata).
    pub async fn set_record(&self, record: &ShutdownRecord) -> Result<()> {
        let body = json!({ "metadata": { "annotations": record.annotations() } });
        let (params, patch) = (record_params(), Patch::Merge(&body));
        retry("record", || self.nodes.patch(&self.node, &params, &patch)).await?;
        Ok(())
    }

    /// A record of an earlier boot, delivered late: written unless the Node
    /// already carries a record of `current_boot` (a shutdown of this boot,
    /// which the controller must see), guarded by the resourceVersion so
    /// that a concurrent last gasp is never overwritten. False: left out.
    pub async fn set_earlier_record(
        &self,
        record: &ShutdownRecord,
        current_boot: &str,
    ) -> Result<bool> {
        let written = retry("record", || async {
            let node = self.nodes.get(&self.node).await?;
            let current =
                matches!(record::of_node(&node), Some(Ok(r)) if r.boot_id == current_boot);
            if current {
                return Ok(false);
            }
            self.put_record(&node, record).await?;
            Ok(true)
        })
        .await?;
        Ok(written)
    }

    /// Says on the Node that an earlier boot ended unannounced.
    pub async fn set_unannounced(&self, end: &UnannouncedEnd) -> Result<()> {
        let raw = serde_json::to_string(end)?;
        let body = json!({ "metadata": { "annotations": { UNANNOUNCED_ANNOTATION: raw } } });
        let (params, patch) = (PatchParams::default(), Patch::Merge(&body));
        retry("unannounced end", || {
            self.nodes.patch(&self.node, &params, &patch)
        })
        .await?;
        Ok(())
    }

    /// The record, in one merge patch guarded by `node`'s resourceVersion.
    async fn put_record(&self, node: &Node, record: &ShutdownRecord) -> Result<(), kube::Error> {
        let body = json!({ "metadata": {
            "resourceVersion": node.metadata.resource_version,
            "annotations": record.annotations() } });
        self.nodes
            .patch(&self.node, &record_params(), &Patch::Merge(&body))
            .await
            .map(|_| ())
    }

    /// Once the kubelet reports the node Ready: the agent's taint off, its
    /// condition False, and a record of an earlier boot closed as back (so
    /// the controller never acts on it again). A record of this boot is the
    /// start's business ([`NodeClient::close_record`]).
    pub async fn clear_when_ready(&self, current_boot: &str) -> Result<()> {
        loop {
            let node = retry("get node", || self.nodes.get(&self.node)).await?;
            let conds = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.clone())
                .unwrap_or_default();
            let ready = conds
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if ready {
                let rec = readable(record::of_node(&node));
                if rec.as_ref().is_some_and(|r| r.boot_id == current_boot) {
                    tracing::info!("the shutdown record is this boot's: left as it is");
                    return Ok(());
                }
                let ours_on = conds
                    .iter()
                    .any(|c| c.type_ == CONDITION && c.status == "True");
                if ours_on {
                    self.set_condition(false, "NodeReady", "the node is back and Ready")
                        .await?;
                }
                self.set_taint(false).await?;
                if let Some(rec) = rec.filter(|r| r.closed.is_none()) {
                    let why = format!("the node is Ready again on boot {current_boot}");
                    self.close_record(&rec.key(), Closing::Back, &why).await;
                }
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    }

    /// The record annotation as it stands, if any (an unreadable one is
    /// logged and read as none).
    pub async fn record(&self) -> Result<Option<ShutdownRecord>> {
        let node = retry("get node", || self.nodes.get(&self.node)).await?;
        Ok(readable(record::of_node(&node)))
    }

    /// Closes `rec`'s episode on the Node: every end of an episode other
    /// than the node going down on it. Nothing is written when the Node
    /// holds another episode's record by then, or this one closed already.
    /// Retried with backoff until it lands (through an API server outage
    /// too): an open record is evidence the controller could act on.
    pub async fn close_record(&self, key: &EpisodeKey, how: Closing, why: &str) {
        let mut wait = Duration::from_millis(200);
        loop {
            match self.try_close(key, how, why).await {
                Ok(true) => {
                    tracing::info!(boot = key.boot_id, episode = key.id, %how, "the shutdown record closed: {why}");
                    return;
                }
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(
                        boot = key.boot_id,
                        episode = key.id,
                        error = %e,
                        again_in = ?wait,
                        "the shutdown record NOT closed yet"
                    );
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
            }
        }
    }

    async fn try_close(
        &self,
        key: &EpisodeKey,
        how: Closing,
        why: &str,
    ) -> Result<bool, kube::Error> {
        let node = self.nodes.get(&self.node).await?;
        let Some(Ok(now)) = record::of_node(&node) else {
            return Ok(false);
        };
        if now.key() != *key || now.closed.is_some() {
            return Ok(false);
        }
        self.put_record(&node, &now.closed(how, why, SystemTime::now()))
            .await?;
        Ok(true)
    }
}

/// Every write of the record under its own field manager (see
/// [`RECORD_MANAGER`]).
pub fn record_params() -> PatchParams {
    PatchParams {
        field_manager: Some(RECORD_MANAGER.into()),
        ..Default::default()
    }
}

/// A record, or none where the annotation is unreadable (said in the log).
fn readable(r: Option<Result<ShutdownRecord, String>>) -> Option<ShutdownRecord> {
    match r? {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(error = %e, "the Node's shutdown record annotation is unreadable");
            None
        }
    }
}

pub fn shutdown_taint(at: SystemTime) -> Taint {
    Taint {
        key: TAINT_KEY.into(),
        value: Some("true".into()),
        effect: "NoSchedule".into(),
        time_added: Timestamp::try_from(at).ok().map(Time),
    }
}

/// The agent's `ShutdownInProgress` condition, the one builder of it.
pub fn condition(status: bool, reason: &str, message: &str, at: SystemTime) -> NodeCondition {
    named_condition(CONDITION, status, reason, message, at)
}

/// One of the agent's conditions ([`CONDITION`], [`DRAIN_IN_PROGRESS`],
/// [`DRAINED`], [`DEGRADED`]: its admission policy allows these and no other).
fn named_condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    at: SystemTime,
) -> NodeCondition {
    let now = Time(Timestamp::try_from(at).unwrap_or_else(|_| Timestamp::now()));
    NodeCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now),
    }
}
