//! Label and field selectors (k8s.io/apimachinery/pkg/labels and /fields).

use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Exists,
    NotExists,
    Eq(String),
    NotEq(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Gt(i64),
    Lt(i64),
}

#[derive(Debug, Clone, PartialEq)]
struct Req {
    key: String,
    op: Op,
}

/// A parsed label selector. An empty selector matches everything; `nothing()` matches nothing.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LabelSelector {
    reqs: Vec<Req>,
    nothing: bool,
}

impl LabelSelector {
    pub fn everything() -> Self {
        Self::default()
    }

    pub fn nothing() -> Self {
        Self {
            reqs: vec![],
            nothing: true,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty() && !self.nothing
    }

    /// Parse the string form used in `?labelSelector=`.
    pub fn parse(input: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in split_top_level(input) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            reqs.push(parse_req(part)?);
        }
        Ok(Self {
            reqs,
            nothing: false,
        })
    }

    /// `metav1.LabelSelectorAsSelector`: nil -> nothing, {} -> everything.
    pub fn from_object(sel: Option<&Value>) -> Result<Self, String> {
        let Some(sel) = sel.filter(|v| !v.is_null()) else {
            return Ok(Self::nothing());
        };
        let mut reqs = Vec::new();
        if let Some(ml) = sel.get("matchLabels").and_then(Value::as_object) {
            for (k, v) in ml {
                reqs.push(Req {
                    key: k.clone(),
                    op: Op::Eq(v.as_str().unwrap_or("").to_string()),
                });
            }
        }
        if let Some(exprs) = sel.get("matchExpressions").and_then(Value::as_array) {
            for e in exprs {
                let key = e
                    .get("key")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let values: Vec<String> = e
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_str().map(String::from))
                            .collect()
                    })
                    .unwrap_or_default();
                let op = match e.get("operator").and_then(Value::as_str).unwrap_or("") {
                    "In" => Op::In(values),
                    "NotIn" => Op::NotIn(values),
                    "Exists" => Op::Exists,
                    "DoesNotExist" => Op::NotExists,
                    other => {
                        return Err(format!("{other:?} is not a valid label selector operator"))
                    }
                };
                reqs.push(Req { key, op });
            }
        }
        Ok(Self {
            reqs,
            nothing: false,
        })
    }

    pub fn matches(&self, labels: &Map<String, Value>) -> bool {
        if self.nothing {
            return false;
        }
        self.reqs.iter().all(|r| {
            let val = labels.get(&r.key).and_then(Value::as_str);
            match &r.op {
                Op::Exists => val.is_some(),
                Op::NotExists => val.is_none(),
                Op::Eq(v) => val == Some(v.as_str()),
                Op::NotEq(v) => val != Some(v.as_str()),
                Op::In(vs) => val.is_some_and(|x| vs.iter().any(|v| v == x)),
                Op::NotIn(vs) => val.is_none_or(|x| !vs.iter().any(|v| v == x)),
                Op::Gt(n) => val
                    .and_then(|x| x.parse::<i64>().ok())
                    .is_some_and(|x| x > *n),
                Op::Lt(n) => val
                    .and_then(|x| x.parse::<i64>().ok())
                    .is_some_and(|x| x < *n),
            }
        })
    }
}

fn split_top_level(input: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in input.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c);
            }
            ')' => {
                depth -= 1;
                cur.push(c);
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 316
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && k.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// A set-based requirement (`key in (a,b)`, `key notin (a,b)`), if `part`
/// is one.
fn set_based(part: &str) -> Result<Option<Req>, String> {
    let err = |m: &str| format!("unable to parse requirement: {m}");
    let words: Vec<&str> = part.splitn(2, char::is_whitespace).collect();
    if words.len() == 2 {
        let rest = words[1].trim_start();
        let (is_in, after) = if let Some(a) = rest.strip_prefix("notin") {
            (false, a)
        } else if let Some(a) = rest.strip_prefix("in") {
            (true, a)
        } else {
            (true, "")
        };
        let after = after.trim();
        if after.starts_with('(') {
            let key = words[0].trim();
            if !valid_key(key) {
                return Err(err(&format!("invalid label key \"{key}\"")));
            }
            let inner = after
                .strip_prefix('(')
                .and_then(|a| a.strip_suffix(')'))
                .ok_or_else(|| err("found '(', expected: ')'"))?;
            let vals: Vec<String> = inner.split(',').map(|v| v.trim().to_string()).collect();
            if let Some(bad) = vals.iter().find(|v| !valid_value(v)) {
                return Err(err(&format!("invalid label value: \"{bad}\"")));
            }
            return Ok(Some(Req {
                key: key.into(),
                op: if is_in { Op::In(vals) } else { Op::NotIn(vals) },
            }));
        }
    }
    Ok(None)
}

fn parse_req(part: &str) -> Result<Req, String> {
    let err = |m: &str| format!("unable to parse requirement: {m}");
    if let Some(key) = part.strip_prefix('!') {
        let key = key.trim();
        if !valid_key(key) {
            return Err(err(&format!("invalid label key \"{key}\"")));
        }
        return Ok(Req {
            key: key.into(),
            op: Op::NotExists,
        });
    }
    if let Some(req) = set_based(part)? {
        return Ok(req);
    }
    for (tok, mk) in [("!=", 0u8), ("==", 1), ("=", 1), (">", 2), ("<", 3)] {
        if let Some(idx) = part.find(tok) {
            let key = part[..idx].trim();
            let val = part[idx + tok.len()..].trim();
            if !valid_key(key) {
                return Err(err(&format!("invalid label key \"{key}\"")));
            }
            let op = match mk {
                0 | 1 => {
                    if !valid_value(val) {
                        return Err(err(&format!("invalid label value: \"{val}\"")));
                    }
                    if mk == 0 {
                        Op::NotEq(val.into())
                    } else {
                        Op::Eq(val.into())
                    }
                }
                _ => {
                    let n: i64 = val.parse().map_err(|_| {
                        err(&format!(
                            "for 'Gt', 'Lt' operators, the value must be an integer: {val}"
                        ))
                    })?;
                    if mk == 2 {
                        Op::Gt(n)
                    } else {
                        Op::Lt(n)
                    }
                }
            };
            return Ok(Req {
                key: key.into(),
                op,
            });
        }
    }
    let key = part.trim();
    if !valid_key(key) {
        return Err(err(&format!("invalid label key \"{key}\"")));
    }
    Ok(Req {
        key: key.into(),
        op: Op::Exists,
    })
}

/// A parsed field selector: `a=b,c!=d` with `=`, `==` and `!=`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FieldSelector {
    terms: Vec<(String, bool, String)>,
}

impl FieldSelector {
    pub fn parse(input: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for part in split_unescaped(input, ',') {
            if part.trim().is_empty() {
                continue;
            }
            let (key, eq, val) = if let Some(i) = find_unescaped(&part, "!=") {
                (&part[..i], false, &part[i + 2..])
            } else if let Some(i) = find_unescaped(&part, "==") {
                (&part[..i], true, &part[i + 2..])
            } else if let Some(i) = find_unescaped(&part, "=") {
                (&part[..i], true, &part[i + 1..])
            } else {
                return Err(format!(
                    "invalid selector: '{input}'; can't understand '{part}'"
                ));
            };
            terms.push((key.trim().to_string(), eq, unescape(val.trim())));
        }
        Ok(Self { terms })
    }

    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.terms.iter().map(|(k, _, _)| k.as_str())
    }

    /// The required value of `key` when the selector pins it with `=`.
    pub fn required(&self, key: &str) -> Option<&str> {
        self.terms
            .iter()
            .find(|(k, eq, _)| k == key && *eq)
            .map(|(_, _, v)| v.as_str())
    }

    pub fn matches(&self, fields: &[(&'static str, String)]) -> bool {
        self.terms.iter().all(|(k, eq, v)| {
            let actual = fields
                .iter()
                .find(|(fk, _)| fk == k)
                .map(|(_, fv)| fv.as_str())
                .unwrap_or("");
            (actual == v) == *eq
        })
    }
}

fn split_unescaped(input: &str, sep: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut esc = false;
    for c in input.chars() {
        if esc {
            cur.push('\\');
            cur.push(c);
            esc = false;
        } else if c == '\\' {
            esc = true;
        } else if c == sep {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

fn find_unescaped(s: &str, tok: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            i += 2;
            continue;
        }
        if s[i..].starts_with(tok) {
            return Some(i);
        }
        i += 1;
    }
    None
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        if esc {
            out.push(c);
            esc = false;
        } else if c == '\\' {
            esc = true;
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn label_selector_forms() {
        let l = labels(json!({"app": "web", "tier": "front", "n": "7"}));
        let cases = [
            ("app=web", true),
            ("app==web", true),
            ("app!=web", false),
            ("app!=db", true),
            ("missing!=x", true),
            ("app in (web,db)", true),
            ("app in (db)", false),
            ("app notin (db)", true),
            ("missing notin (db)", true),
            ("app notin (web)", false),
            ("tier", true),
            ("!tier", false),
            ("!missing", true),
            ("app=web,tier=front", true),
            ("app=web,tier=back", false),
            ("app in (web, db),!missing", true),
            ("n>5", true),
            ("n<5", false),
            ("", true),
        ];
        for (sel, want) in cases {
            let s = LabelSelector::parse(sel).unwrap_or_else(|e| panic!("{sel}: {e}"));
            assert_eq!(s.matches(&l), want, "{sel}");
        }
        assert!(LabelSelector::parse("a in (b").is_err());
        assert!(LabelSelector::parse("-bad=x").is_err());
    }

    #[test]
    fn label_selector_object() {
        let l = labels(json!({"app": "web"}));
        assert!(!LabelSelector::from_object(None).unwrap().matches(&l));
        assert!(LabelSelector::from_object(Some(&json!({})))
            .unwrap()
            .matches(&l));
        let s = json!({"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]});
        assert!(LabelSelector::from_object(Some(&s)).unwrap().matches(&l));
        let s =
            json!({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]});
        assert!(!LabelSelector::from_object(Some(&s)).unwrap().matches(&l));
    }

    #[test]
    fn field_selector_forms() {
        let f = vec![
            ("metadata.name", "a".to_string()),
            ("spec.nodeName", "n1".to_string()),
        ];
        assert!(FieldSelector::parse("metadata.name=a").unwrap().matches(&f));
        assert!(FieldSelector::parse("metadata.name==a,spec.nodeName!=n2")
            .unwrap()
            .matches(&f));
        assert!(!FieldSelector::parse("spec.nodeName!=n1")
            .unwrap()
            .matches(&f));
        assert!(FieldSelector::parse("spec.nodeName=")
            .unwrap()
            .matches(&[("spec.nodeName", String::new())]));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
