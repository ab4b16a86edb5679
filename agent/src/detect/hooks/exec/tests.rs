//! The exec decoder against each tool's command lines.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{
    super::expect::{assert_intent, direct, forced, logind, none, rebooting},
    getopt::*,
    tools::*,
    *,
};
use crate::{
    detect::hooks::{
        reboot::{decode_reboot, REBOOT_MAGIC1, REBOOT_MAGIC2},
        signal::{decode_signal_to_init, signal_name},
    },
    signal::{Effect, Kind},
};

fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

fn bytes<'a>(argv: &[&'a str]) -> Vec<&'a [u8]> {
    argv.iter().map(|a| a.as_bytes()).collect()
}

/// Decodes `argv` exec'd from `path`.
fn run(path: &str, argv: &[&str]) -> Intent {
    decode_exec(path.as_bytes(), None, &bytes(argv), false, now())
}

/// Decodes a space-separated command line; the path is argv[0] when it has a slash,
/// else /usr/sbin/argv[0].
fn exec(line: &str) -> Intent {
    let argv: Vec<&str> = line.split(' ').collect();
    let path = match argv[0] {
        p if p.contains('/') => p.to_string(),
        p => format!("/usr/sbin/{p}"),
    };
    run(&path, &argv)
}

fn unclear() -> Intent {
    Intent::unclear()
}

fn cancel() -> Intent {
    Intent::new(Kind::Unknown, Effect::Cancel, false, false)
}

/// Scheduled `secs` from now (`None`: not computable), via logind.
fn sched(kind: Kind, secs: Option<u64>, spec: &str) -> Intent {
    let at = secs.map(|s| now() + Duration::from_secs(s));
    Intent::new(kind, scheduled(at, spec), false, false)
}

fn check(cases: &[(&str, Intent)]) {
    for (line, want) in cases {
        assert_intent(line, &exec(line), want);
    }
}

#[test]
fn systemctl_verbs() {
    use Kind::*;
    check(&[
        ("systemctl poweroff", logind(Poweroff)),
        ("systemctl reboot", logind(Reboot)),
        ("systemctl halt", logind(Halt)),
        ("systemctl kexec", logind(Kexec)),
        ("systemctl soft-reboot", logind(SoftReboot)),
        ("/usr/bin/systemctl poweroff", logind(Poweroff)),
        ("systemctl -- poweroff", logind(Poweroff)),
        ("systemctl reboot recovery", logind(Reboot)),
        ("systemctl poweroff now", none(Unknown)),
        ("systemctl exit", none(Unknown)),
        ("systemctl", none(Unknown)),
        ("systemctl status", none(Unknown)),
        ("systemctl suspend", none(Unknown)),
        ("systemctl hibernate", none(Unknown)),
        ("systemctl list-units", none(Unknown)),
        ("systemctl stop poweroff.target", none(Unknown)),
    ]);
}

#[test]
fn systemctl_force() {
    use Kind::*;
    check(&[
        ("systemctl poweroff --force", forced(Poweroff)),
        ("systemctl poweroff --force --force", rebooting(Poweroff)),
        ("systemctl reboot -ff", rebooting(Reboot)),
        ("systemctl -f -f reboot", rebooting(Reboot)),
        ("systemctl --force halt", forced(Halt)),
        ("systemctl kexec -f", forced(Kexec)),
        ("systemctl poweroff --forc", forced(Poweroff)), // getopt takes a unique prefix
        ("systemctl poweroff --force --when=+5min", forced(Poweroff)),
        // systemd's soft-reboot ignores --force and asks logind
        ("systemctl soft-reboot --force", logind(SoftReboot)),
    ]);
}

#[test]
fn systemctl_units() {
    use Kind::*;
    check(&[
        ("systemctl start poweroff.target", direct(Poweroff)),
        ("systemctl isolate reboot.target", direct(Reboot)),
        ("systemctl isolate reboot", direct(Reboot)),
        ("systemctl restart halt.target", direct(Halt)),
        ("systemctl reload-or-restart kexec.target", direct(Kexec)),
        ("systemctl start soft-reboot.target", direct(SoftReboot)),
        ("systemctl start ctrl-alt-del.target", direct(Reboot)),
        ("systemctl start shutdown.target", direct(Unknown)),
        ("systemctl start systemd-poweroff.service", direct(Poweroff)),
        ("systemctl start systemd-poweroff", direct(Poweroff)),
        ("systemctl start systemd-reboot.service", direct(Reboot)),
        ("systemctl start systemd-halt", direct(Halt)),
        ("systemctl start systemd-kexec.service", direct(Kexec)),
        (
            "systemctl start systemd-soft-reboot.service",
            direct(SoftReboot),
        ),
        ("systemctl start nginx poweroff.target", direct(Poweroff)),
        ("systemctl --no-block start reboot.target", direct(Reboot)),
        (
            "systemctl start --job-mode replace-irreversibly reboot.target",
            direct(Reboot),
        ),
        (
            "systemctl start --job-mode=fail reboot.target",
            direct(Reboot),
        ),
        ("systemctl start -f poweroff.target", direct(Poweroff)),
        // without a suffix start means poweroff.service, isolate systemd-reboot.target
        ("systemctl start poweroff", none(Unknown)),
        ("systemctl isolate systemd-reboot", none(Unknown)),
        ("systemctl start nginx.service", none(Unknown)),
        ("systemctl start", none(Unknown)),
    ]);
}

#[test]
fn systemctl_when() {
    use Kind::*;
    check(&[
        (
            "systemctl poweroff --when=+5min",
            sched(Poweroff, Some(300), "+5min"),
        ),
        (
            "systemctl reboot --when=+1h30min",
            sched(Reboot, Some(5400), "+1h30min"),
        ),
        (
            "systemctl reboot --when=+1.5h",
            sched(Reboot, Some(5400), "+1.5h"),
        ),
        (
            "systemctl reboot --when +90",
            sched(Reboot, Some(90), "+90"),
        ),
        (
            "systemctl reboot --when=@1700003600",
            sched(Reboot, Some(3600), "@1700003600"),
        ),
        ("systemctl halt --when=auto", sched(Halt, None, "auto")),
        (
            "systemctl halt --when=tomorrow",
            sched(Halt, None, "tomorrow"),
        ),
        ("systemctl poweroff --when=now", logind(Poweroff)),
        ("systemctl poweroff --when=-5min", logind(Poweroff)),
        ("systemctl poweroff --when=+x", none(Unknown)),
        ("systemctl poweroff --when=+5parsecs", none(Unknown)),
        ("systemctl poweroff --when=cancel", cancel()),
        ("systemctl poweroff --when=", cancel()),
        ("systemctl --when=cancel", cancel()),
        ("systemctl --when=cancel --frobnicate", cancel()), // systemctl stops reading there
        ("systemctl poweroff --when=show", none(Unknown)),
    ]);
    let got = run(
        "/usr/bin/systemctl",
        &["systemctl", "reboot", "--when=+5 min"],
    );
    assert_intent("+5 min", &got, &sched(Kind::Reboot, Some(300), "+5 min"));
}

#[test]
fn systemctl_elsewhere_or_dry() {
    use Kind::*;
    check(&[
        ("systemctl -H host poweroff", none(Poweroff)),
        ("systemctl --host=host poweroff", none(Poweroff)),
        ("systemctl poweroff -Hroot@host", none(Poweroff)),
        ("systemctl -M container reboot", none(Reboot)),
        ("systemctl --machine container reboot", none(Reboot)),
        ("systemctl -M .host reboot", logind(Reboot)),
        ("systemctl --user poweroff", none(Unknown)),
        ("systemctl --global poweroff", none(Unknown)),
        ("systemctl --user --system poweroff", logind(Poweroff)),
        ("systemctl -C foo poweroff", none(Unknown)),
        ("systemctl --root=/mnt poweroff", none(Unknown)),
        ("systemctl --image /img poweroff", none(Unknown)),
        ("systemctl --dry-run poweroff", none(Poweroff)),
        ("systemctl -h", none(Unknown)),
        ("systemctl poweroff --help", none(Unknown)),
        ("systemctl --version", none(Unknown)),
    ]);
}

#[test]
fn systemctl_options() {
    use Kind::*;
    check(&[
        ("systemctl poweroff --no-wall", logind(Poweroff)),
        ("systemctl --no-block poweroff", logind(Poweroff)),
        ("systemctl -i reboot", logind(Reboot)),
        ("systemctl reboot --check-inhibitors=no", logind(Reboot)),
        ("systemctl reboot --check-inhibitors no", logind(Reboot)),
        ("systemctl -q poweroff", logind(Poweroff)),
        ("systemctl -qi poweroff", logind(Poweroff)),
        ("systemctl poweroff --message=bye", logind(Poweroff)),
        ("systemctl --message bye poweroff", logind(Poweroff)),
        ("systemctl reboot --firmware-setup", logind(Reboot)),
        ("systemctl reboot --boot-loader-menu=10", logind(Reboot)),
        ("systemctl reboot --boot-loader-entry=foo", logind(Reboot)),
        (
            "systemctl reboot --reboot-argument=recovery",
            logind(Reboot),
        ),
        (
            "systemctl reboot --reboot-argument recovery",
            logind(Reboot),
        ),
        ("systemctl -o json reboot", logind(Reboot)),
        ("systemctl -ojson reboot", logind(Reboot)),
        ("systemctl --job-mode replace reboot", logind(Reboot)),
        ("systemctl -s KILL -n 5 reboot", logind(Reboot)),
        // refused or unknown: the caller keeps the raw
        ("systemctl poweroff --frobnicate", unclear()),
        ("systemctl -Z poweroff", unclear()),
        ("systemctl -fZ poweroff", unclear()),
        ("systemctl poweroff --no-w", unclear()), // ambiguous: --no-wall, --no-warn
        ("systemctl poweroff --force=yes", unclear()),
        ("systemctl poweroff -H", unclear()),
        ("systemctl poweroff --message", unclear()),
    ]);
}

#[test]
fn shutdown_forms() {
    use Kind::*;
    check(&[
        ("shutdown", sched(Poweroff, Some(60), "+1")),
        ("shutdown -h now", logind(Poweroff)),
        ("shutdown now", logind(Poweroff)),
        ("shutdown -P now", logind(Poweroff)),
        ("shutdown --poweroff now", logind(Poweroff)),
        ("shutdown -r now", logind(Reboot)),
        ("shutdown --reboot now", logind(Reboot)),
        ("shutdown -K now", logind(Kexec)),
        ("shutdown --kexec now", logind(Kexec)),
        ("shutdown --halt now", logind(Halt)),
        ("shutdown -H -h now", logind(Halt)),
        ("shutdown -h -H now", logind(Halt)),
        ("shutdown -r -h now", logind(Poweroff)), // -h overrides all but --halt
        ("shutdown -r", sched(Reboot, Some(60), "+1")),
        ("shutdown -r +5", sched(Reboot, Some(300), "+5")),
        ("shutdown -r 5", sched(Reboot, Some(300), "5")),
        ("shutdown -r +010", sched(Reboot, Some(480), "+010")), // C syntax: octal
        ("shutdown -r +0", logind(Reboot)),
        ("shutdown +5 -r", sched(Reboot, Some(300), "+5")),
        // Past year 9999 (any user may run it): unknown, never unwritable.
        (
            "shutdown -h +99999999999",
            sched(Poweroff, None, "+99999999999"),
        ),
        (
            "systemctl poweroff --when=+100000y",
            sched(Poweroff, None, "+100000y"),
        ),
        ("shutdown -H 22:30", sched(Halt, None, "22:30")),
        ("shutdown 7:05", sched(Poweroff, None, "7:05")),
        ("shutdown 00:00", sched(Poweroff, None, "00:00")),
        ("shutdown -c", cancel()),
        ("shutdown -c bye", cancel()),
        ("shutdown -c +x", cancel()),
        ("shutdown -k now", none(Poweroff)),
        ("shutdown -k -r +5", none(Reboot)),
        ("shutdown --show", none(Unknown)),
        ("shutdown --help", none(Unknown)),
        ("shutdown --no-wall -r now", logind(Reboot)),
        ("shutdown -t 5 -r now", logind(Reboot)),
        ("shutdown -t5 -r now", logind(Reboot)),
        ("shutdown -a -f -F now", logind(Poweroff)),
        ("shutdown -r now -- -q", logind(Reboot)),
        ("shutdown +x", none(Unknown)),
        ("shutdown 25:00", none(Unknown)),
        ("shutdown 12:60", none(Unknown)),
        ("shutdown 12:", none(Unknown)),
        ("shutdown -1", unclear()), // an option to getopt
        ("shutdown -r now -q", unclear()),
        ("shutdown --frobnicate", unclear()),
        ("shutdown -t", unclear()),
    ]);
    let wall = run("/sbin/shutdown", &["shutdown", "-r", "+5", "wall msg"]);
    assert_intent("wall", &wall, &sched(Kind::Reboot, Some(300), "+5"));
}

#[test]
fn halt_reboot_poweroff() {
    use Kind::*;
    check(&[
        ("halt", logind(Halt)),
        ("reboot", logind(Reboot)),
        ("poweroff", logind(Poweroff)),
        ("/sbin/halt -f", rebooting(Halt)),
        ("halt -f", rebooting(Halt)),
        ("halt -p", logind(Poweroff)),
        ("halt -p -f", rebooting(Poweroff)),
        ("halt --poweroff", logind(Poweroff)),
        ("reboot -p", logind(Reboot)), // -p does not turn a reboot into a power-off
        ("reboot -ff", rebooting(Reboot)),
        ("reboot -f -f", rebooting(Reboot)),
        ("reboot --force", rebooting(Reboot)),
        ("poweroff -f", rebooting(Poweroff)),
        ("poweroff --reboot", logind(Reboot)),
        ("poweroff --halt", logind(Halt)),
        ("reboot --halt", logind(Halt)),
        ("poweroff -w", none(Poweroff)),
        ("poweroff --wtmp-only", none(Poweroff)),
        ("poweroff -w -f", none(Poweroff)),
        ("reboot -d", logind(Reboot)),
        ("reboot -n", logind(Reboot)),
        ("reboot --no-wtmp --no-sync --no-wall", logind(Reboot)),
        ("halt -i -h", logind(Halt)),
        ("reboot recovery", logind(Reboot)),
        ("poweroff --reboot recovery", logind(Reboot)),
        ("reboot a b", none(Unknown)),
        ("poweroff now", none(Unknown)),
        ("reboot --help", none(Unknown)),
        ("reboot --frobnicate", unclear()),
        ("halt -x", unclear()),
    ]);
}

#[test]
fn argv0_names_the_tool() {
    use Kind::*;
    assert_intent(
        "argv0 reboot",
        &run("/usr/bin/systemctl", &["reboot"]),
        &logind(Reboot),
    );
    assert_intent(
        "argv0 reboot -f",
        &run("/usr/bin/systemctl", &["reboot", "-f"]),
        &rebooting(Reboot),
    );
    assert_intent(
        "argv0 systemctl",
        &run("/sbin/reboot", &["systemctl", "poweroff"]),
        &logind(Poweroff),
    );
    assert_intent(
        "argv0 odd",
        &run("/sbin/reboot", &["foo", "-f"]),
        &rebooting(Reboot),
    );
    assert_intent(
        "argv0 path",
        &run("/usr/bin/systemctl", &["/usr/sbin/shutdown", "now"]),
        &logind(Poweroff),
    );
    assert_intent(
        "busybox link",
        &run("/bin/busybox", &["reboot", "-f"]),
        &rebooting(Reboot),
    );
    assert_intent(
        "busybox link",
        &run("/bin/busybox", &["poweroff"]),
        &direct(Poweroff),
    );
    assert_intent(
        "not a tool",
        &run("/usr/bin/ls", &["ls", "-l"]),
        &none(Unknown),
    );
    assert_intent(
        "not a tool",
        &run("/usr/bin/sleep", &["sleep", "5"]),
        &none(Unknown),
    );
}

#[test]
fn init_telinit() {
    use Kind::*;
    check(&[
        ("init 0", direct(Poweroff)),
        ("telinit 6", direct(Reboot)),
        ("/sbin/telinit 0", direct(Poweroff)),
        ("telinit --no-wall 0", direct(Poweroff)),
        ("init 3", none(Unknown)),
        ("init 1", none(Unknown)),
        ("telinit S", none(Unknown)),
        ("telinit s", none(Unknown)),
        ("telinit 5", none(Unknown)),
        ("telinit q", none(Unknown)),
        ("telinit U", none(Unknown)),
        ("telinit x", none(Unknown)),
        ("/sbin/init splash", none(Unknown)),
        ("/sbin/init", none(Unknown)),
        ("init --system --deserialize 23", none(Unknown)),
        ("init 0 6", none(Unknown)),
        ("init 06", none(Unknown)),
    ]);
}

#[test]
fn kexec_forms() {
    use Kind::*;
    check(&[
        ("kexec -e", rebooting(Kexec)),
        ("kexec --exec", rebooting(Kexec)),
        ("kexec -x -e", rebooting(Kexec)),
        ("kexec -f /boot/vmlinuz", rebooting(Kexec)),
        ("kexec -l /boot/vmlinuz -e", rebooting(Kexec)),
        ("kexec -l /boot/vmlinuz", none(Unknown)),
        ("kexec -e -l /boot/vmlinuz", none(Unknown)),
        (
            "kexec -l /boot/vmlinuz --append=root=/dev/sda1 --initrd=/boot/initrd",
            none(Unknown),
        ),
        (
            "kexec -l /boot/vmlinuz --initrd /boot/initrd --reuse-cmdline",
            none(Unknown),
        ),
        ("kexec --noefi -l /boot/vmlinuz", none(Unknown)),
        ("kexec -t bzImage -l /boot/vmlinuz", none(Unknown)),
        ("kexec -p /boot/vmlinuz", none(Unknown)),
        ("kexec --load-panic /boot/vmlinuz", none(Unknown)),
        ("kexec -u", none(Unknown)),
        ("kexec -s -l /boot/vmlinuz", none(Unknown)),
        ("kexec -c -l /boot/vmlinuz", none(Unknown)),
        ("kexec -S", none(Unknown)),
        ("kexec -h", none(Unknown)),
        ("kexec", none(Unknown)),
        // loads, then runs `shutdown -r now`
        ("kexec /boot/vmlinuz", logind(Kexec)),
        ("kexec -Z", unclear()),
    ]);
}

#[test]
fn busybox_applets() {
    use Kind::*;
    let in_secs = |kind, secs: u64, forced: bool| {
        let at = Some(now() + Duration::from_secs(secs));
        let intent = Intent::new(kind, scheduled(at, &format!("-d {secs}")), forced, true);
        // `-f`: when the delay is over, busybox calls reboot(2) itself.
        if forced {
            intent.calling_reboot()
        } else {
            intent
        }
    };
    check(&[
        ("busybox reboot -f", rebooting(Reboot)),
        ("/bin/busybox reboot -f", rebooting(Reboot)),
        ("busybox /sbin/reboot -f", rebooting(Reboot)),
        ("busybox reboot", direct(Reboot)),
        ("busybox halt", direct(Halt)),
        ("busybox poweroff -n", direct(Poweroff)),
        ("busybox poweroff -d 10", in_secs(Poweroff, 10, false)),
        ("busybox halt -d10 -f", in_secs(Halt, 10, true)),
        ("busybox poweroff -d 0", direct(Poweroff)),
        ("busybox halt -w", none(Halt)),
        ("busybox poweroff -d x", none(Unknown)),
        ("busybox poweroff -d -5", none(Unknown)),
        ("busybox poweroff -d", unclear()),
        ("busybox reboot --force", unclear()),
        ("busybox ls", none(Unknown)),
        ("busybox shutdown", none(Unknown)),
        ("busybox", none(Unknown)),
    ]);
}

#[test]
fn systemd_shutdown_forms() {
    use Kind::*;
    check(&[
        (
            "/usr/lib/systemd/systemd-shutdown poweroff --timeout 90s",
            logind(Poweroff),
        ),
        (
            "/usr/lib/systemd/systemd-shutdown reboot --log-level info --log-target kmsg \
             --log-color --log-location --log-time=yes --exit-code 0",
            logind(Reboot),
        ),
        ("/usr/lib/systemd/systemd-shutdown halt", logind(Halt)),
        (
            "/usr/lib/systemd/systemd-shutdown kexec --timeout=90s",
            logind(Kexec),
        ),
        (
            "/usr/lib/systemd/systemd-shutdown exit --exit-code 3",
            none(Unknown),
        ),
        ("/usr/lib/systemd/systemd-shutdown", unclear()),
        ("/usr/lib/systemd/systemd-shutdown frobnicate", unclear()),
        (
            "/usr/lib/systemd/systemd-shutdown poweroff --bogus",
            unclear(),
        ),
    ]);
}

#[test]
fn not_utf8() {
    let now = now();
    let argv: [&[u8]; 2] = [b"systemctl", b"\xffpoweroff"];
    assert_eq!(
        decode_exec(b"/usr/bin/systemctl", None, &argv, false, now),
        unclear()
    );
    let argv: [&[u8]; 3] = [b"systemctl", b"start", b"\xff.target"];
    assert_eq!(
        decode_exec(b"/usr/bin/systemctl", None, &argv, false, now),
        unclear()
    );
    let argv: [&[u8]; 3] = [b"systemctl", b"poweroff", b"--when=+\xff"];
    assert_eq!(
        decode_exec(b"/usr/bin/systemctl", None, &argv, false, now),
        unclear()
    );
    let argv: [&[u8]; 3] = [b"systemctl", b"poweroff", b"--\xff"];
    assert_eq!(
        decode_exec(b"/usr/bin/systemctl", None, &argv, false, now),
        unclear()
    );
    let argv: [&[u8]; 3] = [b"shutdown", b"-r", b"+\xff"];
    assert_eq!(
        decode_exec(b"/sbin/shutdown", None, &argv, false, now),
        unclear()
    );
    let argv: [&[u8]; 4] = [b"busybox", b"poweroff", b"-d", b"\xff"];
    assert_eq!(
        decode_exec(b"/bin/busybox", None, &argv, false, now),
        unclear()
    );
    // Wall text and reboot arguments are not read.
    let argv: [&[u8]; 4] = [b"shutdown", b"-r", b"now", b"\xff\xfe bye"];
    assert_eq!(
        decode_exec(b"/sbin/shutdown", None, &argv, false, now),
        logind(Kind::Reboot)
    );
    let argv: [&[u8]; 2] = [b"reboot", b"\xff"];
    assert_eq!(
        decode_exec(b"/sbin/reboot", None, &argv, false, now),
        logind(Kind::Reboot)
    );
    let argv: [&[u8]; 2] = [b"\xff", b"-f"];
    assert_eq!(
        decode_exec(b"/sbin/halt", None, &argv, false, now),
        rebooting(Kind::Halt)
    );
}

#[test]
fn truncated_capture() {
    use Kind::*;
    let cut =
        |path: &str, argv: &[&str]| decode_exec(path.as_bytes(), None, &bytes(argv), true, now());
    assert_eq!(
        cut("/usr/bin/systemctl", &["systemctl", "poweroff", "--forc"]),
        unclear()
    );
    assert_eq!(
        cut("/usr/bin/systemctl", &["systemctl", "status", "ngi"]),
        unclear()
    );
    assert_eq!(cut("/sbin/reboot", &["reboot", "-f"]), unclear());
    assert_eq!(cut("/sbin/init", &["init", "0"]), unclear());
    assert_eq!(cut("/bin/busybox", &["busybox", "reb"]), unclear());
    assert_eq!(cut("/sbin/kexec", &["kexec", "-e"]), unclear());
    assert_eq!(cut("/sbin/reboot", &[]), unclear());
    assert_eq!(cut("/sbin/shutdown", &["shutd"]), unclear());
    assert_eq!(cut("/sbin/shutdown", &["shutdown", "-r", "+"]), unclear());
    assert_eq!(cut("/sbin/shutdown", &["shutdown", "-r", "-"]), unclear());
    assert_eq!(
        cut("/sbin/shutdown", &["shutdown", "-r", "now", "-"]),
        unclear()
    );
    assert_eq!(
        cut("/sbin/shutdown", &["shutdown", "-r", "now", "-k"]),
        unclear()
    );
    assert_eq!(cut("/sbin/shutdown", &["shutdown", "-t"]), unclear());
    // Cut inside the wall message: still decoded.
    let got = cut(
        "/sbin/shutdown",
        &["shutdown", "-r", "+5", "going down for maint"],
    );
    assert_eq!(got, sched(Reboot, Some(300), "+5"));
    let got = cut("/sbin/shutdown", &["shutdown", "-h", "now", "a", "b", "c"]);
    assert_eq!(got, logind(Poweroff));
    assert_eq!(
        cut("/sbin/shutdown", &["shutdown", "-c", "never mi"]),
        cancel()
    );
    // Not a shutdown tool at all: the exec'd file decides.
    assert_intent("cut ls", &cut("/usr/bin/ls", &["ls", "-"]), &none(Unknown));
}

#[test]
fn empty_argv() {
    use Kind::*;
    let empty = |path: &str| decode_exec(path.as_bytes(), None, &[], false, now());
    assert_eq!(empty("/sbin/reboot"), logind(Reboot));
    assert_eq!(empty("in/poweroff"), logind(Poweroff)); // a tail of the path
    assert_eq!(empty("/sbin/shutdown"), sched(Poweroff, Some(60), "+1"));
    assert_intent("systemctl", &empty("/usr/bin/systemctl"), &none(Unknown));
    assert_intent("busybox", &empty("/bin/busybox"), &none(Unknown));
    assert_intent("init", &empty("/sbin/init"), &none(Unknown));
    assert_intent("nothing", &empty(""), &none(Unknown));
    assert_intent("dir", &empty("/sbin/"), &none(Unknown));
}

/// xorshift64: a tiny deterministic generator for the garbage tests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn garbage_never_panics() {
    const WORDS: &[&[u8]] = &[
        b"systemctl",
        b"shutdown",
        b"reboot",
        b"poweroff",
        b"halt",
        b"init",
        b"telinit",
        b"kexec",
        b"busybox",
        b"systemd-shutdown",
        b"start",
        b"isolate",
        b"poweroff.target",
        b"-",
        b"--",
        b"-f",
        b"-ff",
        b"--force",
        b"--when",
        b"--when=",
        b"--when=+5min",
        b"--when=+",
        b"--when=@",
        b"+",
        b"+5",
        b"+0x",
        b"0x",
        b"-0",
        b"now",
        b":",
        b"23:59",
        b"-d",
        b"-t",
        b"-H",
        b"-M",
        b"--job-mode",
        b"=",
        b"--=",
        b"-=",
        b"\xff",
        b"\xce\xbc",
        b"0",
        b"6",
        b"-e",
        b"-l",
        b"--append",
        b"--log-color=",
        b"1.",
        b".5",
        b"99999999999999999999",
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..4000 {
        let raw: Vec<u8> = (0..rng.below(300)).map(|_| rng.next() as u8).collect();
        let argv = split_argv(&raw);
        let _ = escape_bytes(&raw);
        let _ = decode_exec(&raw, None, &argv, round % 2 == 0, now());
        let _ = decode_exec(b"/usr/bin/systemctl", None, &argv, round % 3 == 0, now());

        let argv: Vec<&[u8]> = (0..rng.below(8))
            .map(|_| WORDS[rng.below(WORDS.len())])
            .collect();
        let path = WORDS[rng.below(WORDS.len())];
        let _ = decode_exec(path, None, &argv, round % 5 == 0, now());
        let _ = decode_exec(path, None, &argv, false, UNIX_EPOCH);
        let far = UNIX_EPOCH + Duration::from_secs(i64::MAX as u64 / 4);
        let _ = decode_exec(path, None, &argv, false, far);

        let (a, b, c) = (rng.next() as u32, rng.next() as u32, rng.next() as u32);
        let _ = decode_reboot(a, b, c);
        let _ = decode_reboot(REBOOT_MAGIC1, REBOOT_MAGIC2[round % 4], c);
        let _ = decode_signal_to_init(a);
        let _ = signal_name(b);
    }
}

#[test]
fn argv_splitting_and_escaping() {
    let none: Vec<&[u8]> = Vec::new();
    assert_eq!(split_argv(b""), none);
    assert_eq!(split_argv(b"a\0b\0"), [&b"a"[..], b"b"]);
    assert_eq!(split_argv(b"a\0b"), [&b"a"[..], b"b"]);
    assert_eq!(split_argv(b"\0"), [&b""[..]]);
    assert_eq!(split_argv(b"a\0\0b\0"), [&b"a"[..], b"", b"b"]);
    assert_eq!(escape_bytes(b"ab c~"), "ab c~");
    assert_eq!(escape_bytes(b"a\0b\xff\n\\x"), "a\\0b\\xff\\x0a\\\\x");
    assert_eq!(escape_bytes(b""), "");
}

#[test]
fn getopt_reader() {
    let args = bytes(&["-ab", "--c=1", "x", "--", "-d"]);
    let spec = Spec {
        short: "ab",
        long: &[("cat", Val::Req)],
        lenient_long: false,
    };
    let toks = tokenize(&args, &spec);
    assert_eq!(
        toks,
        [
            Tok::Short(b'a', None),
            Tok::Short(b'b', None),
            Tok::Long("cat", Some(&b"1"[..])),
            Tok::Pos(2, b"x"),
            Tok::Pos(4, b"-d"),
        ]
    );
    assert_eq!(tokenize(&bytes(&["-:"]), &spec), [Tok::Bad]);
    assert_eq!(tokenize(&bytes(&["--"]), &spec), []);
}

/// The binary really executed names the tool: a symlink or a script
/// named like one is not one; a multi-call binary acts as its argv[0]
/// names it, another binary ignores argv[0].
#[test]
fn the_binary_names_the_tool() {
    let bin = |path: &str, binary: &str, argv: &[&str]| {
        decode_exec(
            path.as_bytes(),
            Some(binary.as_bytes()),
            &bytes(argv),
            false,
            now(),
        )
    };
    // `ln -s /usr/bin/passwd /tmp/poweroff; /tmp/poweroff -f`
    let i = bin("/tmp/poweroff", "passwd", &["/tmp/poweroff", "-f"]);
    assert!(
        matches!(&i.effect, Effect::None { why } if why == "poweroff runs passwd, which is no shutdown tool"),
        "{i:?}"
    );
    // A `#!` script named like a tool runs its interpreter.
    let i = bin(
        "/usr/local/bin/reboot",
        "dash",
        &["/bin/sh", "/usr/local/bin/reboot", "-ff"],
    );
    assert!(matches!(i.effect, Effect::None { .. }), "{i:?}");
    // Debian's `/sbin/poweroff -> /bin/systemctl`, busybox's applets.
    assert_intent(
        "poweroff -f",
        &bin("/sbin/poweroff", "systemctl", &["poweroff", "-f"]),
        &rebooting(Kind::Poweroff),
    );
    assert_intent(
        "busybox reboot -f",
        &bin("/sbin/reboot", "busybox", &["reboot", "-f"]),
        &rebooting(Kind::Reboot),
    );
    // `exec -a poweroff kexec -f`: kexec does not read argv[0].
    let i = bin("/sbin/kexec", "kexec", &["poweroff", "-f"]);
    assert_ne!(i.kind, Kind::Poweroff, "{i:?}");
    // Not read (no BTF): the path's name stands for the binary.
    assert_intent(
        "reboot -ff, binary unknown",
        &decode_exec(
            b"/sbin/reboot",
            None,
            &bytes(&["reboot", "-ff"]),
            false,
            now(),
        ),
        &rebooting(Kind::Reboot),
    );
}

#[test]
fn exec_without_argv_is_unknown_but_kept() {
    use super::super::{decode, expect};
    use crate::signal::{Detail, Scope};
    let mut r = expect::raw(
        common::RecordSource::Exec as u32,
        common::Flag::NodePidns.bit() | common::Flag::ArgsMissing.bit(),
    );
    r.path[..13].copy_from_slice(b"/sbin/reboot\0");
    r.path_len = 13;
    let s = decode(&r, expect::now());
    assert_eq!(
        (s.kind, s.effect.clone(), s.scope),
        (Kind::Unknown, Effect::Now, Scope::Node)
    );
    assert!(matches!(s.detail, Detail::Exec { ref path, .. } if path == "/sbin/reboot"));
}
