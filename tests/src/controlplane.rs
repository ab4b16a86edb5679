//! A real Kubernetes control plane on loopback: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler v1.32.13, with default
//! controller flags. Certificates, tokens and kubeconfigs are made here;
//! `cargo xtask test` provides the binaries (LASTGASP_K8S_BIN, LASTGASP_ETCD).
//!
//! One control plane per test binary ([`shared`]); its processes die with
//! the test process (PR_SET_PDEATHSIG from a thread that never exits).
use std::{
    fs,
    io::Write,
    net::TcpListener,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, OnceLock},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

pub const ADMIN_TOKEN: &str = "lastgasp-test-admin-token";

/// Where the binaries are, or why they are not here.
pub fn binaries() -> Result<(PathBuf, PathBuf), String> {
    let bin = std::env::var_os("LASTGASP_K8S_BIN").map(PathBuf::from);
    let etcd = std::env::var_os("LASTGASP_ETCD").map(PathBuf::from);
    match (bin, etcd) {
        (Some(b), Some(e)) if b.join("kube-apiserver").is_file() && e.is_file() => Ok((b, e)),
        (Some(b), Some(e)) => Err(format!(
            "no kube-apiserver in {} or no etcd at {}",
            b.display(),
            e.display()
        )),
        _ => Err(
            "LASTGASP_K8S_BIN and LASTGASP_ETCD are not set (`cargo xtask test` sets them \
                  when the v1.32.13 binaries are on this machine)"
                .into(),
        ),
    }
}

/// The shared control plane of this test binary, started on first use;
/// `None` (with SKIPPED printed for `test`) when the binaries are not here.
/// A control plane that fails to start is a failure, not a skip.
pub fn shared(test: &str) -> Option<&'static ControlPlane> {
    static CP: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    started(&CP, test, true)
}

/// As [`shared`], a second control plane without the audit log (the zone
/// bench: a cluster's defaults).
pub fn plain(test: &str) -> Option<&'static ControlPlane> {
    static CP: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    started(&CP, test, false)
}

fn started(
    cp: &'static OnceLock<Result<ControlPlane, String>>,
    test: &str,
    audit: bool,
) -> Option<&'static ControlPlane> {
    if let Err(why) = binaries() {
        println!("SKIPPED {test}: the real control plane: {why}");
        return None;
    }
    let cp = cp.get_or_init(|| {
        // The processes are started from a thread that lives as long as the
        // process, so that PR_SET_PDEATHSIG fires only when the test process ends.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(ControlPlane::start_with(audit).map_err(|e| format!("{e:#}")));
            loop {
                std::thread::park();
            }
        });
        rx.recv()
            .unwrap_or_else(|_| Err("the start thread died".into()))
    });
    match cp {
        Ok(cp) => Some(cp),
        Err(e) => panic!("the real control plane did not start: {e}"),
    }
}

/// The CPU time process `pid` has used so far, user and system, from /proc.
pub fn cpu_of(pid: u32) -> Result<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command's name in parentheses: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').context("/proc/PID/stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// One request as the API server's audit log saw it.
#[derive(Clone, Debug)]
pub struct AuditEvent {
    /// The authorizer's verb (get, list, watch, patch, ...).
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    pub code: u16,
    /// `user.extra`: the bound token's claims (node name, pod).
    pub extra: serde_json::Value,
}

pub struct ControlPlane {
    pub dir: PathBuf,
    pub url: String,
    pub ca_pem: String,
    ca_der: Vec<u8>,
    /// Signs client certificates (a kubelet's, for a real node).
    ca: Issuer<'static, KeyPair>,
    pub port: u16,
    procs: std::sync::Mutex<Vec<(String, Child)>>,
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

fn new_ca(cn: &str) -> Result<(String, Vec<u8>, Issuer<'static, KeyPair>)> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, cn);
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    let key = KeyPair::generate()?;
    let cert = p.self_signed(&key)?;
    Ok((cert.pem(), cert.der().to_vec(), Issuer::new(p, key)))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    cn: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> Result<(String, String)> {
    let mut p = CertificateParams::new(
        sans.iter()
            .map(std::string::ToString::to_string)
            .collect::<Vec<_>>(),
    )?;
    p.distinguished_name.push(DnType::CommonName, cn);
    p.extended_key_usages = vec![usage];
    p.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

impl ControlPlane {
    pub fn start() -> Result<ControlPlane> {
        Self::start_with(true)
    }

    /// With `audit`, the API server logs every request (level Metadata) for
    /// [`ControlPlane::audit`]; the zone bench runs without it, as a
    /// cluster's defaults do (the log costs CPU on every request).
    pub fn start_with(audit: bool) -> Result<ControlPlane> {
        let (bin, etcd) = binaries().map_err(anyhow::Error::msg)?;
        let dir = std::env::temp_dir().join(format!(
            "lastgasp-cp-{}-{}",
            std::process::id(),
            if audit { "audit" } else { "plain" }
        ));
        sweep_dead();
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        let w = |name: &str, body: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            fs::write(&p, body).with_context(|| format!("writing {}", p.display()))?;
            Ok(p)
        };
        let (ca_pem, ca_der, ca) = new_ca("lastgasp-test-ca")?;
        let (fp_ca_pem, _, fp_ca) = new_ca("lastgasp-test-front-proxy-ca")?;
        let (srv, srv_key) = leaf(
            &ca,
            "kube-apiserver",
            // 10.0.2.100: the address a QEMU guest reaches the host's
            // loopback at (vm-test's real node); 10.0.0.1: the `kubernetes`
            // Service of --service-cluster-ip-range, for in-cluster clients.
            &["127.0.0.1", "localhost", "10.0.2.100", "10.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )?;
        let (fp, fp_key) = leaf(
            &fp_ca,
            "front-proxy-client",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let sa = KeyPair::generate()?;
        let ca_file = w("ca.crt", &ca_pem)?;
        let ca_key_file = w("ca.key", &ca.key().serialize_pem())?;
        let fp_ca_file = w("front-proxy-ca.crt", &fp_ca_pem)?;
        let srv_file = w("apiserver.crt", &srv)?;
        let srv_key_file = w("apiserver.key", &srv_key)?;
        let fp_file = w("front-proxy-client.crt", &fp)?;
        let fp_key_file = w("front-proxy-client.key", &fp_key)?;
        let sa_key = w("sa.key", &sa.serialize_pem())?;
        let sa_pub = w("sa.pub", &sa.public_key_pem())?;
        // Who asked for what, and the answer: tests read it to show that a
        // ServiceAccount met no 403 and used exactly its grants.
        let audit_policy = w(
            "audit-policy.yaml",
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n",
        )?;
        let tokens = w(
            "tokens.csv",
            &format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n"),
        )?;

        let mut cp = ControlPlane {
            url: String::new(),
            ca_pem,
            ca_der,
            ca,
            port: 0,
            procs: Default::default(),
            dir: dir.clone(),
        };
        let path = |p: &Path| p.to_string_lossy().into_owned();

        let etcd_port = free_port()?;
        let peer_port = free_port()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        cp.spawn(
            "etcd",
            Command::new(&etcd).args([
                "--name",
                "default",
                "--data-dir",
                &path(&dir.join("etcd")),
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &format!("default={peer_url}"),
            ]),
        )?;

        let port = free_port()?;
        cp.port = port;
        cp.url = format!("https://127.0.0.1:{port}");
        let mut apiserver = Command::new(bin.join("kube-apiserver"));
        apiserver.args([
            "--etcd-servers",
            &etcd_url,
            "--bind-address",
            "127.0.0.1",
            "--advertise-address",
            "127.0.0.1",
            "--secure-port",
            &port.to_string(),
            "--tls-cert-file",
            &path(&srv_file),
            "--tls-private-key-file",
            &path(&srv_key_file),
            "--client-ca-file",
            &path(&ca_file),
            "--token-auth-file",
            &path(&tokens),
            "--authorization-mode",
            "Node,RBAC",
            "--service-account-issuer",
            "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file",
            &path(&sa_pub),
            "--service-account-signing-key-file",
            &path(&sa_key),
            "--service-cluster-ip-range",
            "10.0.0.0/24",
            "--endpoint-reconciler-type",
            "none",
            "--requestheader-client-ca-file",
            &path(&fp_ca_file),
            "--requestheader-allowed-names",
            "front-proxy-client",
            "--requestheader-username-headers",
            "X-Remote-User",
            "--requestheader-group-headers",
            "X-Remote-Group",
            "--requestheader-extra-headers-prefix",
            "X-Remote-Extra-",
            "--proxy-client-cert-file",
            &path(&fp_file),
            "--proxy-client-key-file",
            &path(&fp_key_file),
            "--allow-privileged=true",
            "--profiling=false",
        ]);
        if audit {
            apiserver.args([
                "--audit-policy-file",
                &path(&audit_policy),
                "--audit-log-path",
                &path(&dir.join("audit.log")),
                "--audit-log-maxsize",
                "0",
            ]);
        }
        cp.spawn("kube-apiserver", &mut apiserver)?;
        let kubeconfig = cp.write_kubeconfig("admin.kubeconfig", ADMIN_TOKEN)?;
        cp.wait_ready(Duration::from_secs(90))?;

        let kc = path(&kubeconfig);
        let kcm_port = free_port()?;
        cp.spawn(
            "kube-controller-manager",
            Command::new(bin.join("kube-controller-manager")).args([
                "--kubeconfig",
                &kc,
                "--authentication-kubeconfig",
                &kc,
                "--authorization-kubeconfig",
                &kc,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                &kcm_port.to_string(),
                "--controllers",
                "*",
                "--use-service-account-credentials=false",
                "--service-account-private-key-file",
                &path(&sa_key),
                "--root-ca-file",
                &path(&ca_file),
                "--cluster-signing-cert-file",
                &path(&ca_file),
                "--cluster-signing-key-file",
                &path(&ca_key_file),
                "--leader-elect=false",
            ]),
        )?;
        let sched_port = free_port()?;
        cp.spawn(
            "kube-scheduler",
            Command::new(bin.join("kube-scheduler")).args([
                "--kubeconfig",
                &kc,
                "--authentication-kubeconfig",
                &kc,
                "--authorization-kubeconfig",
                &kc,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                &sched_port.to_string(),
                "--leader-elect=false",
            ]),
        )?;
        eprintln!("control plane: {} (logs in {})", cp.url, dir.display());
        Ok(cp)
    }

    /// Starts `name`, its output in `<dir>/<name>.log`; it dies with the test process.
    fn spawn(&self, name: &str, cmd: &mut Command) -> Result<()> {
        let log = fs::File::create(self.dir.join(format!("{name}.log")))?;
        #[allow(unsafe_code)] // pre_exec: one async-signal-safe prctl
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        self.procs.lock().unwrap().push((name.into(), child));
        Ok(())
    }

    /// The CPU time `name` (etcd, kube-apiserver, ...) has used so far, user
    /// and system, from /proc.
    pub fn cpu(&self, name: &str) -> Result<Duration> {
        let pid = self
            .procs
            .lock()
            .unwrap()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.id())
            .with_context(|| format!("no process {name}"))?;
        cpu_of(pid)
    }

    /// Which of the processes has exited, with the end of its log.
    fn dead(&self) -> Option<String> {
        let mut procs = self.procs.lock().unwrap();
        for (name, child) in procs.iter_mut() {
            if let Ok(Some(st)) = child.try_wait() {
                let log =
                    fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                return Some(format!("{name} exited ({st}):\n{}", tail.join("\n")));
            }
        }
        None
    }

    fn wait_ready(&self, within: Duration) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let t0 = Instant::now();
        loop {
            if let Some(d) = self.dead() {
                bail!("{d}");
            }
            let ok = rt.block_on(async {
                let mut c = self.config(ADMIN_TOKEN);
                c.connect_timeout = Some(Duration::from_secs(2));
                c.read_timeout = Some(Duration::from_secs(2));
                let Ok(client) = kube::Client::try_from(c) else {
                    return false;
                };
                let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
                client.request_text(req).await.is_ok_and(|t| t == "ok")
            });
            if ok {
                return Ok(());
            }
            if t0.elapsed() > within {
                bail!(
                    "kube-apiserver not ready within {within:?}:\n{}",
                    self.log_tail("kube-apiserver", 15)
                );
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// A kubeconfig for `token`, in the control plane's directory.
    pub fn write_kubeconfig(&self, name: &str, token: &str) -> Result<PathBuf> {
        let p = self.dir.join(name);
        let mut f = fs::File::create(&p)?;
        write!(
            f,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: u\ncurrent-context: test\n",
            self.url,
            self.dir.join("ca.crt").display()
        )?;
        Ok(p)
    }

    /// A kubelet's client certificate and key for `node` (user
    /// `system:node:NODE` in group `system:nodes`, as the Node authorizer
    /// wants it), signed by the cluster's CA: PEM (cert, key).
    pub fn node_credentials(&self, node: &str) -> Result<(String, String)> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name
            .push(DnType::CommonName, format!("system:node:{node}"));
        p.distinguished_name
            .push(DnType::OrganizationName, "system:nodes");
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        p.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.ca)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A kube-rs configuration for `token` (the admin's by default).
    pub fn config(&self, token: &str) -> kube::Config {
        let mut c = kube::Config::new(self.url.parse().expect("url"));
        c.root_cert = Some(vec![self.ca_der.clone()]);
        c.auth_info.token = Some(token.to_string().into());
        c
    }

    pub fn client(&self, token: &str) -> kube::Client {
        kube::Client::try_from(self.config(token)).expect("kube client for the control plane")
    }

    /// A client for `token` with the agent's own settings
    /// (`lastgasp::apiserver::tune`: no retries inside kube, its timeouts).
    pub fn agent_client(&self, token: &str, usage: lastgasp::apiserver::Use) -> kube::Client {
        let mut c = self.config(token);
        lastgasp::apiserver::tune(&mut c, usage);
        kube::Client::try_from(c).expect("kube client for the control plane")
    }

    pub fn admin(&self) -> kube::Client {
        self.client(ADMIN_TOKEN)
    }

    /// The API server's audit events of `user`, one per request in arrival
    /// order: its last stage (ResponseComplete; ResponseStarted for a watch
    /// still open).
    pub fn audit(&self, user: &str) -> Vec<AuditEvent> {
        let log = fs::read_to_string(self.dir.join("audit.log")).unwrap_or_default();
        let mut order: Vec<String> = Vec::new();
        let mut last: std::collections::HashMap<String, serde_json::Value> = Default::default();
        for e in log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            if e["user"]["username"] != user {
                continue;
            }
            let id = e["auditID"].as_str().unwrap_or("").to_string();
            if !last.contains_key(&id) {
                order.push(id.clone());
            }
            last.insert(id, e);
        }
        order
            .iter()
            .map(|id| {
                let e = &last[id];
                let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
                AuditEvent {
                    verb: s(&e["verb"]),
                    group: s(&e["objectRef"]["apiGroup"]),
                    resource: s(&e["objectRef"]["resource"]),
                    subresource: s(&e["objectRef"]["subresource"]),
                    name: s(&e["objectRef"]["name"]),
                    code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
                    namespace: s(&e["objectRef"]["namespace"]),
                    extra: e["user"]["extra"].clone(),
                }
            })
            .collect()
    }

    /// The end of a process's log, for a failing test's message.
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        let log = fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Ends the processes and removes the files (kept, and named, when the
    /// thread is panicking). A shared control plane lives in a static,
    /// never dropped: a program that uses one calls this before it exits.
    pub fn stop(&self) {
        let mut procs = self
            .procs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (_, child) in procs.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("control plane files kept in {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Removes the directories of control planes whose test process is gone:
/// the shared ones live in statics, which are never dropped.
fn sweep_dead() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("lastgasp-cp-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// A token of `sa` in `ns` bound to `pod`, as the kubelet projects it into
/// the pod (its node-name claim included); unbound without one.
pub async fn pod_token(
    client: &kube::Client,
    ns: &str,
    sa: &str,
    pod: Option<&k8s_openapi::api::core::v1::Pod>,
) -> String {
    use k8s_openapi::api::{authentication::v1::TokenRequest, core::v1::ServiceAccount};
    use kube::ResourceExt;
    let sas: kube::Api<ServiceAccount> = kube::Api::namespaced(client.clone(), ns);
    let mut spec = serde_json::json!({"expirationSeconds": 3600});
    if let Some(p) = pod {
        spec["boundObjectRef"] = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "name": p.name_any(), "uid": p.metadata.uid});
    }
    let req: TokenRequest = serde_json::from_value(serde_json::json!({"spec": spec})).unwrap();
    sas.create_token_request(sa, &kube::api::PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .expect("a token")
}

/// The bound token of the Running pod of `component` (its
/// `app.kubernetes.io/component` label) on `node` in `ns`, as that pod
/// holds it; waits up to 90 s for the pod.
pub async fn running_pod_token(
    admin: &kube::Client,
    ns: &str,
    component: &str,
    node: &str,
) -> String {
    use k8s_openapi::api::core::v1::Pod;
    let pods: kube::Api<Pod> = kube::Api::namespaced(admin.clone(), ns);
    let lp = kube::api::ListParams::default()
        .labels(&format!("app.kubernetes.io/component={component}"));
    let t0 = std::time::Instant::now();
    loop {
        let list = pods.list(&lp).await.unwrap();
        let found = list.items.into_iter().find(|p| {
            let on = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            running && on == Some(node)
        });
        if let Some(p) = found {
            let sa = p
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap();
            return pod_token(admin, ns, &sa, Some(&p)).await;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(90),
            "no Running {component} pod on {node}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
}
