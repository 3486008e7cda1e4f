//! The scheduler's side of its rank's prefix cache: the index of the blocks the rank keeps
//! (`PrefixCache<()>`: keys, pins, LRU under the byte budget) and the rule that turns it into
//! plans. The rank's executor keeps the blocks themselves and does what the plans say, in
//! order: a new sequence attaches its hit before the step's work (`NewSeq::prefix`), the
//! stores and drops (`CacheOp`) run after it.
//!
//! - **Admission** ([`RankPrefixCache::hit`], [`RankPrefixCache::admit`], walking the chain
//!   the frontend computed, `RequestSpec::prefix_chain`): the longest chain of cached blocks
//!   that ends at or before the decoder start the `ReplayActor` planned (none without one; a V4
//!   model's hits resume instead and end before the prompt's last token) is attached when
//!   [`plan_hit`] gives a replay start after 0 (a resuming hit's end); the prefill then
//!   begins there: only the replayed and the new tokens are planned, so only they count
//!   against the step's token budget. The request pins its blocks until it finishes, is
//!   aborted or preempted ([`RankPrefixCache::release`]).
//! - **Stores** ([`RankPrefixCache::prefilled`], [`RankPrefixCache::finish_plan`]): every
//!   prompt block a planned prefill chunk completes is inserted at the end of the plan that
//!   completes it (the rank stores it after that step's work), evicting least recently used
//!   unpinned leaves; a request another one is still prefilling can hit the blocks its earlier
//!   chunks completed, never those of the plan being built (its attach runs before the work).
//!   A refused insert (no room) ends that request's stores.
//! - **Bytes** are the index's: one block is `PrefixGeometry::cached_block_bytes`, the same
//!   number the executor's block holds (entries) plus its tokens; they never exceed the budget.

use std::collections::HashMap;

use deepinfer_topology::{Backend, PrefixCacheConfig, PrefixReplay, ReplayConfig, RequestId};

use crate::error::EngineError;
use crate::messages::rank::{CacheOp, PrefixAttach};
use crate::prefix_cache::{BlockHash, HitRule, Inserted, PrefixCache, PrefixGeometry, plan_hit};

/// A rank's prefix-cache settings (from `[prefix_cache]` and the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixSettings {
    pub budget_bytes: u64,
    pub geometry: PrefixGeometry,
    /// Tokens a hit replays (`replay.decoder_keep_tokens`, or the exact halo; 0 when it
    /// resumes).
    pub replay_tokens: usize,
}

impl PrefixSettings {
    /// The settings of an engine whose executors (`executor` on `backend`, keeping blocks of
    /// `geometry` when `Some`) serve the topology's `[prefix_cache]` with its `[replay]`; `None`
    /// when the cache is off. Errors name the field: a cache the executors cannot keep (a V4
    /// model's off the CPU), an exact replay the model has none of, a bounded replay of a model
    /// whose hits resume (V4), a budget below one block.
    pub fn for_engine(
        cache: &PrefixCacheConfig,
        replay: &ReplayConfig,
        geometry: Option<PrefixGeometry>,
        (executor, backend): (&str, &Backend),
    ) -> Result<Option<PrefixSettings>, EngineError> {
        let Some(budget_bytes) = cache.bytes_per_rank else {
            return Ok(None);
        };
        let error = |field: &str, message: String| EngineError::Config {
            field: field.into(),
            message,
        };
        let geometry = geometry.ok_or_else(|| {
            error(
                "prefix_cache.bytes_per_rank",
                format!(
                    "the executors ({executor}) keep no prefix-cache blocks (a model's do); \
                     set it to 0"
                ),
            )
        })?;
        if geometry.hits == HitRule::Resume && *backend != Backend::Cpu {
            return Err(error(
                "prefix_cache.bytes_per_rank",
                "a V4-family model's prefix cache runs on the CPU backend only (its blocks' \
                 rows are not checked on CUDA yet); set it to 0"
                    .to_string(),
            ));
        }
        if budget_bytes < geometry.cached_block_bytes() {
            return Err(error(
                "prefix_cache.bytes_per_rank",
                format!(
                    "{budget_bytes} bytes hold no block of {} tokens ({} bytes)",
                    geometry.block_tokens,
                    geometry.cached_block_bytes()
                ),
            ));
        }
        let replay_tokens = match (geometry.hits, cache.replay) {
            (HitRule::Replay { min_replay, .. }, PrefixReplay::Bounded) => replay
                .decoder_keep_tokens
                .map(|keep| (keep as usize).max(min_replay))
                .ok_or("\"bounded\" replays replay.decoder_keep_tokens, which is off".to_string()),
            (
                HitRule::Replay {
                    min_replay,
                    exact_replay,
                },
                PrefixReplay::Exact,
            ) => exact_replay.map(|exact| exact.max(min_replay)).ok_or(
                "the model has no decoder boundary (no ratio-1 layer), so no exact replay; use \
                 \"bounded\""
                    .to_string(),
            ),
            (HitRule::Resume, PrefixReplay::Exact) => Ok(0),
            (HitRule::Resume, PrefixReplay::Bounded) => Err(
                "a V4-family model's blocks keep the rings, so a hit replays nothing and is \
                 exact: set it to \"exact\""
                    .to_string(),
            ),
        }
        .map_err(|message| error("prefix_cache.replay", message))?;
        Ok(Some(PrefixSettings {
            budget_bytes,
            geometry,
            replay_tokens,
        }))
    }

    /// The most prompt tokens a hit may cover: up to the decoder start (none without one) when
    /// a hit replays, up to before the last token when it resumes.
    fn hit_limit(&self, prompt: &[u32], decoder_from: Option<u32>) -> usize {
        match self.geometry.hits {
            HitRule::Replay { .. } => decoder_from.map_or(0, |from| from as usize),
            HitRule::Resume => prompt.len().saturating_sub(1),
        }
    }
}

/// What a hit would attach now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hit {
    /// Cached tokens attached (whole blocks); 0 on a miss.
    pub cached: usize,
    /// Where the prefill starts (0 on a miss).
    pub replay_from: usize,
}

/// Hit counters of one rank (what the metrics report).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCounters {
    /// Admissions looked up, and those served from a hit.
    pub requests: u64,
    pub hit_requests: u64,
    /// Prompt tokens of the admissions, and the cached tokens their hits attached.
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    /// Of the hit tokens, those not fed at all (before the replay start).
    pub skipped_tokens: u64,
}

#[derive(Debug)]
struct Tracked {
    prompt: Vec<u32>,
    chain: Vec<BlockHash>,
    pinned: Vec<BlockHash>,
    /// Blocks of the prompt known cached or already planned for a store.
    covered: usize,
    /// An insert was refused: no more stores for this request.
    stopped: bool,
}

/// The scheduler's index of one rank's prefix cache ([module docs](self)).
#[derive(Debug)]
pub struct RankPrefixCache {
    settings: PrefixSettings,
    index: PrefixCache<()>,
    requests: HashMap<RequestId, Tracked>,
    /// (request, block index) completed by the plan being built.
    completed: Vec<(RequestId, usize)>,
    counters: PrefixCounters,
}

impl RankPrefixCache {
    pub fn new(settings: PrefixSettings) -> RankPrefixCache {
        RankPrefixCache {
            index: PrefixCache::new(settings.geometry.block_tokens, settings.budget_bytes),
            settings,
            requests: HashMap::new(),
            completed: Vec::new(),
            counters: PrefixCounters::default(),
        }
    }

    /// What admitting `prompt` (its blocks' keys `chain`, `RequestSpec::prefix_chain`; decoder
    /// start `decoder_from`) would attach now; no side effect.
    pub fn hit(&self, prompt: &[u32], chain: &[BlockHash], decoder_from: Option<u32>) -> Hit {
        let limit = self.settings.hit_limit(prompt, decoder_from);
        let cached = self.index.peek(chain, prompt, limit) * self.index.block_tokens();
        self.adopt(cached)
    }

    fn adopt(&self, cached: usize) -> Hit {
        let s = &self.settings;
        match plan_hit(cached, s.replay_tokens, s.geometry.align) {
            Some(replay_from) => Hit {
                cached,
                replay_from,
            },
            None => Hit::default(),
        }
    }

    /// Admits `id`: looks its prompt up (counted), pins the hit's blocks and returns the
    /// attach, or `None` on a miss. The request's blocks are stored as its prefill completes
    /// them.
    pub fn admit(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        chain: &[BlockHash],
        decoder_from: Option<u32>,
    ) -> Option<PrefixAttach> {
        self.release(id);
        let limit = self.settings.hit_limit(prompt, decoder_from);
        let found = self.index.lookup(chain, prompt, limit);
        let hit = self.adopt(found.len() * self.index.block_tokens());
        let pinned: Vec<BlockHash> = match hit.replay_from {
            0 => Vec::new(),
            _ => found.iter().map(|(hash, _)| *hash).collect(),
        };
        self.index.acquire(&pinned);
        self.counters.requests += 1;
        self.counters.prompt_tokens += prompt.len() as u64;
        if hit.replay_from > 0 {
            self.counters.hit_requests += 1;
            self.counters.hit_tokens += hit.cached as u64;
            self.counters.skipped_tokens += hit.replay_from as u64;
        }
        let attach = (hit.replay_from > 0).then(|| PrefixAttach {
            blocks: pinned.clone(),
            replay_from: hit.replay_from,
        });
        self.requests.insert(
            id,
            Tracked {
                chain: chain.to_vec(),
                prompt: prompt.to_vec(),
                covered: pinned.len(),
                pinned,
                stopped: false,
            },
        );
        attach
    }

    /// `id`'s planned prefill reaches `prefilled` tokens: the prompt blocks this completes are
    /// stored at the end of this plan.
    pub fn prefilled(&mut self, id: RequestId, prefilled: usize) {
        let Some(t) = self.requests.get_mut(&id) else {
            return;
        };
        let complete = (prefilled / self.settings.geometry.block_tokens).min(t.chain.len());
        for block in t.covered..complete {
            self.completed.push((id, block));
        }
        t.covered = t.covered.max(complete);
    }

    /// Inserts the blocks completed by the plan being built; returns its cache ops in order
    /// (each insert's evictions before its store).
    pub fn finish_plan(&mut self) -> Vec<CacheOp> {
        let n = self.settings.geometry.block_tokens;
        let bytes = self.settings.geometry.block_bytes;
        let mut ops = Vec::new();
        for (id, block) in std::mem::take(&mut self.completed) {
            let Some(t) = self.requests.get_mut(&id).filter(|t| !t.stopped) else {
                continue;
            };
            let hash = t.chain[block];
            let parent = block.checked_sub(1).map(|p| t.chain[p]);
            let tokens = &t.prompt[block * n..(block + 1) * n];
            let (inserted, evicted) = self.index.insert(hash, parent, tokens, (), bytes);
            ops.extend(evicted.into_iter().map(CacheOp::Drop));
            match inserted {
                Inserted::Cached => ops.push(CacheOp::Store {
                    id,
                    hash,
                    start: block * n,
                }),
                Inserted::AlreadyCached => {}
                Inserted::Refused => t.stopped = true,
            }
        }
        ops
    }

    /// `id` ended, was aborted or preempted: its pins go (its blocks stay cached).
    pub fn release(&mut self, id: RequestId) {
        if let Some(t) = self.requests.remove(&id) {
            self.index.release(&t.pinned);
        }
        self.completed.retain(|(of, _)| *of != id);
    }

    /// The rank is lost with every block it kept: the index starts empty.
    pub fn clear(&mut self) {
        self.index = PrefixCache::new(
            self.settings.geometry.block_tokens,
            self.settings.budget_bytes,
        );
        self.requests.clear();
        self.completed.clear();
    }

    pub fn counters(&self) -> PrefixCounters {
        self.counters
    }

    /// Bytes and blocks cached now, and evictions so far.
    pub fn usage(&self) -> (u64, usize, u64) {
        let stats = self.index.stats();
        (stats.bytes, stats.blocks, stats.evictions)
    }

    pub fn budget_bytes(&self) -> u64 {
        self.settings.budget_bytes
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::prefix_cache::{ENGINE_SALT, block_chain};

    /// 4-token blocks of 10 bytes (26 with their tokens), replays of 2 tokens aligned to 2.
    pub(crate) fn settings(budget_blocks: u64) -> PrefixSettings {
        let geometry = PrefixGeometry {
            block_tokens: 4,
            block_bytes: 10,
            align: 2,
            hits: HitRule::Replay {
                min_replay: 2,
                exact_replay: None,
            },
        };
        PrefixSettings {
            budget_bytes: budget_blocks * geometry.cached_block_bytes(),
            geometry,
            replay_tokens: 2,
        }
    }

    fn prompt(n: u32, seed: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + seed).collect()
    }

    /// The keys of `prompt`'s blocks of 4 (what the frontend puts in `RequestSpec::prefix_chain`).
    pub(crate) fn keys(prompt: &[u32]) -> Vec<BlockHash> {
        block_chain(4, ENGINE_SALT, prompt)
    }

    impl RankPrefixCache {
        fn hit_of(&self, prompt: &[u32], decoder_from: Option<u32>) -> Hit {
            self.hit(prompt, &keys(prompt), decoder_from)
        }

        fn admit_of(
            &mut self,
            id: RequestId,
            prompt: &[u32],
            decoder_from: Option<u32>,
        ) -> Option<PrefixAttach> {
            self.admit(id, prompt, &keys(prompt), decoder_from)
        }
    }

    /// A writer's blocks are stored plan by plan as its chunks complete them; a reader admitted
    /// meanwhile hits the blocks of the earlier plans only, replays the bounded suffix, and
    /// pins what it attached until it is released.
    #[test]
    fn stores_follow_the_chunks_and_hits_see_only_earlier_plans() {
        let mut cache = RankPrefixCache::new(settings(100));
        let (a, b) = (RequestId(1), RequestId(2));
        let shared = prompt(16, 1);
        assert_eq!(cache.admit_of(a, &shared, Some(14)), None, "an empty cache");
        cache.prefilled(a, 6);
        let ops = cache.finish_plan();
        assert!(matches!(ops.as_slice(), [CacheOp::Store { id, start: 0, .. }] if *id == a));
        cache.prefilled(a, 12);
        // B is admitted in the plan that completes A's blocks 1 and 2: it sees block 0 only.
        let reader = [&shared[..], &prompt(8, 9)].concat();
        assert_eq!(
            cache.hit_of(&reader, Some(20)),
            Hit {
                cached: 4,
                replay_from: 2
            }
        );
        let attach = cache.admit_of(b, &reader, Some(20)).expect("a hit");
        assert_eq!((attach.blocks.len(), attach.replay_from), (1, 2));
        assert_eq!(cache.finish_plan().len(), 2, "A's blocks 1 and 2");
        cache.prefilled(b, 12);
        assert!(cache.finish_plan().is_empty(), "B's blocks are A's");
        let c = cache.counters();
        assert_eq!((c.requests, c.hit_requests, c.hit_tokens), (2, 1, 4));
        assert_eq!(cache.usage().1, 3);
        // The decoder start bounds the hit; without one nothing is attached.
        assert_eq!(cache.hit_of(&reader, Some(9)).cached, 8);
        assert_eq!(cache.hit_of(&reader, None), Hit::default());
    }

    #[test]
    fn engine_settings_refuse_what_the_executors_cannot_do_naming_the_field() {
        let geometry = settings(1).geometry;
        let replay = ReplayConfig {
            decoder_keep_tokens: Some(140),
            max_backtracking: 6,
        };
        let cache = |bytes, replay| PrefixCacheConfig {
            bytes_per_rank: bytes,
            replay,
        };
        let field = |r: Result<Option<PrefixSettings>, EngineError>| match r {
            Err(EngineError::Config { field, message }) => format!("{field}: {message}"),
            other => panic!("expected a config error, got {other:?}"),
        };
        // The settings for the CPU's executors ("x").
        let on_cpu = |config: &PrefixCacheConfig, geometry| {
            PrefixSettings::for_engine(config, &replay, geometry, ("x", &Backend::Cpu))
        };
        let on = cache(Some(1000), PrefixReplay::Bounded);
        let off = on_cpu(&cache(None, PrefixReplay::Exact), None);
        assert_eq!(off.expect("off"), None);
        let bounded = on_cpu(&on, Some(geometry));
        assert_eq!(bounded.expect("valid").map(|s| s.replay_tokens), Some(140));
        let fake = field(PrefixSettings::for_engine(
            &on,
            &replay,
            None,
            ("fake", &Backend::Cpu),
        ));
        assert!(fake.starts_with("prefix_cache.bytes_per_rank: the executors (fake)"));
        let small = cache(Some(10), PrefixReplay::Bounded);
        let small = field(on_cpu(&small, Some(geometry)));
        assert!(
            small.contains("10 bytes hold no block of 4 tokens (26 bytes)"),
            "{small}"
        );
        let exact = cache(Some(1000), PrefixReplay::Exact);
        let exact = field(on_cpu(&exact, Some(geometry)));
        assert!(exact.starts_with("prefix_cache.replay: the model has no decoder boundary"));
        let with_halo = PrefixGeometry {
            hits: HitRule::Replay {
                min_replay: 2,
                exact_replay: Some(112),
            },
            ..geometry
        };
        let exact = cache(Some(1000), PrefixReplay::Exact);
        let exact = on_cpu(&exact, Some(with_halo));
        assert_eq!(exact.expect("valid").map(|s| s.replay_tokens), Some(112));
        // A V4-family model's hits resume: exact, nothing replayed; "bounded" is refused.
        let resume = Some(PrefixGeometry {
            hits: HitRule::Resume,
            ..geometry
        });
        let exact = cache(Some(1000), PrefixReplay::Exact);
        let exact = on_cpu(&exact, resume);
        assert_eq!(exact.expect("valid").map(|s| s.replay_tokens), Some(0));
        let bounded = field(on_cpu(&on, resume));
        let gpu = Backend::Cuda {
            arch: deepinfer_topology::Arch::Sm90,
            numerics: deepinfer_topology::Numerics::Exact,
        };
        let exact = cache(Some(1000), PrefixReplay::Exact);
        let cuda = field(PrefixSettings::for_engine(
            &exact,
            &replay,
            resume,
            ("x", &gpu),
        ));
        assert!(
            cuda.starts_with(
                "prefix_cache.bytes_per_rank: a V4-family model's prefix cache runs on the CPU"
            ),
            "{cuda}"
        );
        assert!(
            bounded.starts_with("prefix_cache.replay: a V4-family model's blocks keep the rings"),
            "{bounded}"
        );
    }

    /// A resuming hit (V4 family) needs no decoder start: it covers whole blocks up to before
    /// the prompt's last token and the prefill starts at its end.
    #[test]
    fn a_resuming_hit_covers_the_prompt_up_to_its_last_token() {
        let mut settings = settings(100);
        settings.geometry.hits = HitRule::Resume;
        settings.replay_tokens = 0;
        let mut cache = RankPrefixCache::new(settings);
        let shared = prompt(16, 1);
        assert_eq!(cache.admit_of(RequestId(1), &shared, None), None);
        cache.prefilled(RequestId(1), 16);
        assert_eq!(cache.finish_plan().len(), 4, "the writer's 4 blocks");
        let hit = |cached| Hit {
            cached,
            replay_from: cached,
        };
        assert_eq!(
            cache.hit_of(&shared, None),
            hit(12),
            "the last token is computed"
        );
        assert_eq!(cache.hit_of(&[&shared[..], &[7]].concat(), None), hit(16));
        assert_eq!(cache.hit_of(&shared[..11], None), hit(8));
        let attach = cache
            .admit_of(RequestId(2), &shared[..9], None)
            .expect("a hit");
        assert_eq!((attach.blocks.len(), attach.replay_from), (2, 8));
    }

    /// Under a budget of two blocks, stores evict unpinned least recently used leaves and the
    /// drops come before the store that needed the room; a pinned chain stays; the bytes never
    /// exceed the budget.
    #[test]
    fn stores_evict_unpinned_leaves_within_the_budget() {
        let mut cache = RankPrefixCache::new(settings(2));
        let budget = cache.budget_bytes();
        let mut stores = 0;
        for seed in 0..6 {
            let id = RequestId(seed);
            cache.admit_of(id, &prompt(8, 100 * seed as u32), Some(8));
            cache.prefilled(id, 8);
            let ops = cache.finish_plan();
            stores += ops
                .iter()
                .filter(|op| matches!(op, CacheOp::Store { .. }))
                .count();
            if let Some(CacheOp::Store { .. }) = ops.first()
                && seed > 0
            {
                panic!("an eviction precedes the first store of a full cache: {ops:?}");
            }
            assert!(cache.usage().0 <= budget);
            cache.release(id);
        }
        assert_eq!(cache.usage().1, 2);
        assert_eq!(stores, 12);
        assert_eq!(cache.usage().2, 10);
        // A pinned hit survives later stores; its request's own later blocks are refused.
        let kept = prompt(8, 500);
        let pinned = RequestId(10);
        let attach = cache.admit_of(pinned, &[&kept[..], &[1, 2, 3, 4]].concat(), Some(8));
        assert_eq!(attach.map(|a| a.blocks.len()), Some(2));
        let other = RequestId(11);
        cache.admit_of(other, &prompt(8, 900), Some(8));
        cache.prefilled(other, 8);
        assert!(
            cache.finish_plan().is_empty(),
            "no room: refused, nothing evicted"
        );
        assert_eq!(cache.hit_of(&kept, Some(8)).cached, 8);
    }

    /// The scheduler over a prefix cache, playing the rank's side of the protocol.
    mod scheduled {
        use std::collections::HashSet;

        use deepinfer_topology::DpRank;

        use super::*;
        use crate::messages::rank::{SeqInput, StepOutput, StepPlan};
        use crate::messages::request::RequestSpec;
        use crate::sampling::SamplingParams;
        use crate::scheduler::state::tests::output_for;
        use crate::scheduler::state::{PREFER_HIT_WINDOW, SchedulerLimits, SchedulerState};

        fn scheduler(budget_blocks: u64, running: usize) -> SchedulerState {
            let limits = SchedulerLimits {
                max_batched_tokens: 64,
                max_running: running,
                prefill_chunk_tokens: 8,
                overlap_depth: 1,
                context_parallel: None,
            };
            SchedulerState::new(DpRank(0), limits)
                .with_prefix_cache(RankPrefixCache::new(settings(budget_blocks)))
        }

        fn submit(s: &mut SchedulerState, id: u64, prompt: Vec<u32>) {
            let decoder_from = Some(prompt.len() as u32 - 2);
            let spec = RequestSpec {
                id: RequestId(id),
                prefix_chain: keys(&prompt),
                prompt,
                sampling: SamplingParams::greedy(),
                max_tokens: 2,
                stop_token_ids: Vec::new(),
                grammar: None,
                logprobs: None,
            };
            s.submit_with_replay(spec, decoder_from).expect("submitted");
        }

        /// The rank's side: the blocks it keeps, checked against the plan's attaches (before the
        /// work) and cache ops (after it); every producing entry samples token 3.
        fn execute(plan: &StepPlan, kept: &mut HashSet<BlockHash>) -> StepOutput {
            for new in &plan.new_seqs {
                for block in new.prefix.iter().flat_map(|p| &p.blocks) {
                    assert!(
                        kept.contains(block),
                        "{:?} attaches a block not kept",
                        new.id
                    );
                }
            }
            for op in &plan.cache_ops {
                match op {
                    CacheOp::Store { hash, .. } => assert!(kept.insert(*hash), "stored twice"),
                    CacheOp::Drop(hash) => assert!(kept.remove(hash), "dropped unkept"),
                }
            }
            output_for(plan, 3)
        }

        /// Runs every request to its end; returns the plans.
        fn drain(s: &mut SchedulerState, kept: &mut HashSet<BlockHash>) -> Vec<StepPlan> {
            let mut plans = Vec::new();
            while let Some(plan) = s.build_plan() {
                let stats = s.stats().prefix;
                assert!(stats.cached_bytes <= stats.budget_bytes, "over budget");
                let block = settings(1).geometry.cached_block_bytes();
                assert_eq!(
                    stats.cached_bytes,
                    kept.len() as u64 * block + {
                        // This plan's stores and drops are not on the rank yet.
                        let stores = plan
                            .cache_ops
                            .iter()
                            .filter(|op| matches!(op, CacheOp::Store { .. }))
                            .count() as i64;
                        let drops = plan.cache_ops.len() as i64 - stores;
                        ((stores - drops) * block as i64) as u64
                    }
                );
                let output = execute(&plan, kept);
                s.on_step_done(&output);
                plans.push(plan);
                assert!(plans.len() < 1000, "never ends");
            }
            plans
        }

        /// A hit behind a miss is admitted first, attaches the blocks before the decoder start
        /// and is planned from its replay start: only its replayed and new tokens count.
        #[test]
        fn a_hit_is_admitted_first_and_prefills_only_its_uncached_tokens() {
            let mut s = scheduler(100, 4);
            let mut kept = HashSet::new();
            let shared = prompt(16, 1);
            submit(&mut s, 1, shared.clone());
            let plans = drain(&mut s, &mut kept);
            assert_eq!(kept.len(), 4, "the writer's 4 blocks");
            assert!(plans[0].new_seqs[0].prefix.is_none());
            submit(&mut s, 2, prompt(16, 50));
            submit(&mut s, 3, [&shared[..12], &prompt(4, 90)].concat());
            let plan = s.build_plan().expect("a plan");
            let ids: Vec<u64> = plan.new_seqs.iter().map(|n| n.id.get()).collect();
            assert_eq!(ids, [3, 2], "the hit first");
            let attach = plan.new_seqs[0].prefix.clone().expect("a hit");
            // Decoder start 14: 3 blocks; replay 2 tokens from 12 -> 10.
            assert_eq!((attach.blocks.len(), attach.replay_from), (3, 10));
            let chunk = |id| {
                plan.work.iter().find_map(|w| match &w.input {
                    SeqInput::Prefill { tokens, .. } if w.id == RequestId(id) => Some(tokens.len()),
                    _ => None,
                })
            };
            assert_eq!((chunk(3), chunk(2)), (Some(6), Some(8)));
            assert_eq!(plan.token_count(), 14);
            let stats = s.stats().prefix.counters;
            assert_eq!(
                (stats.hit_requests, stats.hit_tokens, stats.skipped_tokens),
                (1, 12, 10)
            );
        }

        /// Hits are admitted before a waiting miss at most `PREFER_HIT_WINDOW` times.
        #[test]
        fn the_head_is_passed_over_a_bounded_number_of_times() {
            let mut s = scheduler(100, 1);
            let mut kept = HashSet::new();
            let shared = prompt(16, 1);
            submit(&mut s, 0, shared.clone());
            drain(&mut s, &mut kept);
            submit(&mut s, 100, prompt(16, 70));
            for id in 1..=PREFER_HIT_WINDOW as u64 + 1 {
                submit(
                    &mut s,
                    id,
                    [&shared[..12], &prompt(4, 90 + id as u32)].concat(),
                );
            }
            let order: Vec<u64> = drain(&mut s, &mut kept)
                .iter()
                .flat_map(|p| p.new_seqs.iter().map(|n| n.id.get()))
                .collect();
            let mut expected: Vec<u64> = (1..=PREFER_HIT_WINDOW as u64).collect();
            expected.extend([100, PREFER_HIT_WINDOW as u64 + 1]);
            assert_eq!(order, expected);
        }

        /// Many requests over a few shared prefixes under a 6-block budget, some aborted: the
        /// rank's blocks follow the plans (no attach of a block it lacks, no double store, no
        /// drop of an unkept block), the bytes stay within the budget at every plan, and once
        /// every request is gone no block is pinned (a new prompt can evict them all).
        #[test]
        fn a_tiny_budget_keeps_the_protocol_and_the_bound_at_every_plan() {
            let mut s = scheduler(6, 3);
            let mut kept = HashSet::new();
            let shared: Vec<Vec<u32>> = (0..2).map(|p| prompt(8, 1000 * p)).collect();
            for id in 0..40u64 {
                let prefix = match id % 3 {
                    0 => prompt(8, 9000 + id as u32),
                    k => shared[k as usize - 1].clone(),
                };
                let tail = prompt(2 + (id % 7) as u32, 5000 + id as u32);
                submit(&mut s, id, [&prefix[..], &tail].concat());
                if let Some(plan) = s.build_plan() {
                    let output = execute(&plan, &mut kept);
                    s.on_step_done(&output);
                }
                if id % 5 == 0 {
                    s.abort(RequestId(id));
                }
            }
            drain(&mut s, &mut kept);
            let stats = s.stats().prefix;
            assert!(stats.counters.hit_requests > 0, "{stats:?}");
            assert!(stats.evictions > 0, "{stats:?}");
            // A prompt of the whole budget evicts every earlier block: none is pinned any more.
            let last = prompt(24, 77_000);
            submit(&mut s, 99, last.clone());
            drain(&mut s, &mut kept);
            submit(&mut s, 100, [&last[..], &[1, 2]].concat());
            let plan = s.build_plan().expect("a plan");
            let attach = plan.new_seqs[0].prefix.as_ref().expect("a hit");
            assert_eq!(attach.blocks.len(), 6);
        }
    }
}
