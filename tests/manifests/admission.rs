//! The admission policy fences every write the agent may make, evaluated with cel-rust.
use super::*;

/// The policy judges exactly the agent's ServiceAccount, and every write its
/// RBAC allows is fenced, but for pods/eviction (documented in the policy:
/// admission cannot see an evicted pod's node).
#[test]
fn the_admission_policy_fences_every_write_the_agent_may_make() {
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = agent_pod(&objs).service_account_name.unwrap();
    let vap: ValidatingAdmissionPolicy = get(
        &objs,
        "ValidatingAdmissionPolicy",
        "lastgasp-agent-own-node",
    );
    let binding: ValidatingAdmissionPolicyBinding = get(
        &objs,
        "ValidatingAdmissionPolicyBinding",
        "lastgasp-agent-own-node",
    );
    let bspec = binding.spec;
    assert_eq!(bspec.policy_name, "lastgasp-agent-own-node");
    assert_eq!(bspec.validation_actions, vec!["Deny".to_string()]);
    let spec = vap.spec.unwrap();
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let mc = spec.match_conditions.unwrap();
    assert_eq!(mc.len(), 1);
    assert_eq!(
        mc[0].expression,
        format!("request.userInfo.username == 'system:serviceaccount:lastgasp:{sa}'")
    );
    let claim = "request.userInfo.extra['authentication.kubernetes.io/node-name']";
    let vars = spec.variables.unwrap();
    assert!(vars
        .iter()
        .any(|v| v.name == "nodeName" && v.expression.contains(claim)));
    let validations = spec.validations.unwrap();
    assert!(
        validations[0]
            .expression
            .contains("variables.nodeName != ''"),
        "a missing claim denies first"
    );

    // (group, resource, operation) the policy sees.
    let mut fenced = BTreeSet::new();
    for r in spec.match_constraints.unwrap().resource_rules.unwrap() {
        for g in r.api_groups.unwrap() {
            for res in r.resources.clone().unwrap() {
                for op in r.operations.clone().unwrap() {
                    fenced.insert((g.clone(), res.clone(), op));
                }
            }
        }
    }
    // RBAC verbs as admission operations (PATCH and PUT are UPDATE).
    let op = |verb: &str| match verb {
        "create" => Some("CREATE"),
        "update" | "patch" => Some("UPDATE"),
        "delete" | "deletecollection" => Some("DELETE"),
        _ => None,
    };
    let unfenced = |objs: &BTreeMap<Key, Value>| {
        let mut out = BTreeSet::new();
        for g in grants(objs, "lastgasp", &sa) {
            for (group, res, verb) in g.triples() {
                if let Some(o) = op(&verb) {
                    if !fenced.contains(&(group.clone(), res.clone(), o.to_string())) {
                        out.insert(format!("{group}/{res} {verb}"));
                    }
                }
            }
        }
        out
    };
    assert_eq!(
        unfenced(&objs),
        BTreeSet::new(),
        "the default: every write fenced"
    );
    if let Some(evict) = evict_objects("the_admission_policy_fences_every_write_the_agent_may_make")
    {
        assert_eq!(
            unfenced(&evict),
            BTreeSet::from(["/pods/eviction create".to_string()]),
            "podRemoval: evict adds the one write admission cannot fence"
        );
    }
}

/// `lastgasp check` asks the API server (SelfSubjectAccessReview) for the
/// permissions it believes the agent needs: the same set as the ClusterRole.
#[test]
fn the_preflight_checks_exactly_the_agents_rbac() {
    type Triples = BTreeSet<(String, String, String)>;
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = agent_pod(&objs).service_account_name.unwrap();
    // The cluster-wide grants: the namespaced read of its own DaemonSet (at
    // its stop, for an uninstall's clean-up) is no preflight matter: without
    // it the host's files stay, and the agent's log says so.
    let granted = |objs: &BTreeMap<Key, Value>| -> Triples {
        grants(objs, "lastgasp", &sa)
            .iter()
            .filter(|g| g.namespace.is_none())
            .flat_map(Grant::triples)
            .collect()
    };
    // (group, resource[/subresource], verb) of check's PERMISSIONS, with or
    // without the eviction (podRemoval: evict).
    let checked = |evict: bool| -> Triples {
        lastgasp::check::PERMISSIONS
            .iter()
            .filter(|(_, _, _, sub, _, _)| evict || *sub != "eviction")
            .map(|(verb, group, res, sub, _, _)| {
                let res = if sub.is_empty() {
                    res.to_string()
                } else {
                    format!("{res}/{sub}")
                };
                (group.to_string(), res, verb.to_string())
            })
            .collect()
    };
    assert_eq!(
        checked(false),
        granted(&objs),
        "lastgasp check's PERMISSIONS (without podRemoval: evict) and the agent's ClusterRole differ"
    );
    if let Some(evict) = evict_objects("the_preflight_checks_exactly_the_agents_rbac") {
        assert_eq!(checked(true), granted(&evict), "with podRemoval: evict");
    }
}

/// What the policy decides for one request: None = allowed (or not judged),
/// Some(message) = denied. Follows the apiserver's order: matchConditions
/// (any false: not judged), then the variables, then each validation; an
/// evaluation error denies (failurePolicy: Fail). Evaluated with cel-rust;
/// the apiserver uses cel-go with Kubernetes' extra libraries, which these
/// expressions do not need (core CEL only: has, in, size, ?:, +, ==).
fn admit(
    vap: &ValidatingAdmissionPolicy,
    request: &Value,
    object: &Value,
    old: &Value,
) -> Option<String> {
    let spec = vap.spec.clone().unwrap();
    let eval = |expr: &str, vars: &Value| -> Result<cel::Value, String> {
        let mut ctx = cel::Context::default();
        ctx.add_variable("request", request.clone()).unwrap();
        ctx.add_variable("object", object.clone()).unwrap();
        ctx.add_variable("oldObject", old.clone()).unwrap();
        ctx.add_variable("variables", vars.clone()).unwrap();
        let program = cel::Program::compile(expr).map_err(|e| format!("{expr}: {e}"))?;
        program.execute(&ctx).map_err(|e| format!("{expr}: {e}"))
    };
    let fail = spec.failure_policy.as_deref() == Some("Fail");
    let mut vars = json!({});
    for mc in spec.match_conditions.unwrap_or_default() {
        match eval(&mc.expression, &vars) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => return None,
            other if fail => return Some(format!("matchCondition {}: {other:?}", mc.name)),
            _ => return None,
        }
    }
    for v in spec.variables.unwrap_or_default() {
        let value = match eval(&v.expression, &vars) {
            Ok(cel::Value::String(s)) => json!(s.as_str()),
            Ok(cel::Value::Bool(b)) => json!(b),
            other => return Some(format!("variable {}: {other:?}", v.name)),
        };
        vars[v.name.as_str()] = value;
    }
    for val in spec.validations.unwrap_or_default() {
        match eval(&val.expression, &vars) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => {
                let msg = match &val.message_expression {
                    Some(m) => match eval(m, &vars) {
                        Ok(cel::Value::String(s)) => s.to_string(),
                        other => panic!("messageExpression {m}: {other:?}"),
                    },
                    None => val
                        .message
                        .clone()
                        .unwrap_or_else(|| format!("failed expression: {}", val.expression)),
                };
                return Some(msg);
            }
            other => return Some(format!("error: {other:?}")),
        }
    }
    None
}

/// An AdmissionRequest as the policy sees it: `what` is (operation, group,
/// resource, subresource), `object` (namespace, name).
fn request(
    user: &str,
    node_claim: Option<Vec<&str>>,
    what: [&str; 4],
    object: (&str, &str),
) -> Value {
    let [op, group, resource, sub] = what;
    let (ns, name) = object;
    let mut user_info =
        json!({"username": user, "groups": ["system:serviceaccounts", "system:authenticated"]});
    if let Some(n) = node_claim {
        user_info["extra"] = json!({
            "authentication.kubernetes.io/node-name": n,
            "authentication.kubernetes.io/pod-name": ["lastgasp-agent-x"],
        });
    }
    // As the API server builds it: an empty subresource is left out.
    let mut req = json!({
        "operation": op, "userInfo": user_info,
        "resource": {"group": group, "version": "v1", "resource": resource},
        "namespace": ns, "name": name,
    });
    if !sub.is_empty() {
        req["subResource"] = json!(sub);
    }
    req
}

/// The agent's user name and the policy that judges it, as the kustomize base renders them.
fn agent_policy() -> (String, ValidatingAdmissionPolicy) {
    let objs = objects("deploy/kustomize", &source_objects());
    let sa = format!(
        "system:serviceaccount:lastgasp:{}",
        agent_pod(&objs).service_account_name.unwrap()
    );
    let vap = get(
        &objs,
        "ValidatingAdmissionPolicy",
        "lastgasp-agent-own-node",
    );
    (sa, vap)
}

#[test]
fn the_admission_policy_lets_an_agent_write_only_its_own_node() {
    let (sa, vap) = agent_policy();
    let n1 = Some(vec!["n1"]);
    let node = |name: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    let pod_on = |node: Option<&str>| {
        let mut p = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": []}});
        if let Some(n) = node {
            p["spec"]["nodeName"] = json!(n);
        }
        p
    };
    let event = |kind: &str, name: &str| {
        json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e", "namespace": "default"},
               "regarding": {"kind": kind, "name": name}, "reason": "NodeShutdown"})
    };
    let null = Value::Null;
    let allowed = |r: &Value, o: &Value, old: &Value| {
        let d = admit(&vap, r, o, old);
        assert!(d.is_none(), "denied: {d:?} for {r}");
    };
    let denied = |r: &Value, o: &Value, old: &Value, why: &str| {
        let d = admit(&vap, r, o, old).unwrap_or_else(|| panic!("allowed: {r}"));
        assert!(d.contains(why), "{d:?} should say {why:?}");
    };

    // Its own Node, both the object and the status (a PATCH is an UPDATE).
    allowed(
        &request(&sa, n1.clone(), ["UPDATE", "", "nodes", ""], ("", "n1")),
        &node("n1"),
        &node("n1"),
    );
    allowed(
        &request(
            &sa,
            n1.clone(),
            ["UPDATE", "", "nodes", "status"],
            ("", "n1"),
        ),
        &node("n1"),
        &node("n1"),
    );
    // Another node's.
    for sub in ["", "status"] {
        denied(
            &request(&sa, n1.clone(), ["UPDATE", "", "nodes", sub], ("", "n2")),
            &node("n2"),
            &node("n2"),
            "the agent on node n1 may only change its own Node, not n2",
        );
    }
    // No claim (a legacy token, a token not bound to a pod), or a garbled one.
    for claim in [None, Some(vec![]), Some(vec!["n1", "n2"]), Some(vec![""])] {
        denied(
            &request(&sa, claim, ["UPDATE", "", "nodes", ""], ("", "n1")),
            &node("n1"),
            &node("n1"),
            "no node-name claim",
        );
    }
    // Pods: only those bound to its node.
    allowed(
        &request(
            &sa,
            n1.clone(),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(Some("n1")),
    );
    denied(
        &request(
            &sa,
            n1.clone(),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(Some("n2")),
        "may only delete pods bound to that node, not default/p",
    );
    denied(
        &request(
            &sa,
            n1.clone(),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(None),
        "may only delete pods bound",
    );
    // Events: only about its own Node, created or (a repeat) patched.
    for op in ["CREATE", "UPDATE"] {
        let r = request(
            &sa,
            n1.clone(),
            [op, "events.k8s.io", "events", ""],
            ("default", "e"),
        );
        allowed(&r, &event("Node", "n1"), &null);
        denied(
            &r,
            &event("Node", "n2"),
            &null,
            "may only report Events about its own Node",
        );
        denied(
            &r,
            &event("Pod", "n1"),
            &null,
            "may only report Events about its own Node",
        );
    }
    // Anyone else is not judged at all (the controller patches every node).
    let other = "system:serviceaccount:lastgasp:lastgasp-controller";
    allowed(
        &request(other, None, ["UPDATE", "", "nodes", ""], ("", "n2")),
        &node("n2"),
        &node("n2"),
    );
    allowed(
        &request(
            "system:node:n2",
            Some(vec!["n2"]),
            ["DELETE", "", "pods", ""],
            ("default", "p"),
        ),
        &null,
        &pod_on(Some("n1")),
    );
}

/// On its own Node the agent may change only its own marks: its taint, its
/// record and proof annotations, its condition. Everything else the policy denies.
#[test]
fn the_admission_policy_keeps_the_agent_to_its_own_marks() {
    let (sa, vap) = agent_policy();
    let old = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1", "labels": {"role": "db"},
                     "annotations": {"other.io/a": "1", "lastgasp.dev/last-shutdown": "{}"}},
        "spec": {"podCIDR": "10.0.0.0/24",
                 "taints": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]},
        "status": {"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "ShutdownInProgress", "status": "False"}],
            "nodeInfo": {"bootID": "b1"}}
    });
    let main = request(
        &sa,
        Some(vec!["n1"]),
        ["UPDATE", "", "nodes", ""],
        ("", "n1"),
    );
    let status = request(
        &sa,
        Some(vec!["n1"]),
        ["UPDATE", "", "nodes", "status"],
        ("", "n1"),
    );
    let changed = |f: &dyn Fn(&mut Value)| {
        let mut n = old.clone();
        f(&mut n);
        n
    };
    let allowed = |r: &Value, o: &Value| {
        let d = admit(&vap, r, o, &old);
        assert!(d.is_none(), "denied: {d:?} for {o}");
    };
    let denied = |r: &Value, o: &Value, why: &str| {
        let d = admit(&vap, r, o, &old).unwrap_or_else(|| panic!("allowed: {o}"));
        assert!(d.contains(why), "{d:?} should say {why:?}");
    };
    // Its own taint and record: allowed (added, changed, removed).
    allowed(
        &main,
        &changed(&|n| {
            n["spec"]["taints"].as_array_mut().unwrap().push(json!(
                {"key": "lastgasp.dev/shutting-down", "value": "true", "effect": "NoSchedule"}));
        }),
    );
    allowed(
        &main,
        &changed(&|n| {
            n["metadata"]["annotations"]["lastgasp.dev/last-shutdown"] = json!("{\"back\":true}");
        }),
    );
    // ... and the proof beside it.
    allowed(
        &main,
        &changed(&|n| n["metadata"]["annotations"]["lastgasp.dev/proof"] = json!("kernel/b1")),
    );
    allowed(&main, &old);
    // Its own condition: allowed.
    allowed(
        &status,
        &changed(&|n| n["status"]["conditions"][1]["status"] = json!("True")),
    );
    // A label change, spec.unschedulable, another taint removed or changed,
    // another annotation, a finalizer: denied.
    denied(
        &main,
        &changed(&|n| n["metadata"]["labels"]["role"] = json!("web")),
        "labels",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["labels"].as_object_mut().unwrap().clear()),
        "labels",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["unschedulable"] = json!(true)),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["podCIDR"] = json!("10.9.0.0/24")),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["taints"] = json!([])),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["spec"]["taints"][0]["effect"] = json!("PreferNoSchedule")),
        "its own taint",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["annotations"]["other.io/a"] = json!("2")),
        "its own annotation",
    );
    denied(
        &main,
        &changed(&|n| {
            n["metadata"]["annotations"]
                .as_object_mut()
                .unwrap()
                .remove("other.io/a");
        }),
        "its own annotation",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["annotations"]["lastgasp.dev/other"] = json!("x")),
        "its own annotation",
    );
    denied(
        &main,
        &changed(&|n| n["metadata"]["finalizers"] = json!(["x.io/hold"])),
        "finalizers",
    );
    // The kubelet's condition, or another status field: denied.
    denied(
        &status,
        &changed(&|n| n["status"]["conditions"][0]["status"] = json!("False")),
        "its own condition",
    );
    denied(
        &status,
        &changed(&|n| n["status"]["nodeInfo"]["bootID"] = json!("b2")),
        "its own condition",
    );
}
