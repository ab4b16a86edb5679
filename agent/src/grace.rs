//! Shutdown grace periods by pod priority, with the kubelet's configuration
//! semantics (KubeletConfiguration field names).
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The kubelet's system-critical priority: the critical bucket's floor.
pub const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// The three KubeletConfiguration fields, as written there.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GraceConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_period: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_period_critical_pods: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_period_by_pod_priority: Option<Vec<PriorityGrace>>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PriorityGrace {
    pub priority: i32,
    pub shutdown_grace_period_seconds: i64,
}

/// One phase of the graceful shutdown: pods whose priority is at least
/// `priority` (and below the next bucket's) get `seconds`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub priority: i32,
    pub seconds: i64,
}

#[derive(Error, Debug, PartialEq, Eq)]
pub enum GraceError {
    #[error("{field}: {value:?} is not a duration (e.g. \"30s\", \"1m30s\")")]
    BadDuration { field: &'static str, value: String },
    #[error("set either shutdownGracePeriodByPodPriority or shutdownGracePeriod/shutdownGracePeriodCriticalPods, not both")]
    BothForms,
    #[error("shutdownGracePeriod is {0:?}: graceful shutdown needs a positive total (the kubelet treats 0 as disabled)")]
    ZeroTotal(String),
    #[error("shutdownGracePeriodCriticalPods ({critical:?}) is larger than shutdownGracePeriod ({total:?})")]
    CriticalAboveTotal { critical: String, total: String },
    #[error("shutdownGracePeriodByPodPriority[{index}].shutdownGracePeriodSeconds is {seconds}: it must not be negative")]
    NegativeSeconds { index: usize, seconds: i64 },
    #[error("shutdownGracePeriodByPodPriority: priority {0} appears more than once")]
    DuplicatePriority(i32),
    #[error("shutdownGracePeriodByPodPriority is empty")]
    Empty,
    #[error("no grace period configured: set shutdownGracePeriod (and shutdownGracePeriodCriticalPods) or shutdownGracePeriodByPodPriority")]
    Unset,
    #[error("{field} is {seconds} s in all: more than the {MAX_TOTAL_SECONDS} s (24 h) a shutdown may be held")]
    TooLong { field: &'static str, seconds: u64 },
}

/// No node's shutdown is held longer than this, whatever the config says:
/// the deadlines computed from it stay in range.
pub const MAX_TOTAL_SECONDS: u64 = 24 * 3600;

impl GraceConfig {
    /// The buckets in the order they run (lowest priority first).
    pub fn buckets(&self) -> Result<Vec<Bucket>, GraceError> {
        let mut buckets = match (
            &self.shutdown_grace_period_by_pod_priority,
            &self.shutdown_grace_period,
        ) {
            (Some(_), Some(_)) => return Err(GraceError::BothForms),
            (Some(_), None) if self.shutdown_grace_period_critical_pods.is_some() => {
                return Err(GraceError::BothForms)
            }
            (Some(list), None) => {
                if list.is_empty() {
                    return Err(GraceError::Empty);
                }
                let mut out = Vec::with_capacity(list.len());
                for (index, p) in list.iter().enumerate() {
                    if p.shutdown_grace_period_seconds < 0 {
                        return Err(GraceError::NegativeSeconds {
                            index,
                            seconds: p.shutdown_grace_period_seconds,
                        });
                    }
                    if out.iter().any(|b: &Bucket| b.priority == p.priority) {
                        return Err(GraceError::DuplicatePriority(p.priority));
                    }
                    out.push(Bucket {
                        priority: p.priority,
                        seconds: p.shutdown_grace_period_seconds,
                    });
                }
                out
            }
            (None, Some(total_s)) => {
                let total = parse_duration("shutdownGracePeriod", total_s)?;
                let critical_s = self
                    .shutdown_grace_period_critical_pods
                    .clone()
                    .unwrap_or_else(|| "0s".into());
                let critical = parse_duration("shutdownGracePeriodCriticalPods", &critical_s)?;
                if total.is_zero() {
                    return Err(GraceError::ZeroTotal(total_s.clone()));
                }
                if critical > total {
                    return Err(GraceError::CriticalAboveTotal {
                        critical: critical_s,
                        total: total_s.clone(),
                    });
                }
                vec![
                    Bucket {
                        priority: 0,
                        seconds: (total - critical).as_secs() as i64,
                    },
                    Bucket {
                        priority: SYSTEM_CRITICAL_PRIORITY,
                        seconds: critical.as_secs() as i64,
                    },
                ]
            }
            (None, None) => return Err(GraceError::Unset),
        };
        let total = buckets
            .iter()
            .map(|b| u64::try_from(b.seconds).unwrap_or(0))
            .fold(0u64, u64::saturating_add);
        if total > MAX_TOTAL_SECONDS {
            let field = if self.shutdown_grace_period_by_pod_priority.is_some() {
                "shutdownGracePeriodByPodPriority"
            } else {
                "shutdownGracePeriod"
            };
            return Err(GraceError::TooLong {
                field,
                seconds: total,
            });
        }
        buckets.sort_by_key(|b| b.priority);
        Ok(buckets)
    }
}

/// The delay to ask logind for: every bucket's time, end to end.
pub fn requested_delay(buckets: &[Bucket]) -> Duration {
    Duration::from_secs(
        buckets
            .iter()
            .map(|b| b.seconds.max(0) as u64)
            .fold(0, u64::saturating_add),
    )
}

/// The bucket a pod runs in: the highest bucket at or below its priority
/// (unset = 0); below every bucket, the lowest. `buckets` sorted ascending.
pub fn bucket_index(buckets: &[Bucket], priority: Option<i32>) -> usize {
    let p = priority.unwrap_or(0);
    buckets.iter().rposition(|b| b.priority <= p).unwrap_or(0)
}

/// A pod's grace period: its bucket's, or its own when that is shorter.
pub fn pod_grace_seconds(bucket: &Bucket, termination_grace_seconds: Option<i64>) -> i64 {
    match termination_grace_seconds {
        Some(own) if own < bucket.seconds => own.max(0),
        _ => bucket.seconds,
    }
}

/// A Go duration ("300ms", "1.5h", "2h45m"), as KubeletConfiguration uses.
pub fn parse_duration(field: &'static str, s: &str) -> Result<Duration, GraceError> {
    let bad = || GraceError::BadDuration {
        field,
        value: s.to_string(),
    };
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = s.trim();
    if rest.is_empty() || rest.starts_with('-') {
        return Err(bad());
    }
    rest = rest.strip_prefix('+').unwrap_or(rest);
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let value: f64 = rest[..num_end].parse().map_err(|_| bad())?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Duration::try_from_secs_f64(total).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[derive(Deserialize)]
    struct Vectors {
        cases: Vec<Case>,
    }

    #[derive(Deserialize)]
    struct Case {
        name: String,
        config: GraceConfig,
        #[serde(default)]
        pods: Vec<Pod>,
        expect: Expect,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Pod {
        name: String,
        priority: Option<i32>,
        termination_grace_period_seconds: Option<i64>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Expect {
        buckets_in_order: Option<Vec<Bucket>>,
        pod_bucket_seconds: Option<BTreeMap<String, i64>>,
        pod_grace_seconds: Option<BTreeMap<String, i64>>,
        requested_delay_seconds: Option<u64>,
        phases_run: Option<Vec<i32>>,
        error_mentions: Option<Vec<String>>,
    }

    /// Every case of the shared vectors (copied into agent/testdata).
    #[test]
    fn grace_bucket_vectors() {
        let v: Vectors =
            serde_json::from_str(include_str!("../testdata/grace-buckets.json")).unwrap();
        assert_eq!(v.cases.len(), 10);
        for case in v.cases {
            let name = &case.name;
            let result = case.config.buckets();
            if let Some(words) = &case.expect.error_mentions {
                let err = result.expect_err(name).to_string();
                for w in words {
                    assert!(
                        err.contains(w.as_str()),
                        "{name}: error {err:?} should mention {w:?}"
                    );
                }
                continue;
            }
            let buckets = result.unwrap_or_else(|e| panic!("{name}: {e}"));
            if let Some(want) = &case.expect.buckets_in_order {
                assert_eq!(&buckets, want, "{name}");
            }
            if let Some(want) = case.expect.requested_delay_seconds {
                assert_eq!(
                    requested_delay(&buckets),
                    Duration::from_secs(want),
                    "{name}"
                );
            }
            let placed = |p: &Pod| buckets[bucket_index(&buckets, p.priority)];
            if let Some(want) = &case.expect.pod_bucket_seconds {
                for p in &case.pods {
                    assert_eq!(
                        Some(&placed(p).seconds),
                        want.get(&p.name),
                        "{name}: pod {}",
                        p.name
                    );
                }
            }
            if let Some(want) = &case.expect.pod_grace_seconds {
                for p in &case.pods {
                    let g = pod_grace_seconds(&placed(p), p.termination_grace_period_seconds);
                    assert_eq!(Some(&g), want.get(&p.name), "{name}: pod {}", p.name);
                }
            }
            if let Some(want) = &case.expect.phases_run {
                let mut run: Vec<i32> = case.pods.iter().map(|p| placed(p).priority).collect();
                run.sort();
                run.dedup();
                assert_eq!(&run, want, "{name}: only buckets with pods run");
            }
        }
    }

    #[test]
    fn go_durations() {
        let d = |s| parse_duration("f", s);
        assert_eq!(d("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(d("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(d("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(d("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(d("0"), Ok(Duration::ZERO));
        for bad in ["", "30", "-5s", "5 s", "5x", "s", "1..5s"] {
            assert!(
                matches!(d(bad), Err(GraceError::BadDuration { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn unset_and_unknown_fields_are_errors() {
        assert_eq!(GraceConfig::default().buckets(), Err(GraceError::Unset));
        let e =
            serde_json::from_str::<GraceConfig>(r#"{"shutdownGracePeriodz":"1s"}"#).unwrap_err();
        assert!(e.to_string().contains("shutdownGracePeriodz"), "{e}");
    }

    #[test]
    fn huge_grace_periods_are_refused_not_overflowed() {
        let by_priority = |secs: &[i64]| GraceConfig {
            shutdown_grace_period_by_pod_priority: Some(
                secs.iter()
                    .enumerate()
                    .map(|(i, s)| PriorityGrace {
                        priority: i as i32,
                        shutdown_grace_period_seconds: *s,
                    })
                    .collect(),
            ),
            ..GraceConfig::default()
        };
        for c in [
            by_priority(&[i64::MAX]),
            by_priority(&[i64::MAX, i64::MAX]),
            by_priority(&[86_400, 1]),
            GraceConfig {
                shutdown_grace_period: Some("1000000000h".into()),
                ..GraceConfig::default()
            },
            GraceConfig {
                shutdown_grace_period: Some("25h".into()),
                ..GraceConfig::default()
            },
        ] {
            let e = c.buckets().unwrap_err().to_string();
            assert!(
                e.contains("24 h") && e.contains("shutdownGracePeriod"),
                "{e}"
            );
        }
        assert!(
            by_priority(&[86_400]).buckets().is_ok(),
            "24 h is the limit"
        );
        assert_eq!(
            requested_delay(&[
                Bucket {
                    priority: 0,
                    seconds: i64::MAX
                },
                Bucket {
                    priority: 1,
                    seconds: i64::MAX
                },
                Bucket {
                    priority: 2,
                    seconds: i64::MAX
                }
            ]),
            Duration::from_secs(u64::MAX),
            "saturates"
        );
    }
}
