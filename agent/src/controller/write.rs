//! The controller's writes. Each is made only while this replica leads; a
//! fence only after the Node and its kubelet's Lease, read live, give the
//! verdict the pass reached from its cache; the taint is on the API server
//! before any pod is deleted.
use std::{
    collections::BTreeSet,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{bail, Result};
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Node, NodeCondition, ObjectReference, Pod, Taint},
    },
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions},
    runtime::events::{Event, EventType, Recorder},
    Api, Client, ResourceExt,
};
use serde_json::json;

use super::{
    lead::Leadership,
    rule::{boot_id, judge, Verdict},
    ControllerConfig, FENCED_BOOT_ANNOTATION, FENCED_CONDITION, FENCE_MANAGER, KEPT_SAME_BOOT,
    NODE_LEASE_NAMESPACE, OUT_OF_SERVICE_KEY, OUT_OF_SERVICE_VALUE, TAINTED_BY_ANNOTATION,
};
use crate::{record, signal::Kind};

/// How long a fence waits for the taint eviction controller to mark the
/// node's pods for deletion before it leaves the rest to the next pass.
const EVICTION_WAIT: Duration = Duration::from_secs(3);

/// One write the pass decided on, carried out beside the others.
#[derive(Clone, Debug)]
pub(super) enum Work {
    Fence {
        why: String,
    },
    Untaint,
    /// Delete the pods of a node fenced earlier (a delete that failed or
    /// waited, or an earlier leader's fence), once a live read says it is
    /// still down on the boot it was fenced in.
    Recover,
    /// The remediators' condition False: what it said no longer holds.
    Clear {
        reason: &'static str,
    },
    /// An Event only (a fence held back or observed, a contradicted record,
    /// a node back on the boot it was fenced in).
    Tell {
        type_: EventType,
        reason: &'static str,
        note: String,
    },
}

/// The pods of a fenced node, after a recovery step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Recovery {
    /// Deleted with grace 0 (each pod once).
    pub deleted: u64,
    /// Still to be marked for deletion by the taint: the next pass.
    pub waiting: usize,
}

/// What a [`Work`] came to.
pub(super) enum Done {
    Fenced {
        recovered: Result<Recovery>,
    },
    /// The live read no longer gives the verdict: nothing written.
    NotFenced(String),
    /// The live read says the node is not (or no longer) this controller's
    /// fence of a node still down: no pod deleted.
    NotRecovered(String),
    Untainted,
    NotUntainted,
    Recovered(Result<Recovery>),
    Told,
}

/// The controller's writes, cloned into each concurrent task.
#[derive(Clone)]
pub(super) struct Writer {
    pub client: Client,
    pub nodes: Api<Node>,
    pub recorder: Recorder,
    pub cfg: ControllerConfig,
    pub lead: Leadership,
}

impl Writer {
    pub(super) async fn execute(&self, name: &str, w: &Work) -> Result<Done> {
        self.leading()?;
        match w {
            Work::Fence { .. } => {
                let (live, lease, now) = self.read_live(name).await?;
                let why = match judge(&live, lease.as_ref(), now, &self.cfg) {
                    Verdict::Fence { why } => why,
                    other => return Ok(Done::NotFenced(format!("{other:?}"))),
                };
                self.leading()?;
                self.set_taint(&live, true).await?;
                let proof = record::written_at(&live).unwrap_or(now);
                let mark = Mark::Fenced {
                    proof,
                    reason: fenced_reason(&live),
                };
                // The API server has the taint: the replacements cannot land
                // on this node, and its volumes may detach. The pods go
                // beside the condition and the Event, not after them.
                let (recovered, ..) = tokio::join!(
                    self.recover(name),
                    self.mark(name, mark, &why),
                    self.event(
                        name,
                        EventType::Warning,
                        "OutOfServiceTaintAdded",
                        why.clone()
                    ),
                );
                Ok(Done::Fenced { recovered })
            }
            Work::Untaint => {
                // The cache said Ready on a new boot; a live read must agree.
                let (live, lease, now) = self.read_live(name).await?;
                if judge(&live, lease.as_ref(), now, &self.cfg) != Verdict::Untaint {
                    return Ok(Done::NotUntainted);
                }
                self.leading()?;
                self.set_taint(&live, false).await?;
                let note = format!(
                    "node is Ready again on boot {}",
                    boot_id(&live).unwrap_or("?")
                );
                self.mark(name, Mark::Cleared { reason: "NodeBack" }, &note)
                    .await;
                self.event(name, EventType::Normal, "OutOfServiceTaintRemoved", note)
                    .await;
                Ok(Done::Untainted)
            }
            Work::Recover => self.recover_if_down(name).await,
            Work::Clear { reason } => {
                let note = match *reason {
                    "NodeBack" => "the node runs another boot than the one fenced",
                    _ => "this controller's out-of-service taint is no longer on the node",
                };
                self.mark(name, Mark::Cleared { reason }, note).await;
                Ok(Done::Told)
            }
            Work::Tell {
                type_,
                reason,
                note,
            } => {
                if *reason == KEPT_SAME_BOOT {
                    self.mark(
                        name,
                        Mark::Cleared {
                            reason: KEPT_SAME_BOOT,
                        },
                        note,
                    )
                    .await;
                }
                self.event(name, *type_, reason, note.clone()).await;
                Ok(Done::Told)
            }
        }
    }

    /// A fence of an earlier pass or leader: its pods go only where the
    /// node, read now, is still down on the boot it was fenced in.
    async fn recover_if_down(&self, name: &str) -> Result<Done> {
        let (live, lease, now) = self.read_live(name).await?;
        match judge(&live, lease.as_ref(), now, &self.cfg) {
            Verdict::Fenced => {}
            other => return Ok(Done::NotRecovered(format!("{other:?}"))),
        }
        self.leading()?;
        Ok(Done::Recovered(self.recover(name).await))
    }

    fn leading(&self) -> Result<()> {
        if !self.lead.valid() {
            bail!("this replica's hold on the Lease is not recent enough to write");
        }
        Ok(())
    }

    /// The Node and its kubelet's Lease, read now, with the API server's
    /// time of the Lease's answer.
    async fn read_live(&self, name: &str) -> Result<(Node, Option<Lease>, SystemTime)> {
        let node = self.nodes.get(name).await?;
        let path =
            format!("/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{name}");
        let (lease, now) = get_with_date::<Lease>(&self.client, &path).await?;
        Ok((node, lease, now))
    }

    /// Deletes with grace 0 the pods of a fenced node that are being
    /// deleted (the taint's eviction marks those that do not tolerate it;
    /// the agent's drain may have marked some before): what the pod garbage
    /// collector does on an out-of-service node once it is NotReady, without
    /// its 50 s + 20 s wait. A pod that tolerates the taint stays; one not
    /// marked yet is waited for a little, then left to the next pass.
    async fn recover(&self, name: &str) -> Result<Recovery> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let lp = ListParams::default().fields(&format!("spec.nodeName={name}"));
        let until = Instant::now() + EVICTION_WAIT;
        let mut done = BTreeSet::new();
        loop {
            let (mut waiting, mut failed) = (0, 0);
            for pod in pods.list(&lp).await? {
                let uid = pod.uid().unwrap_or_default();
                if done.contains(&uid) {
                    continue;
                }
                if pod.metadata.deletion_timestamp.is_none() {
                    // Not marked yet: the taint's eviction comes within
                    // moments, unless the pod tolerates it.
                    if !tolerates_out_of_service(&pod) {
                        waiting += 1;
                    }
                    continue;
                }
                self.leading()?;
                let dp = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: Some(uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                };
                let ns = pod.namespace().unwrap_or_default();
                match Api::<Pod>::namespaced(self.client.clone(), &ns)
                    .delete(&pod.name_any(), &dp)
                    .await
                {
                    Ok(_) => {
                        done.insert(uid);
                    }
                    // Gone already, or replaced by a pod of the same name.
                    Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                    Err(e) => {
                        failed += 1;
                        tracing::warn!(node = %name, pod = %pod.name_any(), error = %e, "grace-0 delete failed");
                    }
                }
            }
            if failed > 0 {
                bail!("{failed} of the node's pods could not be deleted (retried next pass)");
            }
            if waiting == 0 || Instant::now() >= until {
                return Ok(Recovery {
                    deleted: done.len() as u64,
                    waiting,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Sets or removes the taint and the fence's annotations, guarded by
    /// `node`'s resourceVersion (a node written since gives 409, and the
    /// next pass judges again).
    async fn set_taint(&self, node: &Node, present: bool) -> Result<()> {
        let fence = present.then_some(self.cfg.identity.as_str());
        self.nodes
            .patch(
                &node.name_any(),
                &fence_params(),
                &Patch::Merge(&fence_patch(node, fence)),
            )
            .await?;
        Ok(())
    }

    /// Sets the remediators' condition; a failure is logged, and never
    /// undoes or holds back the fence (the taint is the fence).
    async fn mark(&self, node: &str, mark: Mark<'_>, message: &str) {
        if let Err(e) = set_condition(&self.nodes, node, mark, message).await {
            tracing::warn!(
                node,
                condition = FENCED_CONDITION,
                error = %e,
                "condition NOT written"
            );
        }
    }

    async fn event(&self, node: &str, type_: EventType, reason: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            ..Default::default()
        };
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::warn!(error = %e, "controller event");
        }
    }
}

/// What the remediators' condition says.
#[derive(Clone, Copy, Debug)]
pub(super) enum Mark<'a> {
    /// True since `proof`, the API server's time of the record's write.
    Fenced { proof: SystemTime, reason: &'a str },
    /// False since now.
    Cleared { reason: &'a str },
}

/// The [`FENCED_CONDITION`] condition, the one builder of it.
pub(super) fn fenced_condition(mark: Mark<'_>, message: &str, now: SystemTime) -> NodeCondition {
    let (status, since, reason) = match mark {
        Mark::Fenced { proof, reason } => ("True", proof, reason),
        Mark::Cleared { reason } => ("False", now, reason),
    };
    let time = |t: SystemTime| Time(Timestamp::try_from(t).unwrap_or_else(|_| Timestamp::now()));
    NodeCondition {
        type_: FENCED_CONDITION.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(time(now)),
        last_transition_time: Some(time(since)),
    }
}

/// The reason of a True condition: what the record proves.
fn fenced_reason(node: &Node) -> &'static str {
    match record::of_node(node).and_then(Result::ok).map(|r| r.kind()) {
        Some(Kind::Poweroff) => "PoweredOff",
        Some(Kind::Halt) => "Halted",
        // Fenced only under policy also-reboots, after the reboot timeout.
        _ => "RebootNotBack",
    }
}

/// Writes the condition (status subresource; the strategic merge keeps the
/// kubelet's and the agent's conditions, merged by type).
pub(super) async fn set_condition(
    nodes: &Api<Node>,
    node: &str,
    mark: Mark<'_>,
    message: &str,
) -> Result<()> {
    let cond = fenced_condition(mark, message, SystemTime::now());
    let body = json!({ "status": { "conditions": [cond] } });
    nodes
        .patch_status(node, &fence_params(), &Patch::Strategic(&body))
        .await?;
    Ok(())
}

/// The Node patch that sets the fence (`Some(identity)`: the taint and the
/// annotations naming the controller and the boot) or lifts it (`None`),
/// guarded by `node`'s resourceVersion (a node written since gives 409).
pub(super) fn fence_patch(node: &Node, fence: Option<&str>) -> serde_json::Value {
    let mut taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    taints.retain(|t| t.key != OUT_OF_SERVICE_KEY);
    if fence.is_some() {
        taints.push(Taint {
            key: OUT_OF_SERVICE_KEY.into(),
            value: Some(OUT_OF_SERVICE_VALUE.into()),
            effect: "NoExecute".into(),
            time_added: Some(Time(Timestamp::now())),
        });
    }
    let (marker, boot) = match fence {
        Some(identity) => (json!(identity), json!(boot_id(node))),
        None => (serde_json::Value::Null, serde_json::Value::Null),
    };
    json!({
        "metadata": { "resourceVersion": node.resource_version(), "annotations": {
            TAINTED_BY_ANNOTATION: marker, FENCED_BOOT_ANNOTATION: boot } },
        "spec": { "taints": taints },
    })
}

pub(super) fn fence_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FENCE_MANAGER.into()),
        ..Default::default()
    }
}

/// Whether `pod` tolerates `out-of-service:NoExecute` (for good, or for a
/// while): the taint does not evict it now, and it is not deleted.
pub(super) fn tolerates_out_of_service(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.tolerations.as_ref())
        .is_some_and(|ts| {
            ts.iter().any(|t| {
                let exists = t.operator.as_deref() == Some("Exists");
                let key = match t.key.as_deref() {
                    None | Some("") => exists,
                    Some(k) => k == OUT_OF_SERVICE_KEY,
                };
                let effect = matches!(t.effect.as_deref(), None | Some("" | "NoExecute"));
                let value = exists || t.value.as_deref().unwrap_or("") == OUT_OF_SERVICE_VALUE;
                key && effect && value
            })
        })
}

/// A GET whose answer also says the API server's time (its `Date` header).
pub(super) async fn get_with_date<K: serde::de::DeserializeOwned>(
    client: &Client,
    path: &str,
) -> Result<(Option<K>, SystemTime)> {
    use http_body_util::BodyExt;
    let req = ::http::Request::get(path).body(kube::client::Body::empty())?;
    let resp = client.send(req).await?;
    let date = resp
        .headers()
        .get(::http::header::DATE)
        .and_then(|d| d.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .ok_or_else(|| anyhow::anyhow!("the API server's answer has no Date header"))?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status == ::http::StatusCode::NOT_FOUND {
        return Ok((None, date));
    }
    if !status.is_success() {
        bail!("GET {path}: {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok((Some(serde_json::from_slice(&body)?), date))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodSpec, Toleration};

    use super::*;

    #[test]
    fn which_pods_tolerate_the_fence() {
        let pod = |t: Vec<Toleration>| Pod {
            spec: Some(PodSpec {
                tolerations: Some(t),
                ..Default::default()
            }),
            ..Default::default()
        };
        let tol =
            |key: Option<&str>, op: &str, value: Option<&str>, effect: Option<&str>| Toleration {
                key: key.map(Into::into),
                operator: Some(op.into()),
                value: value.map(Into::into),
                effect: effect.map(Into::into),
                toleration_seconds: None,
            };
        assert!(!tolerates_out_of_service(&Pod::default()));
        assert!(tolerates_out_of_service(&pod(vec![tol(
            None, "Exists", None, None
        )])));
        assert!(tolerates_out_of_service(&pod(vec![tol(
            Some(OUT_OF_SERVICE_KEY),
            "Exists",
            None,
            Some("NoExecute")
        )])));
        assert!(tolerates_out_of_service(&pod(vec![tol(
            Some(OUT_OF_SERVICE_KEY),
            "Equal",
            Some("nodeshutdown"),
            None
        )])));
        assert!(!tolerates_out_of_service(&pod(vec![tol(
            Some(OUT_OF_SERVICE_KEY),
            "Equal",
            Some("other"),
            None
        )])));
        assert!(!tolerates_out_of_service(&pod(vec![tol(
            None,
            "Exists",
            None,
            Some("NoSchedule")
        )])));
        // The not-ready and unreachable tolerations every pod gets do not cover it.
        assert!(!tolerates_out_of_service(&pod(vec![tol(
            Some("node.kubernetes.io/not-ready"),
            "Exists",
            None,
            Some("NoExecute")
        )])));
    }
}
