//! What `lastgasp check` reports of the cluster: every permission the agent
//! uses, asked of the API server.
use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};

use crate::preflight::{Report, Status};

/// What the agent asks of the API server (see `act/kube`, `report.rs`):
/// (verb, group, resource, subresource, namespace, why).
pub const PERMISSIONS: &[(&str, &str, &str, &str, &str, &str)] = &[
    ("get", "", "nodes", "", "", "the node's taints and record"),
    (
        "list",
        "",
        "nodes",
        "",
        "",
        "the warm watch of its own node",
    ),
    (
        "watch",
        "",
        "nodes",
        "",
        "",
        "the warm watch of its own node",
    ),
    ("patch", "", "nodes", "", "", "taint and record (last gasp)"),
    (
        "patch",
        "",
        "nodes",
        "status",
        "",
        "its conditions (ShutdownInProgress, DrainInProgress, Drained, LastgaspDegraded)",
    ),
    (
        "list",
        "",
        "pods",
        "",
        "",
        "the warm watch of the node's pods",
    ),
    (
        "watch",
        "",
        "pods",
        "",
        "",
        "the warm watch of the node's pods",
    ),
    ("delete", "", "pods", "", "", "graceful termination"),
    (
        "create",
        "",
        "pods",
        "eviction",
        "",
        "podRemoval: evict (asked only with it)",
    ),
    (
        "create",
        "events.k8s.io",
        "events",
        "",
        "default",
        "NodeShutdown Events",
    ),
    (
        "patch",
        "events.k8s.io",
        "events",
        "",
        "default",
        "repeated Events (kube's recorder patches the series)",
    ),
];

/// "patch nodes/status", "create coordination.k8s.io/leases".
fn permission(verb: &str, group: &str, resource: &str, sub: &str) -> String {
    let group = if group.is_empty() {
        String::new()
    } else {
        format!("{group}/")
    };
    let sub = if sub.is_empty() {
        String::new()
    } else {
        format!("/{sub}")
    };
    format!("{verb} {group}{resource}{sub}")
}

/// `evict`: the config says `podRemoval: evict`, so the Eviction API is
/// needed and asked about (otherwise it is not granted, and not asked).
/// Asks the API server, with SelfSubjectAccessReviews, for each of
/// `PERMISSIONS` (and eviction when `evict`).
pub(crate) async fn preflight(r: &mut Report, client: &kube::Client, url: &str, evict: bool) {
    let api: kube::Api<SelfSubjectAccessReview> = kube::Api::all(client.clone());
    r.push(Status::Info, "API server", url.to_string());
    for (verb, group, resource, sub, ns, why) in PERMISSIONS {
        if *sub == "eviction" && !evict {
            continue;
        }
        let name = permission(verb, group, resource, sub);
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.to_string()),
                    group: Some(group.to_string()),
                    resource: Some(resource.to_string()),
                    subresource: (!sub.is_empty()).then(|| sub.to_string()),
                    namespace: (!ns.is_empty()).then(|| ns.to_string()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            api.create(&kube::api::PostParams::default(), &review),
        )
        .await;
        match answer {
            Ok(Ok(rev)) => {
                let st = rev.status.unwrap_or_default();
                if st.allowed {
                    r.push(Status::Ok, name, format!("allowed: {why}"));
                } else {
                    let reason = st
                        .reason
                        .filter(|s| !s.is_empty())
                        .or(st.evaluation_error)
                        .unwrap_or_default();
                    r.push(
                        Status::Fail,
                        name,
                        format!(
                            "DENIED: needed for {why}{}",
                            if reason.is_empty() {
                                String::new()
                            } else {
                                format!(" ({reason})")
                            }
                        ),
                    );
                }
            }
            Ok(Err(e)) => {
                r.push(
                    Status::Fail,
                    name,
                    format!("SelfSubjectAccessReview failed: {e}"),
                );
                return;
            }
            Err(_) => {
                r.push(
                    Status::Fail,
                    name,
                    "SelfSubjectAccessReview: no answer within 10 s",
                );
                return;
            }
        }
    }
}

/// The per-node admission fence (the chart's `*-agent-own-node`
/// ValidatingAdmissionPolicy), shown by asking it for what it must refuse:
/// dry-run patches, which admission judges and nothing stores. A label on
/// the agent's own Node, an annotation on another Node.
pub async fn fence(r: &mut Report, client: &kube::Client, node: &str) {
    // A key nothing else uses, on a label and an annotation.
    const PROBE: &str = "lastgasp.dev/check-probe";
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{ListParams, Patch, PatchParams};
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let dry = PatchParams {
        dry_run: true,
        field_manager: Some("lastgasp-check".into()),
        ..Default::default()
    };
    let label = serde_json::json!({"metadata": {"labels": {PROBE: "refused"}}});
    let own = nodes.patch(node, &dry, &Patch::Merge(&label)).await;
    refused(
        r,
        "own node",
        own.map(drop),
        &format!("a label on its own Node {node}"),
    );
    let others = nodes.list_metadata(&ListParams::default().limit(2)).await;
    let other = match others {
        Ok(list) => list
            .items
            .into_iter()
            .map(|n| n.metadata.name.unwrap_or_default())
            .find(|n| n != node),
        Err(e) => {
            r.push(
                Status::Fail,
                "other node",
                format!("listing the Nodes: {e}"),
            );
            return;
        }
    };
    let Some(other) = other else {
        r.push(
            Status::Info,
            "other node",
            "the only Node in the cluster: no other to ask about",
        );
        return;
    };
    let note = serde_json::json!({"metadata": {"annotations": {PROBE: "refused"}}});
    let theirs = nodes.patch(&other, &dry, &Patch::Merge(&note)).await;
    refused(
        r,
        "other node",
        theirs.map(drop),
        &format!("an annotation on Node {other}"),
    );
}

/// A probe's verdict: refused by the policy (its messages begin
/// `lastgasp:`) is what the fence is for.
fn refused(r: &mut Report, what: &str, answer: Result<(), kube::Error>, change: &str) {
    match answer {
        Err(kube::Error::Api(e)) if e.code == 403 && e.message.contains("lastgasp:") => {
            r.push(Status::Ok, what, format!("refused (dry run): {}", e.message));
        }
        Err(kube::Error::Api(e)) if e.code == 403 => r.push(
            Status::Fail,
            what,
            format!("refused by RBAC before admission could judge it (the agent lacks patch nodes): {}", e.message),
        ),
        Ok(()) => r.push(
            Status::Fail,
            what,
            format!(
                "ADMITTED {change} (dry run, nothing stored): the agent's ValidatingAdmissionPolicy or its \
                 binding is missing (or was created seconds ago and is not yet in force), and a stolen \
                 agent token could write any Node"
            ),
        ),
        Err(e) => r.push(Status::Fail, what, format!("the dry run failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_permission_has_its_own_line() {
        assert_eq!(
            permission("patch", "", "nodes", "status"),
            "patch nodes/status"
        );
        assert_eq!(
            permission("create", "coordination.k8s.io", "leases", ""),
            "create coordination.k8s.io/leases"
        );
        let mut names: Vec<_> = PERMISSIONS
            .iter()
            .map(|(v, g, r, s, ns, _)| format!("{} {ns}", permission(v, g, r, s)))
            .collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(
            names.len(),
            n,
            "two PERMISSIONS lines ask the same: {names:?}"
        );
    }
}
