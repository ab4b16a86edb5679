//! The agent runs with exactly the documented capabilities and mounts.
use super::*;

#[test]
fn the_agent_runs_unprivileged_with_the_documented_capabilities() {
    let objs = objects("deploy/kustomize", &source_objects());
    let pod = agent_pod(&objs);
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tol = pod.tolerations.clone().unwrap();
    assert!(
        tol.iter().any(|t| t.operator.as_deref() == Some("Exists")
            && t.key.is_none()
            && t.effect.is_none()),
        "every taint is tolerated"
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("lastgasp-agent"));
    let c = &pod.containers[0];
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.run_as_user, Some(0));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.allow_privilege_escalation, None,
        "`false` is invalid with SYS_ADMIN"
    );
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    let add: BTreeSet<String> = caps.add.unwrap().into_iter().collect();
    assert_eq!(
        add,
        ["BPF", "PERFMON", "SYS_ADMIN", "SYS_PTRACE"]
            .map(String::from)
            .into()
    );
    let seccomp = pod.security_context.unwrap().seccomp_profile.unwrap();
    assert_eq!(seccomp.type_, "RuntimeDefault");

    // Host paths: what each mount is for is commented in the manifest.
    let volumes: BTreeMap<String, (String, Option<String>)> = pod
        .volumes
        .unwrap()
        .into_iter()
        .filter_map(|v| v.host_path.map(|h| (v.name, (h.path, h.type_))))
        .collect();
    let mounts: BTreeMap<String, (String, bool)> = c
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .filter(|m| volumes.contains_key(&m.name))
        .map(|m| {
            (
                volumes[&m.name].0.clone(),
                (m.mount_path, m.read_only == Some(true)),
            )
        })
        .collect();
    let want: BTreeMap<&str, (&str, bool)> = BTreeMap::from([
        ("/var/lib/lastgasp", ("/var/lib/lastgasp", false)),
        ("/run/dbus", ("/run/dbus", false)),
        ("/sys/kernel/btf", ("/sys/kernel/btf", true)),
        ("/sys/kernel/tracing", ("/sys/kernel/tracing", true)),
        ("/etc/systemd", ("/host/etc/systemd", true)),
        (
            "/etc/systemd/logind.conf.d",
            ("/host/etc/systemd/logind.conf.d", false),
        ),
        ("/run/systemd", ("/host/run/systemd", true)),
        // Writable: lastgasp's final unit where /usr is read-only.
        ("/run/systemd/system", ("/host/run/systemd/system", false)),
        // Writable: the hook's directory may be missing (created by the agent).
        ("/usr/lib/systemd", ("/host/usr/lib/systemd", false)),
        ("/run/lastgasp", ("/run/lastgasp", false)),
    ]);
    let got: BTreeMap<&str, (&str, bool)> = mounts
        .iter()
        .map(|(h, (m, ro))| (h.as_str(), (m.as_str(), *ro)))
        .collect();
    assert_eq!(got, want);
    // The drop-in lands where logind reads it: the logind root + etc/systemd/logind.conf.d.
    // The hook lands in systemd-shutdown's directory, the FIFO in the shared run dir.
    assert_eq!(
        env_value(c, "LASTGASP_SHUTDOWN_HOOK_DIR").as_deref(),
        Some("/host/usr/lib/systemd/system-shutdown")
    );
    let root = env_value(c, "LASTGASP_LOGIND_ROOT").expect("LASTGASP_LOGIND_ROOT");
    assert_eq!(
        lastgasp::detect::logind::config::dropin_path(Path::new(&root)),
        Path::new("/host/etc/systemd/logind.conf.d/99-lastgasp.conf")
    );
    // Probes on the metrics port, which is the cluster-mode default.
    let port = c
        .ports
        .clone()
        .unwrap()
        .into_iter()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap();
    assert_eq!(port.container_port, 9850);
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.clone().unwrap().http_get.unwrap().path.unwrap()
    };
    assert_eq!(probe_path(&c.readiness_probe), "/readyz");
    assert_eq!(probe_path(&c.liveness_probe), "/healthz");

    // The controller: non-root, read-only, no capabilities at all.
    let pod = controller_pod(&objs);
    let psc = pod.security_context.clone().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    let sc = pod.containers[0].security_context.clone().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_string()]));
    let d: Deployment = get(&objs, "Deployment", "lastgasp-controller");
    assert_eq!(d.spec.replicas, Some(2));
}
