//! The agent's health on its Node, for operators who never read /readyz:
//! `LastgaspDegraded` True and a Warning Event once a part of the graceful
//! path has been lost for `HOLD`, False and a Normal Event when it is back.
//! Never during a shutdown (the caller's rule): the bus goes down with the
//! node, and the API server's time then belongs to the last gasp.
use std::time::{Duration, Instant};

use kube::runtime::events::EventType;
use tokio::task::JoinHandle;

use super::kube::NodeClient;

/// A shorter loss (a dbus-daemon restarted by a package upgrade) is not
/// reported on the Node; the metric and /readyz show it at once.
pub const HOLD: Duration = Duration::from_secs(10);
/// After a failed write, the next try.
const RETRY: Duration = Duration::from_secs(30);

/// Degraded: the condition's reason and the lost parts, with why.
pub type State = Option<(&'static str, String)>;

#[derive(Default)]
pub struct Degraded {
    /// What the Node says, as this agent wrote it (`None`: nothing yet).
    written: Option<State>,
    /// Since when the present loss lasts.
    since: Option<Instant>,
    in_flight: Option<(State, JoinHandle<anyhow::Result<()>>)>,
    retry_at: Option<Instant>,
}

impl Degraded {
    /// The state to write now, if any: the first one seen, a loss held for
    /// `HOLD` (or its reason changed), a return.
    pub fn due(&mut self, state: &State, now: Instant) -> Option<State> {
        match state {
            Some(_) => {
                let since = *self.since.get_or_insert(now);
                if now.duration_since(since) < HOLD {
                    return None;
                }
            }
            None => self.since = None,
        }
        let same = match (&self.written, state) {
            (Some(Some((was, _))), Some((now, _))) => was == now,
            (Some(w), s) => w == s,
            (None, _) => false,
        };
        let waiting = self.retry_at.is_some_and(|t| now < t);
        (!same && !waiting).then(|| state.clone())
    }

    /// Writes what is due on `node`, one write at a time, off the loop.
    pub async fn report(&mut self, node: &NodeClient, state: &State, now: Instant) {
        if let Some((_, h)) = &self.in_flight {
            if !h.is_finished() {
                return;
            }
        }
        if let Some((s, h)) = self.in_flight.take() {
            match h.await {
                Ok(Ok(())) => (self.written, self.retry_at) = (Some(s), None),
                Ok(Err(e)) => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "the Node's LastgaspDegraded NOT written; trying again in {RETRY:?}"
                    );
                    self.retry_at = Some(now + RETRY);
                }
                Err(e) => tracing::error!(error = %e, "the LastgaspDegraded write panicked"),
            }
        }
        let Some(s) = self.due(state, now) else {
            return;
        };
        // An Event only on a change an operator should see: a loss, or the
        // return from one this agent reported (not every start's False).
        let was_degraded = matches!(self.written, Some(Some(_)));
        let (node, st) = (node.clone(), s.clone());
        let write = async move {
            node.set_degraded(st.as_ref().map(|(r, w)| (*r, w.as_str())))
                .await?;
            match st {
                Some((reason, why)) => {
                    node.event_because(EventType::Warning, reason, "Degraded", why)
                        .await
                }
                None if was_degraded => {
                    let note = "the graceful path is armed again".to_string();
                    node.event_because(EventType::Normal, "Armed", "Recovered", note)
                        .await
                }
                None => Ok(()),
            }
        };
        self.in_flight = Some((s, tokio::spawn(write)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(why: &str) -> State {
        Some(("GracefulPathNotArmed", why.into()))
    }

    #[test]
    fn a_loss_is_due_after_the_hold_and_a_return_at_once() {
        let mut d = Degraded::default();
        let t0 = Instant::now();
        assert_eq!(d.due(&None, t0), Some(None), "the first state seen");
        d.written = Some(None);
        assert_eq!(d.due(&None, t0), None);
        // A loss shorter than the hold is never due.
        assert_eq!(d.due(&lost("logind: gone"), t0), None);
        assert_eq!(d.due(&lost("logind: gone"), t0 + HOLD / 2), None);
        assert_eq!(d.due(&None, t0 + HOLD), None);
        // Held: due, then written once.
        let t1 = t0 + HOLD * 2;
        assert_eq!(d.due(&lost("logind: gone"), t1), None);
        let held = d.due(&lost("logind: gone"), t1 + HOLD);
        assert_eq!(held, Some(lost("logind: gone")));
        d.written = held;
        assert_eq!(d.due(&lost("logind: gone again"), t1 + HOLD * 2), None);
        // A failed write waits for the retry.
        d.retry_at = Some(t1 + HOLD * 3);
        assert_eq!(d.due(&None, t1 + HOLD * 2), None);
        assert_eq!(d.due(&None, t1 + HOLD * 3), Some(None));
    }
}
