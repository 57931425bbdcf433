//! The GPU tests' one rule for a missing GPU: without a CUDA driver, NVRTC or device they
//! print `SKIPPED: ...` and pass, unless `KVWIRE_REQUIRE_GPU=1` makes any of those a failure;
//! a driver, NVRTC and a device that still fail is always a failure.

use kvwire::gpu::GpuError;

/// `opened` (a GPU digester, CUDA device memory, ...), or `None` after printing why the test
/// is skipped.
pub fn or_skip<T>(what: &str, opened: Result<T, GpuError>) -> Option<T> {
    let require = std::env::var("KVWIRE_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match opened {
        Ok(t) => Some(t),
        Err(e) if require => panic!("KVWIRE_REQUIRE_GPU=1, but no {what}: {e}"),
        Err(GpuError::NoDriver(why)) => {
            println!("SKIPPED: no CUDA driver ({why})");
            None
        }
        Err(GpuError::NoNvrtc(why)) => {
            println!("SKIPPED: no NVRTC ({why})");
            None
        }
        Err(e @ GpuError::NoDevice { .. }) => {
            println!("SKIPPED: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}
