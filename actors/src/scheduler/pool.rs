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
//!
//! Each rank's budget ([`rank_budgets`], cut into pools by [`PoolPlan::pools`] once the ranks
//! are up): `[memory] state_bytes_per_rank`, or `state_memory_fraction` of the memory the rank's
//! states live in after the weights (`rank::memory`), split evenly among the ranks sharing it;
//! the prefix cache's bytes come out of it.

use std::collections::{HashMap, HashSet};

use deepinfer_model::state_bytes::StateBytes;
use deepinfer_topology::{MemoryConfig, RequestId};

use crate::error::EngineError;
use crate::rank::memory::{FreeMemory, StateMemory};

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

/// How each DP rank's pool is cut: the byte model of its states, the `[memory]` budget rule and
/// the bytes of each rank's budget its prefix cache takes (0 without one).
#[derive(Debug, Clone)]
pub struct PoolPlan {
    pub bytes: StateBytes,
    pub memory: MemoryConfig,
    pub prefix_bytes: u64,
}

impl PoolPlan {
    /// Whether the budget is a share of measured memory (`state_memory_fraction`): the ranks
    /// then report theirs once their weights are resident (`RankExecutor::state_memory`).
    pub fn measures_memory(&self) -> bool {
        matches!(self.memory, MemoryConfig::Fraction(_))
    }

    /// Each rank's pool, in the order of `ranks` (where each rank's states live; with explicit
    /// bytes only their number matters), the host's memory read through `host` when a rank
    /// lives there; the memory plan of each place is logged. Its prefix cache's bytes come out
    /// of each rank's budget, so the states and the cached blocks together stay within it.
    pub fn pools(
        &self,
        ranks: &[StateMemory],
        host: &dyn FreeMemory,
    ) -> Result<Vec<StatePool>, EngineError> {
        let budgets = rank_budgets(self.memory, ranks, host)?;
        let mut logged = HashSet::new();
        let mut pools = Vec::with_capacity(ranks.len());
        for (dp, (budget, place)) in budgets.into_iter().zip(ranks).enumerate() {
            let states = self.states_budget(&budget)?;
            let pool = StatePool::new(self.bytes.clone(), states);
            let (usage, model) = (pool.usage(), pool.model());
            let fits = model.ring_blocks() + 1;
            if let (Some(free), true) = (budget.measured, usage.total_blocks < fits) {
                return Err(EngineError::Config {
                    field: "memory.state_memory_fraction".into(),
                    message: format!(
                        "DP rank {dp}: {} of the {free} bytes free on {} over the {} ranks \
                         there is {} bytes{}, {} blocks of {} bytes: less than the {fits} blocks \
                         of one sequence (its rings and one block of {} tokens)",
                        budget.fraction,
                        place_name(place),
                        budget.sharing,
                        budget.bytes,
                        prefix_note(self.prefix_bytes),
                        usage.total_blocks,
                        usage.block_bytes,
                        usage.block_tokens
                    ),
                });
            }
            if logged.insert(place_name(place)) {
                let longest =
                    usage.total_blocks.saturating_sub(model.ring_blocks()) * model.block_tokens;
                tracing::info!(
                    memory = %place_name(place),
                    free_bytes = budget.measured,
                    ranks_sharing = budget.sharing,
                    budget_bytes = budget.bytes,
                    prefix_cache_bytes = self.prefix_bytes,
                    blocks = usage.total_blocks,
                    block_tokens = usage.block_tokens,
                    block_bytes = usage.block_bytes,
                    ring_bytes = model.ring_bytes(),
                    bytes_per_token = model.bytes_per_token(),
                    longest_context_tokens = longest,
                    "state pool of each DP rank there"
                );
            }
            pools.push(pool);
        }
        Ok(pools)
    }

    /// What of a rank's budget its states get: all of it less the prefix cache's bytes.
    fn states_budget(&self, budget: &RankBudget) -> Result<u64, EngineError> {
        if self.prefix_bytes == 0 {
            return Ok(budget.bytes);
        }
        let of = match budget.measured {
            Some(free) => format!(
                "{} bytes ({} of the {free} bytes free over {} ranks, [memory])",
                budget.bytes, budget.fraction, budget.sharing
            ),
            None => format!("{} bytes ([memory])", budget.bytes),
        };
        budget
            .bytes
            .checked_sub(self.prefix_bytes)
            .filter(|&rest| rest > 0)
            .ok_or_else(|| EngineError::Config {
                field: "prefix_cache.bytes_per_rank".into(),
                message: format!(
                    "{} bytes leave nothing of the rank's state budget of {of}, which the cache \
                     shares",
                    self.prefix_bytes
                ),
            })
    }
}

/// One rank's budget and where it came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankBudget {
    pub bytes: u64,
    /// The free bytes it is a share of (`None`: explicit bytes).
    pub measured: Option<u64>,
    /// The fraction taken of them, and the ranks sharing the memory.
    pub fraction: f64,
    pub sharing: usize,
}

/// The state budget of each DP rank (in the order of `ranks`) from `[memory]`: its bytes, or
/// its share of the memory its states live in: `fraction` of what is free there after the
/// weights, split evenly among the ranks there. The host's memory (every CPU rank of the
/// process) is read now through `host`; a device's is each rank's reading
/// ([`StateMemory::Device`], taken once every rank's weights are resident), the smallest of
/// the readings of one device.
pub fn rank_budgets(
    memory: MemoryConfig,
    ranks: &[StateMemory],
    host: &dyn FreeMemory,
) -> Result<Vec<RankBudget>, EngineError> {
    let fraction = match memory {
        MemoryConfig::StateBytes(bytes) => {
            let budget = RankBudget {
                bytes,
                measured: None,
                fraction: 1.0,
                sharing: 1,
            };
            return Ok(vec![budget; ranks.len()]);
        }
        MemoryConfig::Fraction(fraction) => fraction,
    };
    let host_free = if ranks.contains(&StateMemory::Host) {
        host.free_bytes().map_err(|message| EngineError::Config {
            field: "memory.state_memory_fraction".to_string(),
            message: format!(
                "cannot read the host's available memory ({message}); give \
                 memory.state_bytes_per_rank instead"
            ),
        })?
    } else {
        0
    };
    // Per memory (the host: `None`): its smallest reading and the ranks there.
    let mut free: HashMap<Option<usize>, (u64, usize)> = HashMap::new();
    for place in ranks {
        let bytes = match *place {
            StateMemory::Host => host_free,
            StateMemory::Device { free_bytes, .. } => free_bytes,
        };
        let entry = free.entry(device_of(place)).or_insert((bytes, 0));
        entry.0 = entry.0.min(bytes);
        entry.1 += 1;
    }
    Ok(ranks
        .iter()
        .map(|place| {
            let (measured, sharing) = free[&device_of(place)];
            RankBudget {
                bytes: (measured as f64 * fraction / sharing as f64) as u64,
                measured: Some(measured),
                fraction,
                sharing,
            }
        })
        .collect())
}

/// The device a rank's states live on (`None`: the host).
fn device_of(place: &StateMemory) -> Option<usize> {
    match *place {
        StateMemory::Host => None,
        StateMemory::Device { device, .. } => Some(device),
    }
}

fn place_name(place: &StateMemory) -> String {
    match place {
        StateMemory::Host => "the host".to_string(),
        StateMemory::Device { device, .. } => format!("device {device}"),
    }
}

fn prefix_note(prefix_bytes: u64) -> String {
    match prefix_bytes {
        0 => String::new(),
        bytes => format!(" less the prefix cache's {bytes}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::memory::{FixedFree, HostMemory};
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

    /// A host that must not be read (every rank on a device, or explicit bytes).
    struct Unread;

    impl FreeMemory for Unread {
        fn free_bytes(&self) -> Result<u64, String> {
            Err("the host was read".to_string())
        }
    }

    const GIB: u64 = 1 << 30;

    fn on(device: usize, free_gib: u64) -> StateMemory {
        StateMemory::Device {
            device,
            free_bytes: free_gib * GIB,
        }
    }

    fn bytes_of(budgets: Vec<RankBudget>) -> Vec<u64> {
        budgets.into_iter().map(|b| b.bytes).collect()
    }

    /// A fraction of each device's free memory (its smallest reading), split evenly among the
    /// ranks on it: two GPUs with different free memory, two ranks on each.
    #[test]
    fn a_fraction_of_each_devices_free_memory_is_split_among_its_ranks() {
        let ranks = [on(0, 80), on(1, 40), on(0, 80), on(1, 39)];
        let budgets = rank_budgets(MemoryConfig::Fraction(0.5), &ranks, &Unread).unwrap();
        assert_eq!(budgets[1].measured, Some(39 * GIB));
        assert_eq!(budgets[1].sharing, 2);
        let (gpu0, gpu1) = (20 * GIB, 39 * GIB / 4);
        assert_eq!(bytes_of(budgets), vec![gpu0, gpu1, gpu0, gpu1]);
        let alone = rank_budgets(MemoryConfig::Fraction(0.9), &[on(3, 10)], &Unread).unwrap();
        assert_eq!(bytes_of(alone), vec![(10.0 * 0.9 * GIB as f64) as u64]);
    }

    /// The host's memory is read once and shared by every rank there; explicit bytes read
    /// nothing.
    #[test]
    fn budgets_come_from_bytes_or_the_hosts_available_memory() {
        let host = [StateMemory::Host; 4];
        let bytes = rank_budgets(MemoryConfig::StateBytes(GIB), &host, &Unread).unwrap();
        assert_eq!(bytes_of(bytes), vec![GIB; 4]);
        let half = rank_budgets(MemoryConfig::Fraction(0.5), &host, &FixedFree(16 * GIB));
        assert_eq!(bytes_of(half.unwrap()), vec![2 * GIB; 4]);
        let err = rank_budgets(MemoryConfig::Fraction(0.5), &host, &Unread).unwrap_err();
        assert!(
            matches!(&err, EngineError::Config { field, message }
                if field == "memory.state_memory_fraction" && message.contains("the host was read")),
            "{err}"
        );
        let real = rank_budgets(MemoryConfig::Fraction(0.5), &host[..2], &HostMemory).unwrap();
        assert!(real[0].bytes > 0 && real[0].bytes <= HostMemory.free_bytes().unwrap() / 4 + 1);
    }

    fn plan(memory: MemoryConfig, prefix_bytes: u64) -> PoolPlan {
        PoolPlan {
            bytes: StateBytes::of(&ModelConfig::tiny_v41()),
            memory,
            prefix_bytes,
        }
    }

    /// Each rank's pool is its budget less its prefix cache's bytes, in blocks; a cache that
    /// leaves nothing names its field and the numbers.
    #[test]
    fn the_prefix_cache_comes_out_of_each_ranks_budget() {
        let block = plan(MemoryConfig::StateBytes(1), 0).bytes.block_bytes();
        // Device 0: 0.5 * 400 blocks / 2 ranks = 100 blocks; device 1: 0.5 * 200 = 100.
        let ranks = [
            StateMemory::Device {
                device: 0,
                free_bytes: 400 * block,
            },
            StateMemory::Device {
                device: 1,
                free_bytes: 200 * block,
            },
            StateMemory::Device {
                device: 0,
                free_bytes: 400 * block,
            },
        ];
        let cached = plan(MemoryConfig::Fraction(0.5), 40 * block);
        let blocks: Vec<usize> = (cached.pools(&ranks, &Unread).unwrap().iter())
            .map(|p| p.usage().total_blocks)
            .collect();
        assert_eq!(
            blocks,
            vec![60, 60, 60],
            "(100 - 40) blocks of state on every rank"
        );
        let uncached = plan(MemoryConfig::Fraction(0.5), 0)
            .pools(&ranks, &Unread)
            .unwrap();
        assert_eq!(uncached[1].usage().total_blocks, 100);
        let greedy = plan(MemoryConfig::Fraction(0.5), 100 * block);
        let err = greedy.pools(&ranks, &Unread).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, EngineError::Config { field, .. } if field == "prefix_cache.bytes_per_rank"),
            "{text}"
        );
        assert!(text.contains(&format!("{}", 100 * block)), "{text}");
        assert!(
            text.contains(&format!("{} bytes free over 2 ranks", 400 * block)),
            "{text}"
        );
    }

    /// A fraction that leaves a rank less than one sequence's blocks is refused, naming the
    /// field, the device and the numbers; explicit bytes are taken as given.
    #[test]
    fn a_fraction_too_small_for_one_sequence_is_refused() {
        let small = plan(MemoryConfig::Fraction(0.5), 0);
        let fits = small.bytes.ring_blocks() + 1;
        let free = fits as u64 * small.bytes.block_bytes();
        let ranks = [StateMemory::Device {
            device: 2,
            free_bytes: free,
        }];
        let err = small.pools(&ranks, &Unread).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, EngineError::Config { field, .. } if field == "memory.state_memory_fraction"),
            "{text}"
        );
        for part in [
            format!("0.5 of the {free} bytes free on device 2 over the 1 ranks"),
            format!("less than the {fits} blocks"),
        ] {
            assert!(text.contains(&part), "{part} in {text}");
        }
        let whole = plan(MemoryConfig::Fraction(1.0), 0).pools(&ranks, &Unread);
        assert_eq!(whole.unwrap()[0].usage().total_blocks, fits);
        let tiny = plan(MemoryConfig::StateBytes(1), 0).pools(&ranks, &Unread);
        assert_eq!(tiny.unwrap()[0].usage().total_blocks, 0);
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
