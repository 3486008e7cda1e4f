//! Opt-in device time per kernel: while [`KernelTimer`] is on, every launch of the runtime
//! records an event on the stream right before and right after it, and [`KernelTimer::take`]
//! waits for the events and sums the time between each pair by kernel name. A pair bounds its
//! kernel's run; when the host launches slower than the device runs (an idle stream), the
//! start event passes before the kernel is submitted, so the pair also holds that submission.
//! Off by default: a launch then pays one relaxed atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::CudaEvent;

use crate::error::KernelError;

/// What one kernel name accumulated.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelStats {
    pub launches: u64,
    /// Device seconds between the launches' event pairs.
    pub seconds: f64,
}

/// The per-kernel device times of one runtime ([module docs](self)).
#[derive(Debug, Default)]
pub struct KernelTimer {
    enabled: AtomicBool,
    /// Launches timed since the last [`KernelTimer::take`]: the kernel's name and its events.
    pending: Mutex<Vec<(String, CudaEvent, CudaEvent)>>,
}

impl KernelTimer {
    /// Whether launches are being timed.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns the timing on or off (launches timed so far stay until taken).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Keeps the events a launch of `name` recorded around it.
    pub(crate) fn record(&self, name: &str, (start, end): (CudaEvent, CudaEvent)) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((name.to_string(), start, end));
    }

    /// The device time per kernel name of every launch timed so far, waiting for their events;
    /// the timed launches are forgotten.
    pub fn take(&self) -> Result<BTreeMap<String, KernelStats>, KernelError> {
        let pending =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner));
        let mut times = Vec::with_capacity(pending.len());
        for (name, start, end) in pending {
            let ms = start
                .elapsed_ms(&end)
                .map_err(KernelError::driver(format!("timing a launch of {name}")))?;
            times.push((name, f64::from(ms) / 1e3));
        }
        Ok(tally(times))
    }
}

/// The launches and seconds per name of `(name, seconds)` launches.
fn tally(times: impl IntoIterator<Item = (String, f64)>) -> BTreeMap<String, KernelStats> {
    let mut table: BTreeMap<String, KernelStats> = BTreeMap::new();
    for (name, seconds) in times {
        let entry = table.entry(name).or_default();
        entry.launches += 1;
        entry.seconds += seconds;
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_of_one_name_add_up_and_names_stay_apart() {
        let table = tally([
            ("gemm_fp8_fast_t128_b8".to_string(), 0.25),
            ("moe_combine".to_string(), 0.125),
            ("gemm_fp8_fast_t128_b8".to_string(), 0.5),
        ]);
        assert_eq!(table.len(), 2);
        assert_eq!(
            table["gemm_fp8_fast_t128_b8"],
            KernelStats {
                launches: 2,
                seconds: 0.75
            }
        );
        assert_eq!(table["moe_combine"].launches, 1);
        assert_eq!(table["moe_combine"].seconds, 0.125);
    }

    #[test]
    fn the_timer_is_off_until_turned_on() {
        let timer = KernelTimer::default();
        assert!(!timer.enabled());
        timer.set_enabled(true);
        assert!(timer.enabled());
        assert!(timer.take().expect("nothing pending").is_empty());
    }
}
