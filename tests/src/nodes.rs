//! Nodes for tests: one builder for the Node a test creates, and the
//! readers every test asks of a Node (its taints, a condition, the record).
use k8s_openapi::api::core::v1::{Node, NodeCondition};
use lastgasp::record::{self, ShutdownRecord};
use serde_json::{json, Value};

/// A Node as the tests create it: `node("n1").ready("False").boot("b1").json()`.
#[must_use]
pub struct NodeJson(Value);

/// `name`, Ready (`KubeletReady`), no taints, no boot id.
pub fn node(name: &str) -> NodeJson {
    NodeJson(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}
    }))
}

impl NodeJson {
    /// The Ready condition's status (`True`, `False`, `Unknown`).
    pub fn ready(mut self, status: &str) -> Self {
        self.0["status"]["conditions"][0]["status"] = json!(status);
        self
    }

    /// The boot the kubelet reports (`status.nodeInfo.bootID`).
    pub fn boot(mut self, id: &str) -> Self {
        self.0["status"]["nodeInfo"] = json!({"bootID": id});
        self
    }

    /// The `kubernetes.io/hostname` label, as the kubelet sets it.
    pub fn hostname_label(mut self) -> Self {
        let name = self.0["metadata"]["name"].clone();
        self.0["metadata"]["labels"] = json!({"kubernetes.io/hostname": name});
        self
    }

    /// A taint someone else put there.
    pub fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        let t = json!({"key": key, "value": value, "effect": effect});
        match self.0["spec"]["taints"].as_array_mut() {
            Some(list) => list.push(t),
            None => self.0["spec"] = json!({"taints": [t]}),
        }
        self
    }

    pub fn json(self) -> Value {
        self.0
    }
}

/// The keys of the Node's taints, in order.
pub fn taint_keys(n: &Node) -> Vec<String> {
    n.spec
        .iter()
        .flat_map(|s| s.taints.iter().flatten())
        .map(|t| t.key.clone())
        .collect()
}

/// The condition of `type_`, if the Node has it.
pub fn condition<'a>(n: &'a Node, type_: &str) -> Option<&'a NodeCondition> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
}

/// A condition's status and reason (`""` when it has none).
pub fn status_reason(n: &Node, type_: &str) -> Option<(String, String)> {
    condition(n, type_).map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

/// The agent's record on the Node, when there is one that reads.
pub fn record(n: &Node) -> Option<ShutdownRecord> {
    record::of_node(n)?.ok()
}
