//! Every manifest parses strictly into its k8s-openapi type.
use super::*;

#[test]
fn every_source_manifest_parses_strictly() {
    let objs = objects("deploy/kustomize", &source_objects());
    let kinds: BTreeSet<&str> = objs.keys().map(|k| k.1.as_str()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from([
            "ClusterRole",
            "ClusterRoleBinding",
            "PodDisruptionBudget",
            "ConfigMap",
            "CustomResourceDefinition",
            "DaemonSet",
            "Deployment",
            "Role",
            "RoleBinding",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "FlowSchema",
            "PriorityLevelConfiguration",
            "NetworkPolicy"
        ])
    );
}

#[test]
fn a_misspelled_field_is_caught() {
    let text = std::fs::read_to_string(kustomize_dir().join("agent-daemonset.yaml")).unwrap();
    let good = split_yaml(&text);
    assert!(typed(&good[0]).is_ok());
    // A typo k8s-openapi alone would drop without a word.
    let typo = text.replace("readOnlyRootFilesystem:", "readOnlyRootFileSystem:");
    assert_ne!(typo, text);
    let bad = split_yaml(&typo);
    assert!(
        serde_json::from_value::<DaemonSet>(bad[0].clone()).is_ok(),
        "k8s-openapi itself accepts it"
    );
    let e = typed(&bad[0]).unwrap_err();
    assert!(
        e.contains("spec.template.spec.containers[0].securityContext.readOnlyRootFileSystem"),
        "the path is named: {e}"
    );
    // Deeper and in another kind: a misspelled key in a VAP rule.
    let mut vap = split_yaml(
        &std::fs::read_to_string(kustomize_dir().join("agent-admission-policy.yaml")).unwrap(),
    );
    vap[0]["spec"]["matchConstraints"]["resourceRules"][0]["operation"] = json!(["UPDATE"]);
    let e = typed(&vap[0]).unwrap_err();
    assert!(
        e.contains("spec.matchConstraints.resourceRules[0].operation"),
        "{e}"
    );
    // A wrong type is a plain deserialization error.
    let mut ds = good[0].clone();
    ds["spec"]["template"]["spec"]["hostPID"] = json!("yes");
    assert!(typed(&ds).unwrap_err().contains("does not deserialize"));
    // An unknown kind is refused rather than passed.
    assert!(
        typed(&json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}})).is_err()
    );
}

/// `deploy/namespace.yaml`, applied before either install: the namespace
/// every object lives in, at the Pod Security level the agent's pod needs.
#[test]
fn the_namespace_admits_the_agents_pod() {
    let docs = split_yaml(&std::fs::read_to_string(repo().join("deploy/namespace.yaml")).unwrap());
    assert_eq!(docs.len(), 1);
    typed(&docs[0]).unwrap();
    let ns: Namespace = serde_json::from_value(docs[0].clone()).unwrap();
    assert_eq!(ns.metadata.name.as_deref(), Some("lastgasp"));
    let labels = ns.metadata.labels.unwrap();
    assert_eq!(
        labels["pod-security.kubernetes.io/enforce"], "privileged",
        "hostPID, hostNetwork, hostPath and capabilities"
    );
    // Neither install holds it (Helm cannot own its release's namespace).
    assert!(source_objects().iter().all(|o| o["kind"] != "Namespace"));
}
