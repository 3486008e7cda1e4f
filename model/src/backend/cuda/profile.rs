//! The opt-in per-op profile of [`CudaBackend`]: when on, every [`Backend`] op waits for the
//! device before and after it runs and adds its wall time, kernel launches (and how many of them
//! ran on tensor cores: which numerics' kernels an op took) and host-to-device copies (counted
//! by the kernel runtime) to a table keyed by the op's name, and of the wall time the part until
//! the op returned (its host work) apart. Off by default (then an
//! op pays one relaxed atomic load); turn it on with [`OpProfile::set_enabled`] or by opening the
//! backend with `DEEPINFER_CUDA_PROFILE=1`. The waits change what they measure (no overlap of host
//! work and kernels), so a profile explains a step's time but is not the step's time.
//!
//! An op that calls another [`Backend`] op of this backend is timed once, as the outer op. The
//! host time between two ops (the model's own work, or a wait for device work queued outside
//! any op) is charged to the op that follows it (`before`), so a step's time outside its ops can
//! be placed in the code.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use deepinfer_kernels::runtime::RuntimeCounts;

use super::CudaBackend;

/// The environment variable that turns the profile (and the per-kernel device times) on when the
/// backend is opened.
pub const PROFILE_ENV: &str = "DEEPINFER_CUDA_PROFILE";
// Its sibling `DEEPINFER_CUDA_POISON=1` ([`super::POISON_ENV`], read when the kernel runtime
// opens) fills every output the backend allocates uninitialised (`alloc_written`: the launches
// write every element, so no zero fill) with 0xFF bytes, NaN in every float type, so an element
// a kernel forgets shows in the GPU tests; `tests/gpu-suite.sh run` turns it on.

/// What one op name accumulated.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpStats {
    pub calls: u64,
    /// Wall seconds from the device being idle before the op to it being idle after.
    pub seconds: f64,
    /// Of `seconds`, those until the op returned to its caller, before the wait for the device:
    /// the host's work (building tables, launching), plus any wait inside the op. Close to
    /// `seconds`, the op is bound by the host; far below it, by its kernels.
    pub host_seconds: f64,
    pub launches: u64,
    /// Of `launches`, those of tensor-core kernels (the `fast` numerics' GEMMs, linear and
    /// attention): zero for an op that ran on the exact kernels alone.
    pub tensor_core_launches: u64,
    pub htod_copies: u64,
    pub htod_bytes: u64,
    /// Wall seconds between the end of the op before (this backend's, profile on) and this one's
    /// start, the wait for the device included.
    pub before_seconds: f64,
}

/// The per-op table of one backend (shared: keep a clone to read it after the backend was handed
/// to a model).
#[derive(Debug, Default)]
pub struct OpProfile {
    enabled: AtomicBool,
    /// Ops in progress on this backend (an op inside another is not timed apart).
    depth: AtomicUsize,
    ops: Mutex<BTreeMap<&'static str, OpStats>>,
    /// When the last outermost op ended (cleared when the profile is turned on).
    last_end: Mutex<Option<Instant>>,
}

impl OpProfile {
    /// Whether ops are being profiled.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns the profile on or off (what was gathered stays).
    pub fn set_enabled(&self, on: bool) {
        *self.last_end.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// The table so far, emptying it.
    pub fn take(&self) -> BTreeMap<&'static str, OpStats> {
        std::mem::take(&mut *self.ops.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn add(&self, name: &'static str, times: OpTimes, counts: RuntimeCounts) {
        let mut ops = self.ops.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = ops.entry(name).or_default();
        entry.calls += 1;
        entry.before_seconds += times.before;
        entry.seconds += times.wall;
        entry.host_seconds += times.host;
        entry.launches += counts.launches;
        entry.tensor_core_launches += counts.tensor_core_launches;
        entry.htod_copies += counts.htod_copies;
        entry.htod_bytes += counts.htod_bytes;
    }
}

/// The seconds of one op call: the host time before it, its wall time, and of that the time until
/// it returned (fields of [`OpStats`]).
#[derive(Debug, Clone, Copy)]
struct OpTimes {
    before: f64,
    wall: f64,
    host: f64,
}

/// One op in progress; adds itself to the profile when dropped.
pub(super) struct OpScope<'a> {
    backend: &'a CudaBackend,
    name: &'static str,
    /// Set when this scope counts (profile on); `Some` start when it is the outermost op, with
    /// the host time since the op before.
    entered: bool,
    start: Option<(Instant, RuntimeCounts, f64)>,
}

impl CudaBackend {
    /// Starts profiling op `name` (nothing when the profile is off); hold the result for the op.
    pub(super) fn op_scope(&self, name: &'static str) -> OpScope<'_> {
        let profile = &self.profile;
        if !profile.enabled() {
            return OpScope {
                backend: self,
                name,
                entered: false,
                start: None,
            };
        }
        let outermost = profile.depth.fetch_add(1, Ordering::Relaxed) == 0;
        let start = outermost.then(|| {
            // A failed wait shows up again in the op itself, which reports it.
            let _ = self.rt.synchronize();
            let now = Instant::now();
            let last_end = *profile
                .last_end
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let before = last_end.map_or(0.0, |end| now.duration_since(end).as_secs_f64());
            (now, self.rt.counts(), before)
        });
        OpScope {
            backend: self,
            name,
            entered: true,
            start,
        }
    }
}

impl Drop for OpScope<'_> {
    fn drop(&mut self) {
        if !self.entered {
            return;
        }
        let backend = self.backend;
        if let Some((started, counts, before)) = self.start {
            let host = started.elapsed().as_secs_f64();
            let _ = backend.rt.synchronize();
            let times = OpTimes {
                before,
                wall: started.elapsed().as_secs_f64(),
                host,
            };
            backend
                .profile
                .add(self.name, times, backend.rt.counts() - counts);
            *backend
                .profile
                .last_end
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        }
        backend.profile.depth.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(launches: u64, htod_copies: u64, htod_bytes: u64) -> RuntimeCounts {
        RuntimeCounts {
            launches,
            tensor_core_launches: launches / 3,
            htod_copies,
            htod_bytes,
        }
    }

    #[test]
    fn an_op_accumulates_its_calls_and_take_empties_the_table() {
        let profile = OpProfile::default();
        assert!(!profile.enabled(), "off by default");
        profile.set_enabled(true);
        assert!(profile.enabled());
        let times = |before, wall, host| OpTimes { before, wall, host };
        profile.add("gemm_fp8", times(0.0, 0.25, 0.125), counts(3, 0, 0));
        profile.add("gemm_fp8", times(0.0625, 0.5, 0.25), counts(3, 1, 64));
        profile.add("gather", times(0.03125, 0.125, 0.125), counts(1, 1, 8));
        let table = profile.take();
        assert_eq!(
            table["gemm_fp8"],
            OpStats {
                calls: 2,
                seconds: 0.75,
                host_seconds: 0.375,
                launches: 6,
                tensor_core_launches: 2,
                htod_copies: 1,
                htod_bytes: 64,
                before_seconds: 0.0625,
            }
        );
        assert_eq!(table["gather"].calls, 1);
        assert_eq!(table["gather"].htod_bytes, 8);
        assert_eq!(table["gather"].before_seconds, 0.03125);
        assert_eq!(table.len(), 2);
        assert!(profile.take().is_empty(), "take empties the table");
    }

    #[test]
    fn runtime_counts_subtract_field_by_field() {
        let difference = counts(12, 4, 4096) - counts(6, 1, 1024);
        assert_eq!(difference, counts(6, 3, 3072));
        assert_eq!(difference.tensor_core_launches, 2);
    }
}
