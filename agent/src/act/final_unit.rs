//! lastgasp's final unit: the courier's moment where systemd-shutdown's
//! hook cannot be installed (a read-only `/usr`: Flatcar, Bottlerocket,
//! COS). A template unit in `/run/systemd/system` (a tmpfs: gone at the
//! next boot, written again at the agent's start), wanted by
//! systemd-{poweroff,halt,reboot,kexec}.service and ordered after
//! shutdown.target, umount.target and final.target and before that
//! service. systemd pulls it in only when it starts one of those services,
//! whose success action execs systemd-shutdown; by then every unit with
//! default dependencies was stopped (the kubelet, the runtime) and every
//! mount unit unmounted (the pods' volumes).
//!
//! Pods may still run then: runc's scopes have no default dependencies, so
//! a shutdown stops only those the drain, the kubelet or their slice's stop
//! ended (the agent's own pod, never drained, survives to systemd-shutdown,
//! seen on the real node), and under the cgroupfs driver pods are not units
//! at all. Their end is systemd-shutdown's sweep a moment later; the courier
//! brings it forward for the pods' cgroups only: SIGTERM, SIGKILL after
//! the sweep's own timeout, the agent spared (it sends its own proof if it
//! can).
//!
//! The courier sends the kit's record for the verb only when its own cgroup
//! is that unit's (systemd put it there), systemd's job queue holds the
//! start of systemd-{verb}.service, and then no pod's cgroup holds a
//! process. A failed or slow courier never holds the shutdown: the unit is
//! only wanted, and bounded.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

use crate::hostio::VERBS;

/// The template; its instance is the verb.
pub const TEMPLATE: &str = "lastgasp-last-word@.service";
/// The kit's key for the final unit's record of `verb`.
pub fn key(verb: &str) -> String {
    format!("final-unit/{verb}")
}

fn instance(verb: &str) -> String {
    format!("lastgasp-last-word@{verb}.service")
}

fn wants(unit_dir: &Path, verb: &str) -> PathBuf {
    unit_dir.join(format!("systemd-{verb}.service.wants"))
}

/// The template, running `courier_run` (the host's path) on the kit in
/// `kit_dir`.
pub fn text(courier_run: &Path, kit_dir: &Path) -> String {
    format!(
        r#"# Installed by lastgasp (its node agent) in /run: gone at the next boot;
# `lastgasp clean-host` removes it. systemd runs it right before
# systemd-%i.service, after every unit was stopped and every mount unit
# unmounted; its courier ends what is left in the pods' cgroups (SIGTERM,
# SIGKILL after 90 s, as systemd-shutdown would next), then sends the
# record the agent left for this shutdown.
[Unit]
Description=lastgasp: the node's last word (%i)
DefaultDependencies=no
After=shutdown.target umount.target final.target
Before=systemd-%i.service

[Service]
# Not the template's own slice, which conflicts with shutdown.target.
Slice=system.slice
Type=oneshot
ExecStart=-{} courier --dir {} --verb %i --final-unit
TimeoutStartSec=110
"#,
        courier_run.display(),
        kit_dir.display()
    )
}

/// Writes the template and its wants links (one per verb).
pub fn install(unit_dir: &Path, courier_run: &Path, kit_dir: &Path) -> Result<()> {
    use crate::hostio::write_atomic;
    fs::create_dir_all(unit_dir).with_context(|| format!("creating {}", unit_dir.display()))?;
    let template = unit_dir.join(TEMPLATE);
    write_atomic(&template, text(courier_run, kit_dir).as_bytes(), 0o644)
        .with_context(|| format!("writing {}", template.display()))?;
    for (verb, _) in VERBS {
        let dir = wants(unit_dir, verb);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let link = dir.join(instance(verb));
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(Path::new("..").join(TEMPLATE), &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}

/// Every file the agent may have written in `unit_dir`, whether or not
/// it is there (the wants directories only if the agent's link was the
/// only thing in them).
pub fn files(unit_dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<_> = VERBS
        .iter()
        .map(|(verb, _)| wants(unit_dir, verb).join(instance(verb)))
        .collect();
    out.push(unit_dir.join(TEMPLATE));
    out
}

/// Removes the template and its links (and a wants directory they leave
/// empty); returns what went.
pub fn remove(unit_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut gone = Vec::new();
    for f in files(unit_dir) {
        if f.symlink_metadata().is_err() {
            continue;
        }
        fs::remove_file(&f).with_context(|| format!("removing {}", f.display()))?;
        if let Some(dir) = f.parent().filter(|d| *d != unit_dir) {
            // Not empty: another package's wants stay.
            let _ = fs::remove_dir(dir);
        }
        gone.push(f);
    }
    Ok(gone)
}

/// systemd reads its unit files again (the links are read at load time);
/// on a busy node that takes seconds (over 5 s seen in a TCG guest).
pub async fn reload(bus: Option<&str>) -> Result<()> {
    let wait = std::time::Duration::from_secs(90);
    let conn = crate::bus::connect_waiting(bus, wait)
        .await
        .context("the system bus")?;
    crate::bus::systemd::manager(&conn)
        .await?
        .reload()
        .await
        .context("systemd's Reload")
}

/// Why the courier must send nothing, if anything: `own_cgroup` is its
/// process's cgroup (`/proc/self/cgroup`), `start_jobs` the units systemd
/// is starting, `pods` a pod cgroup that still holds a process.
pub fn refusal(
    verb: &str,
    own_cgroup: &str,
    start_jobs: &[String],
    pods: Option<&str>,
) -> Option<String> {
    if !VERBS.iter().any(|(v, _)| *v == verb) {
        return Some(format!("{verb:?} is not a verb systemd shuts down with"));
    }
    let unit = instance(verb);
    if !own_cgroup
        .lines()
        .any(|l| l.trim_end().ends_with(&format!("/{unit}")))
    {
        return Some(format!(
            "not run by systemd as {unit} (cgroup {own_cgroup:?})"
        ));
    }
    let service = format!("systemd-{verb}.service");
    if !start_jobs.contains(&service) {
        return Some(format!(
            "systemd is not starting {service}: not a {verb} (jobs: {start_jobs:?})"
        ));
    }
    pods.map(|p| {
        format!("a pod's process is left in {p} (pods not stopped as units: the cgroupfs driver?)")
    })
}

/// The units systemd is starting, from `systemctl list-jobs` (which
/// reaches PID 1 on its own socket when the system bus is gone, as it is
/// by the final unit).
pub fn start_jobs() -> Result<Vec<String>> {
    let out = std::process::Command::new("systemctl")
        .args(["list-jobs", "--no-legend", "--no-pager"])
        .output()
        .context("running systemctl list-jobs")?;
    if !out.status.success() {
        bail!(
            "systemctl list-jobs: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(parse_jobs(&String::from_utf8_lossy(&out.stdout)))
}

/// `JOB UNIT TYPE STATE` lines: the units of the start jobs.
fn parse_jobs(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| {
            let f: Vec<_> = l.split_whitespace().collect();
            (f.len() >= 4 && f[2] == "start").then(|| f[1].to_string())
        })
        .collect()
}

/// How long pods' processes left at the final unit get after SIGTERM:
/// what systemd-shutdown's own sweep gives them (its default timeout), so
/// that no pod loses time it would have had without lastgasp.
pub const TERM_GRACE: std::time::Duration = std::time::Duration::from_secs(90);

/// systemd-shutdown's sweep, brought forward for the pods' cgroups: every
/// process left under them but `spare` gets SIGTERM, then when `grace`
/// has passed with some left, SIGKILL. Returns how many were signalled,
/// and killed.
pub fn end_pods(
    cgroup_root: &Path,
    spare: Option<u32>,
    grace: std::time::Duration,
) -> Result<(usize, usize)> {
    use nix::sys::signal::{kill, Signal};
    let signal = |sig| -> Result<usize> {
        let pids = pod_pids(cgroup_root, spare)?;
        for p in &pids {
            // Gone meanwhile: ESRCH, nothing to do.
            let _ = kill(nix::unistd::Pid::from_raw(*p as i32), sig);
        }
        Ok(pids.len())
    };
    let termed = signal(Signal::SIGTERM)?;
    if termed == 0 {
        return Ok((0, 0));
    }
    let until = std::time::Instant::now() + grace;
    while std::time::Instant::now() < until && !pod_pids(cgroup_root, spare)?.is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if pod_pids(cgroup_root, spare)?.is_empty() {
        return Ok((termed, 0));
    }
    let killed = signal(Signal::SIGKILL)?;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    while std::time::Instant::now() < until && !pod_pids(cgroup_root, spare)?.is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok((termed, killed))
}

/// Every process under the pods' cgroups but `spare`.
fn pod_pids(cgroup_root: &Path, spare: Option<u32>) -> Result<Vec<u32>> {
    Ok(pod_procs(cgroup_root, spare)?
        .into_iter()
        .map(|(_, p)| p)
        .collect())
}

/// A process left in a pod cgroup of either driver under the cgroup2 root
/// (`kubepods.slice`, `kubepods`), other than `spare` (the agent itself), if
/// any.
pub fn pods_left(cgroup_root: &Path, spare: Option<u32>) -> Result<Option<String>> {
    if !cgroup_root.join("cgroup.controllers").exists() {
        bail!(
            "{} is not a cgroup2 root: whether pods are left cannot be told",
            cgroup_root.display()
        );
    }
    Ok(pod_procs(cgroup_root, spare)?
        .into_iter()
        .next()
        .map(|(dir, pid)| {
            let rel = dir.strip_prefix(cgroup_root).unwrap_or(&dir);
            format!("{} (pid {pid})", rel.display())
        }))
}

/// (cgroup, pid) of every process under the pods' cgroups but `spare`.
fn pod_procs(cgroup_root: &Path, spare: Option<u32>) -> Result<Vec<(PathBuf, u32)>> {
    let mut out = Vec::new();
    for pods in ["kubepods.slice", "kubepods"] {
        let mut dirs = vec![cgroup_root.join(pods)];
        while let Some(dir) = dirs.pop() {
            if !dir.is_dir() {
                continue;
            }
            match fs::read_to_string(dir.join("cgroup.procs")) {
                Ok(p) => out.extend(
                    p.lines()
                        .filter_map(|l| l.trim().parse::<u32>().ok())
                        .filter(|p| Some(*p) != spare)
                        .map(|p| (dir.clone(), p)),
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
            }
            for e in fs::read_dir(&dir)?.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_a_template_systemd_pulls_in_per_verb_and_removes_it() {
        let dir = std::env::temp_dir().join(format!("lastgasp-units-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        // Another package's wants beside the agent's: they stay.
        fs::create_dir_all(dir.join("systemd-reboot.service.wants")).unwrap();
        fs::write(dir.join("systemd-reboot.service.wants/other.service"), "").unwrap();
        let run = Path::new("/var/lib/lastgasp/courier/run");
        install(&dir, run, Path::new("/run/lastgasp/courier")).unwrap();
        install(&dir, run, Path::new("/run/lastgasp/courier")).unwrap();
        let t = fs::read_to_string(dir.join(TEMPLATE)).unwrap();
        assert!(t.contains(
            "ExecStart=-/var/lib/lastgasp/courier/run courier --dir /run/lastgasp/courier --verb %i --final-unit"
        ));
        assert!(t.contains("After=shutdown.target umount.target final.target"));
        assert!(t.contains("Before=systemd-%i.service"));
        for (verb, _) in VERBS {
            let link = dir.join(format!(
                "systemd-{verb}.service.wants/lastgasp-last-word@{verb}.service"
            ));
            assert_eq!(
                fs::read_link(&link).unwrap(),
                Path::new("..").join(TEMPLATE)
            );
            assert_eq!(fs::read_to_string(&link).unwrap(), t, "{}", link.display());
        }
        assert_eq!(remove(&dir).unwrap().len(), 5);
        assert!(remove(&dir).unwrap().is_empty());
        let mut left: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, vec!["systemd-reboot.service.wants"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_courier_sends_only_in_systemds_shutdown_with_every_pod_gone() {
        let cg = "0::/system.slice/lastgasp-last-word@poweroff.service\n";
        let jobs = vec![
            "poweroff.target".to_string(),
            "systemd-poweroff.service".into(),
        ];
        assert_eq!(refusal("poweroff", cg, &jobs, None), None);
        let why = |verb, cg, jobs: &[String], pods| refusal(verb, cg, jobs, pods).unwrap();
        assert!(why("poweroff", cg, &jobs, Some("kubepods")).contains("left in kubepods"));
        // `systemctl start lastgasp-last-word@poweroff.service` by hand.
        assert!(why(
            "poweroff",
            cg,
            &["lastgasp-last-word@poweroff.service".into()],
            None
        )
        .contains("not starting systemd-poweroff.service"));
        // A reboot's job does not prove a poweroff's record.
        assert!(
            why("poweroff", cg, &["systemd-reboot.service".into()], None)
                .contains("not a poweroff")
        );
        // Run from elsewhere (a shell, another unit).
        assert!(
            why("poweroff", "0::/user.slice/session-1.scope\n", &jobs, None)
                .contains("not run by systemd")
        );
        assert!(why("soft-reboot", cg, &jobs, None).contains("not a verb"));
    }

    #[test]
    fn reads_systemctls_job_list() {
        let listing = "123 poweroff.target                 start waiting\n\
                       124 systemd-poweroff.service         start waiting\n\
                       130 lastgasp-last-word@poweroff.service start running\n\
                       99 kubepods.slice                    stop  running\n";
        assert_eq!(
            parse_jobs(listing),
            vec![
                "poweroff.target",
                "systemd-poweroff.service",
                "lastgasp-last-word@poweroff.service"
            ]
        );
        assert!(parse_jobs("").is_empty());
    }

    /// Real child processes listed in a pod cgroup's `cgroup.procs` (a
    /// copy of the layout): SIGTERM first, SIGKILL for one that ignores it,
    /// the spared pid untouched.
    #[test]
    fn end_pods_terms_then_kills_all_but_the_agent() {
        use std::os::unix::process::ExitStatusExt;
        let root = std::env::temp_dir().join(format!("lastgasp-end-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let scope = root.join("kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope");
        fs::create_dir_all(&scope).unwrap();
        fs::write(root.join("cgroup.controllers"), "").unwrap();
        let spawn = |script: &str| {
            std::process::Command::new("sh")
                .args(["-c", script])
                .spawn()
                .unwrap()
        };
        let (mut polite, mut stubborn, mut agent) = (
            spawn("exec sleep 60"),
            spawn("trap '' TERM; while :; do sleep 0.1; done"),
            spawn("exec sleep 60"),
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
        let pids = format!("{}\n{}\n{}\n", polite.id(), stubborn.id(), agent.id());
        fs::write(scope.join("cgroup.procs"), pids).unwrap();
        let grace = std::time::Duration::from_secs(1);
        let (termed, killed) = end_pods(&root, Some(agent.id()), grace).unwrap();
        assert_eq!((termed, killed), (2, 2), "the copy still lists them");
        assert_eq!(polite.wait().unwrap().signal(), Some(libc::SIGTERM));
        assert_eq!(stubborn.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(agent.try_wait().unwrap().is_none(), "the agent is spared");
        agent.kill().unwrap();
        agent.wait().unwrap();
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn pods_left_reads_either_drivers_cgroup_but_the_agent() {
        let root = std::env::temp_dir().join(format!("lastgasp-cg-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        assert!(pods_left(&root, None).is_err(), "not a cgroup2 root");
        fs::write(root.join("cgroup.controllers"), "cpu memory\n").unwrap();
        assert_eq!(
            pods_left(&root, None).unwrap(),
            None,
            "no pod cgroup at all"
        );
        let scope = root.join("kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope");
        fs::create_dir_all(&scope).unwrap();
        fs::write(root.join("kubepods.slice/cgroup.procs"), "").unwrap();
        fs::write(scope.join("cgroup.procs"), "").unwrap();
        assert_eq!(pods_left(&root, None).unwrap(), None, "every scope empty");
        fs::write(scope.join("cgroup.procs"), "504\n").unwrap();
        assert_eq!(pods_left(&root, Some(504)).unwrap(), None, "only the agent");
        let left = pods_left(&root, None).unwrap().unwrap();
        assert!(left.ends_with("cri-containerd-a.scope (pid 504)"), "{left}");
        fs::create_dir_all(root.join("kubepods/besteffort")).unwrap();
        fs::write(root.join("kubepods/besteffort/cgroup.procs"), "77\n").unwrap();
        let left = pods_left(&root, Some(504)).unwrap().unwrap();
        assert_eq!(left, "kubepods/besteffort (pid 77)");
        fs::remove_dir_all(&root).unwrap();
    }
}
