//! `StatePool`: the sequence-state memory of one DP rank as a byte budget cut into blocks, the
//! exact accounting of the states the rank's executor allocates (each sequence's state stays
//! where the model keeps it; the pool decides which sequences may grow).
//!
//! A block is `StateBytes::block_tokens` tokens of the append-only caches (a multiple of every
//! compression ratio, so a block holds whole compressed entries of every KV source) and
//! `block_bytes` bytes; a sequence of `len` tokens holds `StateBytes::blocks_for(len)` blocks:
//! its bounded rings plus one block per started block of tokens. Since that covers
//! `StateBytes::bytes(len)`, the live states never hold more than `total_blocks · block_bytes`
//! <= the budget. The scheduler reserves before it plans a write ([`StatePool::reserve`]) and
//! retires a sequence's blocks when it frees or preempts it ([`StatePool::retire`]); retired
//! blocks become free only once the step that frees the state on the rank is done
//! ([`StatePool::release`]), so a block is never counted free while the rank still holds it.

use std::collections::HashMap;

use deepinfer_model::state_bytes::StateBytes;
use deepinfer_topology::{Backend, MemoryConfig, RequestId};

use crate::error::EngineError;

/// One rank's state pool ([module docs](self)).
#[derive(Debug, Clone)]
pub struct StatePool {
    bytes: StateBytes,
    total: usize,
    free: usize,
    /// Retired blocks whose states the rank has not freed yet.
    releasing: usize,
    held: HashMap<RequestId, usize>,
}

/// Blocks and bytes of a pool, for stats and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    pub total_blocks: usize,
    /// Blocks held by live sequences or retired and not released yet.
    pub used_blocks: usize,
    pub block_bytes: u64,
    pub block_tokens: usize,
}

impl StatePool {
    /// A pool of `budget_bytes` for states of the `bytes` model.
    pub fn new(bytes: StateBytes, budget_bytes: u64) -> StatePool {
        let total = usize::try_from(budget_bytes / bytes.block_bytes()).unwrap_or(usize::MAX);
        StatePool {
            bytes,
            total,
            free: total,
            releasing: 0,
            held: HashMap::new(),
        }
    }

    /// The byte model the pool accounts with.
    pub fn model(&self) -> &StateBytes {
        &self.bytes
    }

    /// Blocks a sequence of `len` tokens holds.
    pub fn blocks_for(&self, len: usize) -> usize {
        self.bytes.blocks_for(len)
    }

    /// Whether a sequence of `len` tokens fits in the whole pool.
    pub fn fits_alone(&self, len: usize) -> bool {
        self.blocks_for(len) <= self.total
    }

    /// Grows `id`'s blocks to what `len` tokens take; `false` (and nothing changes) when the
    /// free blocks do not suffice. Never shrinks.
    pub fn reserve(&mut self, id: RequestId, len: usize) -> bool {
        let need = self.blocks_for(len);
        let held = self.held.get(&id).copied().unwrap_or(0);
        if need <= held {
            return true;
        }
        if need - held > self.free {
            return false;
        }
        self.free -= need - held;
        self.held.insert(id, need);
        true
    }

    /// The most tokens `id` may hold with its blocks plus every free block.
    pub fn room(&self, id: RequestId) -> usize {
        let blocks = self.held.get(&id).copied().unwrap_or(0) + self.free;
        blocks.saturating_sub(self.bytes.ring_blocks()) * self.bytes.block_tokens
    }

    /// Sets `id`'s blocks to what `len` tokens take when that is fewer (after a rollback the
    /// rank has already applied); the blocks are free at once.
    pub fn shrink(&mut self, id: RequestId, len: usize) {
        let need = self.blocks_for(len);
        if let Some(held) = self.held.get_mut(&id)
            && *held > need
        {
            self.free += *held - need;
            *held = need;
        }
    }

    /// Takes back all of `id`'s blocks; they stay used until [`StatePool::release`]. Returns
    /// how many.
    pub fn retire(&mut self, id: RequestId) -> usize {
        let blocks = self.held.remove(&id).unwrap_or(0);
        self.releasing += blocks;
        blocks
    }

    /// Frees `blocks` retired blocks (the step that frees their states on the rank is done).
    pub fn release(&mut self, blocks: usize) {
        let blocks = blocks.min(self.releasing);
        self.releasing -= blocks;
        self.free += blocks;
    }

    /// Blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.free
    }

    /// Retired blocks that become free when their freeing steps are done.
    pub fn releasing_blocks(&self) -> usize {
        self.releasing
    }

    /// Blocks `id` holds.
    pub fn held(&self, id: RequestId) -> usize {
        self.held.get(&id).copied().unwrap_or(0)
    }

    /// Forgets every sequence (the rank is lost; its states are gone).
    pub fn clear(&mut self) {
        self.held.clear();
        self.releasing = 0;
        self.free = self.total;
    }

    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            total_blocks: self.total,
            used_blocks: self.total - self.free,
            block_bytes: self.bytes.block_bytes(),
            block_tokens: self.bytes.block_tokens,
        }
    }
}

/// The state budget of one DP rank from `[memory]`: its bytes, or with the CPU backend its
/// fraction of the host's available memory (read now, after the weights are loaded) split over
/// `dp_ranks`. `None` where the runtime cannot measure the memory left (a fraction with CUDA:
/// the device's free memory is not read yet, see the `[memory]` docs).
pub fn rank_budget(
    memory: MemoryConfig,
    backend: Backend,
    dp_ranks: usize,
) -> Result<Option<u64>, EngineError> {
    match (memory, backend) {
        (MemoryConfig::StateBytes(bytes), _) => Ok(Some(bytes)),
        (MemoryConfig::Fraction(fraction), Backend::Cpu) => {
            let available = host_available_bytes()?;
            Ok(Some(
                (available as f64 * fraction / dp_ranks.max(1) as f64) as u64,
            ))
        }
        (MemoryConfig::Fraction(_), Backend::Cuda { .. }) => Ok(None),
    }
}

/// `MemAvailable` of `/proc/meminfo` (bytes).
fn host_available_bytes() -> Result<u64, EngineError> {
    let path = "/proc/meminfo";
    let unreadable = |message: String| EngineError::Config {
        field: "memory.state_memory_fraction".to_string(),
        message: format!(
            "cannot read the host's available memory from {path} ({message}); give \
             memory.state_bytes_per_rank instead"
        ),
    };
    let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
    parse_mem_available(&text).ok_or_else(|| unreadable("no MemAvailable line".to_string()))
}

fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_model::config::ModelConfig;
    use rand::{Rng, SeedableRng};

    fn pool(blocks: usize) -> StatePool {
        let bytes = StateBytes::of(&ModelConfig::tiny_v41());
        let budget = blocks as u64 * bytes.block_bytes() + bytes.block_bytes() - 1;
        StatePool::new(bytes, budget)
    }

    /// Random reserves, shrinks, retires and releases: the blocks are conserved (free +
    /// held + releasing = total), a refused reserve changes nothing, and the live sequences'
    /// modelled bytes never pass the budget.
    #[test]
    fn randomized_blocks_are_conserved_and_bytes_stay_in_budget() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut p = pool(40);
        let budget = p.usage().total_blocks as u64 * p.usage().block_bytes;
        let mut lens: HashMap<RequestId, usize> = HashMap::new();
        let mut retired = Vec::new();
        for _ in 0..5000 {
            let id = RequestId(rng.random_range(0..12));
            match rng.random_range(0..6) {
                0..=2 => {
                    let len = lens.get(&id).copied().unwrap_or(0) + rng.random_range(1..90);
                    let before = (p.free_blocks(), p.held(id));
                    if p.reserve(id, len) {
                        lens.insert(id, len);
                    } else {
                        assert_eq!(before, (p.free_blocks(), p.held(id)));
                    }
                }
                3 => {
                    if let Some(len) = lens.get_mut(&id) {
                        *len = len.saturating_sub(rng.random_range(0..7));
                        p.shrink(id, *len);
                    }
                }
                4 => {
                    lens.remove(&id);
                    retired.push(p.retire(id));
                }
                _ => {
                    if !retired.is_empty() {
                        p.release(retired.remove(0));
                    }
                }
            }
            let held: usize = lens.keys().map(|id| p.held(*id)).sum();
            assert_eq!(p.free_blocks() + held + p.releasing_blocks(), 40);
            let live: u64 = lens.values().map(|&len| p.model().bytes(len)).sum();
            assert!(live <= budget, "{live} bytes over the {budget}-byte budget");
        }
    }

    #[test]
    fn budgets_come_from_bytes_or_the_hosts_available_memory() {
        let bytes = MemoryConfig::StateBytes(1 << 30);
        assert_eq!(rank_budget(bytes, Backend::Cpu, 4).unwrap(), Some(1 << 30));
        let text = "MemTotal:       24000000 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(16_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        let half = rank_budget(MemoryConfig::Fraction(0.5), Backend::Cpu, 2)
            .unwrap()
            .expect("the host's memory is read");
        assert!(half > 0 && half <= host_available_bytes().unwrap() / 4 + 1);
    }

    #[test]
    fn room_counts_the_free_blocks_after_the_rings() {
        let mut p = pool(10);
        let (rings, block) = (p.model().ring_blocks(), p.model().block_tokens);
        assert!(rings < 10, "the tiny model's rings fit a 10-block pool");
        assert_eq!(p.room(RequestId(1)), (10 - rings) * block);
        assert!(p.reserve(RequestId(1), block + 1));
        assert_eq!(p.held(RequestId(1)), rings + 2);
        assert_eq!(
            p.room(RequestId(2)),
            (10 - rings - 2).saturating_sub(rings) * block
        );
        assert!(!p.fits_alone((10 - rings) * block + 1));
        assert!(p.fits_alone((10 - rings) * block));
    }
}
