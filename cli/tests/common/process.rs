//! Helpers for the tests that run `kvwire` processes.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A child's stderr lines as it prints them (read on a thread of their own), so a test can
/// wait for what a process says while it runs and still show all it said.
pub struct StderrLines {
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl StderrLines {
    /// Takes `child`'s stderr.
    pub fn of(child: &mut Child) -> Self {
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        StderrLines {
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits until the child has printed `count` lines containing `needle` in all; panics
    /// with everything it printed if that takes longer than `deadline`.
    pub fn wait_for(&mut self, needle: &str, count: usize, deadline: Duration) {
        let end = Instant::now() + deadline;
        while self.seen.iter().filter(|l| l.contains(needle)).count() < count {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => panic!(
                    "never printed {needle:?} {count} times within {deadline:?}:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Everything printed so far (all of it once the child has ended).
    pub fn text(&mut self) -> String {
        self.seen.extend(self.lines.try_iter());
        self.seen.join("\n")
    }
}

/// Waits until the child prints a line containing `needle` on stderr; returns the lines.
pub fn wait_for_line(child: &mut Child, needle: &str) -> Vec<String> {
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.expect("read stderr");
        let hit = line.contains(needle);
        lines.push(line);
        if hit {
            return lines;
        }
    }
    panic!("never printed {needle:?}: {lines:?}");
}

pub fn finish(child: Child, deadline: Duration) -> (Option<i32>, serde_json::Value, String) {
    let start = Instant::now();
    let mut child = child;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let out = child.wait_with_output().expect("output");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            let json = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
            return (status.code(), json, stderr);
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            // What it said before it hung, for the diagnosis.
            let out = child.wait_with_output().expect("output");
            panic!(
                "kvwire did not finish within {deadline:?}; stderr: {}; stdout: {}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process that is killed when the test unwinds (a failed assertion must not leave
/// it running), printing what it wrote to stderr for the diagnosis.
pub struct Reaped(pub Option<Child>);

impl Reaped {
    /// Takes the child back (to wait for it normally).
    pub fn take(&mut self) -> Child {
        self.0.take().expect("child already taken")
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            if let Ok(out) = c.wait_with_output() {
                eprintln!(
                    "killed a kvwire left running; its stderr:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

/// The receiver's own account of three connections in turn (whole, killed mid-transfer,
/// whole), from `kvwire bench --listen --connections 3 --json`: it exits 1 for the killed
/// connection's failures, returned every page after each connection, and served the others
/// completely.
pub fn assert_receiver_account(code: Option<i32>, json: &serde_json::Value, err: &str) {
    assert_eq!(
        code,
        Some(1),
        "the receiver must report the killed connection's failures: {err}"
    );
    let cases = json["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("no receiver report: {err}"));
    assert_eq!(cases.len(), 3, "{json}");
    for (i, c) in cases.iter().enumerate() {
        assert_eq!(
            c["pages_free_after"], c["pages_total"],
            "connection {i}: receiver pages not returned: {c}"
        );
    }
    assert_eq!(cases[0]["verified"], cases[0]["transfers"], "{}", cases[0]);
    // Every verified transfer's bytes were compared with the sender's pattern and matched.
    for c in [&cases[0], &cases[2]] {
        assert_eq!(c["bytes_checked"], c["transfers"], "{c}");
    }
    let killed = &cases[1];
    assert!(
        killed["verified"].as_u64() < killed["transfers"].as_u64(),
        "nothing was cut short: {killed}"
    );
    assert!(
        killed["failures"]
            .as_object()
            .is_some_and(|f| !f.is_empty()),
        "killed connection reported no failures: {killed}"
    );
    assert_eq!(cases[2]["verified"], cases[2]["transfers"], "{}", cases[2]);
    assert!(
        cases[2]["failures"]
            .as_object()
            .is_some_and(|f| f.is_empty()),
        "{}",
        cases[2]
    );
}

/// A bench case's own account says every transfer it ran verified, and it ran some: the
/// counts are numbers (a missing key is not equal to another missing key here).
pub fn assert_all_verified(case: &serde_json::Value) {
    let transfers = case["transfers"]
        .as_u64()
        .unwrap_or_else(|| panic!("no transfer count: {case}"));
    assert!(transfers > 0, "no transfers ran: {case}");
    assert_eq!(case["verified"].as_u64(), Some(transfers), "{case}");
}
