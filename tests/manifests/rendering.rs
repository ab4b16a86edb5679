//! kustomize and Helm render the same objects.
use super::*;

#[test]
fn kustomize_renders_the_source_manifests() {
    let Some(k) = kustomize() else {
        return skip("kustomize_renders_the_source_manifests", "no kustomize");
    };
    let rendered = objects("kustomize build", &render_kustomize(&k));
    let source = objects("deploy/kustomize", &source_objects());
    assert_same(
        "deploy/kustomize files",
        &source,
        "kustomize build",
        &rendered,
    );
}

#[test]
fn kustomize_and_helm_render_the_same_objects() {
    let (Some(k), Some(h)) = (kustomize(), helm()) else {
        return skip(
            "kustomize_and_helm_render_the_same_objects",
            "no helm or kustomize",
        );
    };
    let kust = objects("kustomize build", &render_kustomize(&k));
    let helm = objects("helm template", &render_helm(&h, &[]));
    assert_same("kustomize build", &kust, "helm template", &helm);
    // podRemoval: evict, both ways.
    let kust = evict_objects("kustomize_and_helm_render_the_same_objects").unwrap();
    let helm = objects(
        "helm template --set agent.podRemoval=evict",
        &render_helm(&h, &["agent.podRemoval=evict"]),
    );
    assert_same(
        "the evict overlay",
        &kust,
        "helm --set agent.podRemoval=evict",
        &helm,
    );
    let evicts =
        |o: &BTreeMap<Key, Value>| o.values().any(|v| v.to_string().contains("pods/eviction"));
    assert!(evicts(&kust), "the evict variant grants pods/eviction");
    assert!(
        !evicts(&objects("kustomize build", &render_kustomize(&k))),
        "the default grants no pods/eviction"
    );
}

/// The chart's one structural option: the grace periods from the node's
/// KubeletConfiguration, mounted read-only where the config says.
#[test]
fn helm_mounts_the_kubelets_config_to_check_its_shutdown_is_off() {
    let Some(h) = helm() else {
        return skip(
            "helm_mounts_the_kubelets_config_to_check_its_shutdown_is_off",
            "no helm",
        );
    };
    let path = "/var/lib/kubelet/config.yaml";
    let objs = objects(
        "helm template --set agent.kubeletConfigPath",
        &render_helm(&h, &[&format!("agent.kubeletConfigPath={path}")]),
    );
    let cm: ConfigMap = get(&objs, "ConfigMap", "lastgasp-agent");
    let text = cm.data.unwrap()["config.yaml"].clone();
    assert!(
        text.contains("\nshutdownGracePeriod: 30s"),
        "the agent's own grace periods stay: {text}"
    );
    // Parsed by the agent with a kubelet configuration standing in for the node's.
    let dir = std::env::temp_dir().join(format!("lastgasp-manifests-kcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kcfg = dir.join("config.yaml");
    std::fs::write(
        &kcfg,
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nshutdownGracePeriod: 30s\nshutdownGracePeriodCriticalPods: 10s\n",
    )
    .unwrap();
    let cfg = Config::parse(&text.replace(path, kcfg.to_str().unwrap()))
        .unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    assert_eq!(cfg.buckets().unwrap().len(), 2);
    assert!(
        cfg.kubelet_graceful_shutdown().unwrap().is_some(),
        "the kubelet's shutdownGracePeriod: 30s is found on"
    );
    std::fs::remove_dir_all(&dir).ok();
    let pod = agent_pod(&objs);
    let m = pod.containers[0]
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .find(|m| m.mount_path == path)
        .expect("mounted");
    assert_eq!(m.read_only, Some(true));
    let v = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == m.name)
        .unwrap()
        .host_path
        .unwrap();
    assert_eq!((v.path.as_str(), v.type_.as_deref()), (path, Some("File")));
}
