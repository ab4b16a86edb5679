//! `signal_generate` (`agent-ebpf/src/signal.rs`): the signals sent to the
//! node's PID 1 that systemd treats as shutdown requests.
use lastgasp_common::{RecordSource, SignalSent};

use super::{Attach, Decoded, Hook, Intent, KernelRecord};
use crate::signal::{Detail, Effect, Kind, Scope, Source};

pub(crate) const HOOK: Hook = Hook {
    source: RecordSource::Signal,
    attach: Attach::Tracepoint {
        prog: "signal_generate",
        category: "signal",
        name: "signal_generate",
        required: false,
    },
    decode: record,
};

/// `signal_generate`'s result field, by value.
const SIGNAL_RESULTS: &[&str] = &[
    "delivered",
    "ignored",
    "already-pending",
    "overflow-fail",
    "lose-info",
];

fn record(r: &KernelRecord) -> Decoded {
    let sent: SignalSent = r.raw.payload().unwrap_or_default();
    let signo = sent.sig;
    let result = usize::try_from(sent.result)
        .ok()
        .and_then(|i| SIGNAL_RESULTS.get(i))
        .unwrap_or(&"unknown")
        .to_string();
    Decoded {
        source: Source::SignalPid1,
        intent: decode_signal_to_init(signo),
        detail: Detail::Signal {
            signo,
            name: signal_name(signo),
            result,
        },
        // Sent to the node's PID 1, whoever sent it.
        scope: Some(Scope::Node),
    }
}

/// glibc's SIGRTMIN: the kernel's first two real-time signals are glibc's own.
const SIGRTMIN: u32 = 34;

/// Decodes a signal sent to PID 1 (kernel signal number), as systemd(1) handles it.
pub(crate) fn decode_signal_to_init(signo: u32) -> Intent {
    // The order of systemd's SIGRTMIN+3.. targets and SIGRTMIN+13.. immediate actions.
    fn nth(n: u32) -> Kind {
        match n {
            0 => Kind::Halt,
            1 => Kind::Poweroff,
            2 => Kind::Reboot,
            3 => Kind::Kexec,
            _ => Kind::SoftReboot,
        }
    }
    match (signo, signo.checked_sub(SIGRTMIN)) {
        // Starts ctrl-alt-del.target, normally an alias of reboot.target. More than 7 within
        // 2 s run CtrlAltDelBurstAction= instead (reboot-force by default): not told apart here.
        (2, _) => Intent::new(Kind::Reboot, Effect::Now, false, true),
        (_, Some(n @ 3..=7)) => Intent::new(nth(n - 3), Effect::Now, false, true),
        (_, Some(n @ 13..=17)) => Intent::new(nth(n - 13), Effect::Now, true, true),
        _ => Intent::nothing(
            Kind::Unknown,
            format!("{} does not shut systemd down", signal_name(signo)),
        ),
    }
}

/// The name of a kernel signal number (the generic Linux numbering of x86, arm, riscv...;
/// not that of alpha, mips, parisc or sparc).
pub(crate) fn signal_name(signo: u32) -> String {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    match signo {
        SIGRTMIN..=64 => format!("SIGRTMIN+{}", signo - SIGRTMIN),
        _ => match signo.checked_sub(1).and_then(|i| NAMES.get(i as usize)) {
            Some(name) => (*name).to_string(),
            None => format!("SIG{signo}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{super::expect::*, *};

    #[test]
    fn signals_to_init() {
        use Kind::*;
        let cases = [
            (2, direct(Reboot)),
            (37, direct(Halt)),
            (38, direct(Poweroff)),
            (39, direct(Reboot)),
            (40, direct(Kexec)),
            (41, direct(SoftReboot)),
            (47, forced(Halt)),
            (48, forced(Poweroff)),
            (49, forced(Reboot)),
            (50, forced(Kexec)),
            (51, forced(SoftReboot)),
        ];
        for (signo, want) in cases {
            assert_eq!(decode_signal_to_init(signo), want, "{}", signal_name(signo));
        }
        for signo in [
            0,
            1,
            9,
            10,
            12,
            15,
            30,
            34,
            35,
            36,
            42,
            46,
            52,
            54,
            64,
            65,
            u32::MAX,
        ] {
            assert_intent(
                &signal_name(signo),
                &decode_signal_to_init(signo),
                &none(Unknown),
            );
        }
        let named = [
            (1, "SIGHUP"),
            (2, "SIGINT"),
            (9, "SIGKILL"),
            (15, "SIGTERM"),
            (30, "SIGPWR"),
            (31, "SIGSYS"),
            (34, "SIGRTMIN+0"),
            (38, "SIGRTMIN+4"),
            (49, "SIGRTMIN+15"),
            (64, "SIGRTMIN+30"),
            (0, "SIG0"),
            (32, "SIG32"),
            (33, "SIG33"),
            (65, "SIG65"),
        ];
        for (signo, name) in named {
            assert_eq!(signal_name(signo), name);
        }
    }
}
