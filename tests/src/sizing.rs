//! What the controller costs by cluster size (`cargo xtask bench sizing`):
//! N Nodes shaped as a cloud's (labels, conditions, addresses, 40 images:
//! about 9 KB each as the API server stores them) with their kubelets'
//! Leases, on the real control plane; the real `lastgasp controller`
//! process as the chart runs it (its own token, the kustomize render's
//! RBAC); its resident memory (now and peak) and CPU over a steady window,
//! beside the API server's CPU. Nothing is fenced: the cost of watching.
use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use futures::{stream, StreamExt};
use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::Node},
    jiff::Timestamp,
};
use kube::{
    api::{Patch, PatchParams, PostParams},
    Api, Client,
};
use serde_json::{json, Value};

use crate::{
    controlplane::{cpu_of, ControlPlane},
    zone::{token, CONTROLLER_SA},
};

/// One size's figures.
pub struct Sized {
    pub nodes: usize,
    /// From the process's start to its first 200 on /readyz.
    pub ready_s: f64,
    pub rss_mib: f64,
    pub peak_mib: f64,
    pub cpu_ms_per_s: f64,
    pub apiserver_cpu_ms_per_s: f64,
}

/// The 40 images a busy node holds.
fn images(i: usize) -> Value {
    (0..40)
        .map(|k| {
            json!({"names": [
                format!("registry.example.com/team-{k}/service-{k}@sha256:{:064x}", k * 7919 + i),
                format!("registry.example.com/team-{k}/service-{k}:v1.{k}.{}", i % 97),
            ], "sizeBytes": 50_000_000 + k * 1_000_003})
        })
        .collect()
}

/// A Node as a cloud's kubelet creates it.
fn node(name: &str, i: usize) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "topology.kubernetes.io/zone": format!("zone-{}", i % 3),
            "topology.kubernetes.io/region": "region-1",
            "node.kubernetes.io/instance-type": "m6i.2xlarge",
            "node-pool": format!("pool-{}", i % 5)},
          "annotations": {
            "node.alpha.kubernetes.io/ttl": "0",
            "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        "spec": {"podCIDR": format!("10.{}.{}.0/24", 64 + i / 256 % 64, i % 256),
                 "providerID": format!("aws:///zone-{}/i-{:017x}", i % 3, i)}
    })
}

fn node_status(i: usize) -> Value {
    let now = Timestamp::now().to_string();
    let cond = |t: &str, s: &str, r: &str| {
        json!({"type": t, "status": s, "reason": r,
        "message": format!("kubelet says {r}"), "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    json!({"status": {
        "conditions": [cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID"),
            cond("Ready", "True", "KubeletReady")],
        "addresses": [{"type": "InternalIP", "address": format!("10.0.{}.{}", i / 250, i % 250 + 1)},
            {"type": "Hostname", "address": format!("ip-10-0-{}-{}", i / 250, i % 250 + 1)},
            {"type": "InternalDNS", "address": format!("ip-10-0-{}-{}.region-1.compute.internal", i / 250, i % 250 + 1)}],
        "capacity": {"cpu": "8", "memory": "32386524Ki", "pods": "110", "ephemeral-storage": "104845292Ki"},
        "allocatable": {"cpu": "7910m", "memory": "31371740Ki", "pods": "110", "ephemeral-storage": "95551679124"},
        "nodeInfo": {"machineID": format!("{i:032x}"), "systemUUID": format!("ec2{i:029x}"),
            "bootID": format!("{:08x}-0000-4000-8000-{i:012x}", i), "kernelVersion": "6.1.0-50-amd64",
            "osImage": "Debian GNU/Linux 12 (bookworm)", "containerRuntimeVersion": "containerd://1.7.24",
            "kubeletVersion": "v1.32.13", "kubeProxyVersion": "v1.32.13", "operatingSystem": "linux", "architecture": "amd64"},
        "images": images(i),
    }})
}

/// Nodes `from..to` and their Leases.
pub async fn add_nodes(admin: &Client, from: usize, to: usize) -> Result<()> {
    let nodes: Api<Node> = Api::all(admin.clone());
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "kube-node-lease");
    let results: Vec<Result<()>> = stream::iter(from..to)
        .map(|i| {
            let (nodes, leases) = (nodes.clone(), leases.clone());
            async move {
                let name = format!("size-{i:05}");
                let obj: Node = serde_json::from_value(node(&name, i))?;
                nodes
                    .create(&PostParams::default(), &obj)
                    .await
                    .with_context(|| format!("creating {name}"))?;
                nodes
                    .patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(node_status(i)),
                    )
                    .await
                    .with_context(|| format!("{name}'s status"))?;
                let lease: Lease = serde_json::from_value(json!({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name},
                    "spec": {"holderIdentity": name, "leaseDurationSeconds": 40,
                             "renewTime": Timestamp::now().to_string()}}))?;
                leases
                    .create(&PostParams::default(), &lease)
                    .await
                    .with_context(|| format!("{name}'s Lease"))?;
                Ok(())
            }
        })
        .buffer_unordered(24)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The controller process with the controller's token, until dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn readyz(addr: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if write!(
        s,
        "GET /readyz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

fn status_kib(pid: u32, key: &str) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {key} in /proc/{pid}/status"))
}

/// Starts the controller on `cp`'s `nodes` Nodes and measures it over `window`.
pub fn measure(
    cp: &'static ControlPlane,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    nodes: usize,
    window: Duration,
) -> Result<Sized> {
    let tok = rt.block_on(token(&cp.admin(), CONTROLLER_SA, None))?;
    let kubeconfig = cp.write_kubeconfig(&format!("sizing-{nodes}"), &tok)?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let child = Command::new(bin)
        .args(["--json-logs", "controller", "--lease-namespace", "lastgasp"])
        .args([
            "--lease-name",
            "lastgasp-controller",
            "--metrics-listen",
            &addr,
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env("LASTGASP_IDENTITY", format!("sizing-{nodes}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting lastgasp controller")?;
    let ctl = Running(child);
    let pid = ctl.0.id();
    while !readyz(&addr) {
        if started.elapsed() > Duration::from_secs(300) {
            bail!("the controller with {nodes} nodes was not ready within 300 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let ready_s = started.elapsed().as_secs_f64();
    // Settle, then a steady window.
    std::thread::sleep(Duration::from_secs(10));
    let (c0, a0, t0) = (cpu_of(pid)?, cp.cpu("kube-apiserver")?, Instant::now());
    std::thread::sleep(window);
    let (c1, a1, secs) = (
        cpu_of(pid)?,
        cp.cpu("kube-apiserver")?,
        t0.elapsed().as_secs_f64(),
    );
    let per_s = |d: Duration| d.as_secs_f64() * 1000.0 / secs;
    Ok(Sized {
        nodes,
        ready_s,
        rss_mib: status_kib(pid, "VmRSS:")? / 1024.0,
        peak_mib: status_kib(pid, "VmHWM:")? / 1024.0,
        cpu_ms_per_s: per_s(c1 - c0),
        apiserver_cpu_ms_per_s: per_s(a1 - a0),
    })
}

/// The controller's leader Lease, freed for the next size's process.
pub async fn free_lease(admin: &Client) -> Result<()> {
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "lastgasp");
    match leases
        .delete("lastgasp-controller", &Default::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The stored size of one of the Nodes (its JSON as the server returns it).
pub async fn node_bytes(admin: &Client) -> Result<usize> {
    let nodes: Api<Node> = Api::all(admin.clone());
    let n = nodes.get("size-00000").await?;
    Ok(serde_json::to_vec(&n)?.len())
}
