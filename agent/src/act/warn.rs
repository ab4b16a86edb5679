//! A scheduled shutdown, announced on the Node: a condition and an Event.
use std::time::SystemTime;

use kube::runtime::events::EventType;

use super::Ctx;

pub(super) fn warn(cx: Ctx, due: Option<SystemTime>) {
    let Some(c) = cx.cluster else {
        return;
    };
    let when = due
        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
        .unwrap_or("later".into());
    let msg = format!("{} scheduled for {when}", cx.ep.kind);
    tokio::spawn(async move {
        let (a, b) = tokio::join!(
            c.node.set_condition(true, "ScheduledShutdown", &msg),
            c.node
                .event(EventType::Normal, "ScheduledShutdown", msg.clone()),
        );
        if let Err(e) = a.and(b) {
            tracing::error!(
                error = format!("{e:#}"),
                "announcing the scheduled shutdown"
            );
        }
    });
}
