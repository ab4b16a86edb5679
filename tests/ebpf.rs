//! The kernel hooks, loaded into the real kernel and triggered for real
//! (safely: bad magic, reboot(2) in a fresh PID namespace, stand-in tools,
//! signals to the init of a fresh PID namespace). Needs root; skips otherwise.
use std::process::Command;

use lastgasp::{
    detect::hooks::HookState,
    node::NodePidNs,
    signal::{Detail, Effect, Kind, Scope, Source},
};
use lastgasp_tests::support::*;

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lastgasp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test]
async fn start_report_arms_every_tracepoint_and_names_refused_hooks() {
    if !can_load_ebpf("start_report") {
        return;
    }
    let det = load(NodePidNs::initial().unwrap());
    for tp in [
        "sys_enter_reboot",
        "sys_exit_reboot",
        "sched_process_exec",
        "signal_generate",
    ] {
        let r = det
            .det
            .report
            .iter()
            .find(|r| r.hook == tp)
            .unwrap_or_else(|| panic!("{tp} not in the report"));
        assert_eq!(r.state, HookState::Armed, "{tp}: {r}");
    }
    for f in [
        "kernel_power_off",
        "kernel_restart",
        "kernel_halt",
        "emergency_restart",
    ] {
        let r = det
            .det
            .report
            .iter()
            .find(|r| r.hook == f)
            .unwrap_or_else(|| panic!("{f} not in the report"));
        match &r.state {
            HookState::Armed => println!("{f}: armed ({})", r.attach),
            HookState::Unavailable(why) => {
                assert!(why.contains("fentry") && why.contains("kprobe"), "{why}");
            }
            HookState::Degraded(why) => panic!("{f} degraded: {why}"),
        }
    }
    let orphans: Vec<_> = det.det.report.iter().filter(|r| r.attach == "-").collect();
    assert!(
        orphans.is_empty(),
        "eBPF programs no hook attaches (add them to HOOKS): {orphans:?}"
    );
    assert_eq!(det.det.drops(), 0);
}

#[tokio::test]
async fn bad_magic_reboot_is_seen_and_marked_ineffective() {
    if !can_load_ebpf("bad_magic_reboot") {
        return;
    }
    let mut det = load(NodePidNs::initial().unwrap());
    let child = trigger(&["bad-magic-reboot", "4321fedc"]).spawn().unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the kernel must refuse bad magic with EINVAL"
    );
    let s = det
        .wait_for("bad-magic reboot", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == pid)
        })
        .await;
    assert_eq!(s.source, Source::RebootSyscall);
    assert_eq!(s.kind, Kind::Poweroff);
    assert_eq!(s.scope, Scope::Node);
    assert!(matches!(s.effect, Effect::None { .. }), "{:?}", s.effect);
    let a = s.actor.unwrap();
    assert_eq!(a.comm, "lastgasp-trigge");
    assert_eq!(
        a.ns_pid, pid,
        "in the initial namespace the ns pid is the pid"
    );
    assert_eq!(
        s.detail,
        Detail::Reboot {
            magic1: 0,
            magic2: 0,
            cmd: 0x4321fedc,
            valid_magic: false,
            ret: None,
        }
    );
}

/// A valid-magic reboot(2) inside a fresh PID namespace ends only that
/// namespace, and is classified as container scope in the kernel.
#[tokio::test]
async fn valid_magic_reboots_in_a_child_pid_namespace_are_container_scope() {
    if !can_load_ebpf("child_pidns_reboot") {
        return;
    }
    let mut det = load(NodePidNs::initial().unwrap());
    for (arg, kind, cmd, death) in [
        ("poweroff", Kind::Poweroff, 0x4321fedc, "signal SIGINT"),
        ("restart", Kind::Reboot, 0x01234567, "signal SIGHUP"),
        ("halt", Kind::Halt, 0xcdef0123, "signal SIGINT"),
    ] {
        let child = PidNsChild::spawn(&["pidns-reboot", arg]);
        let pid = child.init_pid;
        let parent = child.child.id();
        assert_eq!(
            child.ended(),
            death,
            "the namespace's init ends as the kernel documents"
        );
        let s = det
            .wait_for(arg, |s| s.actor.as_ref().is_some_and(|a| a.pid == pid))
            .await;
        assert_eq!(
            (s.source, s.kind, s.scope),
            (Source::RebootSyscall, kind, Scope::Container),
            "{arg}"
        );
        assert_eq!(s.effect, Effect::Now);
        assert!(s.forced, "a direct reboot(2) is forced");
        let a = s.actor.unwrap();
        assert_eq!(a.comm, "lastgasp-trigge");
        assert_eq!(a.ns_pid, 0, "outside the node's namespace");
        assert_eq!(
            (a.euid, a.cap_sys_boot),
            (Some(0), Some(true)),
            "root's credentials, read in the kernel"
        );
        // Read in the kernel: the parent is gone from /proc by now.
        assert_eq!(
            a.parents.first().map(|p| (p.pid, p.comm.as_str())),
            Some((parent, "lastgasp-trigge"))
        );
        assert!(matches!(s.detail, Detail::Reboot { cmd: c, valid_magic: true, .. } if c == cmd));
    }
}

/// A child namespace plays the node: a signal to its init, then the init's
/// own power-off, are a node-scope shutdown end to end.
#[tokio::test]
async fn a_child_namespace_playing_the_node_powers_off_by_signal() {
    if !can_load_ebpf("node_signal_poweroff") {
        return;
    }
    let rtmin = libc::SIGRTMIN();
    for (sig, name, kind, forced, death) in [
        (
            rtmin + 4,
            "SIGRTMIN+4",
            Kind::Poweroff,
            false,
            "signal SIGINT",
        ),
        (
            rtmin + 14,
            "SIGRTMIN+14",
            Kind::Poweroff,
            true,
            "signal SIGINT",
        ),
        (
            rtmin + 5,
            "SIGRTMIN+5",
            Kind::Reboot,
            false,
            "signal SIGHUP",
        ),
        (rtmin + 13, "SIGRTMIN+13", Kind::Halt, true, "signal SIGINT"),
        (libc::SIGINT, "SIGINT", Kind::Reboot, false, "signal SIGHUP"),
    ] {
        let node = PidNsChild::spawn(&["fake-init"]);
        let init = node.init_pid;
        let mut det = load(NodePidNs::from_path(&node.pidns_path()).unwrap());
        // Not a shutdown signal: must not be reported.
        send_signal(init, libc::SIGUSR1);
        send_signal(init, sig);
        let s = det.wait_for(name, |s| s.source == Source::SignalPid1).await;
        assert_eq!(
            (s.kind, s.forced, s.scope),
            (kind, forced, Scope::Node),
            "{name}"
        );
        assert!(s.bypasses_logind);
        assert_eq!(
            s.actor.as_ref().unwrap().pid,
            std::process::id(),
            "the sender is the actor"
        );
        assert!(
            matches!(&s.detail, Detail::Signal { name: n, result, .. } if n == name && result == "delivered"),
            "{:?}",
            s.detail
        );
        // Other tests' processes call reboot(2) too (bad magic): its own.
        let r = det
            .wait_for("the init's reboot(2)", |s| {
                s.source == Source::RebootSyscall && s.actor.as_ref().is_some_and(|a| a.pid == init)
            })
            .await;
        let a = r.actor.clone().unwrap();
        assert_eq!((a.pid, a.ns_pid), (init, 1), "the node's own PID 1");
        assert_eq!((r.scope, r.effect.clone()), (Scope::Node, Effect::Now));
        assert!(!r.forced, "PID 1 ending an orderly shutdown is not forced");
        assert_eq!(node.ended(), death);
    }
}

/// A caller without CAP_SYS_BOOT (uid 65534) in the namespace playing the
/// node: its reboot(2) is reported with its credentials as ineffective, and
/// its return (EPERM) as a failed call.
#[tokio::test]
async fn an_unprivileged_reboot_is_refused_and_its_return_reported() {
    if !can_load_ebpf("unprivileged_reboot") {
        return;
    }
    let node = PidNsChild::spawn(&["nobody-init"]);
    let init = node.init_pid;
    let mut det = load(NodePidNs::from_path(&node.pidns_path()).unwrap());
    send_signal(init, libc::SIGUSR1);
    let s = det
        .wait_for("the unprivileged reboot(2)", |s| {
            s.source == Source::RebootSyscall && s.actor.as_ref().is_some_and(|a| a.pid == init)
        })
        .await;
    let a = s.actor.clone().unwrap();
    assert_eq!((a.euid, a.cap_sys_boot), (Some(65534), Some(false)));
    assert_eq!(s.scope, Scope::Node);
    assert!(
        matches!(&s.effect, Effect::None { why } if why.contains("lacks CAP_SYS_BOOT") && why.contains("65534")),
        "{:?}",
        s.effect
    );
    let r = det
        .wait_for("its return", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == init)
                && matches!(s.effect, Effect::Failed { .. })
        })
        .await;
    assert!(
        matches!(&r.effect, Effect::Failed { why } if why.contains("EPERM")),
        "{:?}",
        r.effect
    );
    assert_eq!(node.ended(), "exit 0", "the kernel refused it with EPERM");
}

/// Authority holds both ways, on what the real kernel reports: root's
/// `systemctl poweroff --force` (a stand-in that does nothing) opens an
/// immediate episode on the node; a process that cannot reboot then calls
/// reboot(2) (EPERM): that failure retracts nothing.
#[tokio::test]
async fn a_caller_that_cannot_reboot_undoes_nothing() {
    if !can_load_ebpf("a_caller_that_cannot_reboot_undoes_nothing") {
        return;
    }
    use lastgasp::decide::{Action, Decider};
    let node = PidNsChild::spawn(&["nobody-init"]);
    let init = node.init_pid;
    let mut det = load(NodePidNs::from_path(&node.pidns_path()).unwrap());
    let dir = tmpdir("authority");
    let tool = stand_in(&dir, "systemctl");
    // Root's forced request, from inside the node's PID namespace.
    let status = Command::new("nsenter")
        .args(["-t", &init.to_string(), "-p", "--"])
        .arg(&tool)
        .args(["poweroff", "--force"])
        .status()
        .unwrap();
    assert!(status.success());
    let forced = det
        .wait_for("root's systemctl poweroff --force", |s| {
            s.source == Source::Exec && s.actor.as_ref().is_some_and(|a| a.comm == "systemctl")
        })
        .await;
    send_signal(init, libc::SIGUSR1);
    let entry = det
        .wait_for("the unprivileged reboot(2)", |s| {
            s.source == Source::RebootSyscall && s.actor.as_ref().is_some_and(|a| a.pid == init)
        })
        .await;
    let failed = det
        .wait_for("its return", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == init)
                && matches!(s.effect, Effect::Failed { .. })
        })
        .await;
    let mut d = Decider::new();
    let actions: Vec<Action> = [&forced, &entry, &failed]
        .iter()
        .map(|s| d.decide(s).action)
        .collect();
    assert!(
        matches!(actions[0], Action::Immediate { escalated: false }),
        "{actions:?}"
    );
    assert!(
        actions[1..]
            .iter()
            .all(|a| matches!(a, Action::AuditOnly { .. })),
        "an EPERM reboot(2) undoes nothing: {actions:?}"
    );
    assert!(d.episode().is_some(), "root's episode goes on");
    assert_eq!(node.ended(), "exit 0");
    std::fs::remove_dir_all(&dir).ok();
}

/// The same check on an exec: a forced request by uid 65534 says so.
#[tokio::test]
async fn an_exec_carries_the_callers_credentials() {
    if !can_load_ebpf("exec_credentials") {
        return;
    }
    use std::os::unix::process::CommandExt;
    let dir = tmpdir("exec-creds");
    let mut perm = std::fs::metadata(&dir).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&dir, perm).unwrap();
    let mut det = load(NodePidNs::initial().unwrap());
    let tool = stand_in(&dir, "reboot");
    let child = Command::new(&tool)
        .arg("-ff")
        .uid(65534)
        .gid(65534)
        .spawn()
        .unwrap();
    let pid = child.id();
    child.wait_with_output().unwrap();
    let s = det
        .wait_for("reboot -ff as nobody", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == pid)
        })
        .await;
    let a = s.actor.unwrap();
    assert_eq!(
        (a.uid, a.euid, a.cap_sys_boot),
        (65534, Some(65534), Some(false))
    );
    assert!(s.forced);
    std::fs::remove_dir_all(&dir).ok();
}

/// A `#!` script named like a shutdown tool runs its interpreter: the
/// kernel reads the binary (the shell), so the script is no tool; what it
/// runs is judged in turn (here it exec's the tool, in the same process).
#[tokio::test]
async fn a_script_named_like_a_tool_is_judged_by_what_it_runs() {
    if !can_load_ebpf("script_tool") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tmpdir("script");
    let tool = stand_in(&dir.join("tools"), "reboot");
    let script = dir.join("reboot");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexec {} \"$@\"\n", tool.display()),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut det = load(NodePidNs::initial().unwrap());
    let child = Command::new(&script).arg("-ff").spawn().unwrap();
    let pid = child.id();
    child.wait_with_output().unwrap();
    let ours =
        |s: &lastgasp::signal::ShutdownSignal| s.actor.as_ref().is_some_and(|a| a.pid == pid);
    let s = det.wait_for("the script's exec", ours).await;
    let Detail::Exec { argv, binary, .. } = &s.detail else {
        panic!("{:?}", s.detail)
    };
    assert_eq!(
        argv.first().map(String::as_str),
        Some("/bin/sh"),
        "{argv:?}"
    );
    assert!(
        binary.as_deref().is_some_and(|b| b != "reboot"),
        "the interpreter ran: {binary:?}"
    );
    assert!(matches!(s.effect, Effect::None { .. }), "{:?}", s.effect);
    let s = det.wait_for("the tool it exec'd", ours).await;
    assert!(
        matches!(&s.detail, Detail::Exec { binary: Some(b), .. } if b == "reboot"),
        "{:?}",
        s.detail
    );
    assert_eq!(
        (s.kind, s.forced, s.effect.clone()),
        (Kind::Reboot, true, Effect::Now)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A container flooding the exec hook is rate-limited in the kernel, on a
/// ring buffer of its own: a node-scope record during the flood still
/// arrives, and the refused ones are counted.
#[tokio::test]
async fn a_container_flood_is_rate_limited_and_cannot_crowd_out_the_node() {
    if !can_load_ebpf("container_flood") {
        return;
    }
    let dir = tmpdir("flood");
    let tool = stand_in(&dir, "reboot");
    let mut det = load(NodePidNs::initial().unwrap());
    let flood = trigger(&["exec-loop-in-pidns", "2000", tool.to_str().unwrap(), "-ff"])
        .spawn()
        .unwrap();
    // A node-scope reboot(2) (bad magic: harmless) while the flood runs.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let child = trigger(&["bad-magic-reboot", "4321fedc"]).spawn().unwrap();
    let pid = child.id();
    child.wait_with_output().unwrap();
    let s = det
        .wait_for("the node's reboot(2) during the flood", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == pid)
        })
        .await;
    assert_eq!(s.scope, Scope::Node);
    flood.wait_with_output().unwrap();
    let d = det.det.drops_by_cause();
    println!("drops after 2000 container execs: {d:?}");
    assert!(d.container_rate_limited > 0, "{d:?}");
    assert_eq!(d.node_full, 0, "{d:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn signals_to_other_processes_are_not_reported() {
    if !can_load_ebpf("other_signals") {
        return;
    }
    let node = PidNsChild::spawn(&["fake-init"]);
    let mut det = load(NodePidNs::from_path(&node.pidns_path()).unwrap());
    let mut bystander = Command::new("sleep").arg("30").spawn().unwrap();
    send_signal(bystander.id(), libc::SIGRTMIN() + 4);
    bystander.wait().unwrap();
    send_signal(node.init_pid, libc::SIGRTMIN() + 4);
    let first = det.wait_for("any", |_| true).await;
    assert_eq!(first.source, Source::SignalPid1);
    assert_eq!(first.actor.unwrap().pid, std::process::id());
    assert_no_hook_errors(&det);
    node.ended();
}

/// A record that is not a hook's business (another process's signal, an
/// exec of anything else: the machine runs plenty meanwhile) is no error.
fn assert_no_hook_errors(det: &Signals) {
    let errors: Vec<_> = det
        .det
        .drops_by_cause()
        .hook_errors_by_label()
        .filter(|(_, n)| *n > 0)
        .collect();
    assert!(errors.is_empty(), "hook errors: {errors:?}");
}

struct ExecCase {
    argv: &'static [&'static str],
    kind: Kind,
    forced: bool,
}

/// Stand-ins named like the real tools: the kernel matches them by name and
/// captures their arguments; userspace decodes them.
#[tokio::test]
async fn exec_of_shutdown_tools_is_decoded() {
    if !can_load_ebpf("exec_tools") {
        return;
    }
    let dir = tmpdir("tools");
    let mut det = load(NodePidNs::initial().unwrap());
    let cases = [
        ExecCase {
            argv: &["systemctl", "poweroff"],
            kind: Kind::Poweroff,
            forced: false,
        },
        ExecCase {
            argv: &["systemctl", "poweroff", "--force", "--force"],
            kind: Kind::Poweroff,
            forced: true,
        },
        ExecCase {
            argv: &["systemctl", "start", "poweroff.target"],
            kind: Kind::Poweroff,
            forced: false,
        },
        ExecCase {
            argv: &["systemctl", "soft-reboot"],
            kind: Kind::SoftReboot,
            forced: false,
        },
        ExecCase {
            argv: &["systemctl", "kexec"],
            kind: Kind::Kexec,
            forced: false,
        },
        ExecCase {
            argv: &["shutdown", "-r", "+5"],
            kind: Kind::Reboot,
            forced: false,
        },
        ExecCase {
            argv: &["reboot", "-ff"],
            kind: Kind::Reboot,
            forced: true,
        },
        ExecCase {
            argv: &["halt", "-f"],
            kind: Kind::Halt,
            forced: true,
        },
        ExecCase {
            argv: &["poweroff"],
            kind: Kind::Poweroff,
            forced: false,
        },
        ExecCase {
            argv: &["init", "0"],
            kind: Kind::Poweroff,
            forced: false,
        },
        ExecCase {
            argv: &["telinit", "6"],
            kind: Kind::Reboot,
            forced: false,
        },
        ExecCase {
            argv: &["kexec", "-e"],
            kind: Kind::Kexec,
            forced: true,
        },
        ExecCase {
            argv: &["systemd-shutdown", "reboot"],
            kind: Kind::Reboot,
            forced: false,
        },
    ];
    for case in &cases {
        let tool = stand_in(&dir, case.argv[0]);
        let child = Command::new(&tool).args(&case.argv[1..]).spawn().unwrap();
        let pid = child.id();
        child.wait_with_output().unwrap();
        let what = case.argv.join(" ");
        let s = det
            .wait_for(&what, |s| s.actor.as_ref().is_some_and(|a| a.pid == pid))
            .await;
        assert_eq!(
            (s.source, s.kind, s.forced, s.scope),
            (Source::Exec, case.kind, case.forced, Scope::Node),
            "{what}"
        );
        let a = s.actor.as_ref().unwrap();
        let comm: String = case.argv[0].chars().take(15).collect();
        assert_eq!(a.comm, comm, "{what}");
        assert_eq!(
            a.parents.first().map(|p| p.pid),
            Some(std::process::id()),
            "{what}: spawned by the test"
        );
        match &s.detail {
            Detail::Exec {
                path,
                binary,
                argv,
                truncated,
                ..
            } => {
                assert_eq!(binary.as_deref(), Some(case.argv[0]), "{what}");
                assert_eq!(path, &tool.display().to_string());
                assert_eq!(argv[0], tool.display().to_string());
                assert_eq!(&argv[1..], &case.argv[1..]);
                assert!(!truncated);
            }
            d => panic!("{what}: {d:?}"),
        }
    }
    // `shutdown -c` cancels; `shutdown -k` only warns.
    for (args, effect) in [(&["-c"][..], "cancel"), (&["-k", "now"][..], "none")] {
        let child = Command::new(stand_in(&dir, "shutdown"))
            .args(args)
            .spawn()
            .unwrap();
        let pid = child.id();
        child.wait_with_output().unwrap();
        let s = det
            .wait_for("shutdown -c/-k", |s| {
                s.actor.as_ref().is_some_and(|a| a.pid == pid)
            })
            .await;
        let got = match s.effect {
            Effect::Cancel => "cancel",
            Effect::None { .. } => "none",
            _ => "other",
        };
        assert_eq!(got, effect, "shutdown {args:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A setuid-root program that is no shutdown tool, run by uid 65534
/// through a symlink named after each tool, and a setuid copy of a
/// non-tool named `reboot`: the kernel reads that the exec lent the
/// privilege (AT_SECURE) and which binary ran; nothing is proved, no
/// episode opens, and such records go to the rate-limited ring, not the
/// capable callers' one. Root's own exec of the same copy is unchanged.
#[tokio::test]
async fn privilege_an_exec_lends_proves_nothing() {
    if !can_load_ebpf("borrowed_privilege") {
        return;
    }
    use lastgasp::decide::{Action, Decider, Proof};
    use std::os::unix::{
        fs::{symlink, PermissionsExt},
        process::CommandExt,
    };
    let dir = tmpdir("setuid");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let setuid = |path: &std::path::Path| {
        std::fs::copy("/usr/bin/true", path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o4755)).unwrap();
    };
    let prog = dir.join("notatool");
    setuid(&prog);
    let copies = dir.join("copies");
    std::fs::create_dir_all(&copies).unwrap();
    std::fs::set_permissions(&copies, std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = copies.join("reboot");
    setuid(&copy);
    let mut det = load(NodePidNs::initial().unwrap());
    let nobody = |path: &std::path::Path, args: &[&str]| {
        let child = Command::new(path)
            .args(args)
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap();
        let pid = child.id();
        child.wait_with_output().unwrap();
        pid
    };
    let mut cases: Vec<(std::path::PathBuf, Vec<&str>, &str)> = Vec::new();
    for (name, args) in [
        ("poweroff", vec!["-f"]),
        ("reboot", vec!["-ff"]),
        ("halt", vec!["-f"]),
        ("shutdown", vec!["-h", "now"]),
        ("systemctl", vec!["poweroff", "-ff"]),
        ("init", vec!["0"]),
        ("telinit", vec!["0"]),
        ("kexec", vec!["-e"]),
        ("busybox", vec!["poweroff", "-f"]),
    ] {
        let link = dir.join(name);
        symlink(&prog, &link).unwrap();
        cases.push((link, args, "notatool"));
    }
    cases.push((copy.clone(), vec!["-ff"], "reboot"));
    for (path, args, binary) in &cases {
        let pid = nobody(path, args);
        let what = format!("{} {args:?} as uid 65534", path.display());
        let s = det
            .wait_for(&what, |s| s.actor.as_ref().is_some_and(|a| a.pid == pid))
            .await;
        let a = s.actor.clone().unwrap();
        assert_eq!(
            (a.uid, a.euid, a.cap_sys_boot, a.borrowed),
            (65534, Some(0), Some(true), Some(true)),
            "{what}: the setuid exec gives euid 0 and CAP_SYS_BOOT, lent"
        );
        assert!(
            matches!(&s.detail, Detail::Exec { binary: Some(b), .. } if b == binary),
            "{what}: {:?}",
            s.detail
        );
        let d = Decider::new().decide(&s);
        assert!(
            matches!(d.action, Action::AuditOnly { .. }) && d.episode.is_none(),
            "{what}: {:?}",
            d.action
        );
    }
    // Root runs the same copy: its own privilege, a direct tool's proof.
    let child = Command::new(&copy).arg("-ff").spawn().unwrap();
    let pid = child.id();
    child.wait_with_output().unwrap();
    let s = det
        .wait_for("root's reboot -ff", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == pid)
        })
        .await;
    assert_eq!(s.actor.as_ref().unwrap().borrowed, Some(false));
    let d = Decider::new().decide(&s);
    assert_eq!(
        d.episode.and_then(|e| e.death).map(|x| x.proof),
        Some(Proof::DirectTool)
    );
    // A loop of lent execs: rate-limited with the node's other callers.
    let before = det.det.drops_by_cause();
    for _ in 0..400 {
        nobody(&dir.join("poweroff"), &["-f"]);
    }
    let after = det.det.drops_by_cause();
    println!("drops after 400 lent execs: {after:?}");
    assert!(
        after.node_rate_limited > before.node_rate_limited,
        "{after:?}"
    );
    assert_eq!(after.capable_full, 0, "{after:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A capable caller's direct tool (a stand-in that never reboots) whose
/// exec the agent marks: its exit, or its exec of another program, is
/// reported by the kernel, and withdraws its proof (the record fails). One
/// that ended before it was marked cannot be marked. Unmarked tools' ends
/// are not reported.
#[tokio::test]
async fn a_direct_tools_end_withdraws_its_proof() {
    if !can_load_ebpf("tool_end") {
        return;
    }
    use lastgasp::decide::{Action, Decider, Proof};
    let dir = tmpdir("tool-end");
    let tool = dir.join("poweroff");
    std::fs::copy(trigger_bin(), &tool).unwrap();
    let mut det = load(NodePidNs::initial().unwrap());
    let start = |how: &str| {
        Command::new(&tool)
            .arg("-f")
            .env("LASTGASP_STANDIN", how)
            .spawn()
            .unwrap()
    };
    // Not marked: its end says nothing (every wait below would see it).
    let mut unmarked = start("sleep:100");
    let unmarked_pid = unmarked.id();
    let stray = move |s: &lastgasp::signal::ShutdownSignal| {
        let pid = s.actor.as_ref().map(|a| a.pid);
        assert!(
            !(s.source == Source::ToolEnd && pid == Some(unmarked_pid)),
            "an unmarked tool's end was reported: {s:?}"
        );
        pid
    };
    for (how, said) in [
        ("sleep:600".to_string(), "exited"),
        (
            "exec:600:/usr/bin/true".to_string(),
            "exec'd another program",
        ),
    ] {
        let mut child = start(&how);
        let pid = child.id();
        let s = det
            .wait_for("the tool's exec", |s| {
                s.source == Source::Exec && stray(s) == Some(pid)
            })
            .await;
        let mut d = Decider::new();
        let proof = d.decide(&s).episode.and_then(|e| e.death);
        assert_eq!(
            proof.map(|p| (p.proof, p.pid)),
            Some((Proof::DirectTool, Some(pid))),
            "{how}"
        );
        assert!(det.det.watch(pid), "{how}: still running, so marked");
        let end = det
            .wait_for("its end", |s| {
                s.source == Source::ToolEnd && stray(s) == Some(pid)
            })
            .await;
        assert_eq!(end.detail, Detail::ToolEnd { how: said.into() }, "{how}");
        let a = d.decide(&end).action;
        assert!(matches!(a, Action::Fail { .. }), "{how}: {a:?}");
        child.wait().unwrap();
    }
    unmarked.wait().unwrap();
    // Ended before it was marked.
    let mut child = start("sleep:0");
    let pid = child.id();
    child.wait().unwrap();
    det.wait_for("the quick tool's exec", |s| {
        s.source == Source::Exec && stray(s) == Some(pid)
    })
    .await;
    assert!(!det.det.watch(pid), "gone: nothing to mark");
    assert_no_hook_errors(&det);
    std::fs::remove_dir_all(&dir).ok();
}

/// Execs that do not name a tool never reach userspace; busybox counts only
/// with a shutdown applet.
#[tokio::test]
async fn other_execs_are_filtered_in_the_kernel() {
    if !can_load_ebpf("exec_filter") {
        return;
    }
    let dir = tmpdir("filter");
    let mut det = load(NodePidNs::initial().unwrap());
    for name in ["ls", "systemctl2", "rebooter", "xreboot", "shutdownd"] {
        Command::new(stand_in(&dir, name))
            .arg("poweroff")
            .status()
            .unwrap();
    }
    Command::new(stand_in(&dir, "busybox"))
        .args(["ls", "-l"])
        .status()
        .unwrap();
    let child = Command::new(stand_in(&dir, "busybox"))
        .args(["reboot", "-f"])
        .spawn()
        .unwrap();
    let pid = child.id();
    child.wait_with_output().unwrap();
    let first = det.wait_for("anything", |_| true).await;
    assert_eq!(
        first.actor.as_ref().unwrap().pid,
        pid,
        "the first record must be busybox reboot, got {first:#?}"
    );
    assert_eq!((first.kind, first.forced), (Kind::Reboot, true));
    assert_no_hook_errors(&det);
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn exec_in_a_child_pid_namespace_is_container_scope() {
    if !can_load_ebpf("exec_container") {
        return;
    }
    let dir = tmpdir("ctr");
    let mut det = load(NodePidNs::initial().unwrap());
    let tool = stand_in(&dir, "reboot");
    let child = PidNsChild::spawn(&["exec-in-pidns", tool.to_str().unwrap(), "-f"]);
    let pid = child.init_pid;
    assert_eq!(child.ended(), "exit 0");
    let s = det
        .wait_for("reboot -f in a pid ns", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == pid)
        })
        .await;
    assert_eq!(
        (s.source, s.kind, s.scope),
        (Source::Exec, Kind::Reboot, Scope::Container)
    );
    assert_eq!(s.actor.unwrap().ns_pid, 0);
    std::fs::remove_dir_all(&dir).ok();
}

/// A path longer than the capture keeps its tail, so the tool is still named.
#[tokio::test]
async fn long_paths_and_long_argv_are_cut_not_lost() {
    if !can_load_ebpf("exec_long") {
        return;
    }
    let mut dir = tmpdir("long");
    for _ in 0..4 {
        dir.push("a-rather-long-directory-name-to-push-the-path-past-the-limit");
    }
    let mut det = load(NodePidNs::initial().unwrap());
    let tool = stand_in(&dir, "systemctl");
    let long_arg = "x".repeat(300);
    let child = Command::new(&tool)
        .args(["poweroff", &long_arg])
        .spawn()
        .unwrap();
    let pid = child.id();
    child.wait_with_output().unwrap();
    let s = det
        .wait_for("long exec", |s| {
            s.actor.as_ref().is_some_and(|a| a.pid == pid)
        })
        .await;
    match &s.detail {
        Detail::Exec {
            path,
            truncated,
            raw,
            ..
        } => {
            assert!(
                path.starts_with("...") && path.ends_with("/systemctl"),
                "{path}"
            );
            assert!(*truncated);
            assert!(raw.len() >= 256);
        }
        d => panic!("{d:?}"),
    }
    assert_eq!(s.kind, Kind::Unknown, "a cut argv decodes as unknown");
    std::fs::remove_dir_all(tmpdir("long")).ok();
}

/// The programs read tracepoint fields at fixed offsets (lastgasp_common::tp);
/// this kernel's format files must agree.
#[test]
fn tracepoint_field_offsets_match_this_kernel() {
    if !can_load_ebpf("tracepoint_offsets") {
        return;
    }
    use lastgasp_common::tp;
    let tracefs = lastgasp::node::ensure_tracefs().unwrap();
    let offset = |event: &str, field: &str| -> usize {
        let fmt =
            std::fs::read_to_string(tracefs.join("events").join(event).join("format")).unwrap();
        let line = fmt
            .lines()
            .find(|l| {
                l.contains("field:") && l.split(';').next().unwrap().ends_with(&format!(" {field}"))
            })
            .unwrap_or_else(|| panic!("no {field} in {event}:\n{fmt}"));
        line.split("offset:")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        offset("syscalls/sys_enter_reboot", "magic1"),
        tp::SYSCALL_ARG0
    );
    assert_eq!(
        offset("syscalls/sys_enter_reboot", "magic2"),
        tp::SYSCALL_ARG0 + 8
    );
    assert_eq!(
        offset("syscalls/sys_enter_reboot", "cmd"),
        tp::SYSCALL_ARG0 + 16
    );
    assert_eq!(offset("syscalls/sys_exit_reboot", "ret"), tp::SYSCALL_RET);
    assert_eq!(
        offset("sched/sched_process_exec", "filename"),
        tp::EXEC_FILENAME_LOC
    );
    assert_eq!(offset("signal/signal_generate", "sig"), tp::SIG_SIG);
    assert_eq!(offset("signal/signal_generate", "code"), tp::SIG_CODE);
    assert_eq!(offset("signal/signal_generate", "pid"), tp::SIG_PID);
    assert_eq!(offset("signal/signal_generate", "group"), tp::SIG_GROUP);
    assert_eq!(offset("signal/signal_generate", "result"), tp::SIG_RESULT);
}
