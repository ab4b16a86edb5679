//! What the detectors and the actions both know of the host: the names
//! in systemd-shutdown's directory and in the agent's run directory, the
//! verbs systemd-shutdown passes its hooks, and an atomic write.
use std::{
    fs,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::Path,
};

use anyhow::{Context, Result};

use crate::signal::Kind;

/// The hook's file name in systemd-shutdown's directory.
pub const HOOK_NAME: &str = "lastgasp";
/// Beside the hook: the courier's binary (`act::courier`); systemd-shutdown
/// runs only the files of its directory, not those of a subdirectory.
pub const COURIER: &str = "lastgasp.courier";

/// In the run directory: the agent's pid (the hook skips a dead agent).
pub const PID_FILE: &str = "agent.pid";
/// systemd-shutdown's comm (cut at 15 bytes): the node's PID 1 in its final stage.
pub const FINAL_STAGE_COMM: &str = "systemd-shutdow";

/// The verbs systemd-shutdown passes its hooks, and what each shuts down.
pub const VERBS: [(&str, Kind); 4] = [
    ("poweroff", Kind::Poweroff),
    ("halt", Kind::Halt),
    ("reboot", Kind::Reboot),
    ("kexec", Kind::Kexec),
];

/// Replaces `path` at once with a file of `mode` from its creation (a
/// secret is never readable by others, even for a moment).
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(data)?;
    drop(f);
    fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
    fs::rename(&tmp, path)?;
    Ok(())
}
