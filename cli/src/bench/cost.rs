//! What a case costs in CPU: seconds of user plus system time of this process (every thread,
//! the kernel's TCP work done in its system calls included), from `getrusage(RUSAGE_SELF)`,
//! read around the timed window of a case and of its raw baseline.

use nix::sys::resource::{getrusage, UsageWho};

/// CPU time of this process when the clock started.
#[derive(Clone, Copy, Debug)]
pub(super) struct CpuClock(f64);

impl CpuClock {
    /// Starts counting.
    pub(super) fn start() -> Self {
        Self(process_cpu_seconds())
    }

    /// CPU-seconds this process used since [`CpuClock::start`].
    pub(super) fn seconds(self) -> f64 {
        (process_cpu_seconds() - self.0).max(0.0)
    }
}

/// User plus system CPU-seconds of this process so far (0 if `getrusage` fails, which it
/// does not for `RUSAGE_SELF`).
fn process_cpu_seconds() -> f64 {
    getrusage(UsageWho::RUSAGE_SELF).map_or(0.0, |u| {
        let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
        secs(u.user_time()) + secs(u.system_time())
    })
}

/// CPU-seconds per 10^9 bytes moved; `None` when nothing moved.
pub(super) fn per_gb(cpu_seconds: f64, bytes: u64) -> Option<f64> {
    (bytes > 0).then(|| cpu_seconds / (bytes as f64 / 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_counts_this_process_cpu_work() {
        let clock = CpuClock::start();
        // Busy work the optimizer cannot drop, until the clock has counted 20 ms of it: on a
        // loaded machine that takes longer, never forever (a clock that does not count work
        // fails at the cap).
        let mut x = 1u64;
        let cap = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while clock.seconds() < 0.02 {
            assert!(
                std::time::Instant::now() < cap,
                "a minute of busy work counted as {} CPU-s",
                clock.seconds()
            );
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        assert_eq!(per_gb(2.0, 4_000_000_000), Some(0.5));
        assert_eq!(per_gb(1.0, 0), None);
    }
}
