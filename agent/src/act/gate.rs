//! The cluster half may join after the agent starts (cluster mode, the API
//! server not answering yet). One gate keeps that protocol: what needs the
//! cluster and comes before it waits here, and is handed back, in the order
//! it came, when the cluster joins.
use std::{sync::Arc, time::Duration};

use tokio::sync::watch;

use super::{after_boot::PreviousBoot, Cluster};
use crate::{
    decide::{Action, BeforeCluster},
    signal::ShutdownSignal,
};

/// What waits for the cluster.
pub(super) enum Held {
    /// The previous boot's report.
    PreviousBoot(PreviousBoot),
    /// No previous boot to report: this boot's own open record, looked for.
    OwnOrphan,
    /// The current episode's action (one at most: a later one replaces it).
    Action {
        signal: ShutdownSignal,
        action: Action,
        episode: u32,
    },
}

/// The cluster half (`C`, generic for its tests): here, or still coming,
/// and what waits for it.
pub(super) struct Gate<C = Cluster> {
    cluster: Option<Arc<C>>,
    coming: Option<watch::Receiver<Option<Arc<C>>>>,
    held: Vec<Held>,
}

impl<C> Gate<C> {
    pub(super) fn new(cluster: Option<Arc<C>>) -> Self {
        Gate {
            cluster,
            coming: None,
            held: Vec::new(),
        }
    }

    /// Cluster mode whose cluster half joins later, through `coming`.
    pub(super) fn expect(&mut self, coming: watch::Receiver<Option<Arc<C>>>) {
        if self.cluster.is_none() {
            self.coming = Some(coming);
        }
    }

    pub(super) fn here(&self) -> Option<Arc<C>> {
        self.cluster.clone()
    }

    /// Cluster mode, not joined yet.
    pub(super) fn coming(&self) -> bool {
        self.coming.is_some()
    }

    /// Kept until the cluster joins; `false` (dropped) when none is coming.
    pub(super) fn hold(&mut self, h: Held) -> bool {
        if self.coming.is_none() {
            return false;
        }
        if matches!(h, Held::Action { .. }) {
            self.drop_action();
        }
        self.held.push(h);
        true
    }

    /// The held action is not needed any more (sent, or superseded).
    pub(super) fn drop_action(&mut self) {
        self.held.retain(|h| !matches!(h, Held::Action { .. }));
    }

    /// Before the cluster joined, an action says what it does
    /// (`Action::before_cluster`): `true` when it is held entirely.
    pub(super) fn admit(&mut self, s: Option<&ShutdownSignal>, action: &Action, id: u32) -> bool {
        if self.coming.is_none() {
            return false;
        }
        let held = |s: &ShutdownSignal| Held::Action {
            signal: s.clone(),
            action: action.clone(),
            episode: id,
        };
        match (action.before_cluster(), s) {
            (BeforeCluster::Held, Some(s)) => {
                // logind's delay lock stays taken meanwhile, up to its limit.
                tracing::warn!(episode = id, action = %action, "the API server has not answered yet: the action waits for it");
                self.hold(held(s))
            }
            // The last gasp waits for it within its own bound, and is kept
            // in case the bound passes first.
            (BeforeCluster::Bounded, Some(s)) => {
                self.hold(held(s));
                false
            }
            (BeforeCluster::Clears, _) => {
                self.drop_action();
                false
            }
            _ => false,
        }
    }

    /// The cluster joined: kept, and what waited for it handed back.
    pub(super) fn join(&mut self, c: Arc<C>) -> Vec<Held> {
        self.cluster = Some(c);
        self.coming = None;
        std::mem::take(&mut self.held)
    }

    /// The cluster, waiting at most `bound` for it to join; with what waited
    /// for it when it joined now.
    pub(super) async fn within(&mut self, bound: Duration) -> Option<(Arc<C>, Vec<Held>)> {
        if let Some(c) = &self.cluster {
            return Some((c.clone(), Vec::new()));
        }
        let mut coming = self.coming.clone()?;
        let c = match tokio::time::timeout(bound, coming.wait_for(Option::is_some)).await {
            Ok(Ok(c)) => c.clone()?,
            _ => return None,
        };
        let held = self.join(c.clone());
        Some((c, held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signal::{Kind, Source};

    fn signal() -> ShutdownSignal {
        ShutdownSignal::of(Source::Logind, Kind::Poweroff)
    }

    fn graceful() -> Action {
        Action::Graceful {
            deadline: None,
            protected: true,
        }
    }

    /// What is held, by name, in order.
    fn names(held: &[Held]) -> Vec<String> {
        held.iter()
            .map(|h| match h {
                Held::PreviousBoot(_) => "previous-boot".to_string(),
                Held::OwnOrphan => "own-orphan".to_string(),
                Held::Action {
                    action, episode, ..
                } => format!("{}#{episode}", action.name()),
            })
            .collect()
    }

    fn coming() -> (Gate<u32>, watch::Sender<Option<Arc<u32>>>) {
        let (tx, rx) = watch::channel(None);
        let mut g = Gate::new(None);
        g.expect(rx);
        (g, tx)
    }

    #[test]
    fn standalone_holds_nothing_and_every_action_goes_on() {
        let mut g: Gate<u32> = Gate::new(None);
        assert!(!g.coming());
        assert!(!g.hold(Held::OwnOrphan));
        for a in [
            graceful(),
            Action::Immediate { escalated: false },
            Action::Cancel,
        ] {
            assert!(!g.admit(Some(&signal()), &a, 1), "{a}");
        }
        assert!(g.join(Arc::new(7)).is_empty());
    }

    #[test]
    fn a_joined_cluster_holds_nothing() {
        let mut g = Gate::new(Some(Arc::new(7)));
        let (_tx, rx) = watch::channel(None);
        g.expect(rx);
        assert!(!g.coming(), "already here: nothing is expected");
        assert!(!g.admit(Some(&signal()), &graceful(), 1));
        assert!(!g.hold(Held::OwnOrphan));
    }

    #[test]
    fn before_the_join_each_action_follows_its_own_rule_and_the_latest_is_kept() {
        let (mut g, _tx) = coming();
        assert!(g.hold(Held::OwnOrphan));
        let s = signal();
        // Held whole: the action does not go on.
        assert!(g.admit(Some(&s), &Action::Warn { due: None }, 1));
        assert!(g.admit(Some(&s), &graceful(), 1));
        // Bounded: it goes on (the last gasp waits within its bound), and is
        // kept in case the bound passes first; it replaces the graceful run.
        assert!(!g.admit(Some(&s), &Action::Immediate { escalated: true }, 1));
        // Nothing is held for an action without its signal.
        assert!(!g.admit(None, &graceful(), 1));
        let held = g.join(Arc::new(7));
        assert_eq!(names(&held), ["own-orphan", "immediate#1"]);
        assert!(!g.coming());
        assert_eq!(g.here().as_deref(), Some(&7));
        assert!(!g.admit(Some(&s), &graceful(), 2), "joined: nothing waits");
    }

    #[test]
    fn an_episode_s_end_clears_the_held_action_not_the_reports() {
        let (mut g, _tx) = coming();
        assert!(g.admit(Some(&signal()), &graceful(), 3));
        assert!(g.hold(Held::OwnOrphan));
        assert!(!g.admit(None, &Action::Cancel, 3));
        assert_eq!(names(&g.join(Arc::new(7))), ["own-orphan"]);
    }

    #[tokio::test(start_paused = true)]
    async fn within_waits_its_bound_and_keeps_what_is_held_when_it_passes() {
        let (mut g, tx) = coming();
        assert!(!g.admit(Some(&signal()), &Action::LastWord, 4));
        assert!(g.within(Duration::from_secs(2)).await.is_none());
        assert!(g.coming(), "still coming");
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            tx.send_replace(Some(Arc::new(7)));
        });
        let (c, held) = g.within(Duration::from_secs(2)).await.expect("joined");
        assert_eq!(*c, 7);
        assert_eq!(names(&held), ["last-word#4"]);
        let (_, again) = g.within(Duration::ZERO).await.expect("here");
        assert!(again.is_empty(), "handed back once");
    }
}
