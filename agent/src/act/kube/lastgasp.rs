//! The last gasp: when no time is left, tell the cluster in one round trip on
//! connections that are already open.
//!
//! The API keeps a Node's status apart from its spec and metadata: the
//! condition can only be written through `nodes/NAME/status`, the taint and
//! the annotation only through `nodes/NAME`. So the last gasp is two patches,
//! built before they are needed and sent at the same moment. Nothing stands
//! before them: no list, no discovery, no new connection, no lock. The node's
//! current taints come from a watch kept warm since start.
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::{
    api::{Patch, PatchParams},
    runtime::{reflector, watcher},
    Api, Client,
};
use serde_json::{json, Value};

use super::{condition, shutdown_taint, RECORD_ANNOTATION, TAINT_KEY};
use crate::signal::{Kind, ShutdownSignal};

/// How often idle connections are used, so that none is closed by the
/// server or the pool before a shutdown needs it.
const KEEP_WARM: Duration = Duration::from_secs(15);

#[derive(Clone)]
pub struct LastGasp {
    node: String,
    /// Its own client: the watches keep their connections busy, and these
    /// patches must not queue behind them.
    nodes: Api<Node>,
    this_node: reflector::Store<Node>,
}

#[derive(Debug, Clone)]
pub struct Sent {
    pub started: Instant,
    pub status_done: Duration,
    pub spec_done: Duration,
}

impl LastGasp {
    /// Warms the connections and starts the node watch.
    pub async fn start(watch_client: Client, patch_client: Client, node: &str) -> Result<Self> {
        let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let store = super::warm_store(Api::all(watch_client), config, "node").await?;
        let lg = LastGasp {
            node: node.to_string(),
            nodes: Api::all(patch_client),
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
            tracing::warn!("keeping the API connections warm: {e}");
        }
    }

    fn current_taints(&self) -> Vec<Taint> {
        self.this_node
            .state()
            .first()
            .and_then(|n| n.spec.as_ref()?.taints.clone())
            .unwrap_or_default()
    }

    /// The two bodies: (status patch, spec+metadata patch).
    pub fn bodies(
        &self,
        reason: &str,
        message: &str,
        record: &Value,
        at: SystemTime,
    ) -> (Value, Value) {
        let cond = condition(true, reason, message, at);
        let mut taints = self.current_taints();
        if !taints.iter().any(|t| t.key == TAINT_KEY) {
            taints.push(shutdown_taint(at));
        }
        let status = json!({ "status": { "conditions": [cond] } });
        let spec = json!({
            "metadata": { "annotations": { RECORD_ANNOTATION: record.to_string() } },
            "spec": { "taints": taints },
        });
        (status, spec)
    }

    /// Sends both patches at once; returns when both are answered.
    pub async fn send(&self, status: &Value, spec: &Value) -> Result<Sent> {
        let started = Instant::now();
        let params = PatchParams::default();
        let (s, m) = tokio::join!(
            async {
                let r = self
                    .nodes
                    .patch_status(&self.node, &params, &Patch::Strategic(status))
                    .await;
                (r, started.elapsed())
            },
            async {
                let r = self
                    .nodes
                    .patch(&self.node, &params, &Patch::Merge(spec))
                    .await;
                (r, started.elapsed())
            },
        );
        s.0.context("last gasp: condition patch")?;
        m.0.context("last gasp: taint and record patch")?;
        Ok(Sent {
            started,
            status_done: s.1,
            spec_done: m.1,
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
