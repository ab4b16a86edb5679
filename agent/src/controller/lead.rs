//! Leader election over a coordination.k8s.io Lease, and the pause switch
//! that rides on it. One replica writes; it writes only while its last
//! renewal is recent on its own monotonic clock.
use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{api::PostParams, Api, ResourceExt};

use super::{ControllerConfig, PAUSED_BY_ANNOTATION, PAUSE_ANNOTATION, UNINSTALL_MANAGER};

/// Another holder's Lease as this replica last saw it: (holder, renewTime,
/// when that pair was first seen, on the local monotonic clock). A Lease is
/// judged expired when the pair has not changed for its whole duration on
/// this clock: neither clock skew nor the holder's clock can make a live
/// lease look dead or a dead one look alive.
#[derive(Clone, Debug, Default)]
pub struct LeaseSeen(Option<(String, String, Instant)>);

impl LeaseSeen {
    /// Whether the lease (holder, renew) has gone unrenewed for `dur`.
    pub fn expired(&mut self, holder: &str, renew: &str, dur: Duration, now: Instant) -> bool {
        match &self.0 {
            Some((h, r, since)) if h == holder && r == renew => now.duration_since(*since) > dur,
            _ => {
                self.0 = Some((holder.to_string(), renew.to_string(), now));
                false
            }
        }
    }
}

/// What the Lease said at this pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Term {
    pub(super) leading: bool,
    /// The operator's pause: the Lease carries `lastgasp.dev/paused: "true"`.
    pub(super) paused: bool,
}

/// This replica's leadership, shared with the writes it allows.
#[derive(Clone)]
pub(super) struct Leadership {
    leases: Api<Lease>,
    cfg: ControllerConfig,
    seen: Arc<Mutex<LeaseSeen>>,
    /// When this replica last renewed the Lease (monotonic).
    renewed: Arc<Mutex<Option<Instant>>>,
    /// The API server's creation time of this replica's Deployment.
    installed: Option<SystemTime>,
}

impl Leadership {
    pub(super) fn new(
        leases: Api<Lease>,
        cfg: ControllerConfig,
        installed: Option<SystemTime>,
    ) -> Self {
        Leadership {
            leases,
            cfg,
            seen: Arc::default(),
            renewed: Arc::default(),
            installed,
        }
    }

    /// Whether this replica may write now: it renewed the Lease less than
    /// two thirds of its duration ago, on its own clock. Another replica
    /// takes the Lease only after a whole duration without a renewal on
    /// its clock: the third between is the margin.
    pub(super) fn valid(&self) -> bool {
        let deadline = self.cfg.lease_duration * 2 / 3;
        self.renewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|t| t.elapsed() < deadline)
    }

    /// Takes the Lease when free or expired, renews it while held. A 409
    /// means someone else won.
    pub(super) async fn renew(&self, now: SystemTime) -> Result<Term> {
        let started = Instant::now();
        let term = self.try_lead(now).await;
        let mut renewed = self
            .renewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &term {
            // Counted from before the request: a slow answer shortens the term.
            Ok(Term { leading: true, .. }) => *renewed = Some(started),
            _ => *renewed = None,
        }
        term
    }

    async fn try_lead(&self, now: SystemTime) -> Result<Term> {
        let cfg = &self.cfg;
        let micro =
            |t: SystemTime| MicroTime(Timestamp::try_from(t).unwrap_or_else(|_| Timestamp::now()));
        let spec = |transitions: i32, acquire: Option<MicroTime>| LeaseSpec {
            holder_identity: Some(cfg.identity.clone()),
            lease_duration_seconds: Some(cfg.lease_duration.as_secs() as i32),
            acquire_time: acquire,
            renew_time: Some(micro(now)),
            lease_transitions: Some(transitions),
            ..Default::default()
        };
        match self.leases.get_opt(&cfg.lease_name).await? {
            None => {
                let lease = Lease {
                    metadata: kube::api::ObjectMeta {
                        name: Some(cfg.lease_name.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec(0, Some(micro(now)))),
                };
                let leading = match self.leases.create(&PostParams::default(), &lease).await {
                    Ok(_) => true,
                    Err(kube::Error::Api(s)) if s.code == 409 => false,
                    Err(e) => return Err(e.into()),
                };
                Ok(Term {
                    leading,
                    paused: false,
                })
            }
            Some(mut lease) => {
                let paused = self.paused(&mut lease);
                let cur = lease.spec.clone().unwrap_or_default();
                let mine = cur.holder_identity.as_deref() == Some(cfg.identity.as_str());
                let dur =
                    Duration::from_secs(cur.lease_duration_seconds.unwrap_or(15).max(1) as u64);
                let holder = cur.holder_identity.clone().unwrap_or_default();
                let renew = cur
                    .renew_time
                    .as_ref()
                    .map(|t| t.0.to_string())
                    .unwrap_or_default();
                let expired = holder.is_empty()
                    || self
                        .seen
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .expired(&holder, &renew, dur, Instant::now());
                if !mine && !expired {
                    return Ok(Term {
                        leading: false,
                        paused,
                    });
                }
                let transitions = cur.lease_transitions.unwrap_or(0) + i32::from(!mine);
                let acquire = if mine {
                    cur.acquire_time
                } else {
                    Some(micro(now))
                };
                lease.spec = Some(spec(transitions, acquire));
                // The resourceVersion read above makes a concurrent writer fail.
                let leading = match self
                    .leases
                    .replace(&cfg.lease_name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => true,
                    Err(kube::Error::Api(s)) if s.code == 409 => false,
                    Err(e) => return Err(e.into()),
                };
                Ok(Term { leading, paused })
            }
        }
    }
}

impl Leadership {
    /// Whether `lease` is paused. A pause an uninstall left before this
    /// replica's Deployment was created (a reinstall) is taken off `lease`,
    /// and goes with the write that renews it, when this replica leads.
    fn paused(&self, lease: &mut Lease) -> bool {
        let paused = lease
            .annotations()
            .get(PAUSE_ANNOTATION)
            .is_some_and(|v| v == "true");
        if !paused || !reinstalled(lease, self.installed) {
            return paused;
        }
        let ann = lease.annotations_mut();
        ann.remove(PAUSE_ANNOTATION);
        ann.remove(PAUSED_BY_ANNOTATION);
        tracing::info!(
            lease = self.cfg.lease_name,
            "the Lease was paused by an uninstall before this Deployment was created: a reinstall, the pause lifted"
        );
        false
    }
}

/// The uninstall paused `lease` (its lift's annotation and field manager)
/// before this replica's Deployment was `installed`, by the server's stamps.
fn reinstalled(lease: &Lease, installed: Option<SystemTime>) -> bool {
    let by_uninstall = lease
        .annotations()
        .get(PAUSED_BY_ANNOTATION)
        .is_some_and(|v| v == "uninstall");
    let paused_at = crate::record::managed_time(&lease.metadata, UNINSTALL_MANAGER);
    by_uninstall && matches!((paused_at, installed), (Some(p), Some(i)) if i > p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Lease is expired only when this replica has watched it go unrenewed
    /// for its whole duration, whatever the clocks say.
    #[test]
    fn a_lease_expires_by_what_this_replica_saw() {
        let d = Duration::from_secs(15);
        let t0 = Instant::now();
        let mut seen = LeaseSeen::default();
        // A renewTime far in the past (a skewed holder) is not expiry: first sight.
        assert!(!seen.expired("b", "2001-01-01T00:00:00Z", d, t0));
        assert!(!seen.expired("b", "2001-01-01T00:00:00Z", d, t0 + Duration::from_secs(10)));
        assert!(seen.expired("b", "2001-01-01T00:00:00Z", d, t0 + Duration::from_secs(16)));
        // Renewed (a new renewTime, even one in our past): alive again.
        assert!(!seen.expired("b", "2001-01-01T00:00:05Z", d, t0 + Duration::from_secs(17)));
        assert!(!seen.expired("b", "2001-01-01T00:00:05Z", d, t0 + Duration::from_secs(31)));
        // A new holder starts a new watch.
        assert!(!seen.expired("c", "2001-01-01T00:00:05Z", d, t0 + Duration::from_secs(40)));
    }
}
