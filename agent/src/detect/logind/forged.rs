//! Other peers' PrepareForShutdown: anyone on the bus can send one. Only
//! logind's counts; the rest are reported (rate-limited), audit-only.
use std::time::{Duration, SystemTime};

use tokio::{sync::mpsc, time::Instant};
use zbus::{Connection, Message};

use super::{sender_actor, signal, Flow, Link, LogindDetector};
use crate::signal::{BusSender, Effect, Kind, ShutdownSignal};

impl LogindDetector {
    /// A PrepareForShutdown on the connection watching every peer: logind's
    /// own arrive on the main one (and are skipped here); the others are
    /// forgeries, reported (or, with --trust-unowned-bus-signals, acted on).
    pub(super) async fn on_other(
        &mut self,
        conn: &Link,
        m: Message,
        tx: &mpsc::Sender<ShutdownSignal>,
    ) -> Option<Flow> {
        if self.is_loginds(&m) {
            return None;
        }
        self.on_prepare(conn, m, tx).await
    }

    /// Only the current owner's broadcast speaks for logind (one sent
    /// straight to this connection is another peer's, whoever it names).
    pub(super) fn is_loginds(&self, m: &Message) -> bool {
        let h = m.header();
        h.destination().is_none()
            && h.sender()
                .map(zbus::names::UniqueName::as_str)
                .is_some_and(|s| self.owner.as_deref() == Some(s))
    }

    /// Another peer's PrepareForShutdown: audit-only, never waited for.
    /// Within `Forged`'s rate it is reported with the peer's pid and uid;
    /// past it, counted (and summed up in the log).
    pub(super) async fn report_forged(
        &mut self,
        conn: &Connection,
        sender: &str,
        start: bool,
        (wall, boot_ns): (SystemTime, u64),
        tx: &mpsc::Sender<ShutdownSignal>,
    ) {
        if !self.forged.take() {
            return;
        }
        tracing::warn!(
            sender,
            logind = self.owner.as_deref().unwrap_or("(none)"),
            start,
            "logind: PrepareForShutdown from a peer that does not own org.freedesktop.login1: \
             reported, audit-only (--trust-unowned-bus-signals acts on it)"
        );
        let actor = tokio::time::timeout(Duration::from_millis(100), sender_actor(conn, sender))
            .await
            .ok()
            .flatten();
        let effect = if start { Effect::Now } else { Effect::Cancel };
        let mut s = signal(
            Kind::Unknown,
            effect,
            None,
            wall,
            boot_ns,
            actor,
            "PrepareForShutdown",
        );
        s.sender = Some(BusSender {
            unique: sender.to_string(),
            owns_name: false,
        });
        // Lossy: a flood of reports must not stand before logind's signal.
        if tx.try_send(s).is_err() {
            self.forged.dropped += 1;
        }
    }
}

/// Other peers' PrepareForShutdown reported per second (burst
/// `FORGED_BURST`); the rest are counted.
const FORGED_PER_SEC: f64 = 5.0;
const FORGED_BURST: f64 = 20.0;

/// The forgery reports' token bucket and what it held back.
pub(super) struct Forged {
    tokens: f64,
    at: Instant,
    /// Held back (over the rate, or the signal channel was full) since the
    /// last summary.
    pub(super) dropped: u64,
}

impl Default for Forged {
    fn default() -> Self {
        Forged {
            tokens: FORGED_BURST,
            at: Instant::now(),
            dropped: 0,
        }
    }
}

impl Forged {
    /// Whether one more may be reported now.
    pub(super) fn take(&mut self) -> bool {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * FORGED_PER_SEC)
            .min(FORGED_BURST);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            self.dropped += 1;
            false
        }
    }

    /// Logs what was held back since the last call.
    pub(super) fn summary(&mut self) {
        if self.dropped > 0 {
            tracing::warn!(
                held_back = self.dropped,
                "logind: forged PrepareForShutdown signals not reported one by one (a flood from another peer)"
            );
            self.dropped = 0;
        }
    }
}
