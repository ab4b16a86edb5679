//! A private system bus for the D-Bus tests: Debian's `dbus-daemon` on a
//! socket in a scratch directory, with `lastgasp-fake-systemd` on it as
//! logind and systemd. Dropping it stops both and removes the directory.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, SystemTime},
};

use zbus::Connection;

use crate::support::trigger_bin;

pub const LOGIND: &str = "org.freedesktop.login1";
pub const LOGIND_PATH: &str = "/org/freedesktop/login1";
pub const LOGIND_IFACE: &str = "org.freedesktop.login1.Manager";
pub const SYSTEMD: &str = "org.freedesktop.systemd1";
pub const SYSTEMD_PATH: &str = "/org/freedesktop/systemd1";
pub const SYSTEMD_IFACE: &str = "org.freedesktop.systemd1.Manager";

/// `dbus-daemon` is there, or the test says why it is skipped.
pub fn have_dbus_daemon(test: &str) -> bool {
    for tool in ["dbus-daemon", "dbus-send"] {
        let path = std::env::var_os("PATH").unwrap_or_default();
        if !std::env::split_paths(&path).any(|d| d.join(tool).is_file()) {
            println!("SKIPPED {test}: {tool} is not installed (cargo xtask test installs the dbus package)");
            return false;
        }
    }
    true
}

pub struct TestBus {
    pub dir: PathBuf,
    /// The bus address, as DBUS_SYSTEM_BUS_ADDRESS.
    pub address: String,
    /// The fake's logind configuration root.
    pub root: PathBuf,
    daemon: Child,
    fake: Child,
}

/// One line of the fake's log.
#[derive(Clone, Debug)]
pub struct Event {
    pub at: SystemTime,
    pub text: String,
}

impl Event {
    pub fn is(&self, prefix: &str) -> bool {
        self.text.starts_with(prefix)
    }

    /// The value of `key=...` in the event.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.text
            .split(' ')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    }
}

impl TestBus {
    /// Starts the bus and the fake; `files` are logind config files
    /// (path under the root, content).
    pub fn start(name: &str, files: &[(&str, &str)], fake_args: &[&str]) -> TestBus {
        let dir = std::env::temp_dir().join(format!("lastgasp-dbus-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let root = dir.join("root");
        std::fs::create_dir_all(root.join("etc/systemd")).unwrap();
        for (rel, text) in files {
            let p = root.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let socket = dir.join("system_bus_socket");
        std::fs::write(dir.join("bus.conf"), bus_config(&socket)).unwrap();
        let (daemon, address) = start_daemon(&dir);
        let mut fake = Command::new(fake_bin())
            .args(["--bus", &address, "--root"])
            .arg(&root)
            .arg("--log")
            .arg(dir.join("fake.log"))
            .args(fake_args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting lastgasp-fake-systemd");
        let mut line = String::new();
        BufReader::new(fake.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the fake did not start");
        TestBus {
            dir,
            address,
            root,
            daemon,
            fake,
        }
    }

    /// Stops dbus-daemon and starts a new one on the same socket; waits for
    /// the fake to be back on it.
    pub async fn restart_bus(&mut self) {
        self.stop_bus();
        self.start_bus().await;
    }

    /// Kills the dbus-daemon (the fake stays, reconnecting).
    pub fn stop_bus(&mut self) {
        self.daemon.kill().unwrap();
        self.daemon.wait().unwrap();
        let _ = std::fs::remove_file(self.dir.join("system_bus_socket"));
    }

    /// A new dbus-daemon on the same socket, once the fake is back on it.
    pub async fn start_bus(&mut self) {
        let before = self.events().iter().filter(|e| e.is("connected")).count();
        let (daemon, address) = start_daemon(&self.dir);
        self.daemon = daemon;
        self.address = address;
        self.wait_event(
            "the fake back on the new bus",
            |e| e.is("connected"),
            before + 1,
        )
        .await;
    }

    /// A connection of the test's own.
    pub async fn client(&self) -> Connection {
        zbus::connection::Builder::address(self.address.as_str())
            .build()
            .await
            .expect("connecting to the test bus")
    }

    pub fn events(&self) -> Vec<Event> {
        std::fs::read_to_string(self.dir.join("fake.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (usec, text) = l.split_once(' ')?;
                Some(Event {
                    at: SystemTime::UNIX_EPOCH + Duration::from_micros(usec.parse().ok()?),
                    text: text.to_string(),
                })
            })
            .collect()
    }

    /// The `nth` (1-based) event matching `pred`, waiting up to 10 s.
    pub async fn wait_event(&self, what: &str, pred: impl Fn(&Event) -> bool, nth: usize) -> Event {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let events = self.events();
            if let Some(e) = events.iter().filter(|e| pred(e)).nth(nth - 1) {
                return e.clone();
            }
            if std::time::Instant::now() > deadline {
                let all: Vec<_> = events.iter().map(|e| e.text.as_str()).collect();
                panic!(
                    "the fake logged no {what} within 10 s; its log:\n{}",
                    all.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn event(&self, pred: impl Fn(&Event) -> bool) -> Option<Event> {
        self.events().into_iter().find(|e| pred(e))
    }

    /// logind's method `member` with `body`, as systemctl or shutdown call it.
    pub async fn logind<B>(&self, member: &str, body: &B) -> zbus::Result<zbus::Message>
    where
        B: serde::Serialize + zbus::DynamicType,
    {
        let c = self.client().await;
        c.call_method(Some(LOGIND), LOGIND_PATH, Some(LOGIND_IFACE), member, body)
            .await
    }

    pub async fn systemd<B>(&self, member: &str, body: &B) -> zbus::Result<zbus::Message>
    where
        B: serde::Serialize + zbus::DynamicType,
    {
        let c = self.client().await;
        c.call_method(
            Some(SYSTEMD),
            SYSTEMD_PATH,
            Some(SYSTEMD_IFACE),
            member,
            body,
        )
        .await
    }

    /// The fake's test control: call off the shutdown under way.
    pub async fn cancel_shutdown(&self) {
        let c = self.client().await;
        c.call_method(
            Some(LOGIND),
            "/dev/lastgasp/Fake",
            Some("dev.lastgasp.Fake"),
            "CancelShutdown",
            &(),
        )
        .await
        .expect("CancelShutdown");
    }

    /// logind's inhibitors as (what, who, mode).
    pub async fn inhibitors(&self) -> Vec<(String, String, String)> {
        let m = self.logind("ListInhibitors", &()).await.unwrap();
        let list: Vec<(String, String, String, String, u32, u32)> = m.body().deserialize().unwrap();
        list.into_iter()
            .map(|(what, who, _, mode, _, _)| (what, who, mode))
            .collect()
    }

    /// `dbus-send --system ...` against this bus.
    pub fn dbus_send(&self, args: &[&str]) {
        let out = Command::new("dbus-send")
            .arg("--system")
            .args(args)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "dbus-send {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for TestBus {
    fn drop(&mut self) {
        let _ = self.fake.kill();
        let _ = self.fake.wait();
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("test bus files kept in {}", self.dir.display());
        }
    }
}

fn fake_bin() -> PathBuf {
    trigger_bin().with_file_name("lastgasp-fake-systemd")
}

fn start_daemon(dir: &Path) -> (Child, String) {
    let mut daemon = Command::new("dbus-daemon")
        .arg(format!("--config-file={}", dir.join("bus.conf").display()))
        .args(["--nofork", "--print-address=1"])
        .stdout(Stdio::piped())
        // It warns that it cannot raise its fd limit when not allowed to.
        .stderr(Stdio::null())
        .spawn()
        .expect("starting dbus-daemon");
    let mut address = String::new();
    BufReader::new(daemon.stdout.take().unwrap())
        .read_line(&mut address)
        .unwrap();
    assert!(address.starts_with("unix:"), "dbus-daemon said {address:?}");
    // Without its guid, as a system bus address is: the restarted bus has
    // a new one.
    let address = address.trim().split(",guid=").next().unwrap().to_string();
    (daemon, address)
}

/// A bus where anyone may own any name and send anything (a private test bus).
fn bus_config(socket: &Path) -> String {
    format!(
        r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_type="method_return"/>
    <allow send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="signal"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
  </policy>
</busconfig>
"#,
        socket.display()
    )
}
