//! Exhaustive depth-first exploration of [`World`] with state deduplication.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::world::{Action, World};
use crate::Violation;

/// What an exploration covered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Distinct states reached (after deduplication).
    pub states: u64,
    /// Transitions taken (edges, including those into states already seen).
    pub transitions: u64,
    /// Quiescent states (no action enabled) reached, each checked for termination.
    pub quiescent: u64,
    /// The longest path explored, in actions.
    pub max_depth: usize,
    /// Wall time.
    pub elapsed: Duration,
}

/// A broken property and the actions that lead to it from the initial state.
#[derive(Clone, Debug)]
pub struct Counterexample {
    /// What broke.
    pub violation: Violation,
    /// How to get there.
    pub trace: Vec<Action>,
}

/// Explores every state reachable from `init` (up to `max_depth` actions deep; a path
/// longer than that is reported as a violation, since the bounded model must terminate).
pub fn explore(init: World, max_depth: usize) -> Result<Report, Box<Counterexample>> {
    let start = Instant::now();
    let mut report = Report::default();
    let mut seen: HashSet<u128> = HashSet::new();
    seen.insert(init.fingerprint());
    report.states = 1;
    let mut stack = vec![init];
    while let Some(mut w) = stack.pop() {
        let depth = w.trace.len();
        report.max_depth = report.max_depth.max(depth);
        let actions = w.actions();
        if actions.is_empty() {
            report.quiescent += 1;
            if let Err(violation) = w.check_quiescent() {
                return Err(Box::new(Counterexample {
                    violation,
                    trace: w.trace,
                }));
            }
            continue;
        }
        if depth >= max_depth {
            return Err(Box::new(Counterexample {
                violation: Violation(format!(
                    "still {} actions enabled after {depth} steps: the model does not terminate",
                    actions.len()
                )),
                trace: w.trace,
            }));
        }
        for a in actions {
            let mut next = w.clone();
            report.transitions += 1;
            if let Err(violation) = next.apply(a) {
                return Err(Box::new(Counterexample {
                    violation,
                    trace: next.trace,
                }));
            }
            if seen.insert(next.fingerprint()) {
                report.states += 1;
                stack.push(next);
            }
        }
    }
    report.elapsed = start.elapsed();
    Ok(report)
}
