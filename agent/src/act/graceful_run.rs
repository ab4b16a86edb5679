//! The graceful path as a task beside the loop: pods leave in priority
//! order (`kube::graceful`), the outcome is audited, and logind's delay lock
//! is released when the run ends (a panic included); a cancel or an
//! escalation stops it, and they release.
use tokio::task::{AbortHandle, JoinHandle};

use super::{audit::Outcome, kube::graceful, Ctx};
use crate::record::ShutdownRecord;

/// The run under way, if any, and the task that joins it.
#[derive(Default)]
pub(super) struct GracefulRun(Option<(AbortHandle, JoinHandle<()>)>);

const NOTHING_DONE: Outcome = Outcome::GracefulDone {
    terminated: 0,
    remaining: 0,
};

impl GracefulRun {
    /// Starts the run for `ep` (a run under way is stopped first).
    /// Standalone (no cluster) there is nothing to stop but the record,
    /// already written.
    pub(super) fn start(&mut self, cx: Ctx, record: ShutdownRecord) {
        self.stop();
        let Ctx { hands, cluster, ep } = cx;
        let id = ep.id;
        let h = hands.clone();
        let run = tokio::spawn(async move {
            let outcome = match &cluster {
                Some(c) => {
                    match graceful::run(&c.node, &c.graceful, &ep, &record, &h.metrics).await {
                        Ok(r) => Outcome::GracefulDone {
                            terminated: r.terminated(),
                            remaining: r.remaining(),
                        },
                        Err(e) => {
                            tracing::error!(error = format!("{e:#}"), "graceful path");
                            NOTHING_DONE
                        }
                    }
                }
                None => NOTHING_DONE,
            };
            h.outcome(ep.id, outcome).await;
        });
        let h = hands;
        let abort = run.abort_handle();
        let joiner = tokio::spawn(async move {
            if let Err(e) = run.await {
                if !e.is_panic() {
                    return; // stopped by a cancel or an escalation: they release
                }
                tracing::error!(error = %e, "the graceful run panicked");
                h.outcome(id, NOTHING_DONE).await;
            }
            h.release_lock();
        });
        self.0 = Some((abort, joiner));
    }

    pub(super) fn running(&self) -> bool {
        self.0.as_ref().is_some_and(|(_, j)| !j.is_finished())
    }

    pub(super) fn stop(&mut self) {
        if let Some((run, joiner)) = self.0.take() {
            run.abort();
            joiner.abort();
        }
    }
}
