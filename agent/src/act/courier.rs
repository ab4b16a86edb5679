//! The last word without the agent: once the node's PID 1 has become
//! systemd-shutdown, the container runtime's own clean-up can SIGKILL the
//! agent (containerd, told that a shim died during the final sweep, runs
//! `runc delete --force` on its containers; seen on a real node in about one
//! forced power-off in three). Then systemd-shutdown's hook finds no agent
//! to tell, and the proof that the kernel is going down never leaves.
//!
//! So the agent leaves a courier on the host: at start a copy of its own
//! binary with the loader and libraries it runs with, beside the hook (in
//! a subdirectory systemd-shutdown does not run; /run is mounted noexec);
//! as soon as a shutdown episode opens (and again as it changes), a kit in
//! its run directory (a tmpfs, root's, 0700: the API server, its CA, the
//! agent's own token, and per verb the record patch the hook's signal would
//! produce). With the systemd cgroup driver the agent's scope is stopped
//! before systemd-shutdown: the kit must already be there. The hook runs
//! the courier when the agent is gone: one PATCH, as the agent would send
//! it, under the agent's own identity, and only while PID 1 is
//! systemd-shutdown (a kit proves nothing; the final stage does). The
//! episode's end removes the kit. The token is as exposed as the kubelet's
//! copy of it already is.
use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::kube::record_params;
use crate::hostio::{write_atomic as write, FINAL_STAGE_COMM};

/// Under the agent's run directory: the kit.
pub const DIR: &str = "courier";
const KIT: &str = "kit.json";
/// The hook's entry: `run courier --dir DIR`.
const RUN: &str = "run";
/// The courier's whole budget (systemd-shutdown waits for its hooks).
const BUDGET: Duration = Duration::from_secs(4);

/// Everything the courier needs, written when PID 1 execs systemd-shutdown.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Kit {
    pub server: String,
    /// DER certificates the API server's chain must lead to.
    pub root_certs: Vec<Vec<u8>>,
    pub token: String,
    pub node: String,
    /// Per verb systemd-shutdown passes its hooks (`poweroff`, `reboot`,
    /// ...), and per verb for the final unit (`final-unit/poweroff`, ...):
    /// the record patch (merge, field manager `lastgasp-record`).
    pub evidence: BTreeMap<String, Value>,
}

pub fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join(DIR)
}

/// Where the courier goes without a hook directory (a read-only `/usr`),
/// under the run or the audit directory (each the same path on the host
/// and in the pod).
pub const BESIDE_AUDIT: &str = "courier";
pub const IN_RUN: &str = "bin";

/// Without a hook directory, where the host can exec the courier until
/// systemd's final service: the run directory where its file system (an
/// API mount, never unmounted before systemd-shutdown) is not `noexec`,
/// else the audit directory where it is on the root file system (a
/// separate mount is unmounted before the final unit). `mountinfo` is the
/// host's (`/proc/1/mountinfo`).
pub fn home(mountinfo: &str, run_dir: &Path, audit_dir: &Path) -> Result<PathBuf> {
    let (run_mount, run_opts) = mount_of(mountinfo, run_dir);
    if !run_opts.split(',').any(|o| o == "noexec") {
        return Ok(run_dir.join(IN_RUN));
    }
    let (audit_mount, audit_opts) = mount_of(mountinfo, audit_dir);
    if audit_mount == "/" && !audit_opts.split(',').any(|o| o == "noexec") {
        return Ok(audit_dir.join(BESIDE_AUDIT));
    }
    bail!(
        "no place for the courier: {} is noexec ({run_mount}), and {} is on {audit_mount} ({audit_opts}), not the root file system, unmounted before the final unit",
        run_dir.display(),
        audit_dir.display()
    )
}

/// The mount point holding `path` and its per-mount options.
fn mount_of<'a>(mountinfo: &'a str, path: &Path) -> (&'a str, &'a str) {
    mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<_> = l.split_whitespace().collect();
            Some((*f.get(4)?, *f.get(5)?))
        })
        .filter(|(mp, _)| path.starts_with(mp))
        .max_by_key(|(mp, _)| mp.len())
        .unwrap_or(("?", ""))
}

/// The courier's entry in its directory.
pub fn entry(courier_dir: &Path) -> PathBuf {
    courier_dir.join(RUN)
}

/// At start: in `dir` (the hook directory's `lastgasp.courier`, or the
/// audit directory's `courier`), the binary, the loader and the libraries
/// this process runs with (from /proc/self/maps), and the entry script
/// (`run`, paths relative to itself: the host may see the directory
/// elsewhere than the pod). A stale kit (a soft-reboot keeps /run) is
/// removed.
pub fn install(dir: &Path, run_dir: &Path) -> Result<()> {
    let kits = self::dir(run_dir);
    fs::create_dir_all(&kits).with_context(|| format!("creating {}", kits.display()))?;
    fs::set_permissions(&kits, fs::Permissions::from_mode(0o700))?;
    let _ = fs::remove_file(kits.join(KIT));
    let lib = dir.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    copy(Path::new("/proc/self/exe"), &dir.join("lastgasp"), 0o700)?;
    let maps = fs::read_to_string("/proc/self/maps")?;
    let mut loader = None;
    let mut seen = std::collections::BTreeSet::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let p = Path::new(path);
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !name.contains(".so") || !seen.insert(name.to_string()) {
            continue;
        }
        copy(p, &lib.join(name), 0o700)?;
        if name.starts_with("ld-") {
            loader = Some(name.to_string());
        }
    }
    let d = "d=$(dirname \"$0\")";
    let run = match loader {
        Some(ld) => format!(
            "#!/bin/sh\n{d}\nexec \"$d/lib/{ld}\" --library-path \"$d/lib\" \"$d/lastgasp\" \"$@\"\n"
        ),
        // A static binary.
        None => format!("#!/bin/sh\n{d}\nexec \"$d/lastgasp\" \"$@\"\n"),
    };
    write(&dir.join(RUN), run.as_bytes(), 0o700)
}

/// While an episode is open: what the hook's signal would have the agent
/// send.
pub fn prepare(run_dir: &Path, kit: &Kit) -> Result<()> {
    let kits = dir(run_dir);
    fs::create_dir_all(&kits)?;
    fs::set_permissions(&kits, fs::Permissions::from_mode(0o700))?;
    write(&kits.join(KIT), &serde_json::to_vec(kit)?, 0o600)
}

/// The episode ended: its kit goes.
pub fn remove(run_dir: &Path) -> Result<()> {
    match fs::remove_file(dir(run_dir).join(KIT)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

/// The agent's API server, CA and token, as its own client has them.
pub async fn credentials(server: Option<&str>) -> Result<(String, Vec<Vec<u8>>, String)> {
    let config = kube::Config::infer().await?;
    let url = server
        .map(str::to_string)
        .unwrap_or(config.cluster_url.to_string());
    let certs = match (&config.root_cert, &config.root_cert_file) {
        (Some(c), _) => c.clone(),
        (None, Some(f)) => pem_certs(&fs::read(f)?)?,
        (None, None) => Vec::new(),
    };
    use secrecy::ExposeSecret;
    let token = match (&config.auth_info.token, &config.auth_info.token_file) {
        (Some(t), _) => t.expose_secret().to_string(),
        (None, Some(f)) => fs::read_to_string(f)?.trim().to_string(),
        (None, None) => bail!("the agent's credentials are not a bearer token: no courier"),
    };
    Ok((url, certs, token))
}

fn pem_certs(pem: &[u8]) -> Result<Vec<Vec<u8>>> {
    use rustls_pki_types::{pem::PemObject, CertificateDer};
    CertificateDer::pem_slice_iter(pem)
        .map(|c| Ok(c?.to_vec()))
        .collect()
}

/// `lastgasp courier --dir DIR --verb VERB`, run by the hook: the kit's
/// patch for `verb`, once, within the budget, and only from the final stage
/// (`pid1_comm`: the node's PID 1's name). Prints what came of it (the hook
/// logs it).
pub async fn deliver(dir: &Path, verb: &str, pid1_comm: &str) -> Result<String> {
    if pid1_comm != FINAL_STAGE_COMM {
        bail!("PID 1 is {pid1_comm:?}, not systemd-shutdown: not the final stage, nothing sent");
    }
    send(&read_kit(dir)?, verb).await
}

/// `lastgasp courier --dir DIR --verb VERB --final-unit`, run by the final
/// unit (`final_unit`): the kit's final-unit record for `verb`, only when
/// systemd runs this process as that unit in its shutdown job and no pod's
/// cgroup holds a process (`cgroup_root`).
pub async fn deliver_final_unit(dir: &Path, verb: &str, cgroup_root: &Path) -> Result<String> {
    use super::final_unit;
    let own = fs::read_to_string("/proc/self/cgroup")?;
    let jobs = final_unit::start_jobs()?;
    // The agent's own pid, beside the kit (`shutdown_hook`'s pid file).
    let agent = dir
        .parent()
        .and_then(|run| fs::read_to_string(run.join(crate::hostio::PID_FILE)).ok())
        .and_then(|p| p.trim().parse().ok());
    // Only in systemd's shutdown for the verb, with a record to send, is
    // anything ended.
    if let Some(why) = final_unit::refusal(verb, &own, &jobs, None) {
        bail!("{why}: nothing sent");
    }
    let kit = read_kit(dir)?;
    let (termed, killed) = final_unit::end_pods(cgroup_root, agent, final_unit::TERM_GRACE)?;
    let pods = final_unit::pods_left(cgroup_root, agent)?;
    if let Some(why) = final_unit::refusal(verb, &own, &jobs, pods.as_deref()) {
        bail!("{why}: nothing sent");
    }
    let sent = send(&kit, &final_unit::key(verb)).await?;
    Ok(match termed {
        0 => sent,
        n => {
            format!("{sent} (pods' processes left: {n} ended with SIGTERM, {killed} with SIGKILL)")
        }
    })
}

fn read_kit(dir: &Path) -> Result<Kit> {
    Ok(serde_json::from_slice(
        &fs::read(dir.join(KIT)).with_context(|| format!("no kit in {}", dir.display()))?,
    )?)
}

/// The kit's patch under `key` (a verb, or the final unit's key), once,
/// within the budget.
pub async fn send(kit: &Kit, key: &str) -> Result<String> {
    let evidence = kit
        .evidence
        .get(key)
        .with_context(|| format!("the kit has no record for {key:?}"))?;
    let mut config = kube::Config::new(kit.server.parse().context("the kit's server")?);
    config.root_cert = Some(kit.root_certs.clone());
    config.auth_info.token = Some(kit.token.clone().into());
    crate::apiserver::tune(&mut config, crate::apiserver::Use::Requests);
    let client = kube::Client::try_from(config)?;
    let nodes: Api<Node> = Api::all(client);
    let t = std::time::Instant::now();
    tokio::time::timeout(
        BUDGET,
        nodes.patch(&kit.node, &record_params(), &Patch::Merge(evidence)),
    )
    .await
    .context("the API server did not answer in time")??;
    Ok(format!(
        "the courier delivered the {key} record of {} in {} ms",
        kit.node,
        t.elapsed().as_millis()
    ))
}

/// The kit left in `run_dir`, if any.
pub fn kit(run_dir: &Path) -> Result<Option<Kit>> {
    match fs::read(dir(run_dir).join(KIT)) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b)?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Written only when it differs (the node's root file system, at every start).
fn copy(from: &Path, to: &Path, mode: u32) -> Result<()> {
    let data = fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    if fs::read(to).is_ok_and(|have| have == data) {
        return Ok(());
    }
    write(to, &data, mode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostio::COURIER;

    #[test]
    fn pem_decodes_to_der() {
        // "hello" and "hi!" as two certificate blocks.
        let pem = b"-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n\
                    -----BEGIN CERTIFICATE-----\naGkh\n-----END CERTIFICATE-----\n";
        assert_eq!(
            pem_certs(pem).unwrap(),
            vec![b"hello".to_vec(), b"hi!".to_vec()]
        );
    }

    #[test]
    fn the_courier_goes_where_the_host_can_exec_it_to_the_end() {
        let (run, audit) = (Path::new("/run/lastgasp"), Path::new("/var/lib/lastgasp"));
        let line =
            |mp: &str, opts: &str| format!("36 1 8:1 / {mp} {opts} shared:1 - ext4 /dev/x rw\n");
        let root = line("/", "rw,relatime");
        let run_exec = line("/run", "rw,nosuid,nodev,relatime");
        let run_noexec = line("/run", "rw,nosuid,nodev,noexec,relatime");
        let var = line("/var/lib/lastgasp", "rw,relatime");
        let other = line("/run/lastgasp-other", "rw,noexec");
        assert_eq!(
            home(&format!("{root}{run_exec}{other}"), run, audit).unwrap(),
            run.join(IN_RUN)
        );
        assert_eq!(
            home(&format!("{root}{run_noexec}"), run, audit).unwrap(),
            audit.join(BESIDE_AUDIT)
        );
        let e = home(&format!("{root}{run_noexec}{var}"), run, audit).unwrap_err();
        assert!(
            format!("{e}").contains("unmounted before the final unit"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn the_courier_sends_nothing_outside_the_final_stage() {
        let tmp = std::env::temp_dir().join(format!("lastgasp-kit-{}", std::process::id()));
        let kit = Kit {
            server: "http://127.0.0.1:9".into(),
            root_certs: vec![],
            token: "t".into(),
            node: "n".into(),
            evidence: [("poweroff".to_string(), serde_json::json!({}))].into(),
        };
        prepare(&tmp, &kit).unwrap();
        assert_eq!(super::kit(&tmp).unwrap(), Some(kit));
        let e = deliver(&dir(&tmp), "poweroff", "systemd")
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("not the final stage"), "{e:#}");
        // The final stage, but no record for the verb: nothing sent either.
        let e = deliver(&dir(&tmp), "kexec", FINAL_STAGE_COMM)
            .await
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("no record for \"kexec\""),
            "{e:#}"
        );
        remove(&tmp).unwrap();
        assert_eq!(super::kit(&tmp).unwrap(), None);
        remove(&tmp).unwrap();
        fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn installed_courier_runs_the_binary_it_copied() {
        let tmp = std::env::temp_dir().join(format!("lastgasp-courier-{}", std::process::id()));
        let (hook_dir, run_dir) = (tmp.join("hooks"), tmp.join("run"));
        let d = hook_dir.join(COURIER);
        install(&d, &run_dir).unwrap();
        // The test binary itself, through the loader and libraries it uses.
        let out = std::process::Command::new(d.join(RUN))
            .args(["--list"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout)
            .contains("installed_courier_runs_the_binary_it_copied"));
        for d in [d, dir(&run_dir)] {
            let mode = fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        fs::remove_dir_all(&tmp).unwrap();
    }
}
