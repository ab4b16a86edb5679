//! logind's shutdown delay lock, with one owner. The lock is held outside a
//! shutdown; a shutdown logind announces starts its clock (released when
//! graceful work is done, or `margin` before logind's deadline); when the
//! shutdown does not come the lock is taken again (a new one first, then
//! the old dropped: never a moment without). The rest of the agent holds a
//! [`DelayLockHandle`] and sends it [`Command`]s; the logind detector tells
//! it when a shutdown is announced or called off and lends it the bus.
use std::{
    os::fd::OwnedFd,
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};

use super::logind::Inhibitor;
use crate::health::Health;

const WHO: &str = "lastgasp";
const WHY: &str = "lastgasp needs time to tell the cluster and drain the node";
/// What `health` calls the lock.
pub const PART: &str = "logind delay lock";

/// What the rest of the agent asks of the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Graceful work is done: let the shutdown go on. Outside a shutdown it
    /// does nothing (the lock stays, for the next one).
    Release,
    /// The shutdown did not come (the agent abandoned its episode): forget
    /// it and hold a lock again, for the next one.
    Relock,
}

/// The agent's side of the delay lock.
#[derive(Clone, Debug)]
pub struct DelayLockHandle {
    commands: mpsc::UnboundedSender<Command>,
    held: watch::Receiver<bool>,
}

impl DelayLockHandle {
    pub fn release(&self) {
        let _ = self.commands.send(Command::Release);
    }

    pub fn relock(&self) {
        let _ = self.commands.send(Command::Relock);
    }

    /// Whether the agent holds a delay lock right now.
    pub fn lock_held(&self) -> bool {
        *self.held.borrow()
    }
}

/// A shutdown announced and not called off.
#[derive(Debug)]
struct Announced {
    /// When the lock goes if graceful work has not released it.
    release_at: Instant,
    released: bool,
    /// Announced by logind itself, not by another peer (which anyone on
    /// the bus can be: the kubelet's e2e tests are).
    from_logind: bool,
}

/// What woke the lock's owner: a command, or the release's deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    Command(Command),
    Deadline,
}

/// No shutdown delay is taken as longer than this (logind allows
/// "infinity"): the deadline arithmetic stays in range.
pub const DELAY_CAP: Duration = Duration::from_secs(24 * 3600);

pub struct DelayLock {
    fd: Option<OwnedFd>,
    announced: Option<Announced>,
    /// Release this long before logind's deadline (capped at a quarter of
    /// the delay).
    margin: Duration,
    commands: mpsc::UnboundedReceiver<Command>,
    held: watch::Sender<bool>,
    health: Option<Arc<Health>>,
}

impl DelayLock {
    /// A lock not taken yet, and the agent's handle to it.
    pub fn new(margin: Duration) -> (Self, DelayLockHandle) {
        let (commands, rx) = mpsc::unbounded_channel();
        let (held, held_rx) = watch::channel(false);
        let lock = DelayLock {
            fd: None,
            announced: None,
            margin,
            commands: rx,
            held,
            health: None,
        };
        let handle = DelayLockHandle {
            commands,
            held: held_rx,
        };
        (lock, handle)
    }

    /// Reports a lock that cannot be taken to `health` while it lasts.
    pub fn report_to(&mut self, health: Arc<Health>) {
        self.health = Some(health);
    }

    pub fn is_held(&self) -> bool {
        self.fd.is_some()
    }

    /// Whether a shutdown is announced, and whether logind announced it.
    pub fn announced_by_logind(&self) -> Option<bool> {
        self.announced.as_ref().map(|a| a.from_logind)
    }

    /// Outside a shutdown logind itself announced, the node keeps a lock.
    pub fn wants_lock(&self) -> bool {
        self.announced.as_ref().is_none_or(|a| !a.from_logind)
    }

    /// A shutdown starts: logind goes ahead `left` after `from` whatever we
    /// do. Returns logind's deadline on the wall clock.
    pub fn begin(
        &mut self,
        from: Instant,
        wall: SystemTime,
        left: Duration,
        from_logind: bool,
    ) -> SystemTime {
        let left = left.min(DELAY_CAP);
        let margin = self.margin.min(left / 4);
        self.announced = Some(Announced {
            release_at: from + left.saturating_sub(margin),
            released: false,
            from_logind,
        });
        // Releases asked for before this shutdown belong to an earlier one.
        while let Ok(c) = self.commands.try_recv() {
            if c == Command::Relock {
                tracing::debug!("logind: a relock asked before this shutdown: dropped");
            }
        }
        wall + left
    }

    /// The shutdown was called off (or never came): forget it. Returns
    /// whether one was announced.
    pub fn end(&mut self) -> bool {
        self.announced.take().is_some()
    }

    /// Waits for a command, or for the release's deadline.
    pub async fn wake(&mut self) -> Wake {
        let due = match &self.announced {
            Some(a) if !a.released && self.fd.is_some() => Some(a.release_at),
            _ => None,
        };
        tokio::select! {
            Some(c) = self.commands.recv() => Wake::Command(c),
            () = sleep_until_opt(due) => Wake::Deadline,
        }
    }

    /// Carries out what woke it. Without `host` (the bus is away) the lock
    /// is only released; it is taken again when the bus is back.
    pub async fn apply(&mut self, wake: Wake, host: Option<&impl Inhibitor>) {
        match wake {
            Wake::Command(Command::Release) => self.release("graceful work done"),
            Wake::Deadline => self.release("deadline near"),
            Wake::Command(Command::Relock) => {
                let had = self.end();
                if let Some(h) = host.filter(|_| had || self.fd.is_none()) {
                    tracing::info!("logind: the shutdown did not come: delay lock taken again");
                    self.take(h).await;
                }
                return;
            }
        }
        // After a release for another peer's PrepareForShutdown, logind is
        // not waiting for us: lock again, so a forged signal cannot leave
        // the node unprotected.
        if let Some(h) = host.filter(|_| self.fd.is_none() && self.wants_lock()) {
            tracing::info!(
                "logind: the shutdown was not announced by logind: delay lock taken again"
            );
            self.take(h).await;
        }
    }

    fn release(&mut self, why: &str) {
        let Some(a) = self.announced.as_mut().filter(|a| !a.released) else {
            tracing::debug!("logind: release asked outside a shutdown: the lock stays");
            return;
        };
        a.released = true;
        if self.fd.take().is_some() {
            tracing::info!("logind: delay lock released ({why})");
            self.held.send_replace(false);
        }
    }

    /// Takes a new lock, then drops the old one (never a moment without).
    pub async fn take(&mut self, host: &impl Inhibitor) {
        match take_lock(host).await {
            Ok(fd) => self.taken(fd),
            Err(e) => {
                tracing::error!(error = %e, "logind: cannot take a delay lock");
                if let Some(h) = &self.health {
                    h.lost(PART, &format!("cannot take a delay lock: {e}"));
                }
            }
        }
    }

    /// A lock taken elsewhere (the detector's start) is now this one.
    pub fn taken(&mut self, fd: OwnedFd) {
        let old = self.fd.replace(fd);
        drop(old);
        self.held.send_replace(true);
        if let Some(h) = &self.health {
            h.regained(PART);
        }
    }
}

/// Takes a `shutdown` delay lock; the fd is the lock.
pub async fn take_lock(host: &impl Inhibitor) -> zbus::Result<OwnedFd> {
    host.inhibit_shutdown(WHO, WHY).await
}

async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// logind's side: each lock is a pipe's read end, held while its write
    /// end sees a reader (logind waits for every fd to close).
    #[derive(Default)]
    struct FakeLogind {
        taken: AtomicU32,
        refuse: std::sync::atomic::AtomicBool,
        ends: std::sync::Mutex<Vec<OwnedFd>>,
    }

    impl FakeLogind {
        /// Locks whose fd the agent still holds.
        fn open_locks(&self) -> usize {
            let ends = self.ends.lock().unwrap();
            ends.iter()
                .filter(|w| nix::unistd::write(w, b"x").is_ok())
                .count()
        }
    }

    impl Inhibitor for FakeLogind {
        async fn current_inhibit_delay(&self) -> zbus::Result<Duration> {
            Ok(Duration::from_secs(30))
        }
        async fn inhibit_shutdown(&self, who: &str, _why: &str) -> zbus::Result<OwnedFd> {
            assert_eq!(who, WHO);
            if self.refuse.load(Ordering::SeqCst) {
                return Err(zbus::Error::Failure("denied".into()));
            }
            self.taken.fetch_add(1, Ordering::SeqCst);
            let (r, w) = nix::unistd::pipe().unwrap();
            self.ends.lock().unwrap().push(w);
            Ok(r)
        }
        async fn reload_logind_conf(&self) -> zbus::Result<()> {
            Ok(())
        }
    }

    async fn held(logind: &FakeLogind) -> (DelayLock, DelayLockHandle) {
        let (mut lock, handle) = DelayLock::new(Duration::from_secs(1));
        assert!(!handle.lock_held());
        lock.take(logind).await;
        assert!(handle.lock_held() && lock.is_held());
        (lock, handle)
    }

    /// logind allows "infinity": the deadline arithmetic stays in range.
    #[tokio::test]
    async fn an_infinite_delay_limit_is_capped_not_overflowed() {
        let (mut lock, _) = DelayLock::new(Duration::from_secs(1));
        let wall = SystemTime::now();
        let deadline = lock.begin(Instant::now(), wall, Duration::MAX, true);
        assert_eq!(deadline, wall + DELAY_CAP);
    }

    #[tokio::test(start_paused = true)]
    async fn graceful_work_done_releases_logind_s_shutdown_and_keeps_no_lock() {
        let logind = FakeLogind::default();
        let (mut lock, handle) = held(&logind).await;
        lock.begin(
            Instant::now(),
            SystemTime::now(),
            Duration::from_secs(30),
            true,
        );
        handle.release();
        let w = lock.wake().await;
        assert_eq!(w, Wake::Command(Command::Release));
        lock.apply(w, Some(&logind)).await;
        // logind waits for nobody now: no lock, none taken again.
        assert!(!handle.lock_held());
        assert_eq!(logind.open_locks(), 0);
        assert_eq!(logind.taken.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_release_the_lock_goes_margin_before_logind_s_deadline() {
        let logind = FakeLogind::default();
        let (mut lock, handle) = held(&logind).await;
        let start = Instant::now();
        lock.begin(start, SystemTime::now(), Duration::from_secs(30), true);
        let w = lock.wake().await;
        assert_eq!(w, Wake::Deadline);
        assert_eq!(Instant::now() - start, Duration::from_secs(29));
        lock.apply(w, Some(&logind)).await;
        assert!(!handle.lock_held());
        assert_eq!(logind.open_locks(), 0);
        // Released: no deadline is left to wake for.
        let quiet = tokio::time::timeout(Duration::from_secs(3600), lock.wake()).await;
        assert!(quiet.is_err(), "woke after the release: {quiet:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_for_another_peer_s_signal_locks_again_at_once() {
        let logind = FakeLogind::default();
        let (mut lock, handle) = held(&logind).await;
        lock.begin(
            Instant::now(),
            SystemTime::now(),
            Duration::from_secs(30),
            false,
        );
        handle.release();
        let w = lock.wake().await;
        lock.apply(w, Some(&logind)).await;
        assert!(handle.lock_held());
        assert_eq!(logind.open_locks(), 1);
        assert_eq!(logind.taken.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn the_shutdown_that_did_not_come_takes_a_new_lock_before_the_old_goes() {
        let logind = FakeLogind::default();
        let (mut lock, handle) = held(&logind).await;
        lock.begin(
            Instant::now(),
            SystemTime::now(),
            Duration::from_secs(30),
            true,
        );
        handle.relock();
        let w = lock.wake().await;
        assert_eq!(w, Wake::Command(Command::Relock));
        lock.apply(w, Some(&logind)).await;
        assert_eq!(lock.announced_by_logind(), None);
        assert!(handle.lock_held());
        // The old lock was never released: replaced, one open at the end.
        assert_eq!(logind.taken.load(Ordering::SeqCst), 2);
        assert_eq!(logind.open_locks(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn releases_asked_before_a_shutdown_belong_to_an_earlier_one() {
        let logind = FakeLogind::default();
        let (mut lock, handle) = held(&logind).await;
        handle.release();
        handle.relock();
        lock.begin(
            Instant::now(),
            SystemTime::now(),
            Duration::from_secs(30),
            true,
        );
        // Only the deadline is left: the stale commands were dropped.
        assert_eq!(lock.wake().await, Wake::Deadline);
        assert!(handle.lock_held());
    }

    #[tokio::test(start_paused = true)]
    async fn without_the_bus_a_release_still_releases_and_a_relock_waits_for_it() {
        let logind = FakeLogind::default();
        let (mut lock, handle) = held(&logind).await;
        lock.begin(
            Instant::now(),
            SystemTime::now(),
            Duration::from_secs(30),
            true,
        );
        handle.release();
        let w = lock.wake().await;
        lock.apply(w, None::<&FakeLogind>).await;
        assert!(!handle.lock_held());
        handle.relock();
        let w = lock.wake().await;
        lock.apply(w, None::<&FakeLogind>).await;
        assert!(!handle.lock_held() && lock.wants_lock());
        assert_eq!(logind.taken.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_lock_is_reported_and_a_later_one_clears_it() {
        let logind = FakeLogind::default();
        let health = Health::new("starting");
        let (mut lock, handle) = DelayLock::new(Duration::from_secs(1));
        lock.report_to(health.clone());
        logind.refuse.store(true, Ordering::SeqCst);
        lock.take(&logind).await;
        assert!(!handle.lock_held());
        assert!(
            health.degraded().is_some_and(|d| d.contains(PART)),
            "{:?}",
            health.degraded()
        );
        logind.refuse.store(false, Ordering::SeqCst);
        lock.take(&logind).await;
        assert!(handle.lock_held());
        assert_eq!(health.degraded(), None);
    }
}
