//! What the agent leaves on the host, and how it all goes again
//! (`lastgasp clean-host`, and the agent itself when its DaemonSet is
//! deleted): systemd-shutdown's hook and the courier beside it, or (a
//! read-only `/usr`) the final unit and the courier under the audit
//! directory (systemd reloads its units afterwards), logind's drop-in
//! (logind re-reads its configuration afterwards, so its own
//! `InhibitDelayMaxSec` is back), and the run directory (the hook's FIFO,
//! the agent's pid, a courier kit). The audit log (`/var/lib/lastgasp`) is
//! the operator's record and stays; `--audit` removes it too.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{
    act::{courier, final_unit},
    detect::logind::config::dropin_path,
};

/// Where the agent writes on the host, as mounted here.
#[derive(Clone, Debug, clap::Args)]
pub struct HostPaths {
    /// systemd-shutdown's directory (the hook and the courier's directory).
    #[arg(
        long = "shutdown-hook-dir",
        value_name = "DIR",
        env = "LASTGASP_SHUTDOWN_HOOK_DIR"
    )]
    pub hook_dir: Option<PathBuf>,
    /// The hook's and the agent's meeting place.
    #[arg(long, default_value = "/run/lastgasp", env = "LASTGASP_RUN_DIR")]
    pub run_dir: PathBuf,
    /// systemd's runtime unit directory (the final unit and its links).
    #[arg(long, value_name = "DIR", env = "LASTGASP_UNIT_DIR")]
    pub unit_dir: Option<PathBuf>,
    /// `ROOT/etc/systemd/logind.conf.d` holds the agent's drop-in.
    #[arg(long, default_value = "/", env = "LASTGASP_LOGIND_ROOT")]
    pub logind_root: PathBuf,
    /// The audit log's directory, removed only with `--audit`.
    #[arg(long, default_value = "/var/lib/lastgasp", env = "LASTGASP_AUDIT_DIR")]
    pub audit_dir: PathBuf,
    /// Remove the audit log as well.
    #[arg(long, env = "LASTGASP_AUDIT")]
    pub audit: bool,
}

impl HostPaths {
    /// Every path the agent may have written, whether or not it is there.
    pub fn candidates(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        if let Some(h) = &self.hook_dir {
            out.push(h.join(crate::hostio::HOOK_NAME));
            out.push(h.join(crate::hostio::COURIER));
        }
        if let Some(u) = &self.unit_dir {
            out.extend(final_unit::files(u));
        }
        out.push(dropin_path(&self.logind_root));
        out.push(self.run_dir.clone());
        match self.audit {
            true => out.push(self.audit_dir.clone()),
            false => out.push(self.audit_dir.join(courier::BESIDE_AUDIT)),
        }
        out
    }

    /// Those that are there now.
    pub fn present(&self) -> Vec<PathBuf> {
        self.candidates()
            .into_iter()
            .filter(|p| p.symlink_metadata().is_ok())
            .collect()
    }

    /// Removes every one that is there; returns what went. A directory
    /// that is a mount point here (the run directory in the pod) is
    /// emptied. All are tried, whatever fails.
    pub fn remove(&self) -> Removed {
        let mut removed = Removed::default();
        if let Some(u) = &self.unit_dir {
            match final_unit::remove(u) {
                Ok(gone) => {
                    removed.units |= !gone.is_empty();
                    removed.paths.extend(gone);
                }
                Err(e) => removed.errors.push(format!("{e:#}")),
            }
        }
        for p in self.present() {
            match remove_tree(&p) {
                Ok(()) if p.exists() => removed.emptied.push(p),
                Ok(()) => {
                    removed.logind_dropin |= p == dropin_path(&self.logind_root);
                    removed.paths.push(p);
                }
                Err(e) => removed
                    .errors
                    .push(format!("removing {}: {e}", p.display())),
            }
        }
        removed
    }
}

/// `--no-courier`: a courier an earlier start left goes.
pub fn remove_courier(hook_dir: &Path, run_dir: &Path) -> std::io::Result<()> {
    for p in [hook_dir.join(crate::hostio::COURIER), courier::dir(run_dir)] {
        if p.exists() {
            fs::remove_dir_all(&p)?;
        }
    }
    Ok(())
}

fn remove_tree(p: &Path) -> std::io::Result<()> {
    if !p.is_dir() || p.is_symlink() {
        return fs::remove_file(p);
    }
    for e in fs::read_dir(p)? {
        let e = e?.path();
        if e.is_dir() && !e.is_symlink() {
            fs::remove_dir_all(&e)?;
        } else {
            fs::remove_file(&e)?;
        }
    }
    // A mount point: EBUSY, or EROFS where its parent is the pod's
    // read-only root; emptied, it stays.
    match fs::remove_dir(p) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EROFS)) => Ok(()),
        r => r,
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub paths: Vec<PathBuf>,
    /// Directories that are mount points here: emptied, left in place.
    pub emptied: Vec<PathBuf>,
    /// logind must re-read its configuration.
    pub logind_dropin: bool,
    /// systemd must read its units again.
    pub units: bool,
    /// What could not be removed, and why.
    pub errors: Vec<String>,
}

/// logind re-reads its configuration (SIGHUP through systemd, as the
/// agent's raise did).
pub async fn reload_logind(bus: Option<&str>) -> Result<()> {
    use crate::bus::logind::Inhibitor;
    let conn = crate::bus::connect(bus).await.context("the system bus")?;
    let host = crate::bus::logind::Host::new(&conn).await?;
    host.reload_logind_conf()
        .await
        .context("KillUnit systemd-logind.service SIGHUP")
}

/// `lastgasp clean-host`: removes what the agent left, says what went.
pub async fn clean(paths: &HostPaths, bus: Option<&str>) -> Result<String> {
    let removed = paths.remove();
    let mut out = String::new();
    for p in &removed.paths {
        out += &format!("removed {}\n", p.display());
    }
    for p in &removed.emptied {
        out += &format!(
            "emptied {} (a mount point here; on the host a tmpfs)\n",
            p.display()
        );
    }
    if removed.paths.is_empty() && removed.emptied.is_empty() {
        out += "nothing of lastgasp's on this host\n";
    }
    // logind first: systemd's reload can take seconds on a busy node.
    if removed.logind_dropin {
        reload_logind(bus).await?;
        out += "logind re-read its configuration (its own InhibitDelayMaxSec is back)\n";
    }
    if removed.units {
        final_unit::reload(bus).await?;
        out += "systemd read its units again (lastgasp's final unit is gone)\n";
    }
    match removed.errors.is_empty() {
        true => Ok(out),
        false => anyhow::bail!("{out}NOT removed: {}", removed.errors.join("; ")),
    }
}

/// Whether the agent's DaemonSet `ns/name` is gone or being deleted (an
/// uninstall: `helm uninstall`, `kubectl delete -k`). A rolling update, a
/// node's shutdown, an API server that does not answer: no.
pub async fn daemonset_deleted(client: kube::Client, ns: &str, name: &str) -> Result<bool> {
    use k8s_openapi::api::apps::v1::DaemonSet;
    let api: kube::Api<DaemonSet> = kube::Api::namespaced(client, ns);
    match api.get_opt(name).await? {
        None => Ok(true),
        Some(ds) => Ok(ds.metadata.deletion_timestamp.is_some()),
    }
}

/// What the agent's stop did to the host.
#[derive(Debug, PartialEq, Eq)]
pub enum Left {
    /// Its files removed (what went, as `clean` says it).
    Cleaned(String),
    /// The DaemonSet is deleted, but another agent runs here: nothing moved.
    OtherAgent(String),
    /// The DaemonSet is deleted, and not all went (why).
    NotClean(String),
}

/// At the agent's stop: where its DaemonSet is deleted, no shutdown is
/// under way (`episode_open`) and no other agent has started on the node
/// since (the run directory's pid is this process's), the host is left as
/// it was.
pub async fn leave_if_uninstalled(
    client: kube::Client,
    daemonset: (&str, &str),
    paths: &HostPaths,
    episode_open: bool,
    bus: Option<&str>,
) -> Result<Option<Left>> {
    if episode_open || !daemonset_deleted(client, daemonset.0, daemonset.1).await? {
        return Ok(None);
    }
    let pid = fs::read_to_string(paths.run_dir.join(crate::hostio::PID_FILE)).unwrap_or_default();
    if pid
        .trim()
        .parse::<u32>()
        .is_ok_and(|p| p != std::process::id())
    {
        return Ok(Some(Left::OtherAgent(format!(
            "the DaemonSet is deleted, but another agent (pid {}) runs on this node: its files stay",
            pid.trim()
        ))));
    }
    Ok(Some(match clean(paths, bus).await {
        Ok(said) => Left::Cleaned(said),
        Err(e) => Left::NotClean(format!("{e:#}")),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        detect::shutdown_hook::{self, HookPaths},
        node::NodePidNs,
    };

    /// Every file and directory under `root`, as relative paths.
    fn listing(root: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut dirs = vec![root.to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                out.push(p.strip_prefix(root).unwrap().to_path_buf());
                if p.is_dir() && !p.is_symlink() {
                    dirs.push(p);
                }
            }
        }
        out.sort();
        out
    }

    /// The host as the agent leaves it at start and during a shutdown, then
    /// cleaned: exactly what was there before.
    #[tokio::test]
    async fn clean_leaves_the_host_as_it_was() {
        let root = std::env::temp_dir().join(format!("lastgasp-host-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let hook_dir = root.join("usr/lib/systemd/system-shutdown");
        fs::create_dir_all(&hook_dir).unwrap();
        fs::write(hook_dir.join("mdadm.shutdown"), "#!/bin/sh\n").unwrap();
        fs::create_dir_all(root.join("etc/systemd/logind.conf.d")).unwrap();
        fs::create_dir_all(root.join("run/systemd/system")).unwrap();
        fs::create_dir_all(root.join("var/lib/lastgasp")).unwrap();
        let before = listing(&root);
        let paths = HostPaths {
            hook_dir: Some(hook_dir.clone()),
            run_dir: root.join("run/lastgasp"),
            unit_dir: Some(root.join("run/systemd/system")),
            logind_root: root.clone(),
            audit_dir: root.join("var/lib/lastgasp"),
            audit: false,
        };
        assert_eq!(paths.present(), Vec::<PathBuf>::new());
        // What the agent writes: the hook, its FIFO and pid, the courier,
        // a kit, logind's drop-in.
        let hook = HookPaths {
            hook_dir: hook_dir.clone(),
            run_dir: paths.run_dir.clone(),
        };
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        shutdown_hook::start(&hook, &NodePidNs::initial().unwrap(), tx).unwrap();
        courier::install(&hook_dir.join(crate::hostio::COURIER), &paths.run_dir).unwrap();
        // ... and where the hook's directory is read-only, the courier
        // under the audit directory with the final unit.
        let beside_audit = paths.audit_dir.join(courier::BESIDE_AUDIT);
        courier::install(&beside_audit, &paths.run_dir).unwrap();
        let unit_dir = paths.unit_dir.as_ref().unwrap();
        final_unit::install(unit_dir, &courier::entry(&beside_audit), &paths.run_dir).unwrap();
        let kit = courier::Kit {
            server: "https://192.0.2.1:6443".into(),
            root_certs: vec![],
            token: "t".into(),
            node: "n".into(),
            evidence: Default::default(),
        };
        courier::prepare(&paths.run_dir, &kit).unwrap();
        let dropin = dropin_path(&root);
        crate::detect::logind::config::write_dropin(&dropin, std::time::Duration::from_secs(60))
            .unwrap();
        assert_eq!(paths.present().len(), 10, "{:?}", paths.present());
        let removed = paths.remove();
        assert!(removed.logind_dropin && removed.units);
        assert_eq!(removed.paths.len(), 10, "{removed:?}");
        assert_eq!(listing(&root), before);
        // Nothing left: nothing to remove.
        assert_eq!(paths.remove(), Removed::default());
        fs::remove_dir_all(&root).unwrap();
    }
}
