//! The manifests read by the agent's own parsers: its CLI, its config, `check`.
use super::*;

/// The environment variable clap reads for `--long` of the subcommand `A`.
fn env_of<A: clap::Args>(long: &str) -> Option<String> {
    A::augment_args(clap::Command::new("x"))
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
}

#[test]
fn check_exec_in_the_agents_pod_reads_the_settings_run_reads() {
    // `kubectl exec ds/lastgasp-agent -- lastgasp check`, as written: the
    // settings are environment, which run and check both read; none is an
    // argument of run's alone. (The chart renders the same DaemonSet: see
    // the kustomize/helm comparison.)
    {
        let dir = "deploy/kustomize";
        let objs = objects(dir, &source_objects());
        let pod = agent_pod(&objs);
        let c = &pod.containers[0];
        assert_eq!(
            c.args.clone().unwrap(),
            ["--json-logs", "run"],
            "{dir}: run's settings belong in env, where check finds them too"
        );
        for (long, want) in [
            ("config", "/etc/lastgasp/config.yaml"),
            ("logind-root", "/host"),
        ] {
            let var = env_of::<lastgasp::agent::RunArgs>(long).expect("run reads it from env");
            assert_eq!(
                env_of::<lastgasp::check::CheckArgs>(long).as_deref(),
                Some(var.as_str()),
                "check reads --{long} from the same variable"
            );
            assert_eq!(env_value(c, &var).as_deref(), Some(want), "{dir}: {var}");
        }
        let var = env_of::<lastgasp::agent::RunArgs>("shutdown-hook-dir").unwrap();
        assert_eq!(
            env_value(c, &var).as_deref(),
            Some("/host/usr/lib/systemd/system-shutdown"),
            "{dir}: {var}"
        );
    }
}

#[test]
fn the_config_map_parses_with_the_agents_config_and_fits_the_daemonset() {
    let objs = objects("deploy/kustomize", &source_objects());
    let cm: ConfigMap = get(&objs, "ConfigMap", "lastgasp-agent");
    let text = &cm.data.unwrap()["config.yaml"];
    let cfg = Config::parse(text).unwrap_or_else(|e| panic!("the ConfigMap's config.yaml: {e:#}"));
    assert_eq!(cfg.node_name, None, "the node's name comes from $NODE_NAME");
    assert_eq!(cfg.pod_removal, Removal::Delete);
    let pod = agent_pod(&objs);
    let c = &pod.containers[0];

    // The config file is in the ConfigMap's mount.
    let config_path = PathBuf::from(env_value(c, "LASTGASP_CONFIG").expect("LASTGASP_CONFIG"));
    let mounts = c.volume_mounts.clone().unwrap();
    let volumes = pod.volumes.clone().unwrap();
    let m = mounts
        .iter()
        .find(|m| config_path.starts_with(&m.mount_path))
        .expect("--config is mounted");
    let v = volumes.iter().find(|v| v.name == m.name).unwrap();
    assert_eq!(v.config_map.as_ref().unwrap().name, "lastgasp-agent");
    assert_eq!(config_path.file_name().unwrap(), "config.yaml");

    // auditDir is the host path, mounted at the same place.
    let m = mounts
        .iter()
        .find(|m| Path::new(&m.mount_path) == cfg.audit_dir)
        .expect("auditDir is mounted");
    let hp = volumes
        .iter()
        .find(|v| v.name == m.name)
        .unwrap()
        .host_path
        .clone()
        .expect("a hostPath");
    assert_eq!(
        (hp.path.as_str(), hp.type_.as_deref()),
        ("/var/lib/lastgasp", Some("DirectoryOrCreate"))
    );
    assert_ne!(m.read_only, Some(true));

    // The pod outlives a graceful run the agent may be in when SIGTERM comes.
    let total: i64 = cfg
        .buckets()
        .unwrap()
        .iter()
        .map(|b: &Bucket| b.seconds)
        .sum();
    let tgps = pod.termination_grace_period_seconds.unwrap();
    assert!(
        tgps > total,
        "terminationGracePeriodSeconds {tgps} must exceed the graceful path's {total}s"
    );

    // The downward API gives the names the code reads.
    let env: BTreeMap<String, String> = c
        .env
        .clone()
        .unwrap()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value_from?.field_ref?.field_path)))
        .collect();
    assert_eq!(env["NODE_NAME"], "spec.nodeName");
    assert_eq!(env["POD_NAME"], "metadata.name");
    assert_eq!(env["POD_NAMESPACE"], "metadata.namespace");
    assert_eq!(env["POD_IP"], "status.podIP");
}

#[test]
fn container_args_parse_with_the_agents_cli() {
    let Some(bin) = agent_bin() else {
        return println!("SKIPPED container_args_parse_with_the_agents_cli: no agent binary (cargo xtask test builds it and sets LASTGASP_BIN)");
    };
    let objs = objects("deploy/kustomize", &source_objects());
    for pod in [agent_pod(&objs), controller_pod(&objs)] {
        parses_with_the_cli(&bin, &pod.containers[0]);
    }
    // The chart's uninstall hook: `lastgasp controller ... --lift-fences`.
    if let Some(h) = helm() {
        let chart = objects("helm template", &render_helm(&h, &[]));
        let job: k8s_openapi::api::batch::v1::Job = get(&chart, "Job", "lastgasp-lift-fences");
        let spec = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("lastgasp-controller")
        );
        let c = &spec.containers[0];
        assert!(c
            .args
            .as_ref()
            .unwrap()
            .contains(&"--lift-fences".to_string()));
        parses_with_the_cli(&bin, c);
    }
    // `helm test`'s pod: `lastgasp check` with exactly the agent's spec.
    if let Some(h) = helm() {
        let chart = objects("helm template", &render_helm(&h, &[]));
        let test: Pod = get(&chart, "Pod", "lastgasp-test-check");
        let spec = test.spec.unwrap();
        parses_with_the_cli(&bin, &spec.containers[0]);
        assert_eq!(
            spec.containers[0].args.as_deref(),
            Some(&["check".to_string()][..])
        );
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let mut agent = agent_pod(&chart);
        let c = &mut agent.containers[0];
        // What differs: the subcommand, and no port (the agent on the same
        // node holds 9850 on the host network) and so no probes.
        (c.args, c.ports, c.readiness_probe, c.liveness_probe) =
            (Some(vec!["check".into()]), None, None, None);
        agent.restart_policy = Some("Never".into());
        assert_eq!(
            spec, agent,
            "the helm test pod's spec is the agent's, but for the above"
        );
        let off = objects("helm template", &render_helm(&h, &["tests.enabled=false"]));
        assert!(
            off.values().all(|v| v["kind"] != "Pod"),
            "tests.enabled=false still renders a test pod"
        );
    }
    // And a wrong flag is caught, so the check is real.
    let mut c = agent_pod(&objs).containers[0].clone();
    c.args.as_mut().unwrap().push("--no-such-flag".into());
    let out = Command::new(&bin)
        .args(c.args.unwrap())
        .arg("--help")
        .output()
        .unwrap();
    assert!(!out.status.success());
}
