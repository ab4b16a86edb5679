//! The cluster half of the harness, behind `--cluster` and off until its
//! pieces exist: the Kubernetes API double (`lastgasp-apidouble`, crate
//! `apidouble/`, issue 5) on the host's loopback, and the guest's only route
//! to it — qemu user networking with `restrict=on` (no other traffic leaves
//! the guest) and one `guestfwd` from 10.0.2.100:8099 in the guest to the
//! double's port on 127.0.0.1 (through `socat`, so the double may start
//! after qemu). The agent then runs in cluster mode (issues 4-5) with a
//! kubeconfig pointing at that address.
//!
//! What the double logged during a run (`GET /_double/log`) is the matrix's
//! "cluster got" column.
use std::{
    fs,
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::qemu::Spec;
use crate::setup;

/// Where the guest finds the API server.
pub const GUEST_ADDR: &str = "10.0.2.100:8099";

pub struct Cluster {
    child: Child,
    port: u16,
    vm_dir: PathBuf,
    /// Log entries already seen before the current run.
    seen: usize,
}

impl Cluster {
    pub fn start(root: &Path) -> Result<Cluster> {
        setup::ensure_debs(&[("socat", "socat")])?;
        let bin = apidouble_binary(root)?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let vm_dir = root.join("tests/vm");
        let objects = vm_dir.join("cluster/objects.json");
        let log = fs::File::create(crate::target_dir(root).join("vm/apidouble.log"))?;
        let child = Command::new(&bin)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--objects")
            .arg(&objects)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut c = Cluster {
            child,
            port,
            vm_dir,
            seen: 0,
        };
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t.elapsed() > Duration::from_secs(15) || c.child.try_wait()?.is_some() {
                bail!("the API double did not listen on 127.0.0.1:{port}");
            }
            thread::sleep(Duration::from_millis(50));
        }
        println!("vm-test: API double on 127.0.0.1:{port}, reached from the guest as {GUEST_ADDR}");
        Ok(c)
    }

    /// The guest's NIC, the agent's cluster-mode settings, the kubeconfig.
    pub fn prepare(&mut self, spec: &mut Spec) -> Result<()> {
        let (ip, gport) = GUEST_ADDR.split_once(':').unwrap();
        spec.nic = Some(format!(
            "user,model=virtio-net-pci,restrict=on,guestfwd=tcp:{ip}:{gport}-cmd:socat STDIO TCP:127.0.0.1:{}",
            self.port
        ));
        spec.extra_in.push((
            "kubeconfig".into(),
            fs::read(self.vm_dir.join("cluster/kubeconfig"))?,
        ));
        spec.extra_in.push((
            "lastgasp.env".into(),
            fs::read(self.vm_dir.join("cluster/lastgasp.env"))?,
        ));
        self.seen = self.log().map(|l| l.len()).unwrap_or(0);
        Ok(())
    }

    /// The requests the double logged since `prepare`.
    pub fn summary_since_prepare(&mut self) -> String {
        match self.log() {
            Ok(entries) => {
                let new: Vec<String> = entries
                    .iter()
                    .skip(self.seen)
                    .map(|e| {
                        let get =
                            |k: &str| e.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_string();
                        format!("{} {}", get("method"), get("path"))
                    })
                    .collect();
                self.seen = entries.len();
                if new.is_empty() {
                    "nothing".into()
                } else {
                    format!("{} request(s): {}", new.len(), new.join(", "))
                }
            }
            Err(e) => format!("unknown: {e:#}"),
        }
    }

    fn log(&self) -> Result<Vec<serde_json::Value>> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET /_double/log HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        let json = body.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        // JSON lines (the double's format), or one JSON array.
        if let Ok(lines) = json
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str::<serde_json::Value>)
            .collect::<Result<Vec<_>, _>>()
        {
            if lines.iter().all(|v| v.is_object()) {
                return Ok(lines);
            }
        }
        let v: serde_json::Value =
            serde_json::from_str(json).context("the double's /_double/log is not JSON")?;
        Ok(match v {
            serde_json::Value::Array(a) => a,
            serde_json::Value::Object(mut o) => {
                match o.remove("items").or_else(|| o.remove("requests")) {
                    Some(serde_json::Value::Array(a)) => a,
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn apidouble_binary(root: &Path) -> Result<PathBuf> {
    let target = crate::target_dir(root);
    let find = || {
        ["release", "debug"]
            .iter()
            .map(|p| target.join(p).join("lastgasp-apidouble"))
            .find(|p| p.is_file())
    };
    if let Some(b) = find() {
        return Ok(b);
    }
    let st = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(root)
        .args(["build", "--release", "--package", "lastgasp-apidouble"])
        .status()?;
    match find() {
        Some(b) if st.success() => Ok(b),
        _ => bail!(
            "no lastgasp-apidouble binary (the API double, crate apidouble/, is not built yet): \
             run without --cluster"
        ),
    }
}
