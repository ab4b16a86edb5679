//! The preflight table: each detector and actuator adds its own lines (its
//! `preflight`), and `lastgasp check` draws them.
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Info,
    /// Works, with less (a hook, a detector or a detail missing).
    Warn,
    /// Required and missing: the check exits 1.
    Fail,
}

#[derive(Clone, Debug)]
pub struct Line {
    pub section: &'static str,
    pub status: Status,
    pub what: String,
    pub text: String,
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub lines: Vec<Line>,
    section: &'static str,
}

impl Report {
    /// Where the next lines go.
    pub fn section(&mut self, name: &'static str) {
        self.section = name;
    }

    pub fn push(&mut self, status: Status, what: impl Into<String>, text: impl Into<String>) {
        self.lines.push(Line {
            section: self.section,
            status,
            what: what.into(),
            text: text.into(),
        });
    }

    pub fn failures(&self) -> usize {
        self.count(Status::Fail)
    }

    pub fn count(&self, s: Status) -> usize {
        self.lines.iter().filter(|l| l.status == s).count()
    }

    pub fn line(&self, what: &str) -> Option<&Line> {
        self.lines.iter().find(|l| l.what == what)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "lastgasp check: node preflight (FAIL: required and missing; WARN: works with less)"
        )?;
        let w = self
            .lines
            .iter()
            .map(|l| l.what.len())
            .max()
            .unwrap_or(0)
            .max(14);
        writeln!(f, "  {:<5} {:<10} {:<w$} detail", "", "section", "check")?;
        for l in &self.lines {
            let status = match l.status {
                Status::Ok => "ok",
                Status::Info => "info",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            writeln!(
                f,
                "  {status:<5} {:<10} {:<w$} {}",
                l.section, l.what, l.text
            )?;
        }
        let warns = self.count(Status::Warn);
        match self.failures() {
            0 if warns == 0 => writeln!(f, "result: ok"),
            0 => writeln!(f, "result: ok, with {warns} warning{}", plural(warns)),
            n => writeln!(
                f,
                "result: FAIL: {n} required item{} missing or refused",
                plural(n)
            ),
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_counts_and_names_the_result() {
        let mut r = Report::default();
        r.section("kernel");
        r.push(Status::Ok, "btf", "/sys/kernel/btf/vmlinux");
        r.push(Status::Warn, "kprobes", "none");
        let text = r.to_string();
        assert!(text.contains("result: ok, with 1 warning\n"), "{text}");
        assert!(text.contains("kernel"), "{text}");
        r.section("hooks");
        r.push(Status::Fail, "sys_enter_reboot", "refused");
        r.push(Status::Fail, "sched_process_exec", "refused");
        assert_eq!(r.failures(), 2);
        assert_eq!(r.line("kprobes").unwrap().section, "kernel");
        assert_eq!(r.line("sys_enter_reboot").unwrap().section, "hooks");
        assert!(r
            .to_string()
            .contains("result: FAIL: 2 required items missing or refused"));
    }
}
