//! The courier's kit for the episode open now (`courier`): left on the host
//! while the agent runs, and removed when the episode ends.
use std::{collections::BTreeMap, path::PathBuf, time::SystemTime};

use super::{courier, final_unit, last_gasp, Cluster};
use crate::{
    decide::{Action, Decision},
    record::ShutdownRecord,
    signal::{Detail, ShutdownSignal, Source},
};

/// Where kits go, and the episode whose kit is there.
pub(super) struct Shelf {
    /// The run directory of systemd-shutdown's hook.
    run_dir: PathBuf,
    /// The API server the agent was told to use.
    server: Option<String>,
    left: Option<u32>,
}

impl Shelf {
    pub(super) fn new(run_dir: PathBuf, server: Option<String>) -> Self {
        Shelf {
            run_dir,
            server,
            left: None,
        }
    }

    /// An episode is open: for each verb systemd-shutdown may run its hook
    /// (or systemd the final unit) with, the record the hook's (the unit's)
    /// signal, decided as the paired decision, would have the agent send,
    /// with the final-stage proof, is left for the courier now, while the
    /// agent runs (the systemd cgroup driver stops its scope before
    /// systemd-shutdown; the runtime may kill it in the final sweep). The
    /// kit proves nothing by itself: the courier delivers it only from the
    /// final stage.
    pub(super) async fn leave(
        &mut self,
        c: &Cluster,
        boot_id: &str,
        hooks: &[(ShutdownSignal, Decision)],
    ) {
        let mut evidence = BTreeMap::new();
        let mut episode = None;
        for (hook, d) in hooks {
            let Some(ep) = d
                .episode
                .as_ref()
                .filter(|_| matches!(d.action, Action::LastWord | Action::Immediate { .. }))
            else {
                continue;
            };
            let Detail::Hook { verb } = &hook.detail else {
                continue;
            };
            let key = match hook.source {
                Source::FinalUnit => final_unit::key(verb),
                _ => verb.clone(),
            };
            let record = ShutdownRecord::new(boot_id, hook, ep);
            let (reason, message) = last_gasp::message(hook, ep.kind, false);
            let body = c
                .lastgasp
                .bodies(reason, &message, &record, SystemTime::now());
            evidence.insert(key, body.evidence);
            episode = Some(ep.id);
        }
        let Some(episode) = episode else {
            return self.clear();
        };
        let kit = match courier::credentials(self.server.as_deref()).await {
            Ok((server, root_certs, token)) => courier::Kit {
                server,
                root_certs,
                token,
                node: c.lastgasp.node().to_string(),
                evidence,
            },
            Err(e) => return tracing::warn!(error = format!("{e:#}"), "no courier kit"),
        };
        match courier::prepare(&self.run_dir, &kit) {
            Ok(()) => {
                if self.left != Some(episode) {
                    tracing::info!(episode, "courier kit left for systemd-shutdown's hook");
                }
                self.left = Some(episode);
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "no courier kit"),
        }
    }

    /// No episode: no kit (a later shutdown must not carry this one's record).
    pub(super) fn clear(&mut self) {
        let Some(episode) = self.left.take() else {
            return;
        };
        match courier::remove(&self.run_dir) {
            Ok(()) => tracing::info!(episode, "courier kit removed: the episode ended"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "courier kit NOT removed"),
        }
    }
}
