//! The Helm chart: its values take effect, its schema covers the config, it
//! lints clean, and its README names every value.
use super::*;

/// The chart's knobs: each value set changes what it says and nothing else
/// breaks the strict parse.
/// The API Priority and Fairness objects: on by default in both installs,
/// off with the overlay and the Helm value (nothing else changes); the
/// agent's FlowSchema takes exactly its last-gasp writes (Node, its status,
/// Events) into one FIFO queue of its own level, never lent; the
/// controller's takes all it asks; the values size them.
#[test]
fn flow_control_is_on_by_default_and_off_by_a_switch() {
    let (Some(k), Some(h)) = (kustomize(), helm()) else {
        return skip(
            "flow_control_is_on_by_default_and_off_by_a_switch",
            "no helm or kustomize",
        );
    };
    let is_apf = |k: &Key| k.0.starts_with("flowcontrol.apiserver.k8s.io/");
    let base = objects("kustomize build", &render_kustomize(&k));
    let apf: Vec<&Key> = base.keys().filter(|k| is_apf(k)).collect();
    assert_eq!(apf.len(), 4, "{apf:?}");
    let off = objects(
        "kustomize build deploy/overlays/no-flowcontrol",
        &render_kustomize_dir(&k, &repo().join("deploy/overlays/no-flowcontrol")),
    );
    let without: BTreeMap<Key, Value> = base
        .iter()
        .filter(|(k, _)| !is_apf(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_same("the base without APF", &without, "no-flowcontrol", &off);
    let helm_off = objects(
        "helm template --set flowControl.enabled=false",
        &render_helm(&h, &["flowControl.enabled=false"]),
    );
    assert_same(
        "no-flowcontrol",
        &off,
        "helm --set flowControl.enabled=false",
        &without_helm_only(&helm_off),
    );
    let fs: k8s_openapi::api::flowcontrol::v1::FlowSchema =
        get(&base, "FlowSchema", "lastgasp-agent-evidence");
    let spec = fs.spec;
    assert_eq!(spec.priority_level_configuration.name, "lastgasp-evidence");
    // Before `service-accounts` (9000), where the agent falls otherwise.
    assert!(spec.matching_precedence.unwrap() < 9000);
    let rule = &spec.rules.unwrap()[0];
    let subject = rule.subjects[0].service_account.as_ref().unwrap();
    assert_eq!(
        (subject.namespace.as_str(), subject.name.as_str()),
        ("lastgasp", "lastgasp-agent")
    );
    let writes: Vec<(Vec<String>, Vec<String>, Vec<String>)> = rule
        .resource_rules
        .as_ref()
        .unwrap()
        .iter()
        .map(|r| (r.api_groups.clone(), r.resources.clone(), r.verbs.clone()))
        .collect();
    let v = |x: &[&str]| {
        x.iter()
            .map(std::string::ToString::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        writes,
        [
            (v(&[""]), v(&["nodes", "nodes/status"]), v(&["patch"])),
            (
                v(&["events.k8s.io"]),
                v(&["events"]),
                v(&["create", "patch"])
            ),
        ],
        "the last gasp's writes only: no reads, no pod deletions"
    );
    assert!(rule.non_resource_rules.is_none());
    let pl: k8s_openapi::api::flowcontrol::v1::PriorityLevelConfiguration =
        get(&base, "PriorityLevelConfiguration", "lastgasp-evidence");
    let limited = pl.spec.limited.unwrap();
    assert_eq!(
        limited.lendable_percent,
        Some(0),
        "its seats are there when the burst comes"
    );
    let q = limited.limit_response.queuing.unwrap();
    assert_eq!(
        (q.queues, q.hand_size),
        (Some(1), Some(1)),
        "one FIFO queue"
    );
    assert_eq!(q.queue_length_limit, Some(2000));
    let ctl: k8s_openapi::api::flowcontrol::v1::FlowSchema =
        get(&base, "FlowSchema", "lastgasp-controller");
    let ctl = ctl.spec;
    assert_eq!(ctl.priority_level_configuration.name, "lastgasp-controller");
    assert_eq!(
        ctl.rules.unwrap()[0].subjects[0]
            .service_account
            .as_ref()
            .unwrap()
            .name,
        "lastgasp-controller"
    );
    // The values size the level.
    let sized = render_helm(
        &h,
        &[
            "flowControl.evidence.queueLengthLimit=10000",
            "flowControl.evidence.nominalConcurrencyShares=20",
        ],
    );
    let pl = sized
        .iter()
        .find(|o| {
            o["kind"] == "PriorityLevelConfiguration"
                && o["metadata"]["name"] == "lastgasp-evidence"
        })
        .unwrap();
    assert_eq!(pl["spec"]["limited"]["nominalConcurrencyShares"], 20);
    assert_eq!(
        pl["spec"]["limited"]["limitResponse"]["queuing"]["queueLengthLimit"],
        10000
    );
}

#[test]
fn the_charts_values_take_effect() {
    let Some(h) = helm() else {
        return skip("the_charts_values_take_effect", "no helm");
    };
    let render = |set: &[&str]| -> Vec<Value> { render_helm(&h, set) };
    let find = |objs: &[Value], kind: &str, name: &str| -> Value {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    let ds = |objs: &[Value]| find(objs, "DaemonSet", "lastgasp-agent");
    let default = render(&[]);
    // The controller's policy and ceiling.
    let ctl_args = |objs: &[Value]| {
        find(objs, "Deployment", "lastgasp-controller")["spec"]["template"]["spec"]["containers"][0]
            ["args"]
            .clone()
    };
    let flag_of = |args: &Value, f: &str| {
        let a = args.as_array().unwrap();
        a.iter()
            .position(|x| x == f)
            .map(|i| a[i + 1].as_str().unwrap().to_string())
    };
    let a = ctl_args(&default);
    assert_eq!(flag_of(&a, "--policy").as_deref(), Some("poweroff-only"));
    assert_eq!(flag_of(&a, "--max-fenced").as_deref(), Some("0"));
    let a = ctl_args(&render(&[
        "controller.policy=observe",
        "controller.maxFenced=3",
    ]));
    assert_eq!(flag_of(&a, "--policy").as_deref(), Some("observe"));
    assert_eq!(flag_of(&a, "--max-fenced").as_deref(), Some("3"));
    // Readiness: degraded by default, unready by choice.
    let env_of = |objs: &[Value], name: &str| {
        ds(objs)["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(env_of(&default, "LASTGASP_UNREADY_UNLESS_ARMED"), None);
    let strict = render(&["agent.unreadyUnlessArmed=true"]);
    assert_eq!(
        env_of(&strict, "LASTGASP_UNREADY_UNLESS_ARMED"),
        Some(json!("true"))
    );
    // The last word's opt-outs: no hook, or no courier.
    let hook = "LASTGASP_SHUTDOWN_HOOK_DIR";
    assert!(env_of(&default, hook).is_some());
    assert_eq!(env_of(&default, "LASTGASP_NO_COURIER"), None);
    assert_eq!(env_of(&render(&["agent.shutdownHook=false"]), hook), None);
    let no_courier = render(&["agent.courier=false"]);
    assert_eq!(
        env_of(&no_courier, "LASTGASP_NO_COURIER"),
        Some(json!("true"))
    );
    assert_eq!(
        env_of(&default, "LASTGASP_DAEMONSET"),
        Some(json!("lastgasp-agent"))
    );
    // Nodes without systemd: --no-dbus, and none of the systemd mounts.
    let mounts = |objs: &[Value]| -> Vec<String> {
        ds(objs)["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["hostPath"]["path"].as_str().map(str::to_string))
            .collect()
    };
    let no_systemd = render(&["agent.systemd=false"]);
    assert_eq!(env_of(&no_systemd, "LASTGASP_NO_DBUS"), Some(json!("true")));
    assert_eq!(env_of(&no_systemd, hook), None);
    assert_eq!(env_of(&no_systemd, "LASTGASP_LOGIND_ROOT"), None);
    assert!(mounts(&default).iter().any(|p| p == "/run/dbus"));
    let left = mounts(&no_systemd);
    assert!(
        left.iter()
            .all(|p| !p.contains("systemd") && p != "/run/dbus"),
        "{left:?}"
    );
    assert_eq!(env_of(&default, "LASTGASP_NO_DBUS"), None);
    let d = ds(&default);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"], json!({"kubernetes.io/os": "linux"}));
    assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    let checksum = d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(checksum.len(), 64, "a sha256 of the config");
    // A changed config changes the checksum: `helm upgrade` rolls the agents.
    let other = ds(&render(&["agent.shutdownGracePeriod=40s"]));
    assert_ne!(
        other["spec"]["template"]["metadata"]["annotations"]["checksum/config"],
        json!(checksum)
    );
    let set = render(&[
        "agent.nodeSelector.pool=batch",
        "agent.tolerations[0].key=x",
        "agent.tolerations[0].operator=Exists",
        "agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "agent.priorityClassName=high",
        "agent.updateStrategy.rollingUpdate.maxUnavailable=10%",
        "agent.podAnnotations.team=infra",
        "agent.extraArgs[0]=--metrics-listen",
        "agent.extraArgs[1]=off",
        "agent.extraEnv[0].name=RUST_LOG",
        "agent.extraEnv[0].value=debug",
        "imagePullSecrets[0].name=regcred",
        "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "controller.pdb.enabled=false",
        "controller.nodeSelector.pool=system",
        "podMonitor.enabled=true",
    ]);
    let d = ds(&set);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        json!({"kubernetes.io/os": "linux", "pool": "batch"}),
        "--set merges into the default"
    );
    assert_eq!(pod["tolerations"][0]["key"], "x");
    assert!(pod["affinity"]["nodeAffinity"].is_object());
    assert_eq!(pod["priorityClassName"], "high");
    assert_eq!(
        d["spec"]["updateStrategy"],
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}})
    );
    assert_eq!(
        d["spec"]["template"]["metadata"]["annotations"]["team"],
        "infra"
    );
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(&args[args.len() - 2..], ["--metrics-listen", "off"]);
    assert!(c["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "RUST_LOG" && e["value"] == "debug"));
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "regcred"}]));
    assert!(
        c["image"].as_str().unwrap().starts_with("lastgasp@sha256:"),
        "{}",
        c["image"]
    );
    let ctl = find(&set, "Deployment", "lastgasp-controller");
    assert_eq!(
        ctl["spec"]["template"]["spec"]["nodeSelector"],
        json!({"pool": "system"})
    );
    assert_eq!(
        ctl["spec"]["template"]["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}])
    );
    assert!(
        !set.iter().any(|o| o["kind"] == "PodDisruptionBudget"),
        "controller.pdb.enabled=false"
    );
    assert!(default.iter().any(|o| o["kind"] == "PodDisruptionBudget"));
    let pm = find(&set, "PodMonitor", "lastgasp-agent");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    assert!(!default.iter().any(|o| o["kind"] == "PodMonitor"), "opt-in");
    // The standard labels, on every object Helm renders.
    for o in &default {
        assert_eq!(
            o["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm",
            "{}",
            o["kind"]
        );
        assert!(o["metadata"]["labels"]["helm.sh/chart"]
            .as_str()
            .is_some_and(|c| c.starts_with("lastgasp-")));
    }
    // nameOverride renames every object, and the admission policy follows
    // the agent's ServiceAccount.
    // (A CRD's name is its group's plural: it cannot follow.)
    let renamed = render(&["nameOverride=shutdown"]);
    assert!(
        renamed
            .iter()
            .filter(|o| o["kind"] != "CustomResourceDefinition")
            .all(|o| o["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("shutdown")),
        "every name"
    );
    let vap = find(
        &renamed,
        "ValidatingAdmissionPolicy",
        "shutdown-agent-own-node",
    );
    assert!(vap["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap()
        .contains("system:serviceaccount:lastgasp:shutdown-agent"));
    // ... and the controller and the uninstall's lift use the Lease the
    // renamed Role grants.
    let role = find(&renamed, "Role", "shutdown-controller-lease");
    let granted = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|r| r["resourceNames"][0].as_str())
        .unwrap();
    assert_eq!(granted, "shutdown-controller");
    for (kind, name) in [
        ("Deployment", "shutdown-controller"),
        ("Job", "shutdown-lift-fences"),
    ] {
        let o = find(&renamed, kind, name);
        let args: Vec<&str> = o["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let lease = args
            .windows(2)
            .find(|w| w[0] == "--lease-name")
            .map(|w| w[1]);
        assert_eq!(lease, Some(granted), "{kind} {name}: {args:?}");
    }
    // rbac.create / serviceAccount.create off: those objects are the user's.
    let bare = render(&["rbac.create=false", "serviceAccount.create=false"]);
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ] {
        assert!(!bare.iter().any(|o| o["kind"] == kind), "{kind} rendered");
    }
    // Everything but the PodMonitor (a CRD) parses strictly.
    let typed: Vec<Value> = set
        .into_iter()
        .filter(|o| o["kind"] != "PodMonitor")
        .collect();
    objects("helm template with every value set", &typed);
}

/// The config's field names, as its parser knows them (serde's
/// deny_unknown_fields error lists every one).
fn config_fields() -> BTreeSet<String> {
    let err = format!("{:#}", Config::parse("noSuchField: 1").unwrap_err());
    let fields: BTreeSet<String> = err
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|f| *f != "noSuchField")
        .map(str::to_string)
        .collect();
    assert!(fields.contains("podRemoval"), "{err}");
    fields
}

#[test]
fn the_values_schema_covers_every_config_field_and_refuses_a_typo() {
    let Some(h) = helm() else {
        return skip(
            "the_values_schema_covers_every_config_field_and_refuses_a_typo",
            "no helm",
        );
    };
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(lastgasp_tests::render::chart_dir().join("values.schema.json"))
            .unwrap(),
    )
    .unwrap();
    let agent = &schema["properties"]["agent"]["properties"];
    // Every field the agent reads is settable: its own value, agent.config,
    // or fixed by the DaemonSet (the audit dir's host path, $NODE_NAME).
    let mut settable: BTreeSet<String> = agent["config"]["properties"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    for own in [
        "podRemoval",
        "shutdownGracePeriod",
        "shutdownGracePeriodCriticalPods",
        "kubeletConfigPath",
    ] {
        assert!(agent.get(own).is_some(), "agent.{own} in the schema");
        assert!(settable.insert(own.into()), "{own} settable twice");
    }
    settable.extend(["auditDir".to_string(), "nodeName".to_string()]);
    assert_eq!(
        settable,
        config_fields(),
        "the schema and the config's fields"
    );
    assert_eq!(agent["config"]["additionalProperties"], false);

    // Every agent.config field, set, renders a config the agent accepts.
    let set = [
        "agent.config.ignoreDaemonSets=true",
        "agent.config.excludeNamespaces={kube-system,monitoring}",
        "agent.config.excludePodLabels.keep=yes",
        "agent.config.shutdownGracePeriodByPodPriority[0].priority=0",
        "agent.config.shutdownGracePeriodByPodPriority[0].shutdownGracePeriodSeconds=20",
        "agent.config.shutdownGracePeriodByPodPriority[1].priority=100000",
        "agent.config.shutdownGracePeriodByPodPriority[1].shutdownGracePeriodSeconds=10",
        "agent.config.trust.pendingExpiry=90s",
        "agent.config.apiServer.endpoint=https://10.0.0.10:6443",
        "agent.config.auditMaxFileMiB=32",
        "agent.config.auditFiles=8",
        "agent.shutdownGracePeriod=",
        "agent.shutdownGracePeriodCriticalPods=",
    ];
    // A by-priority list excludes the two grace periods (the kubelet's
    // rule): the schema lets them be emptied, the agent's parser decides.
    // render_helm panics with helm's stderr if the schema refuses any.
    let objs = objects("helm template --set agent.config.*", &render_helm(&h, &set));
    let cm: ConfigMap = get(&objs, "ConfigMap", "lastgasp-agent");
    let yaml = &cm.data.unwrap()["config.yaml"];
    let cfg = Config::parse(yaml).unwrap_or_else(|e| panic!("{e:#}\n{yaml}"));
    assert!(cfg.ignore_daemon_sets);
    assert_eq!(cfg.exclude_namespaces, ["kube-system", "monitoring"]);
    assert_eq!(cfg.audit_max_file_mib, 32);
    assert_eq!(cfg.audit_files, 8);
    assert_eq!(cfg.trust.pending_expiry, Duration::from_secs(90));
    assert_eq!(
        cfg.api_server.endpoint.as_deref(),
        Some("https://10.0.0.10:6443")
    );

    // Typos and wrong types fail at `helm template`, before anything is applied.
    for bad in [
        "agent.config.ignoreDaemonSet=true",
        "agent.config.auditFiles=many",
        "agent.podRemoval=drain",
        "controller.policy=poweroff",
        "controller.proofQuiet=soon",
        "agent.shutdownGracePeriod=30",
        "nosuchvalue=1",
    ] {
        let out = Command::new(&h)
            .args(["template", "lastgasp"])
            .arg(lastgasp_tests::render::chart_dir())
            .args(["--set", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--set {bad} was accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("schema"),
            "--set {bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_charts_controller_flags_reach_the_controller() {
    let (Some(h), Some(bin)) = (helm(), agent_bin()) else {
        return skip(
            "the_charts_controller_flags_reach_the_controller",
            "no helm or no agent binary (LASTGASP_BIN)",
        );
    };
    let objs = objects(
        "helm template --set controller.*",
        &render_helm(
            &h,
            &[
                "controller.proofQuiet=5s",
                "controller.leaseMargin=3s",
                "controller.rebootTimeout=15m",
                "controller.maxFencesPerMinute=0",
                "controller.concurrency=4",
                "controller.priorityClassName=lastgasp-high",
                "controller.extraEnv[0].name=RUST_LOG",
                "controller.extraEnv[0].value=debug",
                "agent.extraEnv[0].name=RUST_LOG",
                "agent.extraEnv[0].value=debug",
                "agent.appArmorProfile.type=Unconfined",
                "agent.seLinuxOptions.type=spc_t",
                "priorityClassQuota.enabled=true",
            ],
        ),
    );
    let pod = controller_pod(&objs);
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    for (f, v) in [
        ("--proof-quiet", "5s"),
        ("--lease-margin", "3s"),
        ("--reboot-timeout", "15m"),
        ("--max-fences-per-minute", "0"),
        ("--concurrency", "4"),
    ] {
        assert_eq!(flag(&args, f).as_deref(), Some(v), "{f}");
    }
    parses_with_the_cli(&bin, c);
    assert_eq!(pod.priority_class_name.as_deref(), Some("lastgasp-high"));
    assert!(c.env.as_ref().unwrap().iter().any(|e| e.name == "RUST_LOG"));
    let a = &agent_pod(&objs).containers[0];
    assert!(a.env.as_ref().unwrap().iter().any(|e| e.name == "RUST_LOG"));
    let sc = a.security_context.clone().unwrap();
    assert_eq!(sc.app_armor_profile.unwrap().type_, "Unconfined");
    assert_eq!(sc.se_linux_options.unwrap().type_.as_deref(), Some("spc_t"));
    let q: k8s_openapi::api::core::v1::ResourceQuota =
        get(&objs, "ResourceQuota", "lastgasp-critical-pods");
    let sel = q
        .spec
        .unwrap()
        .scope_selector
        .unwrap()
        .match_expressions
        .unwrap();
    assert_eq!(
        sel[0].values.clone().unwrap(),
        ["system-node-critical", "lastgasp-high"]
    );
    // Unset, the binary's defaults: no flag rendered.
    let defaults = objects("helm template", &render_helm(&h, &[]));
    let args = controller_pod(&defaults).containers[0]
        .args
        .clone()
        .unwrap();
    assert_eq!(flag(&args, "--proof-quiet"), None);
}

#[test]
fn helm_lint_passes_strict_and_renders_the_notes() {
    let Some(h) = helm() else {
        return skip("helm_lint_passes_strict_and_renders_the_notes", "no helm");
    };
    // `helm lint` renders every template, NOTES.txt included.
    let out = Command::new(&h)
        .args(["lint", "--strict"])
        .arg(lastgasp_tests::render::chart_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm lint --strict:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_chart_readme_names_every_top_level_value() {
    let dir = lastgasp_tests::render::chart_dir();
    let values: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("values.yaml")).unwrap()).unwrap();
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let mut missing = Vec::new();
    for (k, v) in values.as_object().unwrap() {
        // Sections are named by their keys: `agent.podRemoval`, `controller.policy`...
        match v.as_object() {
            Some(m) if !m.is_empty() && k != "rbac" && k != "serviceAccount" => {
                for sub in m.keys() {
                    if !readme.contains(&format!("`{k}.{sub}")) {
                        missing.push(format!("{k}.{sub}"));
                    }
                }
            }
            _ => {
                if !readme.contains(&format!("`{k}")) {
                    missing.push(k.clone());
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "deploy/helm/lastgasp/README.md does not name: {missing:?}"
    );
}

/// Values that would render a broken install are refused by the chart
/// with what to do: a PDB that keeps every controller replica (a node
/// drain could never evict the controller), an agent's termination grace
/// at or below its graceful path (a pod stop mid-shutdown kills the drain),
/// a NetworkPolicy with no peer (it would admit every one), a capability
/// the agent cannot run without.
#[test]
fn values_that_would_break_the_install_are_refused() {
    let Some(h) = helm() else {
        return skip("values_that_would_break_the_install_are_refused", "no helm");
    };
    let refused = |set: &[&str]| -> String {
        let home =
            std::env::temp_dir().join(format!("lastgasp-helm-refuse-{}", std::process::id()));
        let mut cmd = lastgasp_tests::render::helm_command(&h, &home);
        cmd.args(["template", "lastgasp"])
            .arg(lastgasp_tests::render::chart_dir())
            .args(["--namespace", "lastgasp"]);
        for s in set {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().unwrap();
        std::fs::remove_dir_all(&home).ok();
        assert!(!out.status.success(), "{set:?} rendered");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&["controller.replicas=1"]);
    assert!(
        err.contains("controller.pdb.minAvailable (1) must be below controller.replicas (1)"),
        "{err}"
    );
    let one = render_helm(
        &h,
        &["controller.replicas=1", "controller.pdb.enabled=false"],
    );
    assert!(!one.iter().any(|o| o["kind"] == "PodDisruptionBudget"));

    let grace = |o: &[serde_json::Value]| {
        let ds = o.iter().find(|o| o["kind"] == "DaemonSet").unwrap();
        ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_i64()
    };
    let err = refused(&[
        "agent.shutdownGracePeriod=1m29.5s",
        "agent.terminationGracePeriodSeconds=90",
    ]);
    assert!(
        err.contains("agent.terminationGracePeriodSeconds (90) must be above the agent's graceful path (90s)"),
        "{err}"
    );
    let ok = render_helm(
        &h,
        &[
            "agent.shutdownGracePeriod=1m30s",
            "agent.terminationGracePeriodSeconds=91",
        ],
    );
    assert_eq!(grace(&ok), Some(91));
    // By priority, the path is the buckets' sum (the kubelet's semantics).
    let buckets = [
        "agent.shutdownGracePeriod=",
        "agent.shutdownGracePeriodCriticalPods=",
        "agent.config.shutdownGracePeriodByPodPriority[0].priority=0",
        "agent.config.shutdownGracePeriodByPodPriority[0].shutdownGracePeriodSeconds=40",
        "agent.config.shutdownGracePeriodByPodPriority[1].priority=100000",
        "agent.config.shutdownGracePeriodByPodPriority[1].shutdownGracePeriodSeconds=10",
    ];
    let err = refused(&buckets);
    assert!(
        err.contains("(45) must be above the agent's graceful path (50s)"),
        "{err}"
    );
    let ok = render_helm(
        &h,
        &[&buckets[..], &["agent.terminationGracePeriodSeconds=51"]].concat(),
    );
    assert_eq!(grace(&ok), Some(51));

    // Pools: a name or a selector twice.
    let err = refused(&["agent.pools[0].name=a,agent.pools[0].nodeSelector.p=a,agent.pools[1].name=a,agent.pools[1].nodeSelector.p=b"]);
    assert!(
        err.contains("agent.pools: the name a is taken twice"),
        "{err}"
    );
    let err = refused(&["agent.pools[0].name=a,agent.pools[0].nodeSelector.p=a,agent.pools[1].name=b,agent.pools[1].nodeSelector.p=a"]);
    assert!(err.contains("b selects the nodes a does"), "{err}");
    let err = refused(&["agent.pools[0].name=a"]);
    assert!(err.contains("nodeSelector is required"), "{err}");
    let err = refused(&["controller.networkPolicy.metricsFrom=null"]);
    assert!(
        err.contains("metricsFrom is empty, which would admit every peer"),
        "{err}"
    );
    let err = refused(&["agent.dropCapabilities={BPF}"]);
    assert!(
        err.contains("agent.dropCapabilities.0 must be one of"),
        "{err}"
    );
    let fewer = render_helm(&h, &["agent.dropCapabilities={SYS_ADMIN}"]);
    let ds = fewer.iter().find(|o| o["kind"] == "DaemonSet").unwrap();
    let caps = &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"];
    assert_eq!(
        caps["add"],
        serde_json::json!(["BPF", "PERFMON", "SYS_PTRACE"])
    );
    assert_eq!(caps["drop"], serde_json::json!(["ALL"]));
}

/// One component at a time: `agent.image` keeps the agents at their version
/// (a tag over the release's digest) while the controller and its lift Job
/// move, and the reverse; a repository alone keeps the release's tag.
#[test]
fn each_component_can_be_held_at_its_own_image() {
    let Some(h) = helm() else {
        return skip("each_component_can_be_held_at_its_own_image", "no helm");
    };
    let images = |set: &[&str]| -> Vec<(String, String)> {
        let mut v: Vec<_> = render_helm(&h, set)
            .iter()
            .filter(|o| {
                ["DaemonSet", "Deployment", "Job", "Pod"]
                    .contains(&o["kind"].as_str().unwrap_or(""))
            })
            .map(|o| {
                let spec = if o["kind"] == "Pod" {
                    &o["spec"]
                } else {
                    &o["spec"]["template"]["spec"]
                };
                (
                    o["kind"].as_str().unwrap().to_string(),
                    spec["containers"][0]["image"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let chart =
        std::fs::read_to_string(lastgasp_tests::render::chart_dir().join("Chart.yaml")).unwrap();
    let app = chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion: "))
        .unwrap()
        .trim_matches('"');
    let (release, reg) = (format!("lastgasp:{app}"), format!("reg/lg:{app}"));
    let digest = format!("image.digest=sha256:{}", "a".repeat(64));
    let pinned = format!("lastgasp@sha256:{}", "a".repeat(64));
    let want = |ds: &str, ctl: &str| {
        let mut v = vec![
            ("DaemonSet".to_string(), ds.to_string()),
            ("Deployment".to_string(), ctl.to_string()),
            ("Job".to_string(), ctl.to_string()),
            ("Pod".to_string(), ds.to_string()),
        ];
        v.sort();
        v
    };
    assert_eq!(images(&[&digest]), want(&pinned, &pinned));
    assert_eq!(
        images(&[&digest, "agent.image.tag=0.0.9"]),
        want("lastgasp:0.0.9", &pinned)
    );
    assert_eq!(
        images(&["controller.image.tag=0.0.9"]),
        want(&release, "lastgasp:0.0.9")
    );
    assert_eq!(
        images(&["controller.image.repository=reg/lg"]),
        want(&release, &reg)
    );
}

/// Pools: one DaemonSet and ConfigMap each, the pool's config merged over
/// agent.config and its args after agent.extraArgs, its own checksum (a
/// change to one pool rolls that pool only).
#[test]
fn each_agent_pool_gets_its_config_args_and_nodes() {
    let Some(h) = helm() else {
        return skip("each_agent_pool_gets_its_config_args_and_nodes", "no helm");
    };
    let set = |bare_excluded: &str| {
        render_helm(
            &h,
            &[
                "agent.config.ignoreDaemonSets=true",
                "agent.extraArgs[0]=--inhibit-delay=40s",
                "agent.pools[0].name=main,agent.pools[0].nodeSelector.pool=main",
                "agent.pools[1].name=bare,agent.pools[1].nodeSelector.pool=bare",
                "agent.pools[1].extraArgs[0]=--no-dbus",
                &format!("agent.pools[1].config.excludeNamespaces[0]={bare_excluded}"),
            ],
        )
    };
    let objs = set("kube-system");
    let get = |objs: &[Value], kind: &str, name: &str| {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    assert!(!objs.iter().any(|o| ["DaemonSet", "ConfigMap"]
        .contains(&o["kind"].as_str().unwrap())
        && o["metadata"]["name"] == "lastgasp-agent"));
    // Read by the agent's own parser.
    let config = |objs: &[Value], pool: &str| {
        let cm = get(objs, "ConfigMap", &format!("lastgasp-agent-{pool}"));
        let yaml = cm["data"]["config.yaml"].as_str().unwrap().to_string();
        Config::parse(&yaml).unwrap_or_else(|e| panic!("{e:#}\n{yaml}"))
    };
    let (main_cfg, bare_cfg) = (config(&objs, "main"), config(&objs, "bare"));
    assert!(main_cfg.ignore_daemon_sets);
    assert!(main_cfg.exclude_namespaces.is_empty());
    assert!(bare_cfg.ignore_daemon_sets, "merged over agent.config");
    assert_eq!(bare_cfg.exclude_namespaces, ["kube-system"]);
    let pod = |objs: &[Value], pool: &str| {
        get(objs, "DaemonSet", &format!("lastgasp-agent-{pool}"))["spec"]["template"].clone()
    };
    let (main, bare) = (pod(&objs, "main"), pod(&objs, "bare"));
    assert_eq!(main["spec"]["nodeSelector"], json!({"pool": "main"}));
    assert_eq!(bare["spec"]["nodeSelector"], json!({"pool": "bare"}));
    assert_eq!(main["metadata"]["labels"]["lastgasp.dev/pool"], "main");
    assert_eq!(
        main["spec"]["containers"][0]["args"],
        json!(["--json-logs", "run", "--inhibit-delay=40s"])
    );
    assert_eq!(
        bare["spec"]["containers"][0]["args"],
        json!(["--json-logs", "run", "--inhibit-delay=40s", "--no-dbus"])
    );
    assert_eq!(
        bare["spec"]["volumes"][0]["configMap"]["name"],
        "lastgasp-agent-bare"
    );
    // A change to the bare pool's config rolls the bare pool only.
    let changed = set("monitoring");
    let sum = |t: &Value| t["metadata"]["annotations"]["checksum/config"].clone();
    assert_eq!(sum(&pod(&changed, "main")), sum(&main));
    assert_ne!(sum(&pod(&changed, "bare")), sum(&bare));
}

/// `agent.config.apiServer.serverFromKubeconfig` mounts the file it names
/// (it rendered with no mount, and every agent failed at start), and the
/// extra volumes reach the agent's pod.
#[test]
fn a_kubeconfig_the_agent_reads_is_mounted() {
    let Some(h) = helm() else {
        return skip("a_kubeconfig_the_agent_reads_is_mounted", "no helm");
    };
    let objs = render_helm(
        &h,
        &[
            "agent.config.apiServer.serverFromKubeconfig=/etc/kubernetes/kubelet.conf",
            "agent.extraVolumes[0].name=ca",
            "agent.extraVolumes[0].hostPath.path=/etc/pki",
            "agent.extraVolumeMounts[0].name=ca",
            "agent.extraVolumeMounts[0].mountPath=/etc/pki",
        ],
    );
    let ds = objs
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .expect("the agent's DaemonSet");
    let spec = &ds["spec"]["template"]["spec"];
    let mounts = spec["containers"][0]["volumeMounts"].as_array().unwrap();
    let volumes = spec["volumes"].as_array().unwrap();
    let mounted = |path: &str| {
        let m = mounts
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("{path} not mounted: {mounts:?}"));
        volumes
            .iter()
            .any(|v| v["name"] == m["name"] && v["hostPath"]["path"] == path)
    };
    assert!(mounted("/etc/kubernetes/kubelet.conf"));
    assert!(mounted("/etc/pki"));
}
