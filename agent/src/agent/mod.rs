//! The agent's one loop (`turn`) and its body (`Agent::handle`): each
//! `ShutdownSignal` is enriched, decided, audited (fsync'd before it acts,
//! or for the last gasp while its patches leave) and then acted on
//! (`act::Actuator`); time passing is decided too
//! (pending requests expire, episodes past their end are checked with the
//! host and unwound). Detection → decision → action, one way.
//!
//! Nothing here waits on the network for long: the last gasp is bounded
//! (`LAST_GASP_BOUND`), and Events, cancels, warnings, unwinding and the
//! host check run as tasks beside the loop.
use std::{
    borrow::Cow,
    collections::VecDeque,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use lastgasp_common::wire::audit::StdoutLine;
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::{mpsc, watch, Mutex},
};

use crate::{
    act::{
        audit::{AuditLog, Durability, Outcome},
        metrics::Metrics,
        Actuator, AfterBoot, Cluster,
    },
    bus::delay_lock::DelayLockHandle,
    clock,
    decide::{self, Action, Decider, Decision, DecisionPolicy, HostAnswer, HostQuery, Tick},
    detect::{
        actor,
        ebpf::{Drops, EbpfDetector},
        final_sweep,
        hooks::tool_end,
        shutdown_hook,
    },
    health::Health,
    signal::{ShutdownSignal, Source},
};

mod run;

pub use run::{outlive_final_kill, run, RunArgs};

/// The host's answer about an episode (its id).
pub type Answer = (u32, HostAnswer);

pub struct Agent {
    decider: Decider,
    act: Actuator,
    /// logind's delay lock, as its owner says it is.
    lock: Option<DelayLockHandle>,
    audit: Arc<Mutex<AuditLog>>,
    metrics: Metrics,
    /// Print each signal as a JSON line (standalone mode).
    print: bool,
    /// Whether logind or systemd can be reached now.
    host_reachable: Arc<dyn Fn() -> bool + Send + Sync>,
    /// The host's answers, by the episode asked about.
    answers: (mpsc::Sender<Answer>, mpsc::Receiver<Answer>),
}

impl Agent {
    pub fn new(
        audit: AuditLog,
        cluster: Option<Arc<Cluster>>,
        logind: Option<DelayLockHandle>,
        metrics: Metrics,
    ) -> Self {
        let boot_id = audit.boot_id().to_string();
        let audit = Arc::new(Mutex::new(audit));
        let act = Actuator::new(
            audit.clone(),
            cluster,
            logind.clone(),
            metrics.clone(),
            boot_id,
        );
        Agent {
            decider: Decider::new(),
            act,
            lock: logind,
            audit,
            metrics,
            print: false,
            host_reachable: Arc::new(|| true),
            answers: mpsc::channel(4),
        }
    }

    /// Each signal printed as a JSON line with its decision (standalone).
    pub fn printing(mut self) -> Self {
        self.print = true;
        self
    }

    /// With systemd-shutdown's hook in `run_dir`: a courier kit is left
    /// there once PID 1 is systemd-shutdown (`act::courier`).
    pub fn with_courier(mut self, run_dir: PathBuf, server: Option<String>) -> Self {
        self.act.set_courier(run_dir, server);
        self
    }

    /// Cluster mode whose cluster half joins later, through `coming`
    /// ([`Agent::join_cluster`]).
    pub fn with_cluster_coming(mut self, coming: watch::Receiver<Option<Arc<Cluster>>>) -> Self {
        self.act.set_cluster_coming(coming);
        self
    }

    pub fn with_policy(mut self, policy: DecisionPolicy) -> Self {
        self.decider = Decider::with_policy(policy);
        self
    }

    /// How the host is asked whether a shutdown is under way, and whether it
    /// can be reached at all.
    pub fn with_host(
        mut self,
        query: HostQuery,
        reachable: Arc<dyn Fn() -> bool + Send + Sync>,
    ) -> Self {
        self.act.set_host(query);
        self.host_reachable = reachable;
        self
    }

    /// The cluster half is here: what waited for it goes out.
    pub async fn join_cluster(&mut self, c: Arc<Cluster>) {
        let current = self.decider.episode();
        self.act.join_cluster(c, current).await;
    }

    /// The agent's health on its Node (`LastgaspDegraded`), outside any
    /// shutdown: one under way takes the bus down with it, and the API
    /// server's time is the last gasp's.
    pub async fn report_degraded(&mut self, state: &crate::act::degraded::State) {
        if !self.decider.in_episode() {
            self.act
                .report_degraded(state, std::time::Instant::now())
                .await;
        }
    }

    /// How the last last gasp or last word went, since the last call.
    pub fn take_delivery(&mut self) -> Option<Outcome> {
        self.act.take_delivery()
    }

    /// A graceful run is under way (it ends by releasing the logind lock).
    pub fn graceful_running(&self) -> bool {
        self.act.graceful_running()
    }

    /// At start: how did the previous boot end? (`act::after_boot`)
    pub async fn after_boot(&mut self, boot_id: &str) -> Result<Option<AfterBoot>> {
        self.act.after_boot(boot_id).await
    }

    /// A shutdown episode is under way.
    pub fn episode_open(&self) -> bool {
        self.decider.in_episode()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub async fn handle(&mut self, mut s: ShutdownSignal) -> Result<Decision> {
        let queued_ns = clock::boottime_ns().saturating_sub(s.boot_ns);
        let t = Instant::now();
        // Before the decision, while the actor may still run. Walking the
        // cgroup tree for a process already gone is slow on a big node: not
        // for records that leave no time.
        let hurry = s.leaves_no_time();
        // A call's return: its entry line has the caller's /proc already,
        // and the next record should not queue behind a second read.
        let returned = s.is_return();
        if let Some(a) = s.actor.as_mut().filter(|_| !returned) {
            actor::enrich_with(a, !hurry);
        }
        let enriched = t.elapsed();
        if let Some(l) = &self.lock {
            self.decider.set_lock_held(l.lock_held());
        }
        self.decider.set_host_reachable((self.host_reachable)());
        let d = self.decider.decide(&s);
        self.metrics.count_detection(&s);
        self.metrics.count_decision(&d);
        let decided = t.elapsed();
        let sync = self.audit(&s, &d).await;
        let audited = t.elapsed();
        if self.print {
            let line = StdoutLine {
                signal: Cow::Borrowed(&s),
                decision: Cow::Borrowed(&d.action),
            };
            println!("{}", serde_json::to_string(&line)?);
        }
        let printed = t.elapsed();
        // Where the time from the kernel's record to stdout goes (the bench
        // reads these: `cargo xtask bench stdout`).
        tracing::debug!(target: "lastgasp::timing", queued_us = queued_ns / 1000,
            enrich_us = enriched.as_micros() as u64, decide_us = (decided - enriched).as_micros() as u64,
            audit_us = (audited - decided).as_micros() as u64, print_us = (printed - audited).as_micros() as u64,
            "handled");
        tracing::info!(source = %s.source, kind = %s.kind, forced = s.forced, scope = %s.scope,
            pid = s.actor.as_ref().map(|a| a.pid), comm = s.actor.as_ref().map(|a| a.comm.as_str()),
            action = %d.action, episode = d.episode.as_ref().map(|e| e.id), "shutdown signal");
        self.act.act(Some(&s), &d).await;
        self.courier_kit(&d).await;
        if let Some(sync) = sync {
            let synced = sync.await.map_err(anyhow::Error::from).and_then(|r| r);
            if let Err(e) = synced {
                self.metrics.audit_failures.inc();
                tracing::error!(error = format!("{e:#}"), "audit record NOT synced");
            }
        }
        Ok(d)
    }

    /// After a decision that changed the episode: the records
    /// systemd-shutdown's hook (and the final unit) would have the agent
    /// send, for each verb,
    /// left for the courier (`act::courier`); with no episode, none.
    async fn courier_kit(&mut self, d: &Decision) {
        if matches!(d.action, Action::AuditOnly { .. } | Action::Join) && d.episode.is_some() {
            return;
        }
        if !self.decider.in_episode() {
            return self.act.drop_courier_kit();
        }
        let now = SystemTime::now();
        let hooks: Vec<_> = crate::hostio::VERBS
            .iter()
            .flat_map(|(verb, _)| {
                let hook = shutdown_hook::signal(verb, crate::hostio::FINAL_STAGE_COMM, now);
                let unit = shutdown_hook::final_unit_signal(verb, now);
                [hook, unit]
            })
            .map(|s| {
                let d = self.decider.clone().decide(&s);
                (s, d)
            })
            .collect();
        self.act.leave_courier_kit(&hooks).await;
    }

    /// On disk before anything acts on it: the machine may die next.
    /// Records that change nothing are synced in batches (each tick). The
    /// last gasp does not wait for the disk: a direct reboot(2) leaves less
    /// time than a loaded disk's fdatasync, so its patches leave while the
    /// record syncs (the returned task). What the cluster acknowledged and
    /// the disk lost is read back from the Node after the next boot.
    async fn audit(
        &self,
        s: &ShutdownSignal,
        d: &Decision,
    ) -> Option<tokio::task::JoinHandle<Result<()>>> {
        let beside = d.action.leaves_no_time() && self.act.in_cluster();
        let durability = if d.action.moves() && !beside {
            Durability::Now
        } else {
            Durability::Batched
        };
        let mut audit = self.audit.lock().await;
        match audit.append_as(s, Some(d), durability) {
            Err(e) => {
                self.metrics.audit_failures.inc();
                tracing::error!(error = format!("{e:#}"), "audit record NOT written");
                None
            }
            Ok(_) if beside => match audit.sync_beside() {
                Ok(job) => Some(tokio::task::spawn_blocking(job)),
                Err(e) => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "audit record synced before the last gasp, not beside it"
                    );
                    if let Err(e) = audit.flush() {
                        self.metrics.audit_failures.inc();
                        tracing::error!(error = format!("{e:#}"), "audit record NOT synced");
                    }
                    None
                }
            },
            Ok(_) => None,
        }
    }

    /// Time passes (the loop calls this every second): a pending request may
    /// expire, an episode past its expected end is checked with the host
    /// (the answer comes back through [`Agent::next_answer`]).
    pub async fn tick(&mut self, now: SystemTime) {
        if let Err(e) = self.audit.lock().await.flush() {
            self.metrics.audit_failures.inc();
            tracing::error!(error = format!("{e:#}"), "audit records NOT synced");
        }
        match self.decider.tick(now) {
            Tick::Nothing => {}
            Tick::Decided(d) => self.decided(d).await,
            Tick::AskHost(id) => {
                let (query, tx) = (self.act.host(), self.answers.0.clone());
                tokio::spawn(async move {
                    let _ = tx.send((id, query().await)).await;
                });
            }
        }
    }

    /// The host's answer to the last check (and the episode it is about),
    /// when it comes.
    pub async fn next_answer(&mut self) -> Answer {
        match self.answers.1.recv().await {
            Some(a) => a,
            // The agent holds a sender: never closed.
            None => std::future::pending().await,
        }
    }

    pub async fn host_answer(&mut self, (episode, answer): Answer) {
        tracing::info!(episode, ?answer, "host: is a shutdown under way?");
        if let Some(d) = self.decider.host_answer(episode, answer, SystemTime::now()) {
            self.decided(d).await;
        }
    }

    /// A decision made by time, not by a signal.
    async fn decided(&mut self, d: Decision) {
        self.metrics.count_decision(&d);
        tracing::warn!(action = %d.action, episode = d.episode.as_ref().map(|e| e.id), "episode ended without a shutdown");
        self.act.act(None, &d).await;
        self.courier_kit(&d).await;
    }
}

/// What the loop reads: the kernel's records, the buses' and the hook's
/// signals, the cluster half's arrival (cluster mode), the hook's paths.
struct Inputs {
    det: EbpfDetector,
    dbus_rx: mpsc::Receiver<ShutdownSignal>,
    joined: Option<watch::Receiver<Option<Arc<Cluster>>>>,
    hook: Option<shutdown_hook::HookPaths>,
    /// Where no hook is armed: the loop for systemd-shutdown's sweep's end
    /// (`final_sweep`), used once.
    sweep: Option<final_sweep::Reader>,
}

/// The loop: detect → decide → act, fairly (a flood of records, bounded per
/// batch, node scope first, cannot starve the buses, the host's answers or
/// the heartbeat), until SIGTERM or SIGINT.
async fn turn(
    mut agent: Agent,
    inputs: Inputs,
    metrics: &Metrics,
    health: &Health,
) -> Result<bool> {
    let Inputs {
        mut det,
        mut dbus_rx,
        joined,
        hook,
        mut sweep,
    } = inputs;
    let mut join_pending = joined.is_some();
    let (_keep, mut joined) = match joined {
        Some(j) => (None, j),
        None => {
            let (tx, rx) = watch::channel(None);
            (Some(tx), rx)
        }
    };
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut drops = Drops::default();
    let (mut stopping, mut told) = (false, false);
    loop {
        if stopping && !agent.graceful_running() {
            break;
        }
        tokio::select! {
            batch = det.next_batch() => {
                let mut queue: VecDeque<ShutdownSignal> = batch?.into();
                while let Some(s) = queue.pop_front() {
                    let exec = (s.source == Source::Exec).then(|| (s.actor.as_ref().map(|a| a.pid), s.at));
                    let final_stage = s.is_pid1_shutdown().then(|| final_sweep::verb(&s)).flatten();
                    let d = agent.handle(s).await?;
                    if let Some((Some(pid), at)) = exec {
                        watch_tool(&mut det, pid, at, &d, &mut queue);
                    }
                    read_sweep(final_stage, &mut sweep);
                }
            }
            Some(s) = dbus_rx.recv() => {
                let from_hook = s.source == Source::ShutdownHook;
                let d = agent.handle(s).await?;
                // systemd-shutdown waits for this before its reboot(2); the
                // hook puts the answer in the kernel's log.
                if let (true, Some(paths)) = (from_hook, &hook) {
                    let note = match agent.take_delivery() {
                        Some(o) => serde_json::to_string(&o).unwrap_or_default(),
                        None => d.action.to_string(),
                    };
                    shutdown_hook::acknowledge(&paths.run_dir, &note);
                }
            }
            answer = agent.next_answer() => agent.host_answer(answer).await,
            Ok(()) = joined.changed(), if join_pending => {
                let c = joined.borrow_and_update().clone();
                if let Some(c) = c {
                    tracing::info!("the cluster half joined: the API server answered and the warm watches listed");
                    join_pending = false;
                    agent.join_cluster(c).await;
                }
            }
            _ = tick.tick() => {
                health.beat();
                let armed = health.armed(crate::detect::logind::PART);
                metrics.graceful_path_armed.set(i64::from(armed));
                if health.buses_expected() {
                    agent.report_degraded(&degraded_state(health, armed)).await;
                }
                agent.tick(SystemTime::now()).await;
                drops = report_drops(&det, drops, metrics);
            }
            // A graceful run under way is finished first (the pod's
            // terminationGracePeriodSeconds bounds it); signals are still
            // handled meanwhile, so an escalation still sends the last gasp.
            _ = term.recv() => stopping = true,
            _ = int.recv() => stopping = true,
        }
        if stopping && agent.graceful_running() && !told {
            tracing::info!("asked to stop: finishing the graceful run first");
            told = true;
        }
    }
    tracing::info!(ring_buffer_drops = det.drops(), "stopping");
    Ok(agent.episode_open())
}

/// PID 1 exec'd systemd-shutdown (`verb`): the sweep's reader starts, once.
/// (`take` only then: another exec must not use it up.)
fn read_sweep(verb: Option<String>, sweep: &mut Option<final_sweep::Reader>) {
    let Some(verb) = verb else { return };
    if let Some(reader) = sweep.take() {
        reader.watch(verb);
    }
}

/// The Node's `LastgaspDegraded`: which part of the graceful path is lost
/// (with `--no-dbus` nothing is expected, and nothing reported).
fn degraded_state(health: &Health, armed: bool) -> crate::act::degraded::State {
    let why = health.degraded()?;
    let reason = match armed {
        false => "GracefulPathNotArmed",
        true => "ShutdownJobsNotFollowed",
    };
    Some((reason, why))
}

/// A direct tool's exec (by `pid`, seen at `at`) just became the episode's
/// proof of death: the kernel is asked to report the tool's end. One that
/// ended already has what it wrote before its end read first (its
/// reboot(2), if any), then its end.
fn watch_tool(
    det: &mut EbpfDetector,
    pid: u32,
    at: SystemTime,
    d: &Decision,
    queue: &mut VecDeque<ShutdownSignal>,
) {
    let proves = d
        .episode
        .as_ref()
        .and_then(|e| e.death.as_ref())
        .is_some_and(|x| x.proof == decide::Proof::DirectTool && x.pid == Some(pid) && x.at == at);
    if !proves || det.watch(pid) {
        return;
    }
    tracing::info!(pid, "the direct tool ended before it was watched");
    queue.extend(det.drain_capable());
    queue.push_back(tool_end::gone(pid, clock::now_pair()));
}

/// Kernel records lost since `before`: logged and counted when they grew.
fn report_drops(det: &EbpfDetector, before: Drops, metrics: &Metrics) -> Drops {
    let now = det.drops_by_cause();
    if now.hook_errors != before.hook_errors {
        let by_hook: Vec<String> = now
            .hook_errors_by_label()
            .filter(|(_, n)| *n > 0)
            .map(|(hook, n)| format!("{hook} {n}"))
            .collect();
        tracing::warn!(
            hooks = by_hook.join(", "),
            "kernel records a hook failed to write (totals)"
        );
        metrics.set_hook_errors(now.hook_errors_by_label());
    }
    if now.by_label() != before.by_label() {
        tracing::warn!(
            capable_full = now.capable_full,
            node_full = now.node_full,
            node_rate_limited = now.node_rate_limited,
            container_full = now.container_full,
            container_rate_limited = now.container_rate_limited,
            "kernel records lost (totals)"
        );
        metrics.set_ringbuf_drops(&now.by_label());
    }
    now
}
