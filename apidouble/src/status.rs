//! `metav1.Status` errors, built the way apimachinery's `errors` package builds them.

use serde_json::{json, Value};

use crate::resources::ResourceDef;

/// An API error, rendered as a `metav1.Status` body with its HTTP code.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: u16,
    /// `""` for none (the eviction subresource's multi-PDB failure has none).
    pub reason: String,
    pub message: String,
    pub details: Option<Value>,
    /// Sent as `Retry-After` and `details.retryAfterSeconds` when set.
    pub retry_after: Option<u32>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

pub type ApiResult<T> = Result<T, ApiError>;

/// A single field error of an `Invalid` status.
pub struct FieldErr {
    pub field: String,
    /// `FieldValueRequired`, `FieldValueInvalid`, `FieldValueForbidden`, ...
    pub kind: &'static str,
    pub detail: String,
}

impl FieldErr {
    pub fn required(field: &str, detail: &str) -> Self {
        Self {
            field: field.into(),
            kind: "FieldValueRequired",
            detail: detail.into(),
        }
    }
    pub fn invalid(field: &str, value: &Value, detail: &str) -> Self {
        Self {
            field: field.into(),
            kind: "FieldValueInvalid",
            detail: format!("{}: {detail}", value_repr(value)),
        }
    }
    pub fn forbidden(field: &str, detail: &str) -> Self {
        Self {
            field: field.into(),
            kind: "FieldValueForbidden",
            detail: detail.into(),
        }
    }
    fn type_text(&self) -> &'static str {
        match self.kind {
            "FieldValueRequired" => "Required value",
            "FieldValueInvalid" => "Invalid value",
            "FieldValueForbidden" => "Forbidden",
            "FieldValueDuplicate" => "Duplicate value",
            "FieldValueNotSupported" => "Unsupported value",
            _ => "Invalid value",
        }
    }
    fn text(&self) -> String {
        if self.detail.is_empty() {
            self.type_text().to_string()
        } else {
            format!("{}: {}", self.type_text(), self.detail)
        }
    }
}

fn value_repr(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

impl ApiError {
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    pub fn to_status(&self) -> Value {
        let mut st = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "code": self.code,
        });
        if !self.reason.is_empty() {
            st["reason"] = json!(self.reason);
        }
        let mut details = self.details.clone();
        if let Some(ra) = self.retry_after {
            let d = details.get_or_insert_with(|| json!({}));
            d["retryAfterSeconds"] = json!(ra);
        }
        if let Some(d) = details {
            st["details"] = d;
        }
        st
    }

    fn details_for(def: &ResourceDef, name: &str) -> Value {
        let mut d = json!({ "name": name, "kind": def.plural });
        if !def.group.is_empty() {
            d["group"] = json!(def.group);
        }
        d
    }

    pub fn not_found(def: &ResourceDef, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", def.qualified()),
        )
        .with_details(Self::details_for(def, name))
    }

    pub fn already_exists(def: &ResourceDef, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", def.qualified()),
        )
        .with_details(Self::details_for(def, name))
    }

    /// `errors.NewConflict(qualifiedResource, name, err)`.
    pub fn conflict_on(qualified: &str, group: &str, kind: &str, name: &str, err: &str) -> Self {
        let mut d = json!({ "name": name, "kind": kind });
        if !group.is_empty() {
            d["group"] = json!(group);
        }
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {qualified} \"{name}\": {err}"),
        )
        .with_details(d)
    }

    pub const OPTIMISTIC_LOCK: &'static str =
        "the object has been modified; please apply your changes to the latest version and try again";

    pub fn conflict(def: &ResourceDef, name: &str, err: &str) -> Self {
        Self::conflict_on(&def.qualified(), def.group, def.plural, name, err)
    }

    /// Preconditions checked by `rest.BeforeDelete` use the Kind, not the resource.
    pub fn precondition_conflict(def: &ResourceDef, name: &str, err: &str) -> Self {
        let qualified = if def.group.is_empty() {
            def.kind.to_string()
        } else {
            format!("{}.{}", def.kind, def.group)
        };
        Self::conflict_on(&qualified, def.group, def.kind, name, err)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn invalid(def: &ResourceDef, name: &str, errs: Vec<FieldErr>) -> Self {
        Self::invalid_kind(&def.qualified_kind(), def.group, def.kind, name, errs)
    }

    /// A create or update whose object has no name (nor a generateName).
    pub fn name_required(def: &ResourceDef) -> Self {
        let err = FieldErr::required("metadata.name", "name or generateName is required");
        Self::invalid(def, "", vec![err])
    }

    pub fn invalid_kind(
        qualified_kind: &str,
        group: &str,
        kind: &str,
        name: &str,
        errs: Vec<FieldErr>,
    ) -> Self {
        let texts: Vec<String> = errs
            .iter()
            .map(|e| format!("{}: {}", e.field, e.text()))
            .collect();
        let agg = if texts.len() == 1 {
            texts[0].clone()
        } else {
            format!("[{}]", texts.join(", "))
        };
        let causes: Vec<Value> = errs
            .iter()
            .map(|e| json!({ "reason": e.kind, "message": e.text(), "field": e.field }))
            .collect();
        let mut d = json!({ "name": name, "kind": kind, "causes": causes });
        if !group.is_empty() {
            d["group"] = json!(group);
        }
        Self::new(
            422,
            "Invalid",
            format!("{qualified_kind} \"{name}\" is invalid: {agg}"),
        )
        .with_details(d)
    }

    pub fn unprocessable_generic() -> Self {
        Self::new(
            422,
            "Invalid",
            "the server rejected our request due to an error in our request",
        )
    }

    pub fn internal(message: &str) -> Self {
        Self::new(
            500,
            "InternalError",
            format!("Internal error occurred: {message}"),
        )
        .with_details(json!({ "causes": [{ "message": message }] }))
    }

    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(415, "UnsupportedMediaType", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn path_not_found() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .with_details(json!({ "causes": [] }))
    }

    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn too_many_requests(message: &str, retry_after: u32) -> Self {
        let mut e = Self::new(429, "TooManyRequests", message).with_details(json!({}));
        if retry_after > 0 {
            e.retry_after = Some(retry_after);
        }
        e
    }

    pub fn timeout(message: &str, retry_after: u32) -> Self {
        let mut e =
            Self::new(504, "Timeout", format!("Timeout: {message}")).with_details(json!({}));
        if retry_after > 0 {
            e.retry_after = Some(retry_after);
        }
        e
    }

    pub fn forbidden(def_qualified: &str, name: &str, err: &str) -> Self {
        Self::new(
            403,
            "Forbidden",
            format!("{def_qualified} \"{name}\" is forbidden: {err}"),
        )
    }

    /// A fault-injected status: the reason apimachinery pairs with the code.
    pub fn for_code(code: u16, message: Option<&str>) -> Self {
        let (reason, default_msg) = match code {
            400 => ("BadRequest", "the server rejected our request for an unknown reason"),
            401 => ("Unauthorized", "Unauthorized"),
            403 => ("Forbidden", "forbidden"),
            404 => ("NotFound", "the server could not find the requested resource"),
            409 => ("Conflict", "the server reported a conflict"),
            410 => ("Expired", "the resource is gone"),
            422 => ("Invalid", "the server rejected our request due to an error in our request"),
            429 => ("TooManyRequests", "the server has received too many requests and has asked us to try again later"),
            500 => ("InternalError", "an error on the server (\"\") has prevented the request from succeeding"),
            503 => ("ServiceUnavailable", "the server is currently unable to handle the request"),
            504 => ("Timeout", "the server was unable to return a response in the time allotted, but may still be processing the request"),
            _ => ("", "the server responded with an injected status"),
        };
        Self::new(code, reason, message.unwrap_or(default_msg))
    }
}
