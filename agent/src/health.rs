//! Readiness and liveness: what the loop and the detectors report, and what
//! the `/readyz` and `/healthz` endpoints answer. Shared by both sides, so
//! the detectors know nothing of HTTP.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

/// `/healthz` fails when the loop has not stamped for this long.
pub(crate) const STALL_LIMIT: Duration = Duration::from_secs(30);
const NOT_LOOPING: u64 = u64::MAX;

/// Readiness and liveness, shared by the loop and the endpoint.
pub struct Health {
    started: Instant,
    /// Why not ready; `None` once ready.
    not_ready: Mutex<Option<String>>,
    /// Parts lost after the start, with why ("logind": "the bus ...").
    lost: Mutex<BTreeMap<&'static str, String>>,
    /// The bus parts that started (logind, systemd).
    buses: Mutex<BTreeSet<&'static str>>,
    /// Milliseconds since `started` of the loop's last turn; `NOT_LOOPING`
    /// until the first (the start itself is readiness's business).
    heartbeat_ms: AtomicU64,
    /// A lost bus part (the graceful path) makes it unready, not only degraded.
    unready_when_degraded: AtomicBool,
}

/// A part of the host's bus (logind, its delay lock, systemd): losing one
/// degrades the agent (the eBPF hooks and the last gasp still work).
fn bus_part(part: &str) -> bool {
    matches!(part.split(' ').next(), Some("logind" | "systemd"))
}

impl Health {
    pub fn new(why_not_ready: &str) -> Arc<Self> {
        Arc::new(Health {
            started: Instant::now(),
            not_ready: Mutex::new(Some(why_not_ready.to_string())),
            lost: Mutex::default(),
            buses: Mutex::default(),
            heartbeat_ms: AtomicU64::new(NOT_LOOPING),
            unready_when_degraded: AtomicBool::new(false),
        })
    }

    /// Whether a lost bus part makes the agent unready (`--unready-unless-armed`)
    /// or only degraded (the default: Ready, so that rollouts go on).
    pub fn unready_when_degraded(&self, on: bool) {
        self.unready_when_degraded.store(on, Ordering::Relaxed);
    }

    pub fn not_ready(&self, why: &str) {
        *locked(&self.not_ready) = Some(why.to_string());
    }

    pub fn ready(&self) {
        *locked(&self.not_ready) = None;
    }

    /// `part` stopped working (not ready until `regained`); logged once per loss.
    pub fn lost(&self, part: &'static str, why: &str) {
        let mut lost = locked(&self.lost);
        if lost.insert(part, why.to_string()).is_none() {
            tracing::warn!(part, why, "not ready: {part} lost");
        }
    }

    pub fn regained(&self, part: &'static str) {
        let mut lost = locked(&self.lost);
        if lost.remove(part).is_some() {
            tracing::info!(part, "{part} back");
        }
    }

    /// A bus part (logind, systemd) is running: it is reachable while not lost.
    pub fn bus_started(&self, part: &'static str) {
        locked(&self.buses).insert(part);
    }

    /// Whether any bus part was started (not `--no-dbus`).
    pub fn buses_expected(&self) -> bool {
        !locked(&self.buses).is_empty()
    }

    /// Whether logind or systemd can be reached now (a started part not lost).
    pub fn bus_reachable(&self) -> bool {
        let lost = locked(&self.lost);
        locked(&self.buses).iter().any(|p| !lost.contains_key(p))
    }

    /// Whether the graceful path is armed: `part` (logind) started and
    /// neither it nor any of its parts (`part` and the `part …` lock) is lost.
    pub fn armed(&self, part: &str) -> bool {
        let lost = locked(&self.lost);
        locked(&self.buses).contains(part)
            && !lost.keys().any(|p| p.split(' ').next() == Some(part))
    }

    /// Ready (`ok`, or `ok, degraded: ...` naming lost bus parts), or why not.
    pub fn readiness(&self) -> Result<String, String> {
        if let Some(why) = &*locked(&self.not_ready) {
            return Err(why.clone());
        }
        let strict = self.unready_when_degraded.load(Ordering::Relaxed);
        let lost = locked(&self.lost);
        let (degraded, unready): (Vec<_>, Vec<_>) =
            lost.iter().partition(|(part, _)| !strict && bus_part(part));
        if !unready.is_empty() {
            return Err(reasons(unready));
        }
        Ok(match degraded.is_empty() {
            true => "ok".into(),
            false => format!("ok, degraded: {}", reasons(degraded)),
        })
    }

    /// The lost bus parts, with why; `None` while every started one holds.
    pub fn degraded(&self) -> Option<String> {
        let lost = locked(&self.lost);
        let parts: Vec<_> = lost.iter().filter(|(part, _)| bus_part(part)).collect();
        (!parts.is_empty()).then(|| reasons(parts))
    }

    /// The main loop calls this on every turn.
    pub fn beat(&self) {
        self.heartbeat_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since the loop's last turn; `None` before the loop started.
    pub fn since_beat(&self) -> Option<Duration> {
        let ms = self.heartbeat_ms.load(Ordering::Relaxed);
        (ms != NOT_LOOPING).then(|| {
            self.started
                .elapsed()
                .saturating_sub(Duration::from_millis(ms))
        })
    }

    /// Alive while starting (the hooks, the watches: readiness says why it
    /// is not ready yet), then while the loop turns.
    pub fn liveness(&self) -> Result<(), String> {
        let Some(since) = self.since_beat() else {
            return Ok(());
        };
        if since > STALL_LIMIT {
            Err(format!(
                "the main loop has not turned for {}s (limit {}s)",
                since.as_secs(),
                STALL_LIMIT.as_secs()
            ))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
impl Health {
    /// A ready Health whose loop last turned `ago`.
    pub(crate) fn stalled_for(ago: Duration) -> Arc<Self> {
        Arc::new(Health {
            started: Instant::now() - ago,
            not_ready: Mutex::new(None),
            lost: Mutex::default(),
            buses: Mutex::default(),
            heartbeat_ms: AtomicU64::new(0),
            unready_when_degraded: AtomicBool::new(false),
        })
    }
}

fn reasons(parts: Vec<(&&'static str, &String)>) -> String {
    parts
        .iter()
        .map(|(part, why)| format!("{part}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The lock, even if a holder panicked (the state is a plain record).
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_part_makes_it_unready_until_regained() {
        let h = Health::new("starting");
        h.unready_when_degraded(true);
        h.ready();
        h.lost("systemd", "the bus connection closed");
        h.lost("logind", "the bus connection closed");
        assert_eq!(
            h.readiness(),
            Err("logind: the bus connection closed; systemd: the bus connection closed".into())
        );
        h.regained("logind");
        assert_eq!(
            h.readiness(),
            Err("systemd: the bus connection closed".into())
        );
        h.regained("systemd");
        assert_eq!(h.readiness(), Ok("ok".into()));
        // The buses count as reachable while a started one is not lost.
        let h = Health::new("starting");
        assert!(!h.bus_reachable(), "none started");
        h.bus_started("logind");
        h.bus_started("systemd");
        h.lost("logind", "gone");
        assert!(h.bus_reachable(), "systemd is still there");
        h.lost("systemd", "gone");
        assert!(!h.bus_reachable());
        h.regained("systemd");
        assert!(h.bus_reachable());
        // Still starting: the start's reason comes first.
        let h = Health::new("arming the hooks");
        h.lost("logind", "gone");
        assert_eq!(h.readiness(), Err("arming the hooks".into()));
    }

    #[test]
    fn a_lost_bus_part_only_degrades_by_default() {
        let h = Health::new("starting");
        h.ready();
        assert_eq!(h.degraded(), None);
        h.lost("logind delay lock", "cannot take a delay lock: denied");
        assert_eq!(
            h.readiness(),
            Ok("ok, degraded: logind delay lock: cannot take a delay lock: denied".into())
        );
        assert_eq!(
            h.degraded().as_deref(),
            Some("logind delay lock: cannot take a delay lock: denied")
        );
        // The API server is no bus part: unready either way.
        h.lost("api-server", "connection refused");
        assert_eq!(h.readiness(), Err("api-server: connection refused".into()));
        h.regained("api-server");
        h.regained("logind delay lock");
        assert_eq!(h.readiness(), Ok("ok".into()));
        assert_eq!(h.degraded(), None);
    }

    #[test]
    fn the_graceful_path_is_armed_only_while_logind_and_its_lock_hold() {
        let h = Health::new("starting");
        assert!(!h.armed("logind"), "never started (no bus, no logind)");
        h.bus_started("logind");
        assert!(h.armed("logind"));
        h.lost("logind delay lock", "cannot take a delay lock: denied");
        h.lost("logindx", "another part");
        assert!(!h.armed("logind"));
        h.regained("logind delay lock");
        assert!(h.armed("logind"), "a part of another name does not count");
        h.lost("logind", "the bus connection closed");
        assert!(!h.armed("logind"));
    }
}
