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
        "the ShutdownInProgress condition",
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
