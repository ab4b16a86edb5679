//! logind's configuration as it bears on lastgasp: which file sets
//! InhibitDelayMaxSec (logind's own read order), and the drop-in that
//! raises it when the graceful path needs more.
use std::{
    fmt, fs,
    io::Write,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    bus::logind::Inhibitor,
    timespan::{parse_timespan, secs},
};

/// The drop-in written under `<root>/etc/systemd/logind.conf.d/`.
pub const DROPIN_NAME: &str = "99-lastgasp.conf";
/// logind's default InhibitDelayMaxSec.
const LOGIND_DEFAULT_DELAY: Duration = Duration::from_secs(5);

/// One assignment of InhibitDelayMaxSec in a file logind reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub file: PathBuf,
    pub value: String,
    /// `None`: unparsable (logind ignores it).
    pub delay: Option<Duration>,
}

pub fn dropin_path(root: &Path) -> PathBuf {
    root.join("etc/systemd/logind.conf.d").join(DROPIN_NAME)
}

/// The files logind reads, in the order it reads them (later wins): the
/// main file (the first of /etc, /run, /usr/local/lib, /usr/lib), then every
/// `logind.conf.d/*.conf` sorted by file name across those directories, a
/// name in an earlier directory masking the same name in later ones.
pub fn conf_files(root: &Path) -> Vec<PathBuf> {
    const DIRS: [&str; 4] = [
        "etc/systemd",
        "run/systemd",
        "usr/local/lib/systemd",
        "usr/lib/systemd",
    ];
    let mut files: Vec<PathBuf> = DIRS
        .iter()
        .map(|d| root.join(d).join("logind.conf"))
        .find(|p| p.is_file())
        .into_iter()
        .collect();
    let mut dropins: std::collections::BTreeMap<String, PathBuf> = Default::default();
    for d in DIRS {
        let Ok(entries) = fs::read_dir(root.join(d).join("logind.conf.d")) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".conf") {
                dropins.entry(name).or_insert_with(|| e.path());
            }
        }
    }
    files.extend(dropins.into_values());
    files
}

/// Every InhibitDelayMaxSec assignment logind would read, in order: the last
/// one is in force.
pub fn inhibit_delay_settings(root: &Path) -> Vec<Setting> {
    let mut out = Vec::new();
    for file in conf_files(root) {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        let mut in_login = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                in_login = line == "[Login]";
            } else if in_login {
                if let Some((k, v)) = line.split_once('=') {
                    if k.trim() == "InhibitDelayMaxSec" {
                        let value = v.trim().to_string();
                        // An empty assignment resets to the default.
                        let delay = if value.is_empty() {
                            Some(LOGIND_DEFAULT_DELAY)
                        } else {
                            parse_timespan(&value)
                        };
                        out.push(Setting {
                            file: file.clone(),
                            value,
                            delay,
                        });
                    }
                }
            }
        }
    }
    out
}

#[derive(Debug)]
pub enum DelayError {
    /// After the drop-in and a reload, logind still allows less.
    TooLow {
        have: Duration,
        want: Duration,
        /// The assignment in force (the last one logind reads).
        winner: Option<Setting>,
        ours: PathBuf,
        reload: Option<String>,
    },
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    Bus(zbus::Error),
}

impl std::error::Error for DelayError {}

impl fmt::Display for DelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DelayError::TooLow {
                have,
                want,
                winner,
                ours,
                reload,
            } => {
                write!(
                    f,
                    "logind allows a shutdown delay of {} (InhibitDelayMaxUSec) but lastgasp needs {}: ",
                    secs(*have),
                    secs(*want)
                )?;
                match winner {
                    Some(w) if w.file != *ours => write!(
                        f,
                        "{} sets InhibitDelayMaxSec={} and is read after {}, so it wins; raise it there or remove it",
                        w.file.display(),
                        w.value,
                        ours.display()
                    ),
                    Some(w) => write!(
                        f,
                        "{} (InhibitDelayMaxSec={}) is the file in force, but logind has not applied it after a reload{}",
                        w.file.display(),
                        w.value,
                        reload.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
                    ),
                    None => write!(f, "no file sets InhibitDelayMaxSec, yet {} was written", ours.display()),
                }
            }
            DelayError::Write { path, error } => {
                write!(f, "writing the logind drop-in {}: {error}", path.display())
            }
            DelayError::Bus(e) => write!(f, "reading logind's InhibitDelayMaxUSec: {e}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DelayOutcome {
    /// logind already allows at least what is needed.
    Enough(Duration),
    /// The drop-in was written and logind reloaded.
    Raised { from: Duration, to: Duration },
}

/// Makes logind allow at least `want`: writes the drop-in, reloads logind
/// (SIGHUP through systemd's KillUnit, as the kubelet does) and re-reads the
/// value with backoff (100 ms doubling, 5 tries). Never lowers it.
pub async fn ensure_inhibit_delay(
    host: &impl Inhibitor,
    root: &Path,
    want: Duration,
) -> Result<DelayOutcome, DelayError> {
    let have = host
        .current_inhibit_delay()
        .await
        .map_err(DelayError::Bus)?;
    if have >= want {
        return Ok(DelayOutcome::Enough(have));
    }
    let path = dropin_path(root);
    write_dropin(&path, want).map_err(|error| DelayError::Write {
        path: path.clone(),
        error,
    })?;
    tracing::info!(file = %path.display(), from = %secs(have), to = %secs(want), "logind: raising InhibitDelayMaxSec");
    let reload = host
        .reload_logind_conf()
        .await
        .err()
        .map(|e| format!("KillUnit systemd-logind.service SIGHUP failed: {e}"));
    let mut now = have;
    let mut wait = Duration::from_millis(100);
    for _ in 0..5 {
        tokio::time::sleep(wait).await;
        wait *= 2;
        now = host
            .current_inhibit_delay()
            .await
            .map_err(DelayError::Bus)?;
        if now >= want {
            return Ok(DelayOutcome::Raised {
                from: have,
                to: now,
            });
        }
    }
    Err(DelayError::TooLow {
        have: now,
        want,
        winner: inhibit_delay_settings(root).pop(),
        ours: path,
        reload,
    })
}

pub fn dropin_text(want: Duration) -> String {
    // Whole seconds, rounded up: the delay must not come out shorter.
    let s = want.as_secs() + u64::from(want.subsec_nanos() > 0);
    format!("# Written by lastgasp: the time its graceful node shutdown needs.\n[Login]\nInhibitDelayMaxSec={s}\n")
}

pub(crate) fn write_dropin(path: &Path, want: Duration) -> std::io::Result<()> {
    let dir = path.parent().expect("drop-in has a directory");
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    let tmp = path.with_extension("conf.tmp");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(dropin_text(want).as_bytes())?;
    f.set_permissions(fs::Permissions::from_mode(0o644))?;
    f.sync_all()?;
    fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_dropin_by_name_wins_and_etc_masks_usr() {
        let root =
            std::env::temp_dir().join(format!("lastgasp-logind-conf-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let put = |rel: &str, text: &str| {
            let p = root.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        };
        put(
            "etc/systemd/logind.conf",
            "[Login]\n#InhibitDelayMaxSec=5\nInhibitDelayMaxSec=10\n",
        );
        put(
            "usr/lib/systemd/logind.conf.d/50-distro.conf",
            "[Login]\nInhibitDelayMaxSec=7\n",
        );
        put(
            "etc/systemd/logind.conf.d/99-lastgasp.conf",
            &dropin_text(Duration::from_millis(29_500)),
        );
        put(
            "run/systemd/logind.conf.d/zz-cap.conf",
            "[Other]\nInhibitDelayMaxSec=1\n[Login]\nInhibitDelayMaxSec=1min\n",
        );
        // Same name in /etc masks /usr/lib.
        put(
            "usr/lib/systemd/logind.conf.d/zz-cap.conf",
            "[Login]\nInhibitDelayMaxSec=2\n",
        );
        let s = inhibit_delay_settings(&root);
        let got: Vec<_> = s
            .iter()
            .map(|s| {
                (
                    s.file.strip_prefix(&root).unwrap().display().to_string(),
                    s.value.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("etc/systemd/logind.conf".to_string(), "10".to_string()),
                (
                    "usr/lib/systemd/logind.conf.d/50-distro.conf".into(),
                    "7".into()
                ),
                (
                    "etc/systemd/logind.conf.d/99-lastgasp.conf".into(),
                    "30".into()
                ),
                (
                    "run/systemd/logind.conf.d/zz-cap.conf".into(),
                    "1min".into()
                ),
            ]
        );
        assert_eq!(s.last().unwrap().delay, Some(Duration::from_secs(60)));
        fs::remove_dir_all(&root).ok();
    }

    /// logind behind the `Inhibitor` interface: it re-reads its
    /// configuration (under `root`) only when told to reload.
    struct FakeLogind {
        root: PathBuf,
        delay: std::sync::Mutex<Duration>,
        reloads: std::sync::atomic::AtomicU32,
    }

    impl FakeLogind {
        fn new(root: &Path, delay: Duration) -> Self {
            FakeLogind {
                root: root.to_path_buf(),
                delay: std::sync::Mutex::new(delay),
                reloads: Default::default(),
            }
        }
    }

    impl Inhibitor for FakeLogind {
        async fn current_inhibit_delay(&self) -> zbus::Result<Duration> {
            Ok(*self.delay.lock().unwrap())
        }
        async fn inhibit_shutdown(&self, _: &str, _: &str) -> zbus::Result<std::os::fd::OwnedFd> {
            Err(zbus::Error::Unsupported)
        }
        async fn reload_logind_conf(&self) -> zbus::Result<()> {
            self.reloads
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let winner = inhibit_delay_settings(&self.root)
                .into_iter()
                .rev()
                .find_map(|s| s.delay);
            *self.delay.lock().unwrap() = winner.unwrap_or(LOGIND_DEFAULT_DELAY);
            Ok(())
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("lastgasp-delay-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        root
    }

    #[tokio::test(start_paused = true)]
    async fn enough_delay_writes_nothing_and_reloads_nothing() {
        let root = scratch("enough");
        let host = FakeLogind::new(&root, Duration::from_secs(60));
        let got = ensure_inhibit_delay(&host, &root, Duration::from_secs(30)).await;
        assert!(
            matches!(got, Ok(DelayOutcome::Enough(d)) if d == Duration::from_secs(60)),
            "{got:?}"
        );
        assert!(!dropin_path(&root).exists());
        assert_eq!(host.reloads.load(std::sync::atomic::Ordering::SeqCst), 0);
        fs::remove_dir_all(&root).ok();
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_delay_is_raised_by_the_dropin_and_one_reload() {
        let root = scratch("raise");
        let host = FakeLogind::new(&root, Duration::from_secs(5));
        let got = ensure_inhibit_delay(&host, &root, Duration::from_millis(29_500)).await;
        assert!(
            matches!(got, Ok(DelayOutcome::Raised { from, to })
                if from == Duration::from_secs(5) && to == Duration::from_secs(30)),
            "{got:?}"
        );
        assert_eq!(
            fs::read_to_string(dropin_path(&root)).unwrap(),
            dropin_text(Duration::from_secs(30))
        );
        assert_eq!(host.reloads.load(std::sync::atomic::Ordering::SeqCst), 1);
        fs::remove_dir_all(&root).ok();
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_file_that_caps_the_delay_is_named() {
        let root = scratch("capped");
        let cap = root.join("run/systemd/logind.conf.d/zz-cap.conf");
        fs::create_dir_all(cap.parent().unwrap()).unwrap();
        fs::write(&cap, "[Login]\nInhibitDelayMaxSec=10\n").unwrap();
        let host = FakeLogind::new(&root, Duration::from_secs(10));
        match ensure_inhibit_delay(&host, &root, Duration::from_secs(30)).await {
            Err(DelayError::TooLow {
                have,
                want,
                winner: Some(w),
                ours,
                reload: None,
            }) => {
                assert_eq!(
                    (have, want),
                    (Duration::from_secs(10), Duration::from_secs(30))
                );
                assert_eq!(w.file, cap);
                assert_eq!(ours, dropin_path(&root));
            }
            other => panic!("{other:?}"),
        }
        fs::remove_dir_all(&root).ok();
    }
}
