//! Scheduled shutdowns (`shutdown +N`): logind's ScheduledShutdown,
//! announced by PropertiesChanged (systemd ≥ 255) or polled.
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use zbus::Message;

use super::{kind_of, signal, Flow, Link, LogindDetector};
use crate::{
    bus,
    clock::now_pair,
    signal::{Effect, ShutdownSignal},
};

impl LogindDetector {
    /// Follows ScheduledShutdown: `value` from a PropertiesChanged, else read.
    pub(super) async fn check_scheduled(
        &mut self,
        conn: &Link,
        tx: &mpsc::Sender<ShutdownSignal>,
        value: Option<(String, u64)>,
    ) -> Option<Flow> {
        let value = match value {
            Some(v) => v,
            None => match conn.host.logind.scheduled_shutdown().await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(error = %e, "logind: reading ScheduledShutdown");
                    return None;
                }
            },
        };
        // During a shutdown logind reports the delayed action here: not news.
        if self.lock.announced_by_logind().is_some() {
            self.scheduled = None;
            return None;
        }
        let now = (!value.0.is_empty() && value.1 > 0).then_some(value);
        if now == self.scheduled {
            return None;
        }
        let before = std::mem::replace(&mut self.scheduled, now.clone());
        let (wall, boot_ns) = now_pair();
        let s = match (now, before) {
            (Some((t, usec)), _) => {
                let at = bus::wall_usec(usec);
                tracing::info!(r#type = t, at = %humantime::format_rfc3339_seconds(at), "logind: shutdown scheduled");
                let effect = if t.starts_with("dry-") {
                    Effect::None {
                        why: format!("{t}: a dry run (shutdown -k) only warns"),
                    }
                } else {
                    Effect::Scheduled {
                        at: Some(at),
                        spec: t.clone(),
                    }
                };
                signal(
                    kind_of(&t),
                    effect,
                    None,
                    wall,
                    boot_ns,
                    None,
                    "ScheduledShutdown",
                )
            }
            (None, Some((t, usec))) => {
                if SystemTime::now() + Duration::from_secs(1) >= bus::wall_usec(usec) {
                    // Cleared at its time: it is being carried out, not cancelled.
                    return None;
                }
                tracing::info!(r#type = t, "logind: scheduled shutdown cancelled");
                signal(
                    kind_of(&t),
                    Effect::Cancel,
                    None,
                    wall,
                    boot_ns,
                    None,
                    "ScheduledShutdown",
                )
            }
            (None, None) => return None,
        };
        tx.send(s).await.is_err().then_some(Flow::Stop)
    }
}

/// ScheduledShutdown from a PropertiesChanged signal, when it is there.
pub(crate) fn scheduled_from_changed(m: &Message) -> Option<(String, u64)> {
    type Changed = (
        String,
        std::collections::HashMap<String, zbus::OwnedVariant>,
        Vec<String>,
    );
    let (_, mut changed, _): Changed = m.body().deserialize().ok()?;
    <(String, u64)>::try_from(changed.remove("ScheduledShutdown")?).ok()
}
