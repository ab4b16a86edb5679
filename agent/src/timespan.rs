//! systemd's time spans, as logind.conf and systemctl read them: one
//! parser for both.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The latest time RFC 3339 (the audit log, the Node's record, every log
/// line) can write: 9999-12-31T23:59:59Z. humantime refuses to format a
/// later one, or one before 1970, and a refused format is a panic.
pub(crate) fn latest() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(253_402_300_799)
}

/// `t` when it can be written down (1970 to 9999), else `None`: a time
/// derived from outside data (a tool's argument, a bus property) never
/// reaches a serialiser that cannot write it.
pub(crate) fn writable(t: SystemTime) -> Option<SystemTime> {
    (UNIX_EPOCH..=latest()).contains(&t).then_some(t)
}

/// systemd's time span syntax (`parse_sec`): "5min", "1h 30s", "1.5d", "1M";
/// a bare number is seconds; "infinity" is `Duration::MAX`.
pub(crate) fn parse_timespan(text: &str) -> Option<Duration> {
    const USEC_PER_SEC: u64 = 1_000_000;
    fn unit_usec(unit: &str) -> Option<u64> {
        Some(match unit {
            "" | "s" | "sec" | "second" | "seconds" => USEC_PER_SEC,
            "us" | "usec" | "μs" | "µs" => 1,
            "ms" | "msec" => 1_000,
            "m" | "min" | "minute" | "minutes" => 60 * USEC_PER_SEC,
            "h" | "hr" | "hour" | "hours" => 3_600 * USEC_PER_SEC,
            "d" | "day" | "days" => 86_400 * USEC_PER_SEC,
            "w" | "week" | "weeks" => 604_800 * USEC_PER_SEC,
            "M" | "month" | "months" => 2_629_800 * USEC_PER_SEC,
            "y" | "year" | "years" => 31_557_600 * USEC_PER_SEC,
            _ => return None,
        })
    }

    if text.trim() == "infinity" {
        return Some(Duration::MAX);
    }
    let mut rest = text.trim_start();
    if rest.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let (int, after) = rest.split_at(rest.bytes().take_while(u8::is_ascii_digit).count());
        let (frac, after) = match after.strip_prefix('.') {
            Some(f) => f.split_at(f.bytes().take_while(u8::is_ascii_digit).count()),
            None => ("", after),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        let after = after.trim_start();
        let (unit, after) = after.split_at(
            after
                .find(|c: char| !c.is_alphabetic())
                .unwrap_or(after.len()),
        );
        let per = unit_usec(unit)?;
        let whole: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let mut part = whole.checked_mul(per)?;
        let mut scale = per;
        for digit in frac.bytes() {
            scale /= 10;
            part = part.checked_add(u64::from(digit - b'0') * scale)?;
        }
        total = total.checked_add(part)?;
        rest = after.trim_start();
    }
    Some(Duration::from_micros(total))
}

/// A duration as systemd prints a limit: "infinity" or seconds ("20s").
pub(crate) fn secs(d: Duration) -> String {
    if d == Duration::MAX {
        "infinity".into()
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timespans_parse_as_systemd_does() {
        let secs = |s| parse_timespan(s).map(|d| d.as_secs_f64());
        assert_eq!(secs("5min"), Some(300.0));
        assert_eq!(secs("5 min"), Some(300.0));
        assert_eq!(secs("1min30s"), Some(90.0));
        assert_eq!(secs("1h 30min 10s"), Some(5410.0));
        assert_eq!(secs("90"), Some(90.0));
        assert_eq!(secs("1.5s"), Some(1.5));
        assert_eq!(secs("500ms"), Some(0.5));
        assert_eq!(secs("250µs"), Some(0.00025));
        assert_eq!(secs("2d"), Some(172_800.0));
        assert_eq!(secs("1w"), Some(604_800.0));
        assert_eq!(secs("1M"), Some(2_629_800.0));
        assert_eq!(secs("1y"), Some(31_557_600.0));
        assert_eq!(parse_timespan("infinity"), Some(Duration::MAX));
        assert_eq!(secs(""), None);
        assert_eq!(secs("soon"), None);
        assert_eq!(secs("min"), None);
        assert_eq!(secs("5 parsecs"), None);
        assert_eq!(secs("99999999999999999999y"), None);
    }
}
