//! The scenarios, what each must show, and the check of one run.
//!
//! Every check reads what the guest left behind after it was gone: the audit
//! log on its disk (the agent's durable record), the agent's stdout as the
//! host received it live, the kernel's and the runner's console lines, and
//! qemu's own account of how the guest ended.
use std::{
    fmt, fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use serde_json::Value;

use super::{
    cluster::{Cluster, Got, What},
    evidence::{self, Det},
    image::Distro,
    qemu::{Exit, Guest, Run, Spec, HUNG_BEFORE_TRIGGER},
};

/// How the guest must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Powered off: qemu ends by itself (ACPI power-off).
    PowerOff,
    /// Reset, then a second boot in the same qemu, which reports the first.
    Reboot,
    /// Halted: the kernel stops the CPUs and the machine stays on.
    Halt,
    /// A new kernel booted in place (no reset), which reports the first.
    Kexec,
    /// Nothing shuts down; the runner ends the guest itself afterwards.
    StaysUp,
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            End::PowerOff => "powered off",
            End::Reboot => "rebooted",
            End::Halt => "halted",
            End::Kexec => "kexec'd",
            End::StaysUp => "stayed up",
        })
    }
}

/// One expected detection. `None` fields are not checked.
#[derive(Clone, Copy, Debug)]
pub struct Want {
    pub source: &'static str,
    pub kind: Option<&'static str>,
    pub forced: Option<bool>,
    pub scope: &'static str,
    /// now | scheduled | cancel | none
    pub effect: Option<&'static str>,
    /// The actor's comm (first 15 bytes).
    pub comm: Option<&'static str>,
}

const fn w(source: &'static str, kind: &'static str, forced: bool, effect: &'static str) -> Want {
    Want {
        source,
        kind: Some(kind),
        forced: Some(forced),
        scope: "node",
        effect: Some(effect),
        comm: None,
    }
}

impl Want {
    const fn by(mut self, comm: &'static str) -> Want {
        self.comm = Some(comm);
        self
    }
    const fn container(mut self) -> Want {
        self.scope = "container";
        self
    }
    const fn any_forced(mut self) -> Want {
        self.forced = None;
        self
    }

    fn matches(&self, d: &Det) -> bool {
        d.source == self.source
            && self.kind.is_none_or(|k| d.kind == k)
            && self.forced.is_none_or(|f| d.forced == f)
            && d.scope == self.scope
            && self.effect.is_none_or(|e| d.effect == e)
            && self.comm.is_none_or(|c| d.comm == c)
    }
}

impl fmt::Display for Want {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.source)?;
        if let Some(c) = self.comm {
            write!(f, " by {c}")?;
        }
        write!(f, " kind={}", self.kind.unwrap_or("*"))?;
        if let Some(x) = self.forced {
            write!(f, " forced={x}")?;
        }
        write!(f, " scope={}", self.scope)?;
        if let Some(e) = self.effect {
            write!(f, " effect={e}")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
pub struct Scenario {
    /// Also the file `tests/vm/scenarios/NAME.sh`.
    pub name: &'static str,
    /// As typed in the guest (for the matrix).
    pub trigger: &'static str,
    pub end: End,
    /// The first detection after the trigger: what a decision acts on. It
    /// must be in the audit log on the guest's disk after the guest is gone.
    pub first: Option<Want>,
    /// Must also be seen (in the audit, or at least on the agent's stdout
    /// before the guest died), in this order, after `first`.
    pub then: &'static [Want],
    /// The decision core's action for the first detection, and actions that
    /// must follow (in order), once the agent audits decisions.
    pub decide: Option<&'static str>,
    pub decide_then: &'static [&'static str],
    /// Only container-scope detections are allowed (nothing may drain the node).
    pub container_only: bool,
    /// Needs the cluster pieces (decision core, cluster mode, API double).
    pub cluster_only: bool,
    /// With `--cluster`: nothing may be written to the API double after the
    /// trigger (the node is not shutting down). Every scenario whose guest
    /// goes down must instead announce it there before it dies.
    pub quiet: bool,
    /// With `--cluster`: every seeded pod of the node is removed before the
    /// guest dies, lowest priority first.
    pub drains: bool,
    /// A shutdown no last gasp can outrun (the kernel powers off tens of ms
    /// after the trigger): once the guest has powered off, the harness
    /// switches it on again — the same root overlay, audit disk and share,
    /// and with `--cluster` the same API double, state and request log kept
    /// — and the next boot's report of it (the agent's after-boot
    /// PreviousBoot Event, and the last gasp delivered late if its record
    /// reached the disk) counts as the cluster's record of the shutdown:
    /// the announcement must reach the double before the guest died OR
    /// after the next boot, and the row says which.
    pub next_boot: bool,
}

/// The table reads each scenario as what differs from the defaults: no
/// detection required, nothing decided, any scope, not quiet, no drain.
impl Scenario {
    pub const fn new(name: &'static str, trigger: &'static str, end: End) -> Self {
        Scenario {
            name,
            trigger,
            end,
            first: None,
            then: &[],
            decide: None,
            decide_then: &[],
            container_only: false,
            cluster_only: false,
            quiet: false,
            drains: false,
            next_boot: false,
        }
    }
    const fn first(self, first: Want) -> Self {
        Scenario {
            first: Some(first),
            ..self
        }
    }
    const fn then(self, then: &'static [Want]) -> Self {
        Scenario { then, ..self }
    }
    const fn decide(self, action: &'static str) -> Self {
        Scenario {
            decide: Some(action),
            ..self
        }
    }
    const fn decide_then(self, decide_then: &'static [&'static str]) -> Self {
        Scenario {
            decide_then,
            ..self
        }
    }
    const fn container_only(self) -> Self {
        Scenario {
            container_only: true,
            ..self
        }
    }
    const fn cluster_only(self) -> Self {
        Scenario {
            cluster_only: true,
            ..self
        }
    }
    const fn quiet(self) -> Self {
        Scenario {
            quiet: true,
            ..self
        }
    }
    const fn drains(self) -> Self {
        Scenario {
            drains: true,
            ..self
        }
    }
    const fn next_boot(self) -> Self {
        Scenario {
            next_boot: true,
            ..self
        }
    }
}

const EXEC: &str = "exec";
const REBOOT: &str = "reboot-syscall";
const SIGNAL: &str = "signal-pid1";
const KERNEL: &str = "kernel-hook";

const LOGIND: &str = "logind";
const SYSTEMD: &str = "systemd";

/// PID 1 execs systemd-shutdown at the end of an orderly shutdown. Its own
/// reboot(2) comes next, but the kernel powers off at once then: whether the
/// agent records that one is a race it cannot win, so it is only reported.
const fn pid1_final(kind: &'static str) -> Want {
    w(EXEC, kind, false, "now")
        .by("systemd-shutdow")
        .any_forced()
}

/// logind's PrepareForShutdown(true) (the logind detector).
const fn logind(kind: &'static str) -> Want {
    w(LOGIND, kind, false, "now")
}

/// systemd's JobNew for the shutdown target (the systemd detector).
const fn job(kind: &'static str) -> Want {
    w(SYSTEMD, kind, false, "now")
}

pub static SCENARIOS: &[Scenario] = &[
    Scenario::new("poweroff", "systemctl poweroff", End::PowerOff)
        .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
        .then(&[logind("poweroff"), job("poweroff"), pid1_final("poweroff")])
        .decide("pending")
        .decide_then(&["graceful"]),
    Scenario::new("reboot", "systemctl reboot", End::Reboot)
        .first(w(EXEC, "reboot", false, "now").by("systemctl"))
        .then(&[logind("reboot"), job("reboot"), pid1_final("reboot")])
        .decide("pending")
        .decide_then(&["graceful"]),
    Scenario::new(
        "poweroff-force",
        "systemctl poweroff --force",
        End::PowerOff,
    )
    .first(w(EXEC, "poweroff", true, "now").by("systemctl"))
    .then(&[pid1_final("poweroff")])
    .decide("immediate"),
    // systemctl's own reboot(2) kills the machine at once: reported, not required.
    Scenario::new(
        "poweroff-force-force",
        "systemctl poweroff --force --force",
        End::PowerOff,
    )
    .first(w(EXEC, "poweroff", true, "now").by("systemctl"))
    .decide("immediate"),
    Scenario::new(
        "poweroff-target",
        "systemctl start poweroff.target",
        End::PowerOff,
    )
    .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
    .then(&[job("poweroff"), pid1_final("poweroff")])
    .decide("pending")
    .decide_then(&["graceful"]),
    Scenario::new("shutdown-h-1", "shutdown -h +1, waited out", End::PowerOff)
        .first(w(EXEC, "poweroff", false, "scheduled").by("shutdown"))
        .then(&[logind("poweroff"), job("poweroff"), pid1_final("poweroff")])
        .decide("pending")
        .decide_then(&["warn", "graceful"]),
    Scenario::new(
        "shutdown-cancel",
        "shutdown -h +5; shutdown -c",
        End::StaysUp,
    )
    .first(w(EXEC, "poweroff", false, "scheduled").by("shutdown"))
    .then(&[w(EXEC, "unknown", false, "cancel").by("shutdown")])
    .decide("pending")
    .decide_then(&["warn", "cancel"]),
    Scenario::new("sigrtmin4", "kill -s SIGRTMIN+4 1", End::PowerOff)
        .first(w(SIGNAL, "poweroff", false, "now"))
        .then(&[job("poweroff"), pid1_final("poweroff")])
        .decide("graceful"),
    Scenario::new("sigrtmin14", "kill -s SIGRTMIN+14 1", End::PowerOff)
        .first(w(SIGNAL, "poweroff", true, "now"))
        .then(&[pid1_final("poweroff")])
        .decide("immediate"),
    // systemd's halt(8) takes one -f as two (no manager): it calls
    // reboot(2) itself, CAD_ON then HALT, and the CPUs stop at once.
    Scenario::new("halt-f", "halt -f", End::Halt)
        .first(w(EXEC, "halt", true, "now").by("halt"))
        .decide("immediate"),
    // Its own reboot(2) resets the machine at once: reported, not required.
    Scenario::new("reboot-ff", "reboot -ff", End::Reboot)
        .first(w(EXEC, "reboot", true, "now").by("reboot"))
        .decide("immediate"),
    // A race the last gasp may lose: then judged on the next boot.
    Scenario::new("busybox-poweroff-f", "busybox poweroff -f", End::PowerOff)
        .first(w(EXEC, "poweroff", true, "now").by("busybox"))
        .decide("immediate")
        .next_boot(),
    Scenario::new(
        "pidns-reboot",
        "unshare --pid --fork busybox poweroff -f",
        End::StaysUp,
    )
    .first(w(EXEC, "poweroff", true, "now").by("busybox").container())
    .then(&[w(REBOOT, "poweroff", true, "now").by("busybox").container()])
    .decide("audit-only")
    .container_only()
    .quiet(),
    // reboot(2) KEXEC jumps to the new kernel at once: its record is
    // reported when it got out, and judged by the next boot's history.
    Scenario::new(
        "kexec-file-no-dbus",
        "kexec -s -l ...; kexec -e (agent --no-dbus)",
        End::Kexec,
    )
    .first(w(EXEC, "unknown", false, "none").by("kexec"))
    .decide("audit-only"),
    Scenario::new("kexec", "kexec -l ...; systemctl kexec", End::Kexec)
        .first(w(EXEC, "unknown", false, "none").by("kexec"))
        .then(&[
            w(EXEC, "kexec", false, "now").by("systemctl"),
            pid1_final("kexec"),
        ])
        .decide("audit-only")
        .decide_then(&["pending", "graceful"]),
    Scenario::new(
        "soft-reboot",
        "systemctl soft-reboot (systemd 252 refuses it)",
        End::StaysUp,
    )
    .first(w(EXEC, "soft-reboot", false, "now").by("systemctl"))
    .decide("pending")
    .quiet(),
    Scenario::new(
        "sysrq-poweroff",
        "echo o > /proc/sysrq-trigger",
        End::PowerOff,
    )
    .first(w(KERNEL, "poweroff", true, "now"))
    .decide("immediate")
    .next_boot(),
    Scenario::new(
        "privileges",
        "agent started under 4 capability sets (no shutdown)",
        End::StaysUp,
    ),
    Scenario::new(
        "image-arms",
        "the release image of the guest's arch under containerd (no shutdown)",
        End::StaysUp,
    )
    .quiet(),
    Scenario::new(
        "graceful-pods",
        "systemctl poweroff, pods in 4 priority classes",
        End::PowerOff,
    )
    .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
    .then(&[logind("poweroff"), job("poweroff"), pid1_final("poweroff")])
    .decide("pending")
    .decide_then(&["graceful"])
    .cluster_only()
    .drains(),
    Scenario::new(
        "user-poweroff",
        "systemctl poweroff as nobody (logind refuses)",
        End::StaysUp,
    )
    .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
    .decide("pending")
    .quiet(),
    Scenario::new(
        "user-reboot-ff",
        "reboot -ff, busybox reboot -f as nobody (EPERM)",
        End::StaysUp,
    )
    .first(w(EXEC, "reboot", true, "now").by("reboot"))
    .then(&[w(EXEC, "reboot", true, "now").by("busybox")])
    .decide("audit-only")
    .quiet(),
    Scenario::new(
        "block-root-poweroff",
        "systemctl poweroff (no tty) under root's block inhibitor",
        End::PowerOff,
    )
    .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
    .then(&[logind("poweroff"), job("poweroff"), pid1_final("poweroff")])
    .decide("pending")
    .decide_then(&["graceful"]),
    Scenario::new(
        "block-weak-root-poweroff",
        "systemctl poweroff (no tty) under root's block-weak inhibitor",
        End::PowerOff,
    )
    .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
    .then(&[logind("poweroff"), job("poweroff"), pid1_final("poweroff")])
    .decide("pending")
    .decide_then(&["graceful"]),
    Scenario::new(
        "blocked-poweroff",
        "systemctl poweroff --check-inhibitors=yes under a block inhibitor",
        End::StaysUp,
    )
    .first(w(EXEC, "poweroff", false, "now").by("systemctl"))
    .decide("pending")
    .quiet(),
];

pub fn print_list() {
    println!(
        "{:<22} {:<48} 20 times each, one boot (the last-gasp race; --race N)",
        "race",
        RACE.join(", ")
    );
    for s in SCENARIOS {
        println!(
            "{:<22} {:<48} {}{}",
            s.name,
            s.trigger,
            s.end,
            if s.cluster_only {
                " (needs --cluster)"
            } else {
                ""
            }
        );
    }
}

pub fn select(names: &[String]) -> Result<Vec<&'static Scenario>> {
    if names.is_empty() {
        return Ok(SCENARIOS.iter().collect());
    }
    names
        .iter()
        .map(|n| {
            SCENARIOS.iter().find(|s| s.name == n).ok_or_else(|| {
                anyhow::anyhow!(
                    "no scenario {n:?}; there are: {}",
                    SCENARIOS
                        .iter()
                        .map(|s| s.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
        })
        .collect()
}

pub enum Status {
    Pass,
    Fail,
    Skipped(String),
}

/// What one scenario showed.
pub struct Outcome {
    pub name: &'static str,
    pub trigger: &'static str,
    pub expected: End,
    pub status: Status,
    pub problems: Vec<String>,
    /// How the guest ended, as observed.
    pub end_seen: String,
    /// Detections of the first boot between the trigger and the end, in order.
    pub dets: Vec<Det>,
    /// ms from the trigger (guest clock): first detection in the kernel, and
    /// its record written.
    pub first_at_ms: Option<f64>,
    pub first_written_ms: Option<f64>,
    /// Host clock: the trigger marker on the console to the kernel's last
    /// word ("reboot: ...") or qemu's end.
    pub death_ms: Option<f64>,
    pub audit_summary: String,
    pub next_boot: String,
    pub decision: String,
    pub cluster_got: String,
    /// With `--cluster`: what the API double received.
    pub cluster: Option<Got>,
    pub boot_s: Option<f64>,
    pub wall: Duration,
    pub hooks: Vec<String>,
    pub caps: String,
    /// Findings that are not detections (the privilege probes).
    pub notes: Vec<String>,
    /// Booted a second time: why the first boot did not count.
    pub retried: Option<String>,
    /// The first boot's end (host time since qemu's start), as the cluster
    /// column counts it; for the next boot's writes (`Scenario::next_boot`).
    end_t: Option<Duration>,
    /// How a pass was reached, when that is worth saying in the result
    /// column (`next_boot`: before the guest died, or after the next boot).
    pub pass_note: Option<String>,
    /// `next_boot`: the kernel powered off before the agent's record of it
    /// reached the disk (what was missing). Accepted only if the next boot
    /// then reports that boot as unannounced (what its disk really holds).
    lost_to_kernel: Option<String>,
    /// A race run: one boot, a reset ends qemu, no next boot.
    one_boot: bool,
}

impl Outcome {
    fn new(sc: &Scenario) -> Self {
        Outcome {
            name: sc.name,
            trigger: sc.trigger,
            expected: sc.end,
            one_boot: false,
            status: Status::Fail,
            problems: Vec::new(),
            end_seen: String::new(),
            dets: Vec::new(),
            first_at_ms: None,
            first_written_ms: None,
            death_ms: None,
            audit_summary: String::new(),
            next_boot: String::new(),
            decision: "none (nothing detected)".into(),
            cluster_got: "n/a (standalone: run with --cluster)".into(),
            cluster: None,
            boot_s: None,
            wall: Duration::ZERO,
            hooks: Vec::new(),
            caps: String::new(),
            notes: Vec::new(),
            retried: None,
            end_t: None,
            pass_note: None,
            lost_to_kernel: None,
        }
    }
    pub fn failed(&self) -> bool {
        matches!(self.status, Status::Fail)
    }
    pub fn passed(&self) -> bool {
        matches!(self.status, Status::Pass)
    }
    pub fn skipped(&self) -> bool {
        matches!(self.status, Status::Skipped(_))
    }
    pub fn one_line(&self) -> String {
        match &self.status {
            Status::Skipped(why) => format!("SKIPPED {why}"),
            st => format!(
                "{} in {:.0} s: {}; first record on disk {}; {}{}",
                if matches!(st, Status::Pass) {
                    "ok"
                } else {
                    "FAILED"
                },
                self.wall.as_secs_f64(),
                self.end_seen,
                self.first_written_ms
                    .map(|m| format!("+{m:.0} ms after the trigger"))
                    .unwrap_or_else(|| "none".into()),
                self.dets
                    .iter()
                    .map(super::evidence::Det::short)
                    .collect::<Vec<_>>()
                    .join(" -> "),
                if self.problems.is_empty() {
                    String::new()
                } else {
                    format!("\n    problems: {}", self.problems.join("\n              "))
                }
            ),
        }
    }
}

/// `WAIT=` of the scenario file: how long the runner waits after the
/// trigger before it says the guest stayed up (240 s unless set).
fn scenario_wait(guest: &Guest, name: &str) -> u64 {
    fs::read_to_string(guest.vm_dir.join(format!("scenarios/{name}.sh")))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.trim().strip_prefix("WAIT="))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(240)
}

/// A boot is about 30-60 s under TCG; the machine is shared with builds.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

pub fn run(guest: &Guest, sc: &Scenario, dir: &Path, cluster: Option<&mut Cluster>) -> Outcome {
    match for_systemd(sc, guest.image.distro) {
        Ok(sc) => run_as(guest, &sc, dir, cluster, false),
        Err(why) => {
            let mut o = Outcome::new(sc);
            o.status = Status::Skipped(why.into());
            o
        }
    }
}

/// What a scenario must show on the guest's systemd. 257 made `block`
/// inhibitors bind root too (`block-weak` is the old `block`). 247's logind
/// names no kind in PrepareForShutdown (`unknown`: the episode takes it from
/// the exec and systemd's job), and after SIGRTMIN+4 its bus stops before
/// systemd's job signal reaches the agent (systemd-shutdown's exec still
/// ends the episode as a power-off).
fn for_systemd(sc: &Scenario, d: Distro) -> Result<Scenario, &'static str> {
    let then = |then: &'static [Want]| Ok(Scenario { then, ..sc.clone() });
    match (sc.name, d) {
        ("block-root-poweroff", Distro::Trixie) => Ok(BLOCK_ROOT_257.clone()),
        ("block-weak-root-poweroff", Distro::Trixie) => Ok(sc.clone()),
        ("block-weak-root-poweroff", _) => {
            Err("block-weak inhibitors are systemd 257's (--distro trixie)")
        }
        ("poweroff" | "graceful-pods" | "block-root-poweroff", Distro::Bullseye) => {
            then(POWEROFF_247)
        }
        ("sigrtmin4", Distro::Bullseye) => then(SIGRTMIN4_247),
        _ => Ok(sc.clone()),
    }
}

const POWEROFF_247: &[Want] = &[logind("unknown"), job("poweroff"), pid1_final("poweroff")];
const SIGRTMIN4_247: &[Want] = &[pid1_final("poweroff")];

/// `block-root-poweroff` on systemd 257: logind refuses; nothing may drain.
static BLOCK_ROOT_257: Scenario = Scenario::new(
    "block-root-poweroff",
    "systemctl poweroff (no tty) under root's block inhibitor: refused on 257",
    End::StaysUp,
)
.first(w(EXEC, "poweroff", false, "now").by("systemctl"))
.decide("pending")
.quiet();

fn run_as(
    guest: &Guest,
    sc: &Scenario,
    dir: &Path,
    cluster: Option<&mut Cluster>,
    one_boot: bool,
) -> Outcome {
    let mut o = Outcome::new(sc);
    o.one_boot = one_boot;
    if sc.cluster_only && cluster.is_none() {
        o.status =
            Status::Skipped("needs --cluster (the API double and the agent's cluster mode)".into());
        return o;
    }
    let t = Instant::now();
    let mut cluster = cluster;
    if let Err(e) = run_inner(guest, sc, dir, cluster.as_deref_mut(), &mut o) {
        o.problems.push(format!("{e:#}"));
    }
    // A guest that hung before the trigger (nothing of the scenario ran) is
    // booted once more; the retry is reported with the result.
    if o.end_seen.contains(HUNG_BEFORE_TRIGGER) {
        let why = o.end_seen.clone();
        println!("vm-test:   {why}: booting once more");
        o = Outcome::new(sc);
        o.one_boot = one_boot;
        if let Err(e) = run_inner(guest, sc, &dir.join("retry"), cluster, &mut o) {
            o.problems.push(format!("{e:#}"));
        }
        o.retried = Some(why);
    }
    o.wall = t.elapsed();
    if o.problems.is_empty() {
        o.status = Status::Pass;
    }
    o
}

fn run_inner(
    guest: &Guest,
    sc: &Scenario,
    dir: &Path,
    mut cluster: Option<&mut Cluster>,
    o: &mut Outcome,
) -> Result<()> {
    let wait = scenario_wait(guest, sc.name);
    let two_boots = !o.one_boot && matches!(sc.end, End::Reboot | End::Kexec);
    let mut spec = Spec {
        scenario: sc.name,
        dir: dir.to_path_buf(),
        allow_reset: two_boots,
        boot_timeout: BOOT_TIMEOUT,
        timeout: BOOT_TIMEOUT * if two_boots { 2 } else { 1 } + Duration::from_secs(wait + 180),
        extra_in: Vec::new(),
        nic: None,
        disks_from: None,
        keep_overlay: sc.next_boot,
        mem_mib: super::qemu::MEM_MIB,
        apparmor: false,
        arm_timeout: super::qemu::ARM_TIMEOUT,
        base: None,
    };
    if let Some(c) = cluster.as_deref_mut() {
        c.prepare(&mut spec)?;
    }
    if sc.name == "image-arms" {
        let arch = guest.image.arch;
        let archive = guest.image_archive.clone().with_context(|| {
            format!(
                "image-arms needs the {} image: run `cargo xtask image --arch {}` first",
                arch.name(),
                arch.name()
            )
        })?;
        spec.extra_in
            .push(("image.oci.tar".into(), fs::read(&archive)?));
    }
    let run = guest.boot(&spec)?;
    let reqs = match cluster.as_deref() {
        Some(c) => {
            let reqs = c
                .requests()
                .map_err(|e| anyhow::anyhow!("reading the API double's request log: {e:#}"))?;
            fs::write(
                dir.join("apidouble-requests.jsonl"),
                reqs.iter().map(|r| format!("{r}\n")).collect::<String>(),
            )?;
            Some((reqs, c.pods.clone()))
        }
        None => None,
    };
    check(
        sc,
        &run,
        reqs.as_ref().map(|(r, p)| (r.as_slice(), p.as_slice())),
        o,
    );
    if let Some(c) = o.cluster.as_ref().and_then(|g| g.clock.as_ref()) {
        fs::write(
            dir.join("clock.txt"),
            format!(
                "guest->host offset {} ns, ±{} ms: {}\n",
                c.offset_ns,
                c.err_ms
                    .map(|e| format!("{e:.2}"))
                    .unwrap_or_else(|| "?".into()),
                c.how
            ),
        )?;
    }
    if sc.next_boot && !o.one_boot {
        next_boot(guest, sc, dir, &run, cluster, o)?;
    }
    Ok(())
}

/// How long the next boot may take: boot, arm, report, end.
const NEXT_BOOT_TIMEOUT: Duration = Duration::from_secs(420);

/// Where the announcement of a shutdown may arrive, when it must.
const DEFERRED: &str =
    "the announcement must reach the double before the guest died or after the next boot";

/// `Scenario::next_boot`: the powered-off guest switched on again, on the
/// same disks (and the same API double); its report of the first boot.
fn next_boot(
    guest: &Guest,
    sc: &Scenario,
    dir: &Path,
    run: &Run,
    cluster: Option<&mut Cluster>,
    o: &mut Outcome,
) -> Result<()> {
    let tl = evidence::Timeline::read(&run.out);
    if o.end_seen != End::PowerOff.to_string() || tl.boots.len() != 1 || tl.trigger_ns().is_none() {
        not_booted_again(&tl, cluster.is_some(), o);
        return Ok(());
    }
    let boot1 = tl.boots[0].clone();
    let mut spec = Spec {
        scenario: sc.name,
        dir: dir.join("next-boot"),
        allow_reset: false,
        boot_timeout: BOOT_TIMEOUT,
        timeout: NEXT_BOOT_TIMEOUT,
        extra_in: Vec::new(),
        nic: None,
        disks_from: Some(dir.to_path_buf()),
        keep_overlay: false,
        mem_mib: super::qemu::MEM_MIB,
        apparmor: false,
        arm_timeout: super::qemu::ARM_TIMEOUT,
        base: None,
    };
    if let Some(c) = cluster.as_deref() {
        c.attach(&mut spec)?;
    }
    println!("vm-test:   the guest powered off: switching it on again (same disks)");
    let run2 = guest.boot(&spec)?;
    let tl2 = evidence::Timeline::read(&run2.out);
    let fails1 = tl.fails();
    for f in tl2.fails().into_iter().filter(|f| !fails1.contains(f)) {
        o.problems.push(format!("the next boot's runner: {f}"));
    }
    let ended = tl2.ended("after-boot-2");
    let boot2_s = run2.markers("BOOT").first().map(|l| l.t.as_secs_f64());
    let (n, summary) = evidence::next_boot_report(&run2.out, &boot1, &o.dets);
    o.next_boot = format!(
        "harness switched it on again{}: {summary}{}",
        boot2_s
            .map(|b| format!(" (booted in {b:.0} s)"))
            .unwrap_or_default(),
        match (&run2.exit, ended) {
            (_, true) => String::new(),
            (Exit::Killed(why), false) => format!("; next boot killed by the harness: {why}"),
            (e, false) => format!("; next boot ended without its END marker ({e:?})"),
        }
    );
    if !ended {
        o.problems.push(format!(
            "the next boot did not finish its report: {}",
            o.next_boot
        ));
    }
    // Standalone: the next boot's own record of the shutdown is the history
    // above, which may honestly be empty (the kernel can power off before
    // the record reaches the disk): reported, not required.
    if let (Some(lost), 1..) = (&o.lost_to_kernel, n) {
        o.problems.push(format!(
            "{lost} by the harness's reading, yet the next boot's history holds {n} detection(s) of that boot"
        ));
    }
    let Some(c) = cluster else {
        if let Some(lost) = o.lost_to_kernel.take() {
            o.pass_note = Some(format!(
                "the kernel powered off before the agent's record was written ({lost}); \
                 the next boot's history agrees (no detection of that boot)"
            ));
        }
        return Ok(());
    };
    cluster_after_next_boot(c, dir, run, &tl, o)
}

/// The guest did not power off once, or did so before the trigger: no
/// next boot, and what that leaves unproven.
fn not_booted_again(tl: &evidence::Timeline, cluster: bool, o: &mut Outcome) {
    o.next_boot = format!(
        "not booted again (the guest {}{})",
        o.end_seen,
        if tl.trigger_ns().is_none() {
            ", before the trigger"
        } else {
            ""
        }
    );
    if tl.trigger_ns().is_none() {
        return;
    }
    if let Some(lost) = o.lost_to_kernel.take() {
        o.problems
            .push(format!("{lost}, and there was no next boot"));
    }
    if cluster
        && !o
            .cluster
            .as_ref()
            .is_some_and(super::cluster::Got::announced)
    {
        o.problems.push(format!(
            "nothing announcing the shutdown reached the API double before the guest died, \
             and there was no next boot ({DEFERRED})"
        ));
    }
}

/// Cluster mode after the next boot: what the API double got, before the
/// guest died or after the next boot, against what the disk says.
fn cluster_after_next_boot(
    c: &mut Cluster,
    dir: &Path,
    run: &Run,
    tl: &evidence::Timeline,
    o: &mut Outcome,
) -> Result<()> {
    let (Some(trig_ns), Some(got)) = (tl.trigger_ns(), o.cluster.as_ref()) else {
        return Ok(());
    };
    if got.error.is_some() {
        if let Some(lost) = o.lost_to_kernel.take() {
            o.problems.push(lost);
        }
        return Ok(());
    }
    let reqs = c
        .requests()
        .map_err(|e| anyhow::anyhow!("reading the API double's request log: {e:#}"))?;
    fs::write(
        dir.join("next-boot/apidouble-requests.jsonl"),
        reqs.iter().map(|r| format!("{r}\n")).collect::<String>(),
    )?;
    // The first boot's clock relation and end; the later writes are the
    // next boot's (the host's clock runs on between the two qemu runs).
    let end = o.end_t.or(Some(run.exit_t));
    let mut got = Got::read(&reqs, run, trig_ns, end);
    got.after_label = "after the next boot";
    o.cluster_got = got.summary(&c.pods);
    if !got.announced() {
        let after = got.reported_after();
        if after.is_empty() {
            o.problems.push(format!(
                "nothing announcing the shutdown reached the API double before the guest died, \
                 nor a PreviousBoot Event or late record after the next boot ({DEFERRED})"
            ));
        } else {
            // Lost to the kernel: the next boot can only truthfully call that
            // boot unannounced (no record of the shutdown on its disk).
            let unannounced = after
                .iter()
                .any(|i| matches!(&i.what, What::Event(_, Some(e)) if e == "unannounced"));
            let lost = o.lost_to_kernel.take();
            match (&lost, unannounced) {
                (Some(l), false) => o.problems.push(format!(
                    "{l}, yet the next boot did not report the boot as unannounced"
                )),
                (None, true) => o.problems.push(
                    "the next boot reported the boot as unannounced although its record is on the disk"
                        .into(),
                ),
                _ => {}
            }
            o.pass_note = Some(format!(
                "the cluster got no record before the guest died (the kernel powered off first{}); \
                 it got one after the next boot: {}",
                lost.map(|l| format!(", and {l}: the next boot truthfully says unannounced"))
                    .unwrap_or_default(),
                after
                    .iter()
                    .map(|i| format!("{} +{:.0} ms", i.what, i.ms))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    } else {
        if let Some(lost) = o.lost_to_kernel.take() {
            o.problems.push(format!(
                "{lost}, yet the cluster got the last gasp before the guest died"
            ));
        }
        o.pass_note = Some("the cluster got the last gasp before the guest died".into());
    }
    o.cluster = Some(got);
    Ok(())
}

/// Everything the run shows, compared with what the scenario must show.
/// The double's request log and the seeded pods of the node (`--cluster`).
type ClusterLog<'a> = Option<(&'a [Value], &'a [(String, i64)])>;

fn check(sc: &Scenario, run: &Run, cluster: ClusterLog, o: &mut Outcome) {
    let tl = evidence::Timeline::read(&run.out);
    for f in tl.fails() {
        o.problems.push(format!("the guest runner: {f}"));
    }
    o.boot_s = run.markers("BOOT").first().map(|l| l.t.as_secs_f64());
    o.hooks = evidence::hook_lines(run);
    o.caps = evidence::caps(&run.out);

    let (seen, end_t) = guest_end(sc, run, &tl, o);

    // What reached the API double, and when.
    if let (Some((reqs, pods)), Some(trig_ns)) = (cluster, tl.trigger_ns()) {
        let end = match seen {
            Some(End::StaysUp) => None,
            _ => end_t.or(Some(run.exit_t)),
        };
        o.end_t = end;
        let got = Got::read(reqs, run, trig_ns, end);
        o.cluster_got = got.summary(pods);
        check_cluster(sc, &got, pods, &mut o.problems);
        o.cluster = Some(got);
    }

    // What the agent saw and wrote.
    let audit = match evidence::read_audit(&run.audit_img) {
        Ok(a) => a,
        Err(e) => {
            o.problems.push(format!("reading the audit disk: {e:#}"));
            return;
        }
    };
    o.audit_summary = audit.summary();
    let Some(trig_ns) = tl.trigger_ns() else {
        if tl.armed() {
            o.problems
                .push("the runner never reached the trigger".into());
        } else {
            o.problems.push("the agent never armed".into());
        }
        return;
    };
    let boot1 = tl.boots.first().cloned().unwrap_or_default();
    let boot2_t = run.markers("BOOT").get(1).map(|l| l.t);
    let until_ns = tl.after_trigger_end_ns();
    o.dets = evidence::merge(&audit, &boot1, run, boot2_t, trig_ns, until_ns);

    if let Some(first) = o.dets.first() {
        o.first_at_ms = first.at_ms;
        o.first_written_ms = o.dets.iter().find_map(|d| d.written_ms);
    }
    first_detection(sc, o);
    decisions(sc, &audit, &boot1, trig_ns, o);
    let dets = &o.dets;
    let mut rest = dets.iter().skip(1);
    for want in sc.then {
        if !rest.by_ref().any(|d| want.matches(d)) {
            o.problems.push(format!("not seen (in this order): {want}"));
        }
    }
    if sc.container_only {
        for d in dets.iter().filter(|d| d.scope != "container") {
            o.problems.push(format!(
                "a node-scope detection where only the container ended: {}",
                d.long()
            ));
        }
    }
    if audit.unreadable > 0 {
        o.problems.push(format!(
            "{} unreadable line(s) in the audit log",
            audit.unreadable
        ));
    }

    scenario_specific(sc, run, &tl, o);

    // The next boot's report of this one.
    if matches!(sc.end, End::Reboot | End::Kexec) && !o.one_boot {
        let (n, summary) = evidence::next_boot_report(&run.out, &boot1, &o.dets);
        o.next_boot = summary;
        if n == 0 {
            o.problems.push(format!(
                "the next boot did not report the previous shutdown: {}",
                o.next_boot
            ));
        }
    } else {
        o.next_boot = "-".into();
    }
}

/// How the guest ended, against the scenario's end, and when (host time
/// since qemu's start); the trigger-to-end time in the outcome.
fn guest_end(
    sc: &Scenario,
    run: &Run,
    tl: &evidence::Timeline,
    o: &mut Outcome,
) -> (Option<End>, Option<Duration>) {
    let seen = observed_end(run, tl);
    o.end_seen = match (&seen, &run.exit) {
        (Some(e), _) => e.to_string(),
        (None, Exit::Killed(why)) => format!("killed by the harness: {why}"),
        (None, Exit::Exited(st)) => format!("qemu exited ({st}) without a recognised end"),
        (None, Exit::Halted) => "halted".into(),
    };
    if seen != Some(sc.end) {
        o.problems.push(format!(
            "expected the guest to have {}; seen instead: {}",
            o.expected, o.end_seen
        ));
        let err = run.stderr.trim();
        if !err.is_empty() {
            o.problems.push(format!(
                "qemu said: {}",
                err.lines().take(3).collect::<Vec<_>>().join(" / ")
            ));
        }
    }
    let trig_host = run.markers("TRIGGER").first().map(|l| l.t);
    // The end of the first boot (host time since qemu's start).
    let end_t = trig_host.and_then(|t0| match seen {
        Some(End::StaysUp) | None => None,
        Some(End::Kexec) => run
            .console_at("Starting new kernel", t0)
            .or_else(|| run.markers("BOOT").get(1).copied())
            .map(|l| l.t),
        _ => run
            .console_at("reboot: ", t0)
            .map(|l| l.t)
            .or(Some(run.exit_t)),
    });
    o.death_ms = trig_host
        .zip(end_t)
        .map(|(t0, last)| (last.saturating_sub(t0)).as_secs_f64() * 1e3);
    (seen, end_t)
}

/// The first detection against the scenario's; one lost to the kernel is
/// judged after the next boot (`next_boot`).
fn first_detection(sc: &Scenario, o: &mut Outcome) {
    match (sc.first, o.dets.first()) {
        (Some(want), Some(d)) => {
            if !want.matches(d) {
                o.problems
                    .push(format!("first detection: wanted {want}, got {}", d.long()));
            } else if !d.on_disk && sc.next_boot {
                o.lost_to_kernel = Some(format!(
                    "the first detection ({}) never reached the disk",
                    d.short()
                ));
            } else if !d.on_disk {
                o.problems.push(format!(
                    "the first detection ({}) is not in the audit on disk: the guest died before it was written",
                    d.short()
                ));
            }
        }
        (Some(_), None) if sc.next_boot => {
            o.lost_to_kernel =
                Some("nothing detected, on the disk or on the agent's stdout".into());
        }
        (Some(want), None) => o
            .problems
            .push(format!("nothing detected; wanted {want} first")),
        (None, _) => {}
    }
}

/// The decisions audited for the detections, against the scenario's.
fn decisions(
    sc: &Scenario,
    audit: &evidence::AuditDisk,
    boot1: &str,
    trig_ns: i128,
    o: &mut Outcome,
) {
    if let Some(dec) = evidence::decisions(&o.dets, audit, boot1, trig_ns) {
        o.decision = dec;
        let first = o
            .dets
            .first()
            .and_then(|d| d.decision.as_deref())
            .unwrap_or("none");
        let action = |x: &str| x.split(' ').next().unwrap_or("").to_string();
        if let Some(want) = sc.decide {
            if action(first) != want {
                o.problems.push(format!(
                    "decision for the first detection: wanted {want}, got {first}"
                ));
            }
        }
        let mut later = o.dets.iter().skip(1).filter_map(|d| d.decision.as_deref());
        for want in sc.decide_then {
            if !later.by_ref().any(|x| action(x) == *want) {
                o.problems.push(format!("no later decision {want}"));
            }
        }
    }
}

/// What two scenarios show beyond detections: the image armed in the guest
/// (`image-arms`), the capability probes (`privileges`).
fn scenario_specific(sc: &Scenario, run: &Run, tl: &evidence::Timeline, o: &mut Outcome) {
    if sc.name == "image-arms" {
        match run.markers("IMAGE-ARMED").first() {
            Some(l) => o.notes.push(format!(
                "image armed: {}",
                l.text
                    .split_once("IMAGE-ARMED ")
                    .map_or(l.text.as_str(), |(_, r)| r)
            )),
            None => o
                .problems
                .push("no IMAGE-ARMED: the image did not arm in the guest".into()),
        }
    }
    if sc.name == "privileges" {
        let text = fs::read_to_string(run.out.join("privileges.txt")).unwrap_or_default();
        o.notes = text
            .lines()
            .map(|l| l.trim_start_matches("PROBE ").to_string())
            .collect();
        let probes = text.lines().filter(|l| l.starts_with("PROBE ")).count();
        if probes != 4 {
            o.problems
                .push(format!("{probes} of 4 capability probes reported"));
        }
        // The unit's own set must arm, as a probe too.
        if !text
            .lines()
            .any(|l| l.starts_with("PROBE with-sys-admin ") && l.contains(": armed"))
        {
            o.problems
                .push("the agent did not arm with the unit's capability set".into());
        }
        // The unit's own set must arm: lastgasp.service did, before the trigger.
        if tl.armed() {
            o.notes
                .push(format!("lastgasp.service armed with: {}", o.caps));
        }
    }
}

/// What the API double must (not) have received.
fn check_cluster(sc: &Scenario, got: &Got, pods: &[(String, i64)], p: &mut Vec<String>) {
    if let Some(e) = &got.error {
        p.push(format!("cluster: {e}"));
        return;
    }
    // `next_boot`: judged once the next boot has had its say (next_boot());
    // a reset's or a kexec's next boot runs in the same qemu: its report
    // counts here (the row says "after the boot ended").
    let reported = matches!(sc.end, End::Reboot | End::Kexec) && !got.reported_after().is_empty();
    if sc.end != End::StaysUp && !sc.next_boot && !reported && !got.announced() {
        p.push(
            "nothing announcing the shutdown (condition, taint/record, NodeShutdown Event) \
             reached the API double before the guest died"
                .into(),
        );
    }
    if sc.quiet {
        let w: Vec<String> = got
            .items
            .iter()
            .map(|i| format!("{} +{:.0} ms", i.what, i.ms))
            .collect();
        if !w.is_empty() {
            p.push(format!(
                "the API double was written to although the node is not shutting down: {}",
                w.join(", ")
            ));
        }
    }
    if sc.drains {
        let removed = got.pods_removed();
        for (pod, _) in pods {
            if !removed.iter().any(|(x, _)| x == pod) {
                p.push(format!("pod {pod} was not removed before the guest died"));
            }
        }
        let prio = |pod: &str| pods.iter().find(|(x, _)| x == pod).map(|(_, pr)| *pr);
        for w in removed.windows(2) {
            if let (Some(a), Some(b)) = (prio(&w[0].0), prio(&w[1].0)) {
                if b < a {
                    p.push(format!(
                        "pods removed out of priority order: {} (prio {a}) before {} (prio {b})",
                        w[0].0, w[1].0
                    ));
                }
            }
        }
    }
}

/// How the guest ended, from the runner's markers, the kernel's last words
/// and qemu's events.
fn observed_end(run: &Run, tl: &evidence::Timeline) -> Option<End> {
    let reset = run.qmp.iter().any(|e| e.event == "RESET")
        || run
            .console
            .iter()
            .any(|l| l.text.contains("reboot: Restarting system"));
    if tl.boots.len() >= 2 {
        // The second boot was the harness's: it ends itself after reporting.
        return Some(if reset { End::Reboot } else { End::Kexec });
    }
    if tl.ended("still-up") {
        return Some(End::StaysUp);
    }
    match &run.exit {
        Exit::Halted => Some(End::Halt),
        Exit::Killed(_) => None,
        Exit::Exited(_) => {
            let shutdown = run.qmp.iter().find(|e| e.event == "SHUTDOWN");
            let reason = shutdown
                .and_then(|e| e.data.get("reason"))
                .and_then(|r| r.as_str());
            match reason {
                Some("guest-shutdown") => Some(End::PowerOff),
                Some("guest-reset") => Some(End::Reboot),
                _ if run
                    .console
                    .iter()
                    .any(|l| l.text.contains("reboot: Power down")) =>
                {
                    Some(End::PowerOff)
                }
                _ => None,
            }
        }
    }
}

/// The last-gasp race: each trigger `n` times, each a fresh boot, one boot
/// only (a reset ends qemu).
pub const RACE: [&str; 3] = ["poweroff-force-force", "reboot-ff", "busybox-poweroff-f"];

/// What losing the race looks like in a run's problems: the announcement
/// (or the record on disk) did not get out before the machine died; the
/// next boot delivers what the disk or the Node kept.
pub const LOST_RACE: [&str; 2] = ["nothing announcing the shutdown", "the first detection ("];

pub struct Race {
    pub sc: &'static Scenario,
    pub n: u32,
    pub runs: Vec<Outcome>,
}

impl Race {
    /// `systemctl poweroff --force --force` must win every run: its first
    /// record on disk before the guest died and, with `--cluster`, the last
    /// gasp's evidence (the record annotation) received by the double. The direct reboot(2)
    /// callers are measured: a lost race is counted, not failed (the next
    /// boot delivers it; `reboot-ff` and `busybox-poweroff-f` show that).
    pub fn failed(&self) -> bool {
        let strict = self.sc.name == RACE[0];
        self.runs.len() as u32 != self.n
            || self.runs.iter().any(|o| {
                if strict {
                    o.failed()
                        || o.cluster
                            .as_ref()
                            .is_some_and(|g| g.evidence_ms().is_none())
                } else {
                    o.problems
                        .iter()
                        .any(|p| !LOST_RACE.iter().any(|l| p.starts_with(l)))
                }
            })
    }
}

pub fn race(guest: &Guest, n: u32, dir: &Path, mut cluster: Option<&mut Cluster>) -> Vec<Race> {
    let mut races = Vec::new();
    for name in RACE {
        let sc = SCENARIOS
            .iter()
            .find(|s| s.name == name)
            .expect("a race scenario");
        let mut runs = Vec::new();
        for i in 1..=n {
            let o = run_as(
                guest,
                sc,
                &dir.join(format!("{name}-{i:02}")),
                cluster.as_deref_mut(),
                true,
            );
            println!("vm-test: race {name} {i:>2}/{n}: {}", o.one_line());
            runs.push(o);
        }
        races.push(Race { sc, n, runs });
    }
    races
}
