//! The ledger's column of the real-node matrix: the NodeShutdown objects
//! the controller wrote for the guest's Node, judged against the Node's own
//! record as the API server held it: exactly one object for the episode,
//! of its kind, ending where the Node ended, and written within
//! [`WITHIN_S`] of the Node getting there.
use serde_json::Value;

use super::{NodeOutcome, Seen, NODE};

/// How far the ledger may trail the Node (its writer looks every 2 s).
const WITHIN_S: f64 = 5.0;

/// The ending the controller reads from one state of the Node (as
/// `controller::ledger::entry` does): the record's close, back on a new
/// boot and Ready, fenced (the out-of-service taint), down (a proof), open.
fn ending(node: &Value) -> Option<String> {
    let rec = &node["record"];
    if rec.is_null() {
        return None;
    }
    if let Some(how) = rec["closed"].as_str() {
        return Some(how.to_string());
    }
    let ready = node["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    });
    let tainted = node["taints"].as_array().is_some_and(|t| {
        t.iter().any(|t| {
            t.as_str()
                .is_some_and(|t| t.starts_with(lastgasp_common::names::OUT_OF_SERVICE_KEY))
        })
    });
    Some(
        if node["boot"] != rec["boot_id"] && ready {
            "back"
        } else if tainted {
            "fenced"
        } else if !rec["proof"].is_null() {
            "down"
        } else {
            "open"
        }
        .into(),
    )
}

pub(super) fn judge(seen: &Seen, o: &mut NodeOutcome) {
    let of_node = |kind: &'static str| {
        let key = if kind == "Node" { "name" } else { "node" };
        seen.lines
            .iter()
            .filter(move |l| l["kind"] == kind && l["obj"][key] == NODE)
    };
    let entries: Vec<&Value> = of_node("NodeShutdown").collect();
    let mut names: Vec<&str> = entries
        .iter()
        .filter_map(|l| l["obj"]["name"].as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    // The Node's states after the trigger, with the ending each reads as.
    let states: Vec<(f64, &Value, String)> = of_node("Node")
        .filter(|l| seen.rel(l) > 0.0)
        .filter_map(|l| Some((seen.rel(l), &l["obj"], ending(&l["obj"])?)))
        .collect();
    let Some((_, last, want)) = states.last() else {
        return unannounced(seen, &names, &entries, o);
    };
    let rec = &last["record"];
    let Some((name, mine)) = only_object(&names, &entries, "the Node's one episode", o) else {
        return;
    };
    let last_entry = &mine[mine.len() - 1]["obj"];
    for (field, theirs, ours) in [
        ("bootID", &last_entry["bootID"], &rec["boot_id"]),
        ("episode", &last_entry["episode"], &rec["episode"]),
        ("kind", &last_entry["kind"], &rec["kind"]),
    ] {
        if theirs != ours {
            o.problems.push(format!(
                "ledger: {name} says {field} {theirs}, the record {ours}"
            ));
        }
    }
    let node_at = states.iter().find(|s| s.2 == *want).map(|s| s.0);
    within(seen, name, want, node_at, &mine, o);
}

/// The one object of `names` and its lines in turn; a problem when there
/// are none or several `for_what` has one.
fn only_object<'a>(
    names: &[&'a str],
    entries: &[&'a Value],
    for_what: &str,
    o: &mut NodeOutcome,
) -> Option<(&'a str, Vec<&'a Value>)> {
    let [name] = names[..] else {
        o.ledger = format!("objects: {names:?}");
        o.problems.push(format!(
            "ledger: {} objects for {for_what}: {names:?}",
            names.len()
        ));
        return None;
    };
    let mine = entries
        .iter()
        .copied()
        .filter(|l| l["obj"]["name"] == name)
        .collect();
    Some((name, mine))
}

/// No record on the Node: an object only for a boot the Node says ended
/// unannounced (its next boot's agent), of that boot, path `unannounced`,
/// within [`WITHIN_S`] of the Node saying so.
fn unannounced(seen: &Seen, names: &[&str], entries: &[&Value], o: &mut NodeOutcome) {
    let said = seen
        .lines
        .iter()
        .filter(|l| l["kind"] == "Node" && l["obj"]["name"] == NODE && seen.rel(l) > 0.0)
        .find_map(|l| Some((seen.rel(l), l["obj"]["unannounced"].as_str()?)));
    let Some((node_at, boot)) = said else {
        o.ledger = format!("no record on the Node; objects: {names:?}");
        if !names.is_empty() {
            o.problems.push(format!(
                "ledger: objects without a record on the Node: {names:?}"
            ));
        }
        return;
    };
    let Some((name, mine)) = only_object(names, entries, "the one boot that ended unannounced", o)
    else {
        return;
    };
    let last = &mine[mine.len() - 1]["obj"];
    if last["bootID"] != boot || last["path"] != "unannounced" {
        o.problems.push(format!(
            "ledger: {name} says boot {} path {}, the Node: boot {boot} ended unannounced",
            last["bootID"], last["path"]
        ));
    }
    within(seen, name, "unannounced", Some(node_at), &mine, o);
}

/// The entry's endings in turn, and its `want` within [`WITHIN_S`] of the
/// Node's (`node_at`).
fn within(
    seen: &Seen,
    name: &str,
    want: &str,
    node_at: Option<f64>,
    mine: &[&Value],
    o: &mut NodeOutcome,
) {
    let entry_at = mine
        .iter()
        .find(|l| l["obj"]["ending"] == want)
        .map(|l| seen.rel(l));
    let trail: Vec<String> = mine
        .iter()
        .map(|l| {
            format!(
                "{} +{:.1}",
                l["obj"]["ending"].as_str().unwrap_or("?"),
                seen.rel(l)
            )
        })
        .collect();
    o.ledger = format!("{name}: {}", trail.join(", "));
    // The drain, as the graceful path's conditions told the ledger.
    if let Some(d) = mine
        .last()
        .map(|l| &l["obj"]["drain"])
        .filter(|d| !d.is_null())
    {
        o.ledger
            .push_str(&format!("; drain {} gone, {} left", d["gone"], d["left"]));
        if let (Some(pod), Some(secs)) = (
            d["slowest"]["pod"].as_str(),
            d["slowest"]["seconds"].as_f64(),
        ) {
            o.ledger.push_str(&format!(", slowest {pod} {secs:.1} s"));
        }
    }
    match (node_at, entry_at) {
        (Some(n), Some(e)) if e - n <= WITHIN_S => {
            o.ledger
                .push_str(&format!(" ({:.1} s after the Node)", e - n));
        }
        (Some(n), Some(e)) => o.problems.push(format!(
            "ledger: {name} said {want} {:.1} s after the Node (over {WITHIN_S} s)",
            e - n
        )),
        _ => o.problems.push(format!(
            "ledger: {name} never said {want}, where the Node ended"
        )),
    }
}
