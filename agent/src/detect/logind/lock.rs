//! The shutdown delay lock: taking one, and the handle through which the
//! rest of the agent releases it (graceful work done) or asks for it again
//! (the shutdown did not come).
use std::os::fd::OwnedFd;

use tokio::sync::{mpsc, watch};

use crate::bus::logind::Inhibitor;

const WHO: &str = "lastgasp";
const WHY: &str = "lastgasp needs time to tell the cluster and drain the node";

/// Takes a `shutdown` delay lock; the fd is the lock.
pub(crate) async fn take_lock(host: &impl Inhibitor) -> zbus::Result<OwnedFd> {
    host.inhibit_shutdown(WHO, WHY).await
}

/// The agent's side of the delay lock.
#[derive(Clone, Debug)]
pub struct LogindHandle {
    release: mpsc::UnboundedSender<()>,
    relock: mpsc::UnboundedSender<()>,
    held: watch::Receiver<bool>,
}

impl LogindHandle {
    /// Graceful work is done: close the delay lock so the shutdown goes on.
    /// Outside a shutdown this does nothing (the lock stays, for the next one).
    pub fn release(&self) {
        let _ = self.release.send(());
    }

    /// The shutdown did not come (the agent abandoned its episode): forget
    /// it and hold a delay lock again, for the next one.
    pub fn relock(&self) {
        let _ = self.relock.send(());
    }

    /// Whether the agent holds a delay lock right now.
    pub fn lock_held(&self) -> bool {
        *self.held.borrow()
    }
}

impl LogindHandle {
    /// A handle and the detector's ends of it.
    pub(super) fn new() -> (
        Self,
        mpsc::UnboundedReceiver<()>,
        mpsc::UnboundedReceiver<()>,
        watch::Sender<bool>,
    ) {
        let (release, release_rx) = mpsc::unbounded_channel();
        let (relock, relock_rx) = mpsc::unbounded_channel();
        let (held, held_rx) = watch::channel(true);
        let handle = LogindHandle {
            release,
            relock,
            held: held_rx,
        };
        (handle, release_rx, relock_rx, held)
    }
}
