//! Helpers for the tests that run `kvwire` processes.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::{Duration, Instant};

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
