//! One boot of the guest: from a fresh overlay and a fresh audit disk to the
//! end of the qemu process, with everything the host saw on the way, each
//! thing timestamped on arrival (host clock, from qemu's start).
//!
//! Channels out of the guest:
//! - ttyS0, the console (qemu's stdout): the kernel's messages, including its
//!   own last words ("reboot: Power down"), and the agent's logs and the
//!   runner's markers, both written to /dev/kmsg;
//! - ttyS1 (a unix socket): the agent's stdout, one JSON signal per line;
//! - QMP (a unix socket): SHUTDOWN/RESET events, with the reason qemu saw;
//! - the 9p share's `out/` and the audit disk, read after the guest is gone.
use std::{
    fmt, fs,
    io::{BufRead, BufReader, Read, Write},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{bail, Context, Result};

use super::{image::GuestImage, wait_timeout};
use crate::arch::Arch;

pub enum Accel {
    Tcg(String),
    Kvm,
}

impl Accel {
    /// TCG where /dev/kvm cannot run a stock kernel: PVM (`kvm_pvm`) runs only
    /// PVM-enlightened guests, so a Debian kernel crawls under it.
    /// `LASTGASP_VM_ACCEL=tcg|kvm` overrides.
    pub fn choose() -> Accel {
        match std::env::var("LASTGASP_VM_ACCEL").as_deref() {
            Ok("tcg") => return Accel::Tcg("LASTGASP_VM_ACCEL=tcg".into()),
            Ok("kvm") => return Accel::Kvm,
            _ => {}
        }
        if Path::new("/sys/module/kvm_pvm").exists() {
            return Accel::Tcg(
                "/dev/kvm is PVM (kvm_pvm), which runs stock kernels far too slowly".into(),
            );
        }
        let vmx = fs::read_to_string("/proc/cpuinfo")
            .map(|c| {
                c.lines()
                    .filter(|l| l.starts_with("flags"))
                    .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
            })
            .unwrap_or(false);
        let kvm = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        match (kvm, vmx) {
            (true, true) => Accel::Kvm,
            (false, _) => Accel::Tcg("no usable /dev/kvm".into()),
            (true, false) => Accel::Tcg("/dev/kvm without vmx/svm in the CPU flags".into()),
        }
    }

    /// A guest of another arch runs under TCG, whatever /dev/kvm is.
    pub fn choose_for(arch: Arch) -> Accel {
        match arch {
            Arch::Amd64 => Accel::choose(),
            a => Accel::Tcg(format!("an {} guest on this x86_64 host", a.name())),
        }
    }

    pub fn is_tcg(&self) -> bool {
        matches!(self, Accel::Tcg(_))
    }
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Accel::Tcg(why) => write!(f, "TCG (software emulation: {why})"),
            Accel::Kvm => write!(f, "KVM"),
        }
    }
}

/// The qemu that runs a guest of `arch`.
pub fn qemu_system(arch: Arch) -> &'static str {
    match arch {
        Arch::Amd64 => "qemu-system-x86_64",
        Arch::Arm64 => "qemu-system-aarch64",
    }
}

/// qemu starts and knows TCG.
pub fn probe() -> Result<()> {
    let out = Command::new("qemu-system-x86_64")
        .args(["-accel", "help"])
        .output()
        .context("running qemu-system-x86_64")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains("tcg") {
        bail!(
            "`qemu-system-x86_64 -accel help` failed or lists no tcg: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub struct Guest<'a> {
    pub image: &'a GuestImage,
    pub accel: &'a Accel,
    pub agent: &'a Path,
    /// `tests/vm` of the workspace.
    pub vm_dir: PathBuf,
    pub keep_disks: bool,
    /// The agent's image for the guest's arch (`cargo xtask image`), if built.
    pub image_archive: Option<PathBuf>,
}

pub struct Spec<'a> {
    /// `tests/vm/scenarios/NAME.sh`.
    pub scenario: &'a str,
    pub dir: PathBuf,
    /// Let a guest reboot (or kexec) run on in the same qemu, for the report
    /// after the next boot; otherwise a reset ends qemu (`-no-reboot`).
    pub allow_reset: bool,
    pub boot_timeout: Duration,
    pub timeout: Duration,
    /// Extra files for the share's `in/` (cluster mode), and a NIC.
    pub extra_in: Vec<(String, Vec<u8>)>,
    pub nic: Option<String>,
    /// Boot the disks and the share of an earlier boot again (its `dir`):
    /// the same root overlay, audit disk and `out/` — the same machine
    /// switched on again after it powered off. `dir` then holds only this
    /// boot's logs and sockets; the overlay is removed after it (unless
    /// --keep-disks).
    pub disks_from: Option<PathBuf>,
    /// Keep the root overlay after the boot (another boot of it follows).
    pub keep_overlay: bool,
    /// The guest's memory.
    pub mem_mib: u32,
    /// The kernel's AppArmor on (`vm-test --node --apparmor`); off
    /// (`apparmor=0`) otherwise.
    pub apparmor: bool,
    /// From the runner's BOOT marker to ARMED (or FAIL).
    pub arm_timeout: Duration,
    /// A qcow2 disk to stack the root overlay on instead of the image (the
    /// real node's, its images imported: `node::preload`).
    pub base: Option<PathBuf>,
}

/// The guest's memory for the agent as a host service.
pub const MEM_MIB: u32 = 1024;

#[derive(Clone, Debug)]
pub struct Line {
    pub t: Duration,
    pub text: String,
}

#[derive(Clone, Debug)]
pub struct QmpEvent {
    pub t: Duration,
    pub event: String,
    pub data: serde_json::Value,
}

#[derive(Debug)]
pub enum Exit {
    /// qemu ended by itself (guest power-off, or a reset with -no-reboot).
    Exited(ExitStatus),
    /// The kernel said "System halted"; qemu keeps a halted guest running,
    /// so the harness ended it.
    Halted,
    /// Killed by the harness: the reason.
    Killed(String),
}

pub struct Run {
    pub out: PathBuf,
    pub audit_img: PathBuf,
    pub console: Vec<Line>,
    pub agent: Vec<Line>,
    pub qmp: Vec<QmpEvent>,
    pub exit: Exit,
    pub exit_t: Duration,
    pub stderr: String,
    /// The host's wall clock when qemu started (`Line::t` counts from it).
    pub start_wall: SystemTime,
}

impl Run {
    /// First console line containing `pat`, after `from`.
    pub fn console_at(&self, pat: &str, from: Duration) -> Option<&Line> {
        self.console
            .iter()
            .find(|l| l.t >= from && l.text.contains(pat))
    }
    pub fn markers(&self, what: &str) -> Vec<&Line> {
        self.console
            .iter()
            .filter(|l| l.text.contains("lastgasp-vm: ") && l.text.contains(&format!(" {what}")))
            .collect()
    }
}

const AUDIT_DISK_BYTES: u64 = 32 << 20;

/// From the runner's BOOT marker to the agent armed (or the runner's FAIL).
pub const ARM_TIMEOUT: Duration = Duration::from_secs(180);
/// How a kill for a guest stuck before the trigger starts (see `Exit::Killed`).
pub const HUNG_BEFORE_TRIGGER: &str = "the guest hung: the agent had not armed";
/// The kill a scenario asks for with the runner's POWER-CUT marker: QMP
/// `quit` at once, a power loss as the guest sees it (`power-loss.sh`).
pub const POWER_CUT: &str = "the harness cut the power (the runner's POWER-CUT)";

/// The kernel's command line: the console, every notice, the runner's and
/// the agent's lines unthrottled.
fn kernel_cmdline(arch: Arch, apparmor: bool) -> String {
    // loglevel 6: notices too ("kexec_core: Starting new kernel").
    // printk.devkmsg=on: the agent's and runner's lines in /dev/kmsg
    // are not rate-limited. SYSTEMD_COLORS=0 goes to PID 1's environment.
    format!(
        "root=/dev/vda rw console={},115200 loglevel=6 printk.devkmsg=on \
             systemd.show_status=true SYSTEMD_COLORS=0 mitigations=off panic=-1{}",
        match arch {
            Arch::Amd64 => "ttyS0",
            Arch::Arm64 => "ttyAMA0",
        },
        if apparmor { "" } else { " apparmor=0" }
    )
}

/// Why the watchdog ends the guest now: `Some(None)` once it has been
/// halted for 3 s, `Some(Some(why))` to kill it, `None` to let it run.
fn stop_reason(
    spec: &Spec,
    dir: &Path,
    now: Duration,
    console: &[Line],
    qmp: &[QmpEvent],
    halted_at: &mut Option<Instant>,
) -> Option<Option<String>> {
    let (booted, halted, armed, lockup, cut) = {
        let marker = |w: &str| {
            console
                .iter()
                .find(|l| l.text.contains("lastgasp-vm: ") && l.text.contains(w))
                .map(|l| l.t)
        };
        (
            marker(" BOOT "),
            console
                .iter()
                .any(|l| l.text.contains("reboot: System halted")),
            marker(" ARMED ").or(marker(" FAIL ")).is_some(),
            console.iter().any(|l| l.text.contains("soft lockup")),
            marker(" POWER-CUT").is_some(),
        )
    };
    let booted_at = booted;
    let booted = booted.is_some();
    if halted && halted_at.is_none() {
        *halted_at = Some(Instant::now());
    }
    let io_error = qmp
        .iter()
        .find(|e| e.event == "BLOCK_IO_ERROR")
        .map(|e| e.data.clone());
    if cut {
        Some(Some(POWER_CUT.into()))
    } else if halted_at.is_some_and(|h| h.elapsed() > Duration::from_secs(3)) {
        Some(None)
    } else if let Some(d) = io_error {
        // qemu pauses the guest on ENOSPC (werror=enospc): it would
        // sit there until the timeout. Say why, now.
        Some(Some(format!(
            "qemu stopped the guest: a {} on its {} disk failed on the host: {} \
             ({} free under {})",
            d["operation"].as_str().unwrap_or("write"),
            d["device"].as_str().unwrap_or("?"),
            d["reason"].as_str().unwrap_or("I/O error"),
            super::free_space(dir).map_or("?".into(), super::mib),
            dir.display()
        )))
    } else if booted_at.is_some_and(|b| !armed && now > b + spec.arm_timeout) {
        // The runner gives the agent 120 s to arm; past that the guest
        // itself is stuck (seen under TCG: soft lockups of both vCPUs
        // while the agent attaches its programs).
        Some(Some(format!(
            "{} {} s after the boot, before the trigger{}",
            HUNG_BEFORE_TRIGGER,
            spec.arm_timeout.as_secs(),
            if lockup {
                " (the guest kernel reported soft lockups)"
            } else {
                ""
            }
        )))
    } else if !booted && now > spec.boot_timeout {
        // Nothing of the scenario ran either: retried like a hang
        // after the boot (seen under TCG: RCU stalls and soft
        // lockups in early user space).
        Some(Some(format!(
            "{HUNG_BEFORE_TRIGGER}: the guest did not come up within {} s{}",
            spec.boot_timeout.as_secs(),
            if lockup {
                " (the guest kernel reported soft lockups)"
            } else {
                ""
            }
        )))
    } else if now > spec.timeout {
        Some(Some(format!(
            "the guest was still running after {} s",
            spec.timeout.as_secs()
        )))
    } else {
        None
    }
}

impl Guest<'_> {
    /// qemu's command line: the image's kernel, the root overlay, the audit
    /// disk (its flushes honoured), the 9p share, the console on stdout, the
    /// agent's channel and QMP on sockets.
    fn command(
        &self,
        spec: &Spec,
        (overlay, audit_img, share): (&Path, &Path, &Path),
        (qmp_sock, agent_sock): (&Path, &Path),
    ) -> Command {
        let arch = self.image.arch;
        let mut cmd = Command::new(qemu_system(arch));
        cmd.args(["-name", &format!("lastgasp-{}", spec.scenario)])
            .args(["-nodefaults", "-no-user-config", "-display", "none"]);
        match arch {
            Arch::Amd64 => cmd.args(["-machine", "pc"]),
            // pauth-impdef: TCG's pointer authentication, the cheap way.
            Arch::Arm64 => cmd.args(["-machine", "virt", "-cpu", "max,pauth-impdef=on"]),
        };
        cmd.args(match self.accel {
            Accel::Tcg(_) => ["-accel", "tcg,thread=multi"],
            Accel::Kvm => ["-accel", "kvm"],
        })
        .args(["-smp", "2", "-m", &spec.mem_mib.to_string()])
        // The guest's clock starts from the host's UTC (whole seconds);
        // cluster mode relates the two to the ms (vm/cluster.rs).
        .args(["-rtc", "base=utc"])
        .arg("-kernel")
        .arg(&self.image.kernel)
        .arg("-initrd")
        .arg(&self.image.initrd)
        .arg("-append")
        // loglevel 6: notices too ("kexec_core: Starting new kernel").
        // printk.devkmsg=on: the agent's and runner's lines in /dev/kmsg
        // are not rate-limited. SYSTEMD_COLORS=0 goes to PID 1's environment.
        .arg(kernel_cmdline(arch, spec.apparmor))
        .arg("-drive")
        .arg(drive(overlay, "qcow2", "root", "unsafe"))
        .args(["-device", "virtio-blk-pci,drive=root"])
        // The audit disk honours the guest's flushes: its fsync is real.
        .arg("-drive")
        .arg(drive(audit_img, "raw", "audit", "writeback"))
        .args(["-device", "virtio-blk-pci,drive=audit"])
        .arg("-fsdev")
        .arg(format!(
            "local,id=share,path={},security_model=passthrough",
            share.display()
        ))
        .args(["-device", "virtio-9p-pci,fsdev=share,mount_tag=lastgasp"])
        .args(["-serial", "stdio"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=agent,path={},server=on,wait=off",
            agent_sock.display()
        ));
        match arch {
            Arch::Amd64 => cmd.args(["-serial", "chardev:agent"]),
            // `virt` has one UART: the agent's channel is a virtio console,
            // hvc0 (the image's drop-in points the agent's stdout there).
            Arch::Arm64 => cmd.args([
                "-device",
                "virtio-serial-pci",
                "-device",
                "virtconsole,chardev=agent",
            ]),
        };
        cmd.arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp_sock.display()));
        match &spec.nic {
            Some(nic) => cmd.args(["-nic", nic]),
            None => cmd.args(["-nic", "none"]),
        };
        if !spec.allow_reset {
            cmd.arg("-no-reboot");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    pub fn boot(&self, spec: &Spec) -> Result<Run> {
        let dir = &spec.dir;
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir)?;
        let (overlay, audit_img, share) = self.disks(spec)?;
        let out = share.join("out");

        let (qmp_sock, agent_sock) = (dir.join("qmp.sock"), dir.join("agent.sock"));
        let arch = self.image.arch;
        let mut cmd = self.command(
            spec,
            (&overlay, &audit_img, &share),
            (&qmp_sock, &agent_sock),
        );
        fs::write(dir.join("qemu.cmd"), format!("{cmd:?}\n"))?;

        let start = Instant::now();
        let start_wall = SystemTime::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", qemu_system(arch)))?;
        let console = Arc::new(Mutex::new(Vec::<Line>::new()));
        let con_thread = {
            let stdout = child.stdout.take().unwrap();
            let console = console.clone();
            thread::spawn(move || read_lines(stdout, start, &console))
        };
        let err_thread = {
            let mut stderr = child.stderr.take().unwrap();
            thread::spawn(move || {
                let mut s = String::new();
                let _ = stderr.read_to_string(&mut s);
                s
            })
        };
        let agent = Arc::new(Mutex::new(Vec::<Line>::new()));
        let qmp = Arc::new(Mutex::new(Vec::<QmpEvent>::new()));
        let mut qmp_ctl = None;
        let mut threads = Vec::new();
        if let Some(s) = connect(&agent_sock, &mut child) {
            let agent = agent.clone();
            threads.push(thread::spawn(move || read_lines(s, start, &agent)));
        }
        if let Some(mut s) = connect(&qmp_sock, &mut child) {
            let _ = s.write_all(b"{\"execute\":\"qmp_capabilities\"}\n");
            qmp_ctl = s.try_clone().ok();
            let qmp = qmp.clone();
            threads.push(thread::spawn(move || read_qmp(s, start, &qmp)));
        }

        let exit = watch(&mut child, spec, start, &console, &qmp, qmp_ctl)?;
        let exit_t = start.elapsed();
        let _ = con_thread.join();
        let stderr = err_thread.join().unwrap_or_default();
        for t in threads {
            let _ = t.join();
        }
        let console = console.lock().unwrap().clone();
        let agent = agent.lock().unwrap().clone();
        let qmp = qmp.lock().unwrap().clone();
        save_logs(dir, &console, &agent, &qmp, &stderr);
        if !self.keep_disks && !spec.keep_overlay {
            let _ = fs::remove_file(&overlay);
        }
        Ok(Run {
            out,
            audit_img,
            console,
            agent,
            qmp,
            exit,
            exit_t,
            stderr,
            start_wall,
        })
    }
}

impl Guest<'_> {
    /// The disks to boot: an earlier boot's (`disks_from`, with more files in
    /// its share), or fresh ones.
    fn disks(&self, spec: &Spec) -> Result<(PathBuf, PathBuf, PathBuf)> {
        let (overlay, audit_img, share) = match &spec.disks_from {
            Some(from) => {
                let share = from.join("share");
                for (name, data) in &spec.extra_in {
                    write_in(&share.join("in"), name, data)?;
                }
                (from.join("root.qcow2"), from.join("audit.img"), share)
            }
            None => self.fresh_disks(spec)?,
        };
        for f in [&overlay, &audit_img] {
            if !f.is_file() {
                bail!("no disk {} to boot", f.display());
            }
        }
        Ok((overlay, audit_img, share))
    }
}

/// Watches the guest until it exits, halts or must be killed
/// (`stop_reason`), every 20 ms.
fn watch(
    child: &mut Child,
    spec: &Spec,
    start: Instant,
    console: &Mutex<Vec<Line>>,
    qmp: &Mutex<Vec<QmpEvent>>,
    mut qmp_ctl: Option<UnixStream>,
) -> Result<Exit> {
    let mut halted_at: Option<Instant> = None;
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(Exit::Exited(st));
        }
        let why = stop_reason(
            spec,
            &spec.dir,
            start.elapsed(),
            &console.lock().unwrap(),
            &qmp.lock().unwrap(),
            &mut halted_at,
        );
        if let Some(why) = why {
            if let Some(s) = qmp_ctl.as_mut() {
                let _ = s.write_all(b"{\"execute\":\"quit\"}\n");
            }
            if wait_timeout(child, Duration::from_secs(5))?.is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Ok(match why {
                None => Exit::Halted,
                Some(w) => Exit::Killed(w),
            });
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The run's logs beside it. Best effort: on a full disk these fail too,
/// and the run's own result (in memory) must still reach the report.
fn save_logs(dir: &Path, console: &[Line], agent: &[Line], qmp: &[QmpEvent], stderr: &str) {
    save(&dir.join("console.log"), &lines(console));
    save(&dir.join("agent-stdout.log"), &lines(agent));
    save(
        &dir.join("qmp-events.log"),
        &qmp.iter()
            .map(|e| format!("{:>9.3} {} {}\n", e.t.as_secs_f64(), e.event, e.data))
            .collect::<String>(),
    );
    save(&dir.join("qemu.stderr"), stderr);
}

impl Guest<'_> {
    /// A fresh share (the agent, its unit, the runner, the scenario), a qcow2
    /// overlay over the image and an empty audit disk, under `spec.dir`.
    fn fresh_disks(&self, spec: &Spec) -> Result<(PathBuf, PathBuf, PathBuf)> {
        let dir = &spec.dir;
        let share = dir.join("share");
        let (inp, out) = (share.join("in"), share.join("out"));
        fs::create_dir_all(&inp)?;
        fs::create_dir_all(&out)?;
        // Stripped if possible: a third of the size through 9p, and of what the guest pages in.
        let strip = match self.image.arch {
            Arch::Amd64 => "strip",
            Arch::Arm64 => "aarch64-linux-gnu-strip",
        };
        let stripped = Command::new(strip)
            .arg("-o")
            .arg(inp.join("lastgasp"))
            .arg(self.agent)
            .status()
            .is_ok_and(|s| s.success());
        if stripped {
            fs::set_permissions(inp.join("lastgasp"), fs::Permissions::from_mode(0o755))?;
        } else {
            copy_exec(self.agent, &inp.join("lastgasp"))?;
        }
        if self.image.distro.needs_host_libc() {
            with_host_libc(self.agent, &inp)?;
        }
        copy_exec(&self.vm_dir.join("guest/runner.sh"), &inp.join("runner.sh"))?;
        fs::copy(
            self.vm_dir.join("guest/lastgasp.service"),
            inp.join("lastgasp.service"),
        )?;
        let sc = self.vm_dir.join(format!("scenarios/{}.sh", spec.scenario));
        fs::copy(&sc, inp.join("scenario.sh"))
            .with_context(|| format!("copying {}", sc.display()))?;
        for (name, data) in &spec.extra_in {
            write_in(&inp, name, data)?;
        }

        let overlay = dir.join("root.qcow2");
        let (format, base) = match &spec.base {
            Some(b) => ("qcow2", b),
            None => ("raw", &self.image.base),
        };
        run_quiet(
            Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-F", format, "-b"])
                .arg(base)
                .arg(&overlay),
        )?;
        let audit_img = dir.join("audit.img");
        fs::File::create(&audit_img)?.set_len(AUDIT_DISK_BYTES)?;
        run_quiet(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-L", "lastgasp-audit"])
                .arg(&audit_img),
        )?;
        Ok((overlay, audit_img, share))
    }
}

fn drive(file: &Path, format: &str, id: &str, cache: &str) -> String {
    format!(
        "file={},format={format},if=none,id={id},cache={cache}",
        file.display()
    )
}

/// Where the guest's unit puts the host's loader and libraries
/// (`tests/vm/guest/lastgasp.service`): on the root file system, which
/// outlives the share until the final stage.
const HOST_LIBC_DIR: &str = "/usr/local/lib/lastgasp";

/// For a guest whose glibc is older than the host's: the host's loader and
/// libraries in `in/lib/`, and the agent's copy in `in/` pointed at them
/// (its ELF interpreter and rpath), so that it runs as itself (its comm,
/// its /proc/self/exe) rather than under an explicit loader.
fn with_host_libc(agent: &Path, inp: &Path) -> Result<()> {
    crate::setup::ensure_debs(&[("patchelf", "patchelf")])?;
    let lib = inp.join("lib");
    fs::create_dir_all(&lib)?;
    let mut interpreter = None;
    for (l, _) in crate::image::libraries(agent)? {
        let name = l.file_name().context("a library path has a name")?;
        fs::copy(&l, lib.join(name)).with_context(|| format!("copying {}", l.display()))?;
        if name.to_string_lossy().starts_with("ld-linux") {
            interpreter = Some(name.to_string_lossy().into_owned());
        }
    }
    let interpreter = interpreter.context("ldd named no ld-linux loader for the agent")?;
    run_quiet(
        Command::new("patchelf")
            .arg("--set-interpreter")
            .arg(format!("{HOST_LIBC_DIR}/{interpreter}"))
            .arg("--set-rpath")
            .arg(HOST_LIBC_DIR)
            .arg(inp.join("lastgasp")),
    )
}

fn copy_exec(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn run_quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Waits for `child` at most `timeout`; `None` if it is still running.
/// One file of the share's `in/` (`name` may have directories).
fn write_in(inp: &Path, name: &str, data: &[u8]) -> Result<()> {
    let to = inp.join(name);
    if let Some(d) = to.parent() {
        fs::create_dir_all(d)?;
    }
    fs::write(&to, data).with_context(|| format!("writing {}", to.display()))?;
    if name.ends_with(".sh") || !name.contains('.') {
        fs::set_permissions(&to, fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// qemu creates its sockets before the guest starts; give it a few seconds.
fn connect(path: &Path, child: &mut Child) -> Option<UnixStream> {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(15) {
        if let Ok(s) = UnixStream::connect(path) {
            return Some(s);
        }
        if matches!(child.try_wait(), Ok(Some(_))) {
            return None;
        }
        thread::sleep(Duration::from_millis(20));
    }
    None
}

fn read_lines(r: impl Read, start: Instant, out: &Mutex<Vec<Line>>) {
    let mut r = BufReader::new(r);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let t = start.elapsed();
                let text = String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\r', '\n'])
                    .replace('\r', "");
                out.lock().unwrap().push(Line { t, text });
            }
        }
    }
}

fn read_qmp(s: UnixStream, start: Instant, out: &Mutex<Vec<QmpEvent>>) {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let t = start.elapsed();
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if let Some(ev) = v.get("event").and_then(|e| e.as_str()) {
                        out.lock().unwrap().push(QmpEvent {
                            t,
                            event: ev.to_string(),
                            data: v.get("data").cloned().unwrap_or_default(),
                        });
                    }
                }
            }
        }
    }
}

fn lines(lines: &[Line]) -> String {
    lines
        .iter()
        .map(|l| format!("{:>9.3} {}\n", l.t.as_secs_f64(), l.text))
        .collect()
}

fn save(path: &Path, data: &str) {
    if let Err(e) = fs::write(path, data) {
        eprintln!("vm-test: could not write {}: {e}", path.display());
    }
}
