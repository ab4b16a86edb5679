//! `cargo xtask vm-test`: real shutdowns of a real systemd guest under QEMU.
//! Every shutdown happens inside the guest; nothing here ever
//! shuts down the host.
//!
//! - `image`: the cached Debian guest (debootstrap), rebuilt only when its
//!   inputs under `tests/vm/image/` change.
//! - `qemu`: one boot of the guest: a qcow2 overlay over the image, a fresh
//!   audit disk, the 9p share that carries the agent, its unit and the
//!   scenario in, and the console, the agent's stdout and QMP events out.
//! - `scenario`: the scenarios, what each must show, and the check.
//! - `report`: the audit read back from the guest's disk, the matrix.
//! - `cluster`: the API double and the guest's route to it (off until they
//!   exist).
mod cluster;
mod evidence;
mod image;
mod node;
mod qemu;
mod report;
mod scenario;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use crate::setup;

#[derive(clap::Args, Debug, Default)]
pub struct Args {
    /// Scenarios to run (default: every one, then the race; `race` alone: only the race); see --list.
    pub scenarios: Vec<String>,
    /// Consecutive `systemctl poweroff --force --force` runs for the
    /// last-gasp race (default: 20 when no scenario is named, else none).
    #[arg(long)]
    pub race: Option<u32>,
    /// List the scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Run the agent in cluster mode against the Kubernetes API double
    /// (`lastgasp-apidouble`, a fresh one per boot on the host's loopback,
    /// reached by the guest through qemu's user networking) and fill the
    /// matrix's "cluster got" column.
    #[arg(long)]
    pub cluster: bool,
    /// Keep every run's disks (overlay and audit image) under target/vm/.
    #[arg(long)]
    pub keep_disks: bool,
    /// Use the debug build of the agent, as `cargo xtask test` (CI) does.
    #[arg(long)]
    pub debug: bool,
    /// A real Kubernetes node in the guest (containerd, the kubelet v1.32.13;
    /// the agent as its DaemonSet's pod) on the real control plane: the
    /// real-node scenarios (or those named), in each arm of --arm.
    #[arg(long)]
    pub node: bool,
    /// With --node: lastgasp (the kubelet's graceful shutdown off), kubelet
    /// (its graceful shutdown on, no agent), both; default all three.
    #[arg(long, value_delimiter = ',')]
    pub arm: Vec<String>,
    /// With --node: do not switch a powered-off node on again.
    #[arg(long)]
    pub one_boot: bool,
    /// With --node: the kubelet's and containerd's cgroup driver. With
    /// `systemd` (kubeadm's default) every container is a systemd scope that
    /// the shutdown stops; with `cgroupfs` containers live until
    /// systemd-shutdown's final kill.
    #[arg(long, value_enum, default_value_t = node::CgroupDriver::Systemd)]
    pub cgroup_driver: node::CgroupDriver,
    /// The guest's Debian release (its kernel and systemd); each is built
    /// once and cached.
    #[arg(long, value_enum, default_value_t = image::Distro::Bookworm)]
    pub distro: image::Distro,
    /// The guest's CPU: arm64 is a `qemu-system-aarch64` guest under TCG
    /// (the agent cross-built), its image built once with debootstrap under
    /// qemu-user. Not with --node.
    #[arg(long, value_enum, default_value_t)]
    pub arch: crate::arch::Arch,
    /// With --node: AppArmor on in the guest (every other run boots with
    /// apparmor=0), the agent's container under containerd's default
    /// profile or, as docs/security.md advises, unconfined.
    #[arg(long, value_enum)]
    pub apparmor: Option<node::AppArmor>,
    /// With --node: `/usr` read-only in the guest (bound over itself and
    /// remounted read-only before containerd starts), as on Flatcar,
    /// Bottlerocket or COS: systemd-shutdown's hook cannot be installed.
    #[arg(long)]
    pub ro_usr: bool,
    /// With --node: how the guest's network is configured.
    #[arg(long, value_enum, default_value_t)]
    pub network: node::Network,
}

/// The scenarios `cargo xtask test` runs (CI), in cluster mode: the
/// PID-namespace reboot (no cluster contact), a logind power-off with the
/// graceful drain by priority, and three requests that must not move the
/// cluster: an unprivileged `systemctl poweroff` (refused), an unprivileged
/// `reboot -ff` (EPERM) and a root power-off held by a block inhibitor.
/// `poweroff` (graceful-pods checks its chain and more) and `poweroff-force`
/// (the real node's CI cells run it on the real API server) are left out:
/// CI's 90 minutes.
/// `poweroff-force-force` is left to the race (`vm-test race`): there the
/// guest dies within a second of the trigger, and it sometimes dies before
/// the patches arrive, which would make CI flaky (tests/testing-log.md).
pub const CI_SUBSET: &[&str] = &[
    "pidns-reboot",
    "graceful-pods",
    "user-poweroff",
    "user-reboot-ff",
    "blocked-poweroff",
];

/// `cargo xtask vm-test`.
pub fn vm_test(
    root: &Path,
    args: Args,
    build_agent: impl FnOnce(bool) -> Result<PathBuf>,
) -> Result<()> {
    if args.list {
        scenario::print_list();
        println!("\nwith --node (arms {}):", node::ARMS.join(", "));
        for (n, t) in node::SCENARIOS {
            println!("  {n:<16} {t}");
        }
        return Ok(());
    }
    if args.apparmor.is_some() && !args.node {
        bail!("--apparmor is for the real node (--node)");
    }
    if (args.ro_usr || args.network != node::Network::Static) && !args.node {
        bail!("--ro-usr and --network are for the real node (--node)");
    }
    if args.node {
        if args.arch != crate::arch::Arch::Amd64 {
            bail!(
                "--node runs an amd64 guest only (the real node's Kubernetes binaries are amd64)"
            );
        }
        if let Err(e) = preflight() {
            bail!("the VM tests cannot run here: {e:#}");
        }
        let agent = build_agent(!args.debug)?;
        return node_test(root, &args, &agent);
    }
    // `race` names the last-gasp race itself: `vm-test race` runs only it.
    let named: Vec<String> = args
        .scenarios
        .iter()
        .filter(|s| *s != "race")
        .cloned()
        .collect();
    let race_named = named.len() != args.scenarios.len();
    let selected = if race_named && named.is_empty() {
        Vec::new()
    } else {
        scenario::select(&named)?
    };
    let race = args
        .race
        .unwrap_or(if args.scenarios.is_empty() || race_named {
            20
        } else {
            0
        });
    if let Err(e) = preflight() {
        bail!("the VM tests cannot run here: {e:#}");
    }
    if args.arch == crate::arch::Arch::Arm64 {
        if args.distro.needs_host_libc() {
            bail!("an arm64 guest runs bookworm or trixie (bullseye's glibc is older than the cross-built agent's)");
        }
        setup::ensure_debs(&[("qemu-system-aarch64", "qemu-system-arm")])?;
    }
    // The binary is taken from the target dir (CARGO_TARGET_DIR honoured).
    match args.arch {
        crate::arch::Arch::Amd64 => build_agent(!args.debug)?,
        a => crate::build::build_for(root, !args.debug, a)?,
    };
    let profile = if args.debug { "debug" } else { "release" };
    run_all(root, &selected, race, &args, profile)
}

/// The end of `cargo xtask test`: the CI subset in cluster mode, or SKIPPED
/// with the reason where QEMU cannot run at all (or the guest image cannot
/// be built here). `LASTGASP_VM=skip` opts out. A failing scenario fails.
pub fn ci(root: &Path, build_agent: impl FnOnce() -> Result<PathBuf>) -> Result<()> {
    if let Some(v) = std::env::var_os("LASTGASP_VM").filter(|v| v == "skip") {
        println!("SKIPPED VM scenarios: LASTGASP_VM={}", v.to_string_lossy());
        return Ok(());
    }
    if let Err(e) = preflight() {
        println!("SKIPPED VM scenarios: {e:#}");
        return Ok(());
    }
    // The image first: where debootstrap cannot build it (no mirror), skip.
    if let Err(e) = image::ensure(root, image::Distro::Bookworm, crate::arch::Arch::Amd64) {
        println!("SKIPPED VM scenarios: the guest image cannot be built here: {e:#}");
        return Ok(());
    }
    let selected = scenario::select(
        &CI_SUBSET
            .iter()
            .map(std::string::ToString::to_string)
            .collect::<Vec<_>>(),
    )?;
    let agent = build_agent()?;
    if let Err(e) = enough_disk(&crate::target_dir(root).join("vm")) {
        println!("SKIPPED VM scenarios: {e:#}");
        return Ok(());
    }
    let args = Args {
        cluster: true,
        ..Args::default()
    };
    println!("vm-test: the CI subset: {}", CI_SUBSET.join(", "));
    let started = Instant::now();
    let subset = run_all(root, &selected, 0, &args, "debug");
    println!(
        "vm-test: the CI subset took {:.1} min",
        started.elapsed().as_secs_f64() / 60.0
    );
    // Then the real node: the agent as its DaemonSet's pod (the image
    // `cargo xtask test` built just before), the kubelet's graceful
    // shutdown off, `systemctl poweroff --force`, one boot. Run even when
    // the subset failed, so that one run says all that is wrong.
    let node = if crate::k8s::tools_dir(root)
        .join("kube-apiserver.xz")
        .is_file()
    {
        let (arm, sc) = (node::CI_ARM, node::CI.join(", "));
        let args = Args {
            node: true,
            arm: vec![arm.into()],
            scenarios: node::CI
                .iter()
                .map(std::string::ToString::to_string)
                .collect(),
            one_boot: true,
            debug: true,
            ..Args::default()
        };
        println!("vm-test: the CI's real-node scenarios: arm {arm}, {sc}");
        let writable = node_test(root, &args, &agent);
        // And where /usr is read-only: lastgasp's final unit, not the hook.
        let args = Args {
            ro_usr: true,
            scenarios: node::CI_RO_USR
                .iter()
                .map(std::string::ToString::to_string)
                .collect(),
            ..args
        };
        println!(
            "vm-test: the CI's real-node scenarios with /usr read-only: arm {arm}, {}",
            node::CI_RO_USR.join(", ")
        );
        writable.and(node_test(root, &args, &agent))
    } else {
        println!(
            "SKIPPED the real-node scenario: no Kubernetes {} binaries in {}",
            crate::k8s::VERSION,
            crate::k8s::tools_dir(root).display()
        );
        Ok(())
    };
    subset.and(node)
}

/// The real-node arms and scenarios asked for (all when none is named).
fn node_selection(args: &Args) -> Result<(Vec<&'static str>, Vec<&'static str>)> {
    let arms: Vec<&'static str> = if args.arm.is_empty() {
        node::ARMS.to_vec()
    } else {
        args.arm
            .iter()
            .map(|a| {
                node::ARMS
                    .iter()
                    .find(|x| **x == a.as_str())
                    .copied()
                    .with_context(|| format!("unknown arm {a} ({})", node::ARMS.join(", ")))
            })
            .collect::<Result<_>>()?
    };
    let scenarios: Vec<&'static str> = if args.scenarios.is_empty() {
        node::SCENARIOS.iter().map(|(n, _)| *n).collect()
    } else {
        args.scenarios
            .iter()
            .map(|s| {
                node::SCENARIOS
                    .iter()
                    .find(|(n, _)| *n == s.as_str())
                    .map(|(n, _)| *n)
                    .with_context(|| format!("unknown real-node scenario {s} (see --list)"))
            })
            .collect::<Result<_>>()?
    };
    Ok((arms, scenarios))
}

/// The guest's side of the real node: the agent's image, the control-plane
/// helper, the sleeper image and the node's files ready (`node::prepare`).
fn node_prepared(
    root: &Path,
    args: &Args,
    target: &Path,
    k8s: &crate::k8s::ControlPlaneBinaries,
    agent: &Path,
) -> Result<node::Prepared> {
    let tools = setup::ensure_manifest_tools()?;
    // The agent's image: `cargo xtask image`'s archive (CI built it just
    // before), else built now from the agent of this run.
    let agent_image = crate::image::archive(root, target, crate::arch::Arch::Amd64)?;
    if !args.debug || !agent_image.0.is_file() {
        crate::image::build(
            root,
            target,
            crate::image::From::Host(agent),
            crate::arch::Arch::Amd64,
            &crate::image::env_version(root)?,
            crate::image::Base::Local,
        )?;
    }
    let sleeper = crate::image::sleeper(root, target)?;
    crate::cmd::run(
        crate::cmd::cargo()
            .current_dir(root)
            .args([
                "build",
                "-q",
                "-p",
                "lastgasp-tests",
                "--bin",
                "lastgasp-vm-cluster",
            ])
            .env("LASTGASP_EBPF_OBJ", crate::build::ebpf_object(root)),
    )?;
    let helper = target.join("debug/lastgasp-vm-cluster");
    node::prepare(
        root,
        helper,
        vec![
            ("LASTGASP_K8S_BIN".into(), k8s.bin_dir.clone()),
            ("LASTGASP_ETCD".into(), k8s.etcd.clone()),
            ("LASTGASP_KUSTOMIZE".into(), tools.kustomize.clone()),
        ],
        agent_image,
        sleeper,
        &k8s.bin_dir.join("kubelet"),
        (args.apparmor, args.ro_usr, args.network),
    )
}

/// `vm-test --node`: every named (arm, scenario) on a fresh control plane
/// and guest, then the comparison table.
fn node_test(root: &Path, args: &Args, agent: &Path) -> Result<()> {
    let started = Instant::now();
    let (arms, scenarios) = node_selection(args)?;
    let accel = qemu::Accel::choose();
    let img = image::ensure(root, args.distro, crate::arch::Arch::Amd64)?;
    let target = crate::target_dir(root);
    let Some(k8s) = crate::k8s::ensure(root)? else {
        bail!(
            "the real node needs the Kubernetes {} binaries (see above)",
            crate::k8s::VERSION
        );
    };
    let mut prep = node_prepared(root, args, &target, &k8s, agent)?;
    let out = target.join("vm");
    let run_dir = new_run(&out, "node-")?;
    println!(
        "vm-test: real node: accelerator {accel}, guest image {}, {} MiB, results under {}",
        img.dir.display(),
        node::MEM_MIB,
        run_dir.display()
    );
    let guest = qemu::Guest {
        image: &img,
        accel: &accel,
        agent,
        vm_dir: root.join("tests/vm"),
        keep_disks: args.keep_disks,
        image_archive: None,
    };
    // Said, not hidden: without the disk each cell imports the images (1-2 min more each).
    if let Err(e) = node::preload(&guest, &mut prep, &out) {
        println!("vm-test: {e:#}; every cell imports the node's images itself");
    }
    let mut outcomes = Vec::new();
    let total = arms.len() * scenarios.len();
    for (i, (arm, sc)) in arms
        .iter()
        .flat_map(|a| scenarios.iter().map(move |s| (*a, *s)))
        .enumerate()
    {
        println!("vm-test: [{}/{total}] real node, arm {arm}: {sc}", i + 1);
        // CI's scenario must win: the record before the node dies, the fence after.
        // Those that stay up are judged by their own checks.
        let strict = arm == node::CI_ARM
            && (node::CI.contains(&sc) || node::CI_RO_USR.contains(&sc))
            && !node::STAYS_UP.contains(&sc)
            && sc != node::POWER_LOSS;
        let run = |dir: &Path| {
            node::run(
                &guest,
                &prep,
                (arm, sc, args.cgroup_driver),
                dir,
                !args.one_boot,
                strict,
            )
        };
        outcomes.push(run_twice_if_stalled(
            &run_dir.join(format!("{arm}-{sc}")),
            run,
        ));
    }
    let md = format!(
        "{}\nGuest: {} MiB, {accel}; {:.1} min in all.\n",
        node::matrix(&outcomes),
        node::MEM_MIB,
        started.elapsed().as_secs_f64() / 60.0
    );
    println!("\n{md}");
    node::write_matrix(&run_dir.join("node-matrix.md"), &md)?;
    node::write_matrix(&out.join("node-matrix.md"), &md)?;
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| o.failed())
        .map(|o| format!("{}/{}", o.arm, o.scenario))
        .collect();
    ensure!(
        failed.is_empty(),
        "real-node scenarios failed: {} (logs under {})",
        failed.join(", "),
        run_dir.display()
    );
    Ok(())
}

/// What must be true before a guest can boot: root (debootstrap, 9p
/// passthrough), and qemu, qemu-img and debootstrap, installed if missing.
fn preflight() -> Result<()> {
    if !is_root() {
        bail!("they need root (debootstrap builds the guest, qemu shares files with it as root)");
    }
    setup::ensure_debs(&[
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("qemu-img", "qemu-utils"),
        ("debootstrap", "debootstrap"),
        ("debugfs", "e2fsprogs"),
    ])
    .context("installing qemu and debootstrap")?;
    qemu::probe().context("qemu-system-x86_64 does not start")?;
    Ok(())
}

/// What a run writes under `target/vm`: a guest's overlay grows to ~40 MiB,
/// its audit disk is 32 MiB, logs and the audit read back are small; the
/// margin is for the host's own writes while the guests run.
const MIN_FREE: u64 = 1 << 30;

/// Runs kept under target/vm for each kind (`run-`, `node-`), the new one
/// among them: each is 0.3 to 0.4 GB (disks, logs, the guest's inputs).
const RUNS_KEPT: usize = 3;

/// A new run's directory under `out`, once the oldest runs of its kind are
/// gone (so that it makes `RUNS_KEPT`) and the disk has room.
fn new_run(out: &Path, prefix: &str) -> Result<PathBuf> {
    prune_runs(out, prefix)?;
    enough_disk(out)?;
    let dir = out.join(format!("{prefix}{}", date_stamp()));
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn prune_runs(out: &Path, prefix: &str) -> Result<()> {
    let Ok(entries) = fs::read_dir(out) else {
        return Ok(());
    };
    let mut runs: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix) && e.path().is_dir())
        .map(|e| e.path())
        .collect();
    runs.sort_by_key(|d| fs::metadata(d).and_then(|m| m.modified()).ok());
    let old = runs.len().saturating_sub(RUNS_KEPT - 1);
    for dir in &runs[..old] {
        fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        println!("vm-test: removed an older run, {}", dir.display());
    }
    Ok(())
}

/// `dir` (created if missing) has room for a run.
fn enough_disk(dir: &Path) -> Result<()> {
    require_free(
        dir,
        MIN_FREE,
        "the VM scenarios (qemu would pause a guest whose disk write fails)",
    )
    .map(drop)
}

/// The bytes free under `dir` (created if missing), once they are at least
/// `need`; `what` says who needs them, for the error.
pub fn require_free(dir: &Path, need: u64, what: &str) -> Result<u64> {
    fs::create_dir_all(dir)?;
    let free = free_space(dir).with_context(|| format!("statvfs of {}", dir.display()))?;
    ensure!(
        free >= need,
        "only {} free under {}; {} needed for {what}",
        mib(free),
        dir.display(),
        mib(need)
    );
    Ok(free)
}

/// The child's exit status, or `None` once `timeout` has passed.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(Some(st));
        }
        if t.elapsed() > timeout {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Bytes available (as `df` shows them) on the filesystem holding `path`.
pub fn free_space(path: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

pub fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn run_all(
    root: &Path,
    selected: &[&'static scenario::Scenario],
    race: u32,
    args: &Args,
    profile: &str,
) -> Result<()> {
    let started = Instant::now();
    let accel = qemu::Accel::choose_for(args.arch);
    println!("vm-test: accelerator: {accel}");
    let img = image::ensure(root, args.distro, args.arch)?;
    println!(
        "vm-test: guest image {} (kernel {}, booting {})",
        img.dir.display(),
        img.kernel_release,
        match (img.pvh, img.arch) {
            (true, _) => "vmlinux via PVH",
            (false, crate::arch::Arch::Amd64) => "the bzImage",
            (false, _) => "its kernel image",
        }
    );
    let agent = agent_binary(root, profile, args.arch)?;
    println!("vm-test: agent {}", agent.display());
    let out = crate::target_dir(root).join("vm");
    let run_dir = new_run(&out, "run-")?;
    println!("vm-test: results under {}", run_dir.display());

    let mut cluster = if args.cluster {
        Some(cluster::Cluster::start(root, profile).context("--cluster")?)
    } else {
        None
    };
    let (archive, _) = crate::image::archive(root, &crate::target_dir(root), args.arch)?;
    let guest = qemu::Guest {
        image: &img,
        accel: &accel,
        agent: &agent,
        vm_dir: root.join("tests/vm"),
        keep_disks: args.keep_disks,
        image_archive: archive.is_file().then_some(archive),
    };

    let mut outcomes = Vec::new();
    for (i, sc) in selected.iter().enumerate() {
        println!(
            "vm-test: [{}/{}] {} ({})",
            i + 1,
            selected.len(),
            sc.name,
            sc.trigger
        );
        let o = scenario::run(&guest, sc, &run_dir.join(sc.name), cluster.as_mut());
        println!("vm-test:   {}", o.one_line());
        outcomes.push(o);
    }
    let races = if race > 0 {
        scenario::race(&guest, race, &run_dir.join("race"), cluster.as_mut())
    } else {
        Vec::new()
    };

    let md = report::matrix(
        &accel,
        &img,
        profile,
        &outcomes,
        &races,
        started.elapsed(),
        args.cluster,
    );
    println!("\n{md}");
    for f in [run_dir.join("matrix.md"), out.join("matrix.md")] {
        fs::write(&f, &md).with_context(|| format!("writing {}", f.display()))?;
    }
    println!(
        "vm-test: matrix written to {}",
        out.join("matrix.md").display()
    );

    verdict(&outcomes, &races, &run_dir)
}

/// The tally of a VM run, and an error naming what failed.
fn verdict(outcomes: &[scenario::Outcome], races: &[scenario::Race], run_dir: &Path) -> Result<()> {
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| o.failed())
        .map(|o| o.name.to_string())
        .chain(
            races
                .iter()
                .filter(|r| r.failed())
                .map(|r| format!("race {}", r.sc.name)),
        )
        .collect();
    let (pass, skip) = (
        outcomes.iter().filter(|o| o.passed()).count(),
        outcomes.iter().filter(|o| o.skipped()).count(),
    );
    println!(
        "vm-test: {} passed, {} failed, {} skipped",
        pass + races.iter().filter(|r| !r.failed()).count(),
        failed.len(),
        skip
    );
    if !failed.is_empty() {
        bail!(
            "VM scenarios failed: {} (logs under {})",
            failed.join(", "),
            run_dir.display()
        );
    }
    Ok(())
}

/// The agent the xtask just built (`CARGO_TARGET_DIR` honoured).
fn agent_binary(root: &Path, profile: &str, arch: crate::arch::Arch) -> Result<PathBuf> {
    let bin = arch.agent_binary(&crate::target_dir(root), profile == "release");
    if !bin.is_file() {
        bail!(
            "no agent binary at {}: run `cargo xtask build`",
            bin.display()
        );
    }
    Ok(bin)
}

fn date_stamp() -> String {
    Command::new("date")
        .args(["-u", "+%Y%m%dT%H%M%SZ"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("{}", std::process::id()))
}

/// `~/.cache/lastgasp/vm` (XDG_CACHE_HOME honoured), like the toolchain cache.
fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
        })
        .join("lastgasp/vm")
}

/// A real-node run; a guest that stalled under TCG before the trigger
/// tested nothing: once more, and the row says so (as for the VM
/// scenarios). A failure prints the end of its console.
fn run_twice_if_stalled(dir: &Path, run: impl Fn(&Path) -> node::NodeOutcome) -> node::NodeOutcome {
    let mut dir = dir.to_path_buf();
    let mut o = run(&dir);
    if o.trigger_never_ran() {
        println!("vm-test:   {}; once more", o.one_line());
        console_tail(&dir);
        dir.set_file_name(format!(
            "{}-again",
            dir.file_name().unwrap_or_default().to_string_lossy()
        ));
        o = run(&dir);
        o.ran_as
            .push_str(" (run twice: the first guest stalled before the trigger)");
    }
    println!("vm-test:   {}", o.one_line());
    if o.failed() {
        console_tail(&dir);
    }
    o
}

/// The end of a failed real-node run's console, on stdout: CI keeps only
/// what was printed.
fn console_tail(dir: &Path) {
    let path = dir.join("boot1/console.log");
    let text = String::from_utf8_lossy(&fs::read(&path).unwrap_or_default()).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    println!("vm-test:   the last lines of {}:", path.display());
    for l in &lines[lines.len().saturating_sub(30)..] {
        println!("vm-test:   | {l}");
    }
}
