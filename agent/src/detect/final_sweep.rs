//! systemd-shutdown's kill sweep, read from /proc. Where no hook can be
//! installed (a read-only `/usr`) and a shutdown stops no unit (`systemctl
//! poweroff --force`, `reboot --force`), no final unit runs either: the
//! final stage is marked only by PID 1 exec'ing systemd-shutdown, which
//! then sends SIGTERM to every process but kernel threads and root ones
//! whose argv[0] begins with `@` (the agent is one), SIGKILL after its
//! timeout, then unmounts and calls reboot(2). The agent, seeing that exec
//! in the kernel's record, reads /proc until the sweep has left no process
//! it would kill, nor any pod's process it spared: every workload is dead.
//! Only then does it send its final-stage word; the unmount loop and the
//! reboot(2) are still to come (the controller's settle covers them).
use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{bail, Context, Result};
use tokio::sync::mpsc::Sender;

use crate::signal::{Detail, ShutdownSignal, Source};

/// systemd-shutdown's SIGTERM timeout (90 s), its SIGKILL wait, and margin.
pub const BOUND: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(50);
/// `PF_KTHREAD` in /proc/PID/stat's flags.
const PF_KTHREAD: u64 = 0x0020_0000;

/// The verb of an exec of systemd-shutdown (its argv[1]); the caller has
/// checked that the node's PID 1 made it (`ShutdownSignal::is_pid1_shutdown`).
pub fn verb(s: &ShutdownSignal) -> Option<String> {
    match &s.detail {
        Detail::Exec { argv, .. } => Some(argv.get(1).cloned().unwrap_or_default()),
        _ => None,
    }
}

/// The sweep's end as a signal: systemd-shutdown (PID 1) its actor.
pub fn signal(verb: &str, at: SystemTime) -> ShutdownSignal {
    use crate::hostio::FINAL_STAGE_COMM;
    let mut s = super::shutdown_hook::signal(verb, FINAL_STAGE_COMM, at);
    s.source = Source::FinalSweep;
    s
}

/// Where and by whom the sweep is read: the node's /proc, the agent's own
/// pid there (spared; 0 where the agent runs outside the node's namespace),
/// and the loop's channel.
pub struct Reader {
    pub proc_root: PathBuf,
    pub me: u32,
    pub tx: Sender<ShutdownSignal>,
}

impl Reader {
    /// For the node's PID namespace: the agent's own /proc in the initial
    /// one; else (tests) the /proc its init sees.
    pub fn of(node: &crate::node::NodePidNs, tx: Sender<ShutdownSignal>) -> Self {
        let (proc_root, me) = match node.init_pid {
            1 => (PathBuf::from("/proc"), std::process::id()),
            init => (PathBuf::from(format!("/proc/{init}/root/proc")), 0),
        };
        Reader { proc_root, me, tx }
    }

    /// Reads the sweep on a thread of its own (blocking reads of /proc must
    /// not hold the agent's loop): see [`await_end`].
    pub fn watch(self, verb: String) {
        tracing::info!(verb, "the last word: reading systemd-shutdown's kill sweep");
        let why = format!(
            "reading systemd-shutdown's kill sweep (every {} ms, up to {} s)",
            POLL.as_millis(),
            BOUND.as_secs()
        );
        let _ = self.tx.try_send(without_effect(&verb, why));
        let Reader { proc_root, me, tx } = self;
        let spawned = std::thread::Builder::new()
            .name("final-sweep".into())
            .spawn(move || await_end(&proc_root, me, &verb, &tx));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no last word from the sweep: no thread to read it");
        }
    }
}

/// Waits (up to [`BOUND`]) until systemd-shutdown's sweep has left nothing
/// in `proc_root` but PID 1, kernel threads, `me` and root `@` processes
/// outside pods, then sends the sweep's signal on `tx`. What holds the
/// sweep (the first reading, then any that holds it a second or more: a
/// few of them), an unreadable /proc, or the
/// bound passing go out as signals without effect: the audit keeps them.
pub fn await_end(proc_root: &Path, me: u32, verb: &str, tx: &Sender<ShutdownSignal>) {
    let started = Instant::now();
    let (mut first, mut told) = (None::<(String, Instant)>, 0);
    let why = loop {
        let left =
            match first_survivor(proc_root, me) {
                Ok(None) => {
                    tracing::info!(verb, waited_ms = started.elapsed().as_millis() as u64,
                    "the last word: systemd-shutdown's kill sweep left no process but the spared");
                    let _ = tx.blocking_send(signal(verb, SystemTime::now()));
                    return;
                }
                Ok(Some(p)) => p,
                Err(e) => break format!("systemd-shutdown's sweep cannot be read: {e:#}"),
            };
        if started.elapsed() >= BOUND {
            break format!(
                "systemd-shutdown's sweep did not end in {} s: {left}",
                BOUND.as_secs()
            );
        }
        match &first {
            Some((p, since)) if *p == left => {
                if told < HOLDERS_TOLD && since.elapsed() >= Duration::from_secs(1) {
                    told += 1;
                    let why = format!("systemd-shutdown's sweep waits: {left}");
                    let _ = tx.blocking_send(without_effect(verb, why));
                    first = Some((left, Instant::now() + BOUND));
                }
            }
            // The first reading is told at once: the sweep is being read.
            _ if first.is_none() => {
                told += 1;
                let why = format!("systemd-shutdown's sweep, first read: {left}");
                let _ = tx.blocking_send(without_effect(verb, why));
                first = Some((left, Instant::now()));
            }
            _ => first = Some((left, Instant::now())),
        }
        std::thread::sleep(POLL);
    };
    tracing::warn!(why, "no last word from systemd-shutdown's sweep");
    let _ = tx.blocking_send(without_effect(verb, why));
}

/// How many of the processes that hold the sweep are audited.
const HOLDERS_TOLD: usize = 8;

fn without_effect(verb: &str, why: String) -> ShutdownSignal {
    let mut s = signal(verb, SystemTime::now());
    s.effect = crate::signal::Effect::None { why };
    s
}

/// The first process that keeps the sweep from being over, if any.
pub fn first_survivor(proc_root: &Path, me: u32) -> Result<Option<String>> {
    let comm = fs::read_to_string(proc_root.join("1/comm")).context("PID 1's comm")?;
    if comm.trim() != crate::hostio::FINAL_STAGE_COMM {
        bail!("PID 1 is {:?}, not systemd-shutdown", comm.trim());
    }
    let pod_depth = ups(&cgroup(&proc_root.join("1"))?.unwrap_or_default());
    for e in fs::read_dir(proc_root)?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == 1 || pid == me {
            continue;
        }
        match survives(&e.path(), pod_depth) {
            Ok(Some(why)) => return Ok(Some(format!("pid {pid} {why}"))),
            Ok(None) => {}
            // Gone while read.
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e.context(format!("reading pid {pid}"))),
        }
    }
    Ok(None)
}

fn gone(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|e| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)))
}

/// Why the process at `dir` still counts: systemd-shutdown would kill it,
/// or it is a pod's (`pod_depth`: how far this cgroup namespace's root is
/// below the host's, read from PID 1's path).
fn survives(dir: &Path, pod_depth: usize) -> Result<Option<String>> {
    let stat = fs::read_to_string(dir.join("stat"))?;
    let (comm, rest) = stat
        .split_once(" (")
        .and_then(|(_, r)| r.rsplit_once(") "))
        .context("an unreadable stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (state, flags) = (
        f.first().copied(),
        f.get(6).and_then(|x| x.parse::<u64>().ok()),
    );
    if matches!(state, Some("Z" | "X")) || flags.is_some_and(|f| f & PF_KTHREAD != 0) {
        return Ok(None);
    }
    let root = fs::read_to_string(dir.join("status"))?
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|u| u.split_whitespace().next().map(|u| u == "0"))
        .unwrap_or(false);
    let at = fs::read(dir.join("cmdline"))?.first() == Some(&b'@');
    if !(root && at) {
        return Ok(Some(format!("({comm}) is left for the sweep")));
    }
    match cgroup(dir)? {
        Some(path) if !in_pod(&path, pod_depth) => Ok(None),
        Some(path) => Ok(Some(format!("({comm}) is a pod's, spared ({path})"))),
        None => Ok(Some(format!("({comm}) is spared, in an unknown cgroup"))),
    }
}

/// The cgroup2 path (`0::PATH`), as this cgroup namespace shows it.
fn cgroup(dir: &Path) -> Result<Option<String>> {
    Ok(fs::read_to_string(dir.join("cgroup"))?
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string)))
}

/// Leading `..` components: how far above this namespace's root a path is.
fn ups(path: &str) -> usize {
    path.split('/')
        .filter(|c| !c.is_empty())
        .take_while(|c| *c == "..")
        .count()
}

/// Whether a cgroup path (relative to this namespace's root, which is
/// `pod_depth` below the host's, inside the agent's own pod when above 0)
/// is under the kubelet's pods: it shares a part of that root, or starts
/// from the host's root with the kubelet's slice (either driver).
fn in_pod(path: &str, pod_depth: usize) -> bool {
    let up = ups(path);
    if up < pod_depth {
        return true;
    }
    let first = path
        .split('/')
        .filter(|c| !c.is_empty())
        .nth(up)
        .unwrap_or("");
    first == "kubepods.slice" || first == "kubepods"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process in a fake /proc: `head` is its stat line's start, "PID
    /// (COMM) STATE".
    fn proc_entry(root: &Path, head: &str, flags: u64, uid: u32, cmdline: &[u8], cg: &str) {
        let (pid, rest) = head.split_once(" (").unwrap();
        let comm = rest.split_once(')').unwrap().0;
        let d = root.join(pid);
        fs::create_dir_all(&d).unwrap();
        fs::write(
            d.join("stat"),
            format!("{head} 1 1 1 0 -1 {flags} 0 0 0 0 0 0\n"),
        )
        .unwrap();
        fs::write(d.join("comm"), format!("{comm}\n")).unwrap();
        let status = format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n");
        fs::write(d.join("status"), status).unwrap();
        fs::write(d.join("cmdline"), cmdline).unwrap();
        fs::write(d.join("cgroup"), format!("0::{cg}\n")).unwrap();
    }

    /// The agent's view under the systemd driver: its cgroup namespace's
    /// root is its container's scope, four levels below the host's.
    #[test]
    fn the_sweep_ends_when_only_the_spared_outside_pods_are_left() {
        let root = std::env::temp_dir().join(format!("lastgasp-sweep-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let r = root.as_path();
        proc_entry(
            r,
            "1 (systemd-shutdow) S",
            0,
            0,
            b"/usr/lib/systemd/systemd-shutdown\0poweroff\0",
            "/../../../../init.scope",
        );
        proc_entry(r, "2 (kthreadd) S", PF_KTHREAD, 0, b"", "/../../../..");
        proc_entry(r, "500 (lastgasp) S", 0, 0, b"@lastgasp\0run\0", "/");
        proc_entry(
            r,
            "600 (iscsid) S",
            0,
            0,
            b"@iscsid\0",
            "/../../../../system.slice/iscsid.service",
        );
        proc_entry(r, "700 (postgres) Z", 0, 999, b"", "/../../../kubepods-burstable.slice/kubepods-burstable-podb.slice/cri-containerd-c.scope");
        assert_eq!(first_survivor(r, 500).unwrap(), None);

        proc_entry(r, "701 (postgres) S", 0, 999, b"postgres\0", "/../../../kubepods-burstable.slice/kubepods-burstable-podb.slice/cri-containerd-c.scope");
        let left = first_survivor(r, 500).unwrap().unwrap();
        assert!(left.starts_with("pid 701 (postgres) is left"), "{left}");
        fs::remove_dir_all(r.join("701")).unwrap();

        // A root `@` process systemd spares, in a pod beside the agent's
        // (same QoS slice) or in another: a workload alive.
        proc_entry(
            r,
            "702 (writer) S",
            0,
            0,
            b"@writer\0",
            "/../../kubepods-besteffort-podc.slice/cri-containerd-d.scope",
        );
        assert!(first_survivor(r, 500)
            .unwrap()
            .unwrap()
            .contains("a pod's, spared"));
        fs::remove_dir_all(r.join("702")).unwrap();
        // A non-root `@` process is killed by the sweep: left for it.
        proc_entry(
            r,
            "703 (user) S",
            0,
            1000,
            b"@user\0",
            "/../../../../user.slice",
        );
        assert!(first_survivor(r, 500)
            .unwrap()
            .unwrap()
            .contains("left for the sweep"));
        fs::remove_dir_all(r.join("703")).unwrap();
        assert_eq!(first_survivor(r, 500).unwrap(), None);

        // Not the final stage: nothing is read as the sweep.
        proc_entry(
            r,
            "1 (systemd) S",
            0,
            0,
            b"/sbin/init\0",
            "/../../../../init.scope",
        );
        assert!(first_survivor(r, 500).is_err());
        fs::remove_dir_all(r).unwrap();
    }

    /// Where pods sit, for both drivers and with or without a cgroup
    /// namespace of the agent's own.
    #[test]
    fn pods_are_told_from_the_host_under_either_driver() {
        // cgroupfs driver, agent at /kubepods/besteffort/podA/ctr (4 deep).
        assert!(in_pod("/../../../burstable/podb/ctr", 4));
        assert!(in_pod("/../../podc/ctr", 4));
        assert!(in_pod("/../../../../kubepods/podd/ctr", 4));
        assert!(!in_pod("/../../../../system.slice/containerd.service", 4));
        assert!(!in_pod("/../../../..", 4));
        // No namespace of its own: absolute paths.
        assert!(in_pod(
            "/kubepods.slice/kubepods-pode.slice/cri-containerd-f.scope",
            0
        ));
        assert!(!in_pod("/init.scope", 0));
        assert!(!in_pod("/", 0));
    }

    /// The sweep's end goes out as the final stage's signal; a /proc that
    /// is not the final stage's, as a signal without effect saying why.
    #[test]
    fn the_watch_sends_the_end_or_why_not() {
        let root = std::env::temp_dir().join(format!("lastgasp-sweep-w-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        proc_entry(
            &root,
            "1 (systemd-shutdow) S",
            0,
            0,
            b"/lib/systemd/systemd-shutdown\0poweroff\0",
            "/../../init.scope",
        );
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        await_end(&root, 500, "poweroff", &tx);
        let s = rx.try_recv().unwrap();
        assert_eq!(
            (s.source, s.kind, s.effect.clone()),
            (
                Source::FinalSweep,
                crate::signal::Kind::Poweroff,
                crate::signal::Effect::Now
            )
        );
        assert_eq!(
            crate::decide::proof_of(&s).unwrap().proof,
            crate::decide::Proof::FinalStage
        );
        proc_entry(
            &root,
            "1 (systemd) S",
            0,
            0,
            b"/sbin/init\0",
            "/../../init.scope",
        );
        await_end(&root, 500, "poweroff", &tx);
        let s = rx.try_recv().unwrap();
        assert!(
            matches!(&s.effect, crate::signal::Effect::None { why } if why.contains("not systemd-shutdown")),
            "{:?}",
            s.effect
        );
        assert!(crate::decide::proof_of(&s).is_none());
        fs::remove_dir_all(&root).unwrap();
    }

    /// This machine's own /proc: PID 1 is not systemd-shutdown, so nothing
    /// is read as its sweep; a live child is a survivor whatever PID 1 is.
    #[test]
    fn a_running_system_is_not_the_final_stage() {
        let e = first_survivor(Path::new("/proc"), std::process::id()).unwrap_err();
        assert!(e.to_string().contains("not systemd-shutdown"), "{e:#}");
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let dir = PathBuf::from(format!("/proc/{}", child.id()));
        let why = survives(&dir, 0).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(why.unwrap().contains("(sleep) is left for the sweep"));
    }
}
