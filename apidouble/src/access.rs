//! `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`.
//!
//! The double has no authentication or RBAC: every request is allowed. A
//! SelfSubjectAccessReview is answered from a configurable deny list
//! instead: a review matching a rule is denied with the rule's reason;
//! anything else is allowed, as the double itself would. Like the real
//! apiserver, the review is not stored (201 Created, the review echoed with
//! its `status`).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::status::{ApiError, FieldErr};

/// A rule of the deny list. An empty (or `*`) field matches anything; the
/// subresource and namespace are compared exactly otherwise (`""` matches
/// only a review without one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccessRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verb: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subresource: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The denial's `status.reason` (default: a generic RBAC-like message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl AccessRule {
    /// Deny `verb` on `group`/`resource` (any subresource, any namespace unless narrowed).
    pub fn deny(verb: &str, group: &str, resource: &str) -> Self {
        AccessRule {
            verb: Some(verb.into()),
            group: Some(group.into()),
            resource: Some(resource.into()),
            ..Default::default()
        }
    }

    pub fn subresource(mut self, s: &str) -> Self {
        self.subresource = Some(s.into());
        self
    }

    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = Some(ns.into());
        self
    }

    pub fn reason(mut self, r: &str) -> Self {
        self.reason = Some(r.into());
        self
    }

    fn matches(&self, attrs: &Value) -> bool {
        let field = |name: &str| attrs.get(name).and_then(Value::as_str).unwrap_or("");
        let ok = |rule: &Option<String>, name: &str| match rule.as_deref() {
            None | Some("*") => true,
            Some(want) => want == field(name),
        };
        ok(&self.verb, "verb")
            && ok(&self.group, "group")
            && ok(&self.resource, "resource")
            && ok(&self.subresource, "subresource")
            && ok(&self.namespace, "namespace")
    }
}

/// Answers one review against `rules`: the review with its status, or 422.
pub fn review(body: &Value, rules: &[AccessRule]) -> Result<Value, ApiError> {
    let spec = body.get("spec").cloned().unwrap_or(Value::Null);
    let res = spec.get("resourceAttributes").filter(|v| v.is_object());
    let non = spec.get("nonResourceAttributes").filter(|v| v.is_object());
    let (allowed, reason) = match (res, non) {
        (Some(attrs), None) => match rules.iter().find(|r| r.matches(attrs)) {
            Some(rule) => {
                let f = |n: &str| {
                    attrs
                        .get(n)
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                };
                let what = format!(
                    "{} {}{}{}",
                    f("verb"),
                    if f("group").is_empty() {
                        String::new()
                    } else {
                        format!("{}/", f("group"))
                    },
                    f("resource"),
                    if f("subresource").is_empty() {
                        String::new()
                    } else {
                        format!("/{}", f("subresource"))
                    },
                );
                let reason = rule
                    .reason
                    .clone()
                    .unwrap_or_else(|| format!("denied by the double's access rules: {what}"));
                (false, reason)
            }
            None => (true, String::new()),
        },
        (None, Some(_)) => (true, String::new()),
        _ => {
            return Err(ApiError::invalid_kind(
                "SelfSubjectAccessReview.authorization.k8s.io",
                "authorization.k8s.io",
                "SelfSubjectAccessReview",
                "",
                vec![FieldErr::required(
                    "spec.resourceAttributes",
                    "exactly one of nonResourceAttributes or resourceAttributes must be specified",
                )],
            ))
        }
    };
    let mut status = json!({ "allowed": allowed });
    if !allowed {
        status["denied"] = json!(true);
        status["reason"] = json!(reason);
    }
    let mut meta = body.get("metadata").cloned().unwrap_or_else(|| json!({}));
    if let Some(m) = meta.as_object_mut() {
        m.insert("creationTimestamp".into(), Value::Null);
    }
    Ok(json!({
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": meta,
        "spec": spec,
        "status": status,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ssar(verb: &str, group: &str, resource: &str, sub: &str) -> Value {
        json!({"spec": {"resourceAttributes": {"verb": verb, "group": group, "resource": resource, "subresource": sub}}})
    }

    #[test]
    fn rules() {
        let rules = vec![AccessRule::deny("create", "", "pods").subresource("eviction")];
        assert_eq!(
            review(&ssar("create", "", "pods", "eviction"), &rules).unwrap()["status"]["allowed"],
            false
        );
        assert_eq!(
            review(&ssar("delete", "", "pods", ""), &rules).unwrap()["status"]["allowed"],
            true
        );
        assert_eq!(
            review(&ssar("create", "", "pods", ""), &rules).unwrap()["status"]["allowed"],
            true
        );
        assert!(review(&json!({"spec": {}}), &rules).is_err());
    }
}
