//! Where a rank's sequence states live and how much of that memory is free: what
//! `[memory] state_memory_fraction` is a fraction of (`scheduler::pool::rank_budgets`).
//!
//! A rank on the CPU backend keeps its states in the host's memory, which every rank of the
//! process shares ([`StateMemory::Host`], read by the engine from `/proc/meminfo`,
//! [`HostMemory`]). A rank on a device reads its device's free memory through a [`FreeMemory`]
//! (a `CudaBackend`'s memory probe, `gpu::free_memory_of`; a fixed figure in CPU tests) once
//! its weights are resident ([`StateMemory::Device`], from `RankExecutor::state_memory`); the
//! ranks on one device share what it has free.

use std::sync::Arc;

/// Reads the bytes free now in the memory a rank's states live in.
pub trait FreeMemory: Send + Sync {
    /// Free bytes now; the reason when the memory cannot be read.
    fn free_bytes(&self) -> Result<u64, String>;
}

/// Where a rank's states live, read after its weights are resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateMemory {
    /// The host's memory, shared by every rank of the process (the CPU backend).
    Host,
    /// Device ordinal `device` of the node, with `free_bytes` free after the weights of every
    /// rank on it were loaded.
    Device { device: usize, free_bytes: u64 },
}

/// The device a rank runs on and its free-memory reading (`ModelExecutor::with_device_memory`).
#[derive(Clone)]
pub struct DeviceMemory {
    /// Device ordinal on the node: ranks with the same ordinal share its memory.
    pub device: usize,
    pub probe: Arc<dyn FreeMemory>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// The host's available memory: `MemAvailable` of `/proc/meminfo`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostMemory;

impl FreeMemory for HostMemory {
    fn free_bytes(&self) -> Result<u64, String> {
        let path = "/proc/meminfo";
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        parse_mem_available(&text).ok_or_else(|| format!("{path}: no MemAvailable line"))
    }
}

/// A fixed figure (tests: a device of this many free bytes).
#[derive(Debug, Clone, Copy)]
pub struct FixedFree(pub u64);

impl FreeMemory for FixedFree {
    fn free_bytes(&self) -> Result<u64, String> {
        Ok(self.0)
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub(crate) fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_available_memory_is_read_from_meminfo() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(16_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert!(HostMemory.free_bytes().expect("a Linux host") > 0);
        assert_eq!(FixedFree(7).free_bytes(), Ok(7));
    }
}
