//! Entry points for the fuzz targets (`fuzz/`, run by `cargo xtask bench
//! fuzz`): every parser of outside data, called as the agent calls it. Built
//! only with the `fuzzing` feature.
use std::time::{Duration, SystemTime};

use lastgasp_common::{self as common, RawEvent};

use crate::{decide::Decider, detect::hooks};

fn now() -> (SystemTime, u64) {
    (
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
        5_000_000_000,
    )
}

/// Decoded, decided and serialised as the agent's loop does.
fn decide(raw: &RawEvent) {
    let s = hooks::decode(raw, now());
    let d = Decider::new().decide(&s);
    let _ = serde_json::to_string(&(&s, &d.action));
}

/// A ring-buffer record, whatever its bytes.
pub fn kernel_record(data: &[u8]) {
    if let Some(raw) = RawEvent::from_bytes(data) {
        decide(&raw);
    }
}

/// An exec record of one of the matched tools: the first byte picks the
/// tool and the flags, the second where the path ends; the rest is the exec'd
/// path and the NUL-separated argv, as the kernel copies them.
pub fn exec_record(data: &[u8]) {
    let [tool, flags, split, rest @ ..] = data else {
        return;
    };
    let mut raw = RawEvent::ZERO;
    let (name, _) = common::TOOLS[usize::from(*tool) % common::TOOLS.len()];
    let mut exe = [0; common::EXE_NAME_LEN];
    exe[..name.len()].copy_from_slice(name.as_bytes());
    raw.set(&common::ToolExec { exe });
    raw.flags = u32::from(*flags);
    let (path, args) = rest.split_at(usize::from(*split).min(rest.len()));
    let path = &path[..path.len().min(common::PATH_LEN)];
    let args = &args[..args.len().min(common::ARGS_LEN)];
    raw.path[..path.len()].copy_from_slice(path);
    raw.path_len = path.len() as u32;
    raw.args[..args.len()].copy_from_slice(args);
    raw.args_len = args.len() as u32;
    decide(&raw);
}

/// The Node's shutdown record annotation.
pub fn node_record(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(r) = crate::record::ShutdownRecord::parse(text) {
            let _ = r.death();
            let _ = r.to_json();
        }
    }
}

/// The agent's config file.
pub fn config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(c) = crate::config::Config::parse(text) {
            let _ = c.buckets();
            let _ = c.audit_limits();
            let _ = c.api_server.url();
        }
    }
}

/// One audit log file, and each boot's report from it.
pub fn audit_log(data: &[u8]) {
    let contents = crate::act::audit::parse(data);
    let boots: std::collections::BTreeSet<&str> = contents
        .records
        .iter()
        .map(|r| r.boot_id.as_str())
        .collect();
    for b in boots {
        let _ = crate::act::report::classify(&contents.records, b);
        let _ = crate::act::report::previous_boot(&contents.records, b);
    }
}

/// The body of a D-Bus signal a detector reads: the first byte picks which
/// (and so the signature the bus daemon would have checked), the rest is the
/// body, deserialised as the detector does.
pub fn dbus_body(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let signature = match which % 5 {
        0 => "b",
        1 => "sa{sv}as",
        2 => "sss",
        3 => "uos",
        _ => "uoss",
    };
    let b = zbus::message::Message::signal(
        "/org/freedesktop/login1",
        "org.freedesktop.login1.Manager",
        "X",
    );
    // SAFETY: an invalid body is what the fuzzer looks for; zbus checks it
    // on deserialisation (the bus daemon would already have).
    #[allow(unsafe_code)]
    let Ok(m) = (unsafe { b.build_raw_body(body, signature, vec![]) }) else {
        return;
    };
    match which % 5 {
        0 => {
            let _ = m.body().deserialize::<bool>();
        }
        1 => {
            let _ = crate::detect::logind::scheduled_from_changed(&m);
        }
        2 => {
            let _ = m.body().deserialize::<(String, String, String)>();
        }
        3 => {
            let _ = m
                .body()
                .deserialize::<(u32, zbus::OwnedObjectPath, String)>();
        }
        _ => {
            let _ = m
                .body()
                .deserialize::<(u32, zbus::OwnedObjectPath, String, String)>();
        }
    }
}
