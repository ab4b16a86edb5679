//! A node simulator for the real control plane: it plays the kubelets of
//! several nodes and a CSI external-attacher.
//!
//! Each node registers its Node, renews its Lease in `kube-node-lease` every
//! 10 s (duration 40 s, as the kubelet), posts Ready with the heartbeat, runs
//! the pods bound to it (Running and Ready, once every CSI volume they use is
//! attached to this node), reports `volumesInUse`/`volumesAttached`, and
//! deletes a pod with grace 0 once it is marked for deletion, as a kubelet
//! does after its containers stop. [`Sim::power_off`] stops all of that for
//! one node at once. The attacher is cluster-wide and keeps running.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod},
        storage::v1::VolumeAttachment,
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    jiff::Timestamp,
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions},
    Api, Client, ResourceExt,
};
use serde_json::json;

pub const DRIVER: &str = "sim.csi.lastgasp.dev";
const FINALIZER: &str = "external-attacher/sim-csi-lastgasp-dev";
pub const HEARTBEAT: Duration = Duration::from_secs(10);
pub const LEASE_SECONDS: i32 = 40;

struct NodeState {
    task: tokio::task::JoinHandle<()>,
    last_beat: Arc<Mutex<Instant>>,
    pub boot_id: String,
}

pub struct Sim {
    client: Client,
    nodes: Mutex<BTreeMap<String, NodeState>>,
    attacher: tokio::task::JoinHandle<()>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.attacher.abort();
        for (_, n) in self.nodes.lock().unwrap().iter() {
            n.task.abort();
        }
    }
}

fn now_time() -> Time {
    Time(Timestamp::now())
}

/// A small random number in [0, n), from the clock: enough to spread
/// power-offs over the heartbeat cycle.
pub fn random_below(n: u64) -> u64 {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut x = t ^ 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id());
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x % n.max(1)
}

impl Sim {
    /// Creates the CSIDriver (attachRequired) and starts the attacher.
    pub async fn start(client: Client) -> Result<Sim> {
        let drivers: Api<k8s_openapi::api::storage::v1::CSIDriver> = Api::all(client.clone());
        let d = serde_json::from_value(json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver",
            "metadata": {"name": DRIVER},
            "spec": {"attachRequired": true, "podInfoOnMount": false}
        }))?;
        match drivers.create(&PostParams::default(), &d).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e).context("creating the CSIDriver"),
        }
        let attacher = tokio::spawn(attacher(client.clone()));
        Ok(Sim {
            client,
            nodes: Mutex::new(BTreeMap::new()),
            attacher,
        })
    }

    /// Registers `name` (on a new boot id) and starts its kubelet.
    pub async fn add_node(&self, name: &str) -> Result<String> {
        let boot_id = format!("boot-{name}-{:x}", random_below(u64::MAX));
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name,
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
                "annotations": {"volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        }))?;
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e).context("registering the Node"),
        }
        self.resume(name, &boot_id).await?;
        Ok(boot_id)
    }

    /// Starts `name`'s kubelet on boot `boot_id` (a node that never went
    /// down, when it is the boot it had).
    pub async fn resume(&self, name: &str, boot_id: &str) -> Result<()> {
        let last_beat = Arc::new(Mutex::new(Instant::now()));
        let kubelet = Kubelet {
            client: self.client.clone(),
            name: name.to_string(),
            boot_id: boot_id.to_string(),
            last_beat: last_beat.clone(),
            ready_since: now_time(),
        };
        // The first heartbeat before returning: the node is Ready when this returns.
        kubelet
            .heartbeat(&BTreeSet::new(), &BTreeSet::new())
            .await?;
        let task = tokio::spawn(kubelet.run());
        if let Some(old) = self.nodes.lock().unwrap().insert(
            name.into(),
            NodeState {
                task,
                last_beat,
                boot_id: boot_id.to_string(),
            },
        ) {
            old.task.abort();
        }
        Ok(())
    }

    /// When the node's last heartbeat (Lease and status) was answered.
    pub fn last_beat(&self, name: &str) -> Option<Instant> {
        let nodes = self.nodes.lock().unwrap();
        let beat = nodes.get(name)?.last_beat.clone();
        let t = *beat.lock().unwrap();
        Some(t)
    }

    pub fn boot_id(&self, name: &str) -> Option<String> {
        self.nodes
            .lock()
            .unwrap()
            .get(name)
            .map(|n| n.boot_id.clone())
    }

    /// Stops the node's kubelet at once: no Lease renewal, no status, no pod
    /// handling. Returns when it happened.
    pub fn power_off(&self, name: &str) -> SystemTime {
        if let Some(n) = self.nodes.lock().unwrap().remove(name) {
            n.task.abort();
        }
        SystemTime::now()
    }

    /// Waits until `phase` (0..1) of the node's heartbeat cycle has passed
    /// since its last heartbeat, then powers it off.
    pub async fn power_off_at_phase(&self, name: &str, phase: f64) -> SystemTime {
        let last = {
            let nodes = self.nodes.lock().unwrap();
            let beat = nodes.get(name).expect("a running node").last_beat.clone();
            let t = *beat.lock().unwrap();
            t
        };
        let at = last + HEARTBEAT.mul_f64(phase.clamp(0.0, 0.999));
        tokio::time::sleep_until(at.into()).await;
        self.power_off(name)
    }
}

struct Kubelet {
    client: Client,
    name: String,
    boot_id: String,
    last_beat: Arc<Mutex<Instant>>,
    /// When this boot's kubelet first posted Ready: the condition's
    /// lastTransitionTime, which the real kubelet moves only when the
    /// status changes.
    ready_since: Time,
}

fn unique_name(handle: &str) -> String {
    format!("kubernetes.io/csi/{DRIVER}^{handle}")
}

impl Kubelet {
    async fn run(self) {
        let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT, HEARTBEAT);
        let mut pods = tokio::time::interval(Duration::from_millis(100));
        let mut in_use = BTreeSet::new();
        let mut attached = BTreeSet::new();
        loop {
            tokio::select! {
                _ = beat.tick() => {
                    if let Err(e) = self.heartbeat(&in_use, &attached).await {
                        eprintln!("nodesim {}: heartbeat: {e:#}", self.name);
                    }
                }
                _ = pods.tick() => {
                    match self.sync_pods().await {
                        Ok((u, a)) => {
                            if u != in_use || a != attached {
                                in_use = u;
                                attached = a;
                                if let Err(e) = self.post_status(&in_use, &attached).await {
                                    eprintln!("nodesim {}: status: {e:#}", self.name);
                                }
                            }
                        }
                        Err(e) => eprintln!("nodesim {}: pods: {e:#}", self.name),
                    }
                }
            }
        }
    }

    async fn heartbeat(
        &self,
        in_use: &BTreeSet<String>,
        attached: &BTreeSet<String>,
    ) -> Result<()> {
        self.renew_lease().await?;
        self.post_status(in_use, attached).await?;
        *self.last_beat.lock().unwrap() = Instant::now();
        Ok(())
    }

    async fn renew_lease(&self) -> Result<()> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), "kube-node-lease");
        let now = MicroTime(Timestamp::now());
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now}
        });
        leases
            .patch(
                &self.name,
                &PatchParams::apply("kubelet").force(),
                &Patch::Apply(&lease),
            )
            .await
            .context("renewing the Lease")?;
        Ok(())
    }

    async fn post_status(
        &self,
        in_use: &BTreeSet<String>,
        attached: &BTreeSet<String>,
    ) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let now = now_time();
        let status = json!({"status": {
            "capacity": {"cpu": "4", "memory": "8Gi", "pods": "110"},
            "allocatable": {"cpu": "4", "memory": "8Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status (simulated)",
                "lastHeartbeatTime": now, "lastTransitionTime": self.ready_since}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
            "nodeInfo": {"bootID": self.boot_id, "machineID": self.name, "systemUUID": self.name,
                "kernelVersion": "6.1.0", "osImage": "lastgasp nodesim", "containerRuntimeVersion": "sim://1",
                "kubeletVersion": "v1.32.13", "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
            "volumesInUse": in_use,
            "volumesAttached": attached.iter().map(|n| json!({"name": n, "devicePath": ""})).collect::<Vec<_>>(),
        }});
        nodes
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Strategic(&status),
            )
            .await
            .context("posting the node status")?;
        Ok(())
    }

    /// One pass over the pods bound here; returns (volumes in use, volumes attached).
    async fn sync_pods(&self) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let vas: Api<VolumeAttachment> = Api::all(self.client.clone());
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.name));
        let mine = pods.list(&lp).await?;
        // PV name -> volume handle, for the attachments to this node that are attached.
        let mut attached_pv: BTreeMap<String, String> = BTreeMap::new();
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        for va in vas.list(&ListParams::default()).await? {
            if va.spec.node_name != self.name || va.spec.attacher != DRIVER {
                continue;
            }
            if !va.status.as_ref().is_some_and(|s| s.attached) {
                continue;
            }
            if let Some(pv) = va.spec.source.persistent_volume_name.clone() {
                if let Some(p) = pvs.get_opt(&pv).await? {
                    if let Some(csi) = p.spec.as_ref().and_then(|s| s.csi.as_ref()) {
                        attached_pv.insert(pv, csi.volume_handle.clone());
                    }
                }
            }
        }
        let attached: BTreeSet<String> = attached_pv.values().map(|h| unique_name(h)).collect();
        let mut in_use = BTreeSet::new();
        for pod in mine {
            let ns = pod.namespace().unwrap_or_default();
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
            if pod.metadata.deletion_timestamp.is_some() {
                // The containers "stop" at once; the kubelet then deletes with grace 0.
                let dp = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: pod.uid(),
                        resource_version: None,
                    }),
                    ..Default::default()
                };
                match api.delete(&pod.name_any(), &dp).await {
                    Ok(_) | Err(kube::Error::Api(_)) => {}
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            // Which PVs it needs; it runs once all are attached here.
            let mut need = Vec::new();
            for v in pod
                .spec
                .as_ref()
                .and_then(|s| s.volumes.clone())
                .unwrap_or_default()
            {
                if let Some(c) = v.persistent_volume_claim {
                    let pvcs: Api<PersistentVolumeClaim> =
                        Api::namespaced(self.client.clone(), &ns);
                    let pv = pvcs
                        .get_opt(&c.claim_name)
                        .await?
                        .and_then(|p| p.spec.and_then(|s| s.volume_name));
                    need.push(pv);
                }
            }
            let ready = need
                .iter()
                .all(|pv| pv.as_ref().is_some_and(|pv| attached_pv.contains_key(pv)));
            for pv in need.iter().flatten() {
                if let Some(h) = attached_pv.get(pv) {
                    in_use.insert(unique_name(h));
                }
            }
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            if ready && !running {
                let now = now_time();
                let containers: Vec<_> = pod
                    .spec
                    .as_ref()
                    .map(|s| s.containers.clone())
                    .unwrap_or_default()
                    .into_iter()
                    .map(|c| json!({"name": c.name, "image": c.image, "imageID": "", "ready": true,
                        "restartCount": 0, "started": true, "state": {"running": {"startedAt": now}}}))
                    .collect();
                let st = json!({"status": {"phase": "Running", "hostIP": "127.0.0.1", "podIP": "10.1.0.1",
                    "startTime": now,
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                                   {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                                   {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                                   {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}],
                    "containerStatuses": containers}});
                api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(&st))
                    .await
                    .context("marking a pod Running")?;
            }
        }
        Ok((in_use, attached))
    }
}

/// The CSI external-attacher: marks this driver's VolumeAttachments
/// attached (with its finalizer), and lets deleted ones go (detach).
async fn attacher(client: Client) {
    let vas: Api<VolumeAttachment> = Api::all(client);
    loop {
        match vas.list(&ListParams::default()).await {
            Ok(list) => {
                for va in list {
                    if va.spec.attacher != DRIVER {
                        continue;
                    }
                    let name = va.name_any();
                    let has_fin = va.finalizers().iter().any(|f| f == FINALIZER);
                    let r = if va.metadata.deletion_timestamp.is_some() {
                        if has_fin {
                            let fins: Vec<&String> =
                                va.finalizers().iter().filter(|f| *f != FINALIZER).collect();
                            vas.patch(
                                &name,
                                &PatchParams::default(),
                                &Patch::Merge(json!({"metadata": {"finalizers": fins}})),
                            )
                            .await
                            .map(|_| ())
                        } else {
                            Ok(())
                        }
                    } else if !va.status.as_ref().is_some_and(|s| s.attached) {
                        let mut fins: Vec<String> = va.finalizers().to_vec();
                        if !has_fin {
                            fins.push(FINALIZER.into());
                        }
                        match vas
                            .patch(
                                &name,
                                &PatchParams::default(),
                                &Patch::Merge(json!({"metadata": {"finalizers": fins}})),
                            )
                            .await
                        {
                            Ok(_) => vas
                                .patch_status(
                                    &name,
                                    &PatchParams::default(),
                                    &Patch::Merge(json!({"status": {"attached": true}})),
                                )
                                .await
                                .map(|_| ()),
                            Err(e) => Err(e),
                        }
                    } else {
                        Ok(())
                    };
                    if let Err(e) = r {
                        eprintln!("nodesim attacher: {name}: {e}");
                    }
                }
            }
            Err(e) => eprintln!("nodesim attacher: list: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A one-replica StatefulSet `name` in `ns` with a ReadWriteOnce CSI volume
/// (a static PV bound to its claim), preferring node `on`.
pub async fn stateful_app(client: &Client, ns: &str, name: &str, on: &str) -> Result<()> {
    let pv_name = format!("pv-{ns}-{name}");
    let claim = format!("data-{name}-0");
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    pvs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "sim",
                "claimRef": {"namespace": ns, "name": claim},
                "csi": {"driver": DRIVER, "volumeHandle": format!("vol-{ns}-{name}")}}
        }))?,
    )
    .await
    .context("creating the PV")?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    pvcs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "sim", "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}}}
        }))?,
    )
    .await
    .context("creating the PVC")?;
    let sts: Api<k8s_openapi::api::apps::v1::StatefulSet> = Api::namespaced(client.clone(), ns);
    sts.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": 1, "serviceName": name,
                "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": {"labels": {"app": name}},
                    "spec": {"terminationGracePeriodSeconds": 30,
                        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 100, "preference": {"matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": [on]}]}}]}},
                        "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}},
                "volumeClaimTemplates": [{"metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "sim",
                        "resources": {"requests": {"storage": "1Gi"}}}}]}
        }))?,
    )
    .await
    .context("creating the StatefulSet")?;
    Ok(())
}

/// The node of the app's Running pod, if one runs.
pub async fn running_on(client: &Client, ns: &str, name: &str) -> Result<Option<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let Some(p) = pods.get_opt(&format!("{name}-0")).await? else {
        return Ok(None);
    };
    if p.metadata.deletion_timestamp.is_some()
        || p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running")
    {
        return Ok(None);
    }
    Ok(p.spec.and_then(|s| s.node_name))
}

/// Whether a VolumeAttachment of the app's PV to `node` exists.
pub async fn attached_to(client: &Client, ns: &str, name: &str, node: &str) -> Result<bool> {
    let pv = format!("pv-{ns}-{name}");
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    Ok(vas
        .list(&ListParams::default())
        .await?
        .into_iter()
        .any(|va| {
            va.spec.node_name == node
                && va.spec.source.persistent_volume_name.as_deref() == Some(&pv)
        }))
}

/// Waits until the node lifecycle controller has lifted the
/// `node.kubernetes.io/not-ready` taint it puts on every new Node: before
/// that, the scheduler places nothing there, whatever the affinity prefers.
pub async fn schedulable(client: &Client, names: &[&str], within: Duration) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let t0 = Instant::now();
    for name in names {
        loop {
            let n = nodes.get(name).await?;
            let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
            if !taints
                .iter()
                .any(|t| t.key == "node.kubernetes.io/not-ready")
            {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < within,
                "node {name} still has the not-ready taint after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Creates namespace `ns` (ignores "exists").
pub async fn namespace(client: &Client, ns: &str) -> Result<()> {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    match api
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            )?,
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}
