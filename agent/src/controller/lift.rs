//! `lastgasp controller --lift-fences`: an uninstall's last step (the
//! chart's pre-delete hook). Every out-of-service taint this controller set
//! (the node carries its `out-of-service-by` annotation) is removed with its
//! annotations; a taint anyone else set is left alone. Without the
//! controller nobody would lift them when their nodes come back.
use anyhow::{bail, Result};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node};
use kube::{
    api::{ListParams, Patch, PostParams},
    Api, Client, ResourceExt,
};

use super::{
    write::{fence_params, fence_patch, set_condition, Mark},
    FENCED_BOOT_ANNOTATION, PAUSED_BY_ANNOTATION, PAUSE_ANNOTATION, TAINTED_BY_ANNOTATION,
    UNINSTALL_MANAGER,
};

/// Pauses the replicas still running (the controller's Lease annotated
/// `lastgasp.dev/paused=true`, `lastgasp.dev/paused-by=uninstall`), so
/// that none fences again while the uninstall removes them; a reinstall's
/// controller lifts it. No Lease: no replica ever led.
pub async fn pause(client: Client, namespace: &str, name: &str) -> Result<()> {
    let leases: Api<Lease> = Api::namespaced(client, namespace);
    for _ in 0..3 {
        let Some(mut lease) = leases.get_opt(name).await? else {
            return Ok(());
        };
        let ann = lease.annotations_mut();
        ann.insert(PAUSE_ANNOTATION.into(), "true".into());
        ann.insert(PAUSED_BY_ANNOTATION.into(), "uninstall".into());
        // Its own field manager: the server's stamp says when it paused.
        let pp = PostParams {
            field_manager: Some(UNINSTALL_MANAGER.into()),
            ..Default::default()
        };
        match leases.replace(name, &pp, &lease).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {} // changed meanwhile: again
            Err(e) => return Err(e.into()),
        }
    }
    bail!("the Lease {namespace}/{name} kept changing: not paused")
}

/// Lifts every fence the controller set; returns the nodes lifted. A node
/// written meanwhile (409) is read again, up to three times.
pub async fn lift_all(client: Client) -> Result<Vec<String>> {
    let nodes: Api<Node> = Api::all(client);
    let mut lifted = Vec::new();
    let mut failed = Vec::new();
    for node in nodes.list(&ListParams::default()).await? {
        if !node.annotations().contains_key(TAINTED_BY_ANNOTATION) {
            continue;
        }
        let name = node.name_any();
        let mut current = node;
        let mut tries = 0;
        loop {
            tries += 1;
            let by = current.annotations().get(TAINTED_BY_ANNOTATION).cloned();
            let boot = current.annotations().get(FENCED_BOOT_ANNOTATION).cloned();
            match nodes
                .patch(
                    &name,
                    &fence_params(),
                    &Patch::Merge(&fence_patch(&current, None)),
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(node = %name, by = ?by, boot = ?boot, "fence lifted");
                    let note = "the fence was lifted by the controller's uninstall";
                    if let Err(e) = set_condition(
                        &nodes,
                        &name,
                        Mark::Cleared {
                            reason: "FenceLifted",
                        },
                        note,
                    )
                    .await
                    {
                        tracing::warn!(node = %name, error = %e, "the condition NOT cleared");
                    }
                    lifted.push(name);
                    break;
                }
                Err(kube::Error::Api(s)) if s.code == 409 && tries < 3 => {
                    current = nodes.get(&name).await?;
                }
                Err(kube::Error::Api(s)) if s.code == 404 => break,
                Err(e) => {
                    tracing::error!(node = %name, error = %e, "fence NOT lifted");
                    failed.push(name);
                    break;
                }
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "fences not lifted on {}: lift each with `kubectl taint node NODE node.kubernetes.io/out-of-service-` \
             and `kubectl annotate node NODE {TAINTED_BY_ANNOTATION}- {FENCED_BOOT_ANNOTATION}-`",
            failed.join(", ")
        );
    }
    Ok(lifted)
}
