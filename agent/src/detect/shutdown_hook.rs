//! systemd-shutdown's own hooks: right before the final sync and reboot(2),
//! after every service was stopped, every remaining process killed and the
//! file systems unmounted, it runs each executable in
//! `/usr/lib/systemd/system-shutdown/` and waits for them (systemd-shutdown(8)).
//! The agent installs one there. It tells the agent, which systemd-shutdown's
//! final kill spared (`@lastgasp`), and waits a few seconds for its answer:
//! the agent's last word then goes out while the node still waits for it,
//! instead of racing the kernel's power-off after reboot(2).
//!
//! The hook writes the verb to a FIFO in the agent's run directory; the
//! agent checks that the node's PID 1 really is systemd-shutdown (only then
//! is the node in its final stage), turns it into a `ShutdownSignal`, and
//! once the loop has acted on it, writes `<fifo>.done`.
use std::{
    fs,
    io::{BufRead, BufReader},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    time::SystemTime,
};

use anyhow::{Context, Result};
use tokio::sync::mpsc;

use crate::{
    hostio::{write_atomic, COURIER, FINAL_STAGE_COMM, HOOK_NAME, PID_FILE, VERBS},
    node::NodePidNs,
    signal::{Actor, Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};

/// In the run directory: the FIFO the hook writes its verb to.
const FIFO: &str = "shutdown-hook";
/// How long the hook waits for the agent's answer, in tenths of a second.
const WAIT_TENTHS: u32 = 50;
/// The installed script. POSIX sh and `sleep`: it runs in systemd-shutdown's
/// degraded environment (the root file system likely read-only; /run still
/// there).
fn script(run_dir: &Path) -> String {
    let dir = run_dir.display();
    let secs = WAIT_TENTHS / 10;
    format!(
        r#"#!/bin/sh
# Installed by lastgasp (its node agent). systemd-shutdown runs this after
# every process was stopped or killed and the file systems unmounted, right
# before the final sync and reboot(2): it tells the agent, and waits at most
# {secs} s for its last word to reach the cluster. Without a running agent it
# does nothing. The agent writes this file at start; delete it with the agent.
# What it does goes to the kernel's log (systemd-shutdown's own stdio is
# /dev/null).
dir={dir}
say() {{ echo "lastgasp: $*" > /dev/kmsg 2>/dev/null || echo "lastgasp: $*" >&2; }}
verb="${{1:-unknown}}"
# Without the agent (the systemd cgroup driver stopped its scope, or the
# container runtime's clean-up killed it), its courier sends the record the
# agent left when the shutdown began.
courier() {{
    say "$1"
    bin="$(dirname "$0")/{COURIER}/run"
    if [ -f "$dir/courier/kit.json" ]; then
        say "$("$bin" courier --dir "$dir/courier" --verb "$verb" 2>&1 | tail -n 3 | tr '\n' ' ')"
    fi
    exit 0
}}
pid=$(cat "$dir/{PID_FILE}" 2>/dev/null) || courier "no agent ($dir/{PID_FILE})"
kill -0 "$pid" 2>/dev/null || courier "the agent (pid $pid) is not running"
[ -p "$dir/{FIFO}" ] || {{ say "no $dir/{FIFO}"; exit 0; }}
rm -f "$dir/{FIFO}.done"
# Opened read-write: never blocks, whoever reads.
exec 3<>"$dir/{FIFO}"
echo "$verb" >&3
i=0
while [ "$i" -lt {WAIT_TENTHS} ] && [ ! -e "$dir/{FIFO}.done" ]; do
    sleep 0.1
    i=$((i + 1))
done
if [ -e "$dir/{FIFO}.done" ]; then
    say "the agent (pid $pid) answered in $i/10 s: $(cat "$dir/{FIFO}.done" 2>/dev/null)"
else
    say "no answer from the agent (pid $pid) within {secs} s"
fi
exit 0
"#
    )
}

/// Where the hook lives and talks to the agent.
#[derive(Clone, Debug)]
pub struct HookPaths {
    /// systemd-shutdown's directory, as the agent sees it.
    pub hook_dir: PathBuf,
    /// The agent's run directory, the same path on the host and in the pod.
    pub run_dir: PathBuf,
}

impl HookPaths {
    fn fifo(&self) -> PathBuf {
        self.run_dir.join(FIFO)
    }
}

/// Installs the hook and starts reading its FIFO on a thread; signals go to
/// `tx`. The node's PID 1 (`node.init_pid`) is checked for each.
pub fn start(paths: &HookPaths, node: &NodePidNs, tx: mpsc::Sender<ShutdownSignal>) -> Result<()> {
    fs::create_dir_all(&paths.run_dir)
        .with_context(|| format!("creating {}", paths.run_dir.display()))?;
    fs::set_permissions(&paths.run_dir, fs::Permissions::from_mode(0o700))?;
    let fifo = paths.fifo();
    let _ = fs::remove_file(&fifo);
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
        .with_context(|| format!("mkfifo {}", fifo.display()))?;
    // Read-write: the agent's own writer end keeps the FIFO from ever
    // reading EOF between hooks.
    let reader = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&fifo)
        .with_context(|| format!("opening {}", fifo.display()))?;
    write_atomic(
        &paths.run_dir.join(PID_FILE),
        std::process::id().to_string().as_bytes(),
        0o600,
    )?;
    fs::create_dir_all(&paths.hook_dir)
        .with_context(|| format!("creating {}", paths.hook_dir.display()))?;
    let hook = paths.hook_dir.join(HOOK_NAME);
    write_atomic(&hook, script(&paths.run_dir).as_bytes(), 0o755)
        .with_context(|| format!("installing {}", hook.display()))?;
    tracing::info!(hook = %hook.display(), fifo = %fifo.display(), "systemd-shutdown hook installed");
    let init_pid = node.init_pid;
    std::thread::Builder::new()
        .name("shutdown-hook".into())
        .spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(verb) = line else { return };
                let s = signal(verb.trim(), &pid1_comm(init_pid), SystemTime::now());
                if tx.blocking_send(s).is_err() {
                    return;
                }
            }
        })?;
    Ok(())
}

/// The loop has acted on the hook's signal: the hook may go on, and says
/// `note` (what came of it) in the kernel's log.
pub fn acknowledge(run_dir: &Path, note: &str) {
    let done = run_dir.join(format!("{FIFO}.done"));
    let note: String = note.chars().filter(|c| !c.is_control()).take(400).collect();
    if let Err(e) = fs::write(&done, note) {
        tracing::warn!(
            path = %done.display(),
            error = %e,
            "systemd-shutdown's hook NOT answered"
        );
    }
}

fn pid1_comm(init_pid: u32) -> String {
    fs::read_to_string(format!("/proc/{init_pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_default()
}

/// The hook's verb as a signal: the node's final stage only while its PID 1
/// is systemd-shutdown; else what it is.
pub(crate) fn signal(verb: &str, pid1: &str, at: SystemTime) -> ShutdownSignal {
    let kind = VERBS
        .iter()
        .find(|(v, _)| *v == verb)
        .map_or(Kind::Unknown, |(_, k)| *k);
    let effect = if pid1 == FINAL_STAGE_COMM {
        Effect::Now
    } else {
        Effect::None {
            why: format!(
                "the shutdown hook ran while PID 1 is {pid1:?}, not systemd-shutdown: not the node's final stage"
            ),
        }
    };
    ShutdownSignal {
        source: Source::ShutdownHook,
        kind,
        forced: true,
        bypasses_logind: true,
        calls_reboot: false,
        scope: Scope::Node,
        effect,
        actor: Some(Actor {
            pid: 1,
            ns_pid: 1,
            comm: pid1.to_string(),
            uid: 0,
            euid: Some(0),
            ..Default::default()
        }),
        sender: None,
        at,
        boot_ns: crate::clock::boottime_ns(),
        deadline: None,
        detail: Detail::Hook {
            verb: verb.to_string(),
        },
    }
}

/// The final unit's verb as a signal (`act::final_unit`): only its
/// courier meets it, systemd's PID 1 its actor.
pub(crate) fn final_unit_signal(verb: &str, at: SystemTime) -> ShutdownSignal {
    let mut s = signal(verb, FINAL_STAGE_COMM, at);
    s.source = Source::FinalUnit;
    if let Some(a) = s.actor.as_mut() {
        a.comm = "systemd".into();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pid1_as_systemd_shutdown_is_the_final_stage() {
        let s = signal("poweroff", "systemd-shutdow", SystemTime::now());
        assert_eq!((s.kind, &s.effect), (Kind::Poweroff, &Effect::Now));
        let s = signal("reboot", "systemd", SystemTime::now());
        assert_eq!(s.kind, Kind::Reboot);
        assert!(matches!(s.effect, Effect::None { .. }), "{:?}", s.effect);
        assert_eq!(
            signal("x", "systemd-shutdow", SystemTime::now()).kind,
            Kind::Unknown
        );
    }

    /// The installed script, run for real: it tells the agent (a reader of
    /// the FIFO), waits for the answer, and returns at once with no agent.
    #[test]
    fn the_hook_tells_the_agent_and_waits_for_its_answer() {
        let dir = std::env::temp_dir().join(format!("lastgasp-hook-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let paths = HookPaths {
            hook_dir: dir.join("system-shutdown"),
            run_dir: dir.join("run"),
        };
        let (tx, mut rx) = mpsc::channel(4);
        let node = NodePidNs::initial().unwrap();
        start(&paths, &node, tx).unwrap();
        let hook = paths.hook_dir.join(HOOK_NAME);
        let run = std::process::Command::new(&hook)
            .arg("poweroff")
            .spawn()
            .unwrap();
        let s = rx.blocking_recv().expect("the hook's verb");
        assert_eq!((s.source, s.kind), (Source::ShutdownHook, Kind::Poweroff));
        // This machine's PID 1 is not systemd-shutdown: no final stage.
        assert!(matches!(s.effect, Effect::None { .. }));
        let t0 = std::time::Instant::now();
        acknowledge(&paths.run_dir, "{\"last-gasp-delivered\":{\"ms\":1.0}}");
        let out = run.wait_with_output().unwrap();
        assert!(out.status.success());
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(2),
            "it waits only for the answer"
        );
        // A dead agent: the hook returns at once.
        fs::write(paths.run_dir.join(PID_FILE), b"999999999").unwrap();
        let t0 = std::time::Instant::now();
        assert!(std::process::Command::new(&hook)
            .arg("poweroff")
            .status()
            .unwrap()
            .success());
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        // A dead agent that left a courier and its kit: the hook runs it
        // (here a stand-in that records its arguments).
        let courier = paths.run_dir.join("courier");
        let bin = paths.hook_dir.join(COURIER);
        fs::create_dir_all(&courier).unwrap();
        fs::create_dir_all(&bin).unwrap();
        let called = dir.join("courier-called");
        write_atomic(
            &bin.join("run"),
            format!(
                "#!/bin/sh\necho \"$@\" > {}\necho delivered\n",
                called.display()
            )
            .as_bytes(),
            0o700,
        )
        .unwrap();
        let hook_run = || {
            std::process::Command::new(&hook)
                .arg("poweroff")
                .status()
                .unwrap()
        };
        assert!(hook_run().success());
        assert!(!called.exists(), "no kit: no courier");
        fs::write(courier.join("kit.json"), b"{}").unwrap();
        assert!(hook_run().success());
        assert_eq!(
            fs::read_to_string(&called).unwrap().trim(),
            format!("courier --dir {} --verb poweroff", courier.display())
        );
        fs::remove_dir_all(&dir).ok();
    }
}
