//! The `lastgasp` binary as an operator runs it: `run --standalone` prints
//! each signal as a JSON line and audits it; `history` reads the audit back.
use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use lastgasp::{act::audit::AuditRecord, signal::ShutdownSignal};
use lastgasp_tests::support::*;

/// `lastgasp run --standalone`, armed, its stdout's lines on a channel.
struct Standalone {
    agent: std::process::Child,
    lines: mpsc::Receiver<String>,
}

fn standalone(dir: &std::path::Path) -> Standalone {
    standalone_with(dir, &[])
}

fn standalone_with(dir: &std::path::Path, extra: &[&str]) -> Standalone {
    let _ = std::fs::remove_dir_all(dir);
    let mut agent = Command::new(agent_bin())
        .args(["run", "--standalone", "--audit-dir"])
        .arg(dir)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting lastgasp (build it with cargo xtask build)");
    let mut err = BufReader::new(agent.stderr.take().unwrap());
    let mut report = String::new();
    loop {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "agent exited before arming:\n{report}"
        );
        report.push_str(&line);
        if line.contains(" armed") && line.contains("armed_ms") {
            // The VM runner and readiness checks wait for exactly this text.
            assert!(line.contains("lastgasp: armed"), "arm line moved: {line}");
            break;
        }
    }
    for hook in ["sys_enter_reboot", "sched_process_exec", "signal_generate"] {
        assert!(
            report
                .lines()
                .any(|l| l.contains(hook) && l.trim_end().ends_with("armed")),
            "{hook} not armed:\n{report}"
        );
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let (tx, lines) = mpsc::channel();
    let out = agent.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    Standalone { agent, lines }
}

impl Standalone {
    /// The next printed signal (with its decision) that `pred` accepts.
    fn next(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> (String, serde_json::Value) {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(5))
                .unwrap_or_else(|_| panic!("no JSON line for {what} within 5 s"));
            let v: serde_json::Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
            if pred(&v) {
                return (line, v);
            }
        }
    }

    /// SIGTERM, and a clean stop.
    fn stop(mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.agent.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert!(
            self.agent.wait().unwrap().success(),
            "SIGTERM is a clean stop"
        );
    }
}

#[test]
fn standalone_run_reports_a_namespace_poweroff_and_audits_it() {
    if !can_load_ebpf("cli_standalone") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lastgasp-cli-{}", std::process::id()));
    let agent = standalone(&dir);

    let child = PidNsChild::spawn(&["pidns-reboot", "poweroff"]);
    let pid = child.init_pid;
    assert_eq!(child.ended(), "signal SIGINT");
    let (line, v) = agent.next("the namespace's reboot(2)", |v| v["actor"]["pid"] == pid);
    let signal: ShutdownSignal =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["source"], "reboot-syscall");
    assert_eq!(v["kind"], "poweroff");
    assert_eq!(v["scope"], "container");
    assert_eq!(v["effect"], "now");
    assert_eq!(v["forced"], true);
    assert_eq!(v["actor"]["comm"], "lastgasp-trigge");
    assert_eq!(v["detail"]["valid_magic"], true);
    assert_eq!(
        v["decision"]["action"], "audit-only",
        "a container's reboot never drains the node"
    );
    agent.stop();

    let history = |boot: &str| -> Vec<AuditRecord> {
        let out = Command::new(agent_bin())
            .args(["history", "--boot", boot, "--audit-dir"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let current = history("current");
    let rec = current
        .iter()
        .find(|r| {
            r.signal()
                .and_then(|s| s.actor.as_ref())
                .is_some_and(|a| a.pid == pid)
        })
        .expect("audited");
    assert_eq!(
        rec.signal(),
        Some(&signal),
        "the audit holds exactly what was printed"
    );
    assert_eq!(
        rec.boot_id,
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap()
            .trim()
    );
    assert!(
        history("previous").is_empty(),
        "no earlier boot in a fresh log"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Root's `poweroff -f` whose tool never reaches the kernel (a stand-in
/// that exits): the real agent decides it immediate on the direct tool's
/// proof, then fails the episode when the tool ends, whether it ended
/// after the agent asked the kernel to watch it or before.
#[test]
fn a_direct_tool_that_ends_without_a_reboot_fails_its_episode() {
    if !can_load_ebpf("cli_tool_end") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lastgasp-cli-end-{}", std::process::id()));
    let agent = standalone(&dir);
    let tool = dir.join("tools/poweroff");
    std::fs::create_dir_all(tool.parent().unwrap()).unwrap();
    std::fs::copy(trigger_bin(), &tool).unwrap();
    for how in ["sleep:500", "sleep:0"] {
        let mut child = Command::new(&tool)
            .arg("-f")
            .env("LASTGASP_STANDIN", how)
            .spawn()
            .unwrap();
        let pid = child.id();
        let (_, exec) = agent.next("the tool's exec", |v| {
            v["source"] == "exec" && v["actor"]["pid"] == pid
        });
        assert_eq!(exec["decision"]["action"], "immediate", "{how}: {exec}");
        let (_, end) = agent.next("the tool's end", |v| {
            v["source"] == "tool-end" && v["actor"]["pid"] == pid
        });
        assert_eq!(end["decision"]["action"], "fail", "{how}: {end}");
        child.wait().unwrap();
    }
    agent.stop();
    std::fs::remove_dir_all(&dir).ok();
}

/// `systemctl poweroff --force` where no hook is armed: PID 1 exec's
/// systemd-shutdown, whose sweep the agent reads in the node's /proc. A
/// fresh PID namespace is the node (`--node-pid-ns`); its PID 1 runs
/// stand-ins only (copies of the trigger that sleep and exit, never a
/// reboot(2)): `systemctl poweroff --force`, then exec's one named
/// systemd-shutdown, leaving no other process. The agent audits that it
/// reads the sweep, then sends the final stage's word (a /proc whose PID 1
/// is not systemd-shutdown proves nothing: `final_sweep`'s unit tests).
#[test]
fn the_sweeps_end_is_read_only_from_systemd_shutdown() {
    if !can_load_ebpf("cli_final_sweep") {
        return;
    }
    let base = std::env::temp_dir().join(format!("lastgasp-cli-sweep-{}", std::process::id()));
    let tools = base.join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    for tool in ["systemctl", "systemd-shutdown"] {
        std::fs::copy(trigger_bin(), tools.join(tool)).unwrap();
    }
    let go = base.join("go");
    let script = format!(
        "[ $$ = 1 ] || exit 9; while [ ! -e {go} ]; do sleep 0.05; done; \
         LASTGASP_STANDIN=sleep:0 {t}/systemctl poweroff --force; \
         LASTGASP_STANDIN=sleep:3000 exec {t}/systemd-shutdown poweroff",
        go = go.display(),
        t = tools.display()
    );
    let mut node = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "bash", "-c", &script])
        .spawn()
        .expect("unshare (util-linux)");
    // The namespace's init: bash, forked by unshare.
    let init = (0..100)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            let kids =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", node.id())).ok()?;
            kids.split_whitespace().next().map(str::to_string)
        })
        .expect("the namespace's init");
    let ns = format!("/proc/{init}/ns/pid");
    let agent = standalone_with(
        &base.join("audit"),
        &["--no-dbus", "--metrics-listen", "off", "--node-pid-ns", &ns],
    );
    std::fs::write(&go, "").unwrap();
    let (_, exec) = agent.next("systemctl poweroff --force", |v| {
        v["source"] == "exec" && v["actor"]["comm"] == "systemctl"
    });
    assert_eq!(exec["decision"]["action"], "immediate", "{exec}");
    let (_, pid1) = agent.next("PID 1's exec of systemd-shutdown", |v| {
        v["source"] == "exec" && v["actor"]["ns_pid"] == 1
    });
    assert_eq!(pid1["decision"]["action"], "join", "{pid1}");
    let (_, reading) = agent.next("the sweep read", |v| v["source"] == "final-sweep");
    assert_eq!(reading["decision"]["action"], "audit-only", "{reading}");
    assert!(
        reading["decision"]["why"]
            .as_str()
            .unwrap()
            .starts_with("reading systemd-shutdown's kill sweep"),
        "{reading}"
    );
    let (_, end) = agent.next("the sweep's end", |v| v["source"] == "final-sweep");
    assert_eq!(
        (&end["effect"], &end["kind"]),
        (&"now".into(), &"poweroff".into()),
        "{end}"
    );
    assert_eq!(
        end["decision"]["action"], "last-word",
        "the final stage's proof: {end}"
    );
    agent.stop();
    assert!(node.wait().unwrap().success());
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn cluster_mode_without_a_config_is_refused_clearly() {
    let out = Command::new(agent_bin()).arg("run").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config"));
}

#[test]
fn history_reports_torn_lines_and_keeps_the_rest() {
    let dir = std::env::temp_dir().join(format!("lastgasp-hist-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("audit.jsonl"), "{\"boot_id\":\"x\",\"seq\n").unwrap();
    let out = Command::new(agent_bin())
        .args(["history", "--audit-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("audit.jsonl:1: unreadable record"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Every flag has an environment twin (`LASTGASP_*`), as a DaemonSet or a
/// unit file sets them; and the twin works.
#[test]
fn every_flag_has_an_environment_twin() {
    for sub in ["run", "controller", "check", "history", "clean-host"] {
        let out = std::process::Command::new(lastgasp_tests::support::agent_bin())
            .args([sub, "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8(out.stdout).unwrap();
        // Each option's block: its `--name` line and the wrapped lines after it.
        let mut blocks: Vec<String> = Vec::new();
        for line in help.lines().map(str::trim_start) {
            if line.starts_with("--") || line.starts_with("-h,") {
                blocks.push(line.to_string());
            } else if let Some(b) = blocks.last_mut() {
                b.push(' ');
                b.push_str(line);
            }
        }
        for block in blocks {
            let Some(flag) = block.strip_prefix("--") else {
                continue;
            };
            let name = flag.split_whitespace().next().unwrap();
            if name == "help" || name == "version" {
                continue;
            }
            let want = format!("[env: LASTGASP_{}=", name.to_uppercase().replace('-', "_"));
            assert!(
                block.contains(&want),
                "lastgasp {sub} --{name} has no {want}]:\n{block}"
            );
        }
    }
    // A bad config given through LASTGASP_CONFIG is read and refused, by name.
    let dir = std::env::temp_dir().join(format!("lastgasp-cli-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("bad.yaml");
    std::fs::write(&cfg, "shutdownGracePeriod: 30s\nfrobnicate: 1\n").unwrap();
    let out = std::process::Command::new(lastgasp_tests::support::agent_bin())
        .args(["check", "--only", "kernel", "--standalone"])
        .env("LASTGASP_CONFIG", &cfg)
        .output()
        .unwrap();
    let report = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(report.contains("frobnicate"), "{report}");
    std::fs::remove_dir_all(&dir).ok();
}

/// As root, `lastgasp run` runs as `@lastgasp` (argv[0] begins with `@`),
/// which systemd-shutdown's final kill spares, so that it lives to send its
/// last word; its comm stays `lastgasp`. `--outlive-final-kill false` keeps
/// its own name.
#[test]
fn run_outlives_the_final_kill_unless_told_not_to() {
    if !can_load_ebpf("run_outlives_the_final_kill_unless_told_not_to") {
        return;
    }
    for (flag, spared) in [(None, true), (Some("false"), false)] {
        let dir = std::env::temp_dir().join(format!("lastgasp-arg0-{}", std::process::id()));
        let mut cmd = Command::new(agent_bin());
        cmd.args([
            "run",
            "--standalone",
            "--metrics-listen",
            "off",
            "--audit-dir",
        ])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        if let Some(v) = flag {
            cmd.args(["--outlive-final-kill", v]);
        }
        let mut agent = cmd.spawn().unwrap();
        let mut err = BufReader::new(agent.stderr.take().unwrap());
        loop {
            let mut line = String::new();
            assert!(
                err.read_line(&mut line).unwrap() > 0,
                "exited before arming"
            );
            if line.contains("lastgasp: armed") {
                break;
            }
        }
        let pid = agent.id();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
        agent.kill().unwrap();
        agent.wait().unwrap();
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(
            cmdline.starts_with("@lastgasp run "),
            spared,
            "{flag:?}: {cmdline}"
        );
        assert_eq!(cmdline.starts_with('@'), spared, "{flag:?}: {cmdline}");
        assert_eq!(comm.trim(), "lastgasp", "{flag:?}");
    }
}

/// `lastgasp clean-host` removes what the agent left (not the audit log
/// unless asked), says what went, and says so when there is nothing.
#[test]
fn clean_host_removes_what_the_agent_left_and_says_what() {
    let root = std::env::temp_dir().join(format!("lastgasp-cli-clean-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let hooks = root.join("system-shutdown");
    std::fs::create_dir_all(hooks.join("lastgasp.courier/lib")).unwrap();
    std::fs::write(hooks.join("lastgasp"), "#!/bin/sh\n").unwrap();
    std::fs::write(hooks.join("other-hook"), "#!/bin/sh\n").unwrap();
    std::fs::create_dir_all(root.join("run/courier")).unwrap();
    std::fs::create_dir_all(root.join("audit")).unwrap();
    let clean = || {
        let out = Command::new(agent_bin())
            .arg("clean-host")
            .arg("--shutdown-hook-dir")
            .arg(&hooks)
            .arg("--run-dir")
            .arg(root.join("run"))
            .arg("--logind-root")
            .arg(&root)
            .arg("--audit-dir")
            .arg(root.join("audit"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let said = clean();
    for gone in [
        "system-shutdown/lastgasp\n",
        "system-shutdown/lastgasp.courier\n",
        "/run\n",
    ] {
        assert!(said.contains(gone), "{gone:?} not in {said}");
        assert!(!said.contains("audit"), "{said}");
    }
    assert!(hooks.join("other-hook").exists() && root.join("audit").exists());
    assert!(!hooks.join("lastgasp").exists() && !root.join("run").exists());
    assert_eq!(clean(), "nothing of lastgasp's on this host\n");
    std::fs::remove_dir_all(&root).unwrap();
}

/// `lastgasp check --only host`: whether the last word's files can be
/// written, and the operator's opt-outs, each said (never silent).
#[test]
fn check_says_whether_the_last_word_can_be_armed_on_this_host() {
    let dir = std::env::temp_dir().join(format!("lastgasp-cli-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let check = |args: &[&str]| {
        let out = Command::new(agent_bin())
            .args(["check", "--only", "host", "--standalone"])
            .args(args)
            .env_remove("LASTGASP_SHUTDOWN_HOOK_DIR")
            .env_remove("LASTGASP_NO_COURIER")
            .env_remove("LASTGASP_UNIT_DIR")
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let hooks = dir.join("system-shutdown");
    let ok = check(&["--shutdown-hook-dir", hooks.to_str().unwrap()]);
    assert!(ok.contains("writable (not installed yet)"), "{ok}");
    let warns = |r: &str| {
        r.lines()
            .filter(|l| l.trim_start().starts_with("WARN "))
            .count()
    };
    assert_eq!(warns(&ok), 0, "{ok}");
    let none = check(&[]);
    assert_eq!(warns(&none), 1, "{none}");
    assert!(
        none.contains("never under the systemd cgroup driver"),
        "{none}"
    );
    let no_courier = check(&[
        "--shutdown-hook-dir",
        hooks.to_str().unwrap(),
        "--no-courier",
    ]);
    assert_eq!(warns(&no_courier), 1, "{no_courier}");
    assert!(no_courier.contains("off (--no-courier"), "{no_courier}");
    // The hook's directory cannot be written: the final unit, if given a
    // directory, runs the courier; without one, a warning.
    let hooks_ro = "/nonexistent-lastgasp/usr/system-shutdown";
    let units = dir.join("units");
    std::fs::create_dir_all(&units).unwrap();
    let unit = check(&[
        "--shutdown-hook-dir",
        hooks_ro,
        "--unit-dir",
        units.to_str().unwrap(),
    ]);
    assert_eq!(warns(&unit), 0, "{unit}");
    assert!(
        unit.contains("final unit runs the courier instead"),
        "{unit}"
    );
    assert!(
        unit.contains("lastgasp-last-word@.service (not installed yet)"),
        "{unit}"
    );
    let no_unit = check(&["--shutdown-hook-dir", hooks_ro]);
    assert_eq!(warns(&no_unit), 2, "{no_unit}");
    assert!(no_unit.contains("none (no --unit-dir)"), "{no_unit}");
    std::fs::remove_dir_all(&dir).ok();
}
