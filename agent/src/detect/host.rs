//! Asks the host whether a shutdown is under way, when an episode outlives
//! its expected end.
use anyhow::Result;

use std::sync::Arc;

use super::{launch::DbusArgs, systemd::unit_kind};
use crate::{
    bus::{self, logind::Host, systemd::start_jobs, CALL_TIMEOUT},
    signal::{HostAnswer, HostQuery},
};

/// Asks the host whether a shutdown is under way: logind's
/// `PreparingForShutdown`, and systemd's job list. Its own connection, made
/// afresh for each question (asked rarely: once an episode outlives its
/// expected end).
#[derive(Clone, Debug)]
pub(crate) struct HostProbe {
    bus: Option<String>,
}

impl HostProbe {
    pub(crate) fn new(bus: Option<String>) -> Self {
        HostProbe { bus }
    }

    /// Asks logind and systemd whether a shutdown is under way (`HostAnswer`).
    pub(crate) fn query(args: &DbusArgs) -> HostQuery {
        let probe = (!args.no_dbus).then(|| HostProbe::new(args.system_bus.clone()));
        Arc::new(move || {
            let probe = probe.clone();
            Box::pin(async move {
                let Some(probe) = probe else {
                    return HostAnswer::Unknown("D-Bus detection is off (--no-dbus)".into());
                };
                match probe.shutdown_under_way().await {
                    Ok(Some(evidence)) => HostAnswer::UnderWay(evidence),
                    Ok(None) => HostAnswer::NotUnderWay,
                    Err(e) => HostAnswer::Unknown(format!("{e:#}")),
                }
            })
        })
    }

    /// `Some(evidence)` when a shutdown is under way, `None` when neither
    /// logind nor systemd has one, an error when neither could be asked.
    pub(crate) async fn shutdown_under_way(&self) -> Result<Option<String>> {
        let conn = tokio::time::timeout(CALL_TIMEOUT, bus::connect(self.bus.as_deref()))
            .await
            .map_err(|_| anyhow::anyhow!("connecting to the system bus timed out"))??;
        let host = Host::new(&conn).await?;
        let (preparing, jobs) =
            tokio::join!(host.logind.preparing_for_shutdown(), shutdown_jobs(&host));
        match (preparing, jobs) {
            (Ok(true), _) => Ok(Some("logind is preparing for shutdown".into())),
            (_, Ok(jobs)) if !jobs.is_empty() => Ok(Some(format!(
                "systemd has shutdown jobs: {}",
                jobs.join(", ")
            ))),
            (Ok(false) | Err(_), Ok(_)) | (Ok(false), Err(_)) => Ok(None),
            (Err(l), Err(s)) => Err(anyhow::anyhow!(
                "neither logind ({l}) nor systemd ({s}) answered"
            )),
        }
    }
}

/// systemd's queued start jobs for units that shut the node down.
async fn shutdown_jobs(host: &Host) -> zbus::Result<Vec<String>> {
    Ok(start_jobs(&host.systemd)
        .await?
        .into_iter()
        .filter(|(_, unit)| unit_kind(unit).is_some())
        .map(|(_, unit)| unit)
        .collect())
}
