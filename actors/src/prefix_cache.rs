//! The prefix cache of one DP rank: the compressed KV of shared prompt prefixes, kept by token
//! block, so that a request whose prompt starts with a cached prefix replays only a bounded
//! suffix of it instead of prefilling it whole.
//!
//! Design:
//! - **Blocks.** A block is `StateBytes::block_tokens` tokens (derived from the config: a multiple
//!   of 64 and of every compression ratio; 64 for V4.1's ratios 2 and 1, 128 for V4-Flash's 4 and
//!   128), so a block holds whole compressed entries and index keys of every KV / index source
//!   and never ends inside a compression group: a prompt that diverges inside one hits the blocks
//!   before it and prefills the group's tokens again.
//! - **Keys.** Block `i` of a prompt is keyed by a hash chain `h_i = H(h_{i-1}, salt, tokens of
//!   block i)`; `salt` names everything else the state depends on (the model and its adapter).
//!   An entry also keeps its tokens and its parent's key, and a lookup compares both, so a hash
//!   collision is a miss, never a wrong hit. In the engine a prompt's chain ([`block_chain`]) is
//!   computed once, by the frontend, and travels with the request (`RequestSpec::prefix_chain`)
//!   to the affinity mirrors and the rank's index.
//! - **V4.1: what a block holds** ([`PrefixBlock`]): every KV source's compressed-KV entries and index
//!   keys of its groups (the inputs of the indexer and of the candidate pool, which is recomputed
//!   per query from them) and the Engram history of its positions. **What a hit rebuilds:** the
//!   window rings of every layer, the compressor tails, the decoder and the DSpark rings, by
//!   replaying the last `replay_tokens` tokens of the hit ([`plan_hit`]; the ReplayActor's rule,
//!   `window + max_backtracking` at least, 140 by default) through the model. The replayed
//!   positions' windows read nothing below the replay start and the attached entries are never
//!   rewritten.
//! - **V4 family** (`v4::PrefixBlock`, [`HitRule::Resume`]; `replay = "exact"` required): no
//!   decoder bounded replay, and a window layer's output depends on the whole past through the
//!   layers below it, so a bounded replay would never be exact. A block keeps, besides its
//!   groups' entries (attention and indexer), the rows of every ring the next token reads once
//!   the sequence ends at the block's end (the last `window` window rows of every layer, the
//!   previous group of an overlapping (CSA) compressor, the MTP block's rows, the DSpark
//!   context): `StateBytes::prefix_block_bytes`. A hit covers the prompt up to before its last
//!   token and resumes at its end, replaying nothing: bitwise a cold prefill. The rings drop
//!   those rows in the forward that computes them, so the step that completes a block holds
//!   them (`RankExecutor::prepare_prefix_store`) until the block is taken after it.
//! - **Exact and approximate parts (V4.1).** The attached entries are bitwise the ones the sequence that
//!   wrote them computed. A hit whose replay covers [`exact_replay_tokens`] (the layers below the
//!   decoder boundary times their window) is bitwise a cold prefill. A shorter replay (the
//!   ReplayActor's `keep`, 140 by default) is an approximation like decoder bounded replay: the
//!   replayed windows saw a truncated past, so the rows after the hit, and the compressed entries
//!   the hit's own prefill appends, drift (`tests/tests/prefix_cache.rs` bounds it by the rule of
//!   `tests/tests/replay_logits.rs`), and the blocks such a request inserts carry that drift.
//! - **Sharing and eviction.** A request pins the blocks it attaches ([`PrefixCache::acquire`],
//!   [`PrefixCache::release`]); the blocks' bytes (entries plus kept tokens) stay within the
//!   cache's byte budget: an insert evicts the least recently used unpinned block that no cached
//!   block continues (a leaf, so a chain is never cut in the middle), or is refused.
//! - **Misses** fall back block by block: a hit is the longest chain of cached blocks that ends at
//!   or before the decoder's kept suffix (so the decoder's rows follow a full replay), the rest of
//!   the prompt is prefilled, and the blocks it completes are inserted ([`prefill`]).
//! - **In the engine** (`[prefix_cache]`): each rank's scheduler keeps the index (a
//!   `PrefixCache<()>`: keys, pins, LRU, bytes; `scheduler::prefix`) and its executor keeps the
//!   blocks (`RankExecutor::store_prefix_block`), the plans carrying the attaches, stores and
//!   drops in order; the frontend keeps a mirror per rank for placement (`frontend::affinity`).
//!   [`PrefixGeometry`] is what they need of the model.
//!   An attach copies the block's rows into the sequence (the state pool counts them there);
//!   the cache's own budget comes out of the rank's state budget.
//! - **Not yet:** not run on CUDA (the blocks are backend tensors, so it goes through the
//!   `Backend` trait, untested there; a V4-family model's cache is refused there); the
//!   standalone [`prefill`] is V4.1's.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use deepinfer_model::config::{ModelConfig, ModelFamily};
use deepinfer_model::error::ModelError;
use deepinfer_model::state_bytes::StateBytes;
use deepinfer_model::v41::MAX_BACKTRACK;
use deepinfer_model::{
    EntryOutput, LogitsWanted, Model, PrefixBlock, SequenceState, StepEntry, StepOptions,
};

/// The salt of an engine's caches: one model per engine, no adapters, so every prompt shares it.
pub const ENGINE_SALT: u64 = 0x7072_6566_6978;

/// What a rank's prefix cache needs of the model: block size and bytes, the replay alignment
/// and how a hit rebuilds what the blocks do not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixGeometry {
    /// Tokens per block (`StateBytes::block_tokens`).
    pub block_tokens: usize,
    /// Bytes of one block (what `PrefixBlock::held_bytes` holds, at most), without its kept
    /// tokens: `StateBytes::block_bytes` (V4.1), `StateBytes::prefix_block_bytes` (V4).
    pub block_bytes: u64,
    /// A hit ends or replays from a multiple of this (every compression ratio).
    pub align: usize,
    pub hits: HitRule,
}

/// How a hit rebuilds the state its blocks do not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitRule {
    /// V4.1: the blocks keep the caches; a hit ends at or before the decoder start and replays
    /// a suffix of it: at least `min_replay` tokens (window + max backtracking), bitwise from
    /// `exact_replay` on ([`exact_replay_tokens`]; `None` without a decoder boundary).
    Replay {
        min_replay: usize,
        exact_replay: Option<usize>,
    },
    /// V4 family: the blocks keep the rings' rows the next token reads too
    /// (`v4::PrefixBlock`); a hit covers the prompt up to before its last token and resumes at
    /// its end, bitwise a cold prefill, replaying nothing.
    Resume,
}

impl PrefixGeometry {
    pub fn of(cfg: &ModelConfig) -> PrefixGeometry {
        let bytes = StateBytes::of(cfg);
        let (block_bytes, hits) = match cfg.family {
            ModelFamily::V41 => (
                bytes.block_bytes(),
                HitRule::Replay {
                    min_replay: cfg.window_size + MAX_BACKTRACK,
                    exact_replay: exact_replay_tokens(cfg),
                },
            ),
            ModelFamily::V4 => (bytes.prefix_block_bytes(), HitRule::Resume),
        };
        PrefixGeometry {
            block_tokens: bytes.block_tokens,
            block_bytes,
            align: alignment(cfg),
            hits,
        }
    }

    /// Bytes a cache accounts for one block: its entries and its kept tokens.
    pub fn cached_block_bytes(&self) -> u64 {
        self.block_bytes + (self.block_tokens * std::mem::size_of::<u32>()) as u64
    }
}

/// The key of a block: the hash chain over the blocks up to it ([module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// The keys of every complete `block_tokens`-token block of `tokens` under `salt`, in order: a
/// prompt's chain is computed once (by the frontend, carried by its `RequestSpec`) and every
/// lookup walks it.
pub fn block_chain(block_tokens: usize, salt: u64, tokens: &[u32]) -> Vec<BlockHash> {
    let mut parent = salt;
    tokens
        .chunks_exact(block_tokens.max(1))
        .map(|block| {
            let mut h = DefaultHasher::new();
            (parent, salt, block).hash(&mut h);
            parent = h.finish();
            BlockHash(parent)
        })
        .collect()
}

#[derive(Debug)]
struct Entry<B> {
    block: Arc<B>,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    bytes: u64,
    /// Requests that pinned it.
    refs: usize,
    /// Cached blocks whose parent it is.
    children: usize,
    last_used: u64,
}

/// Counters of a cache, for stats and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Lookups, and those that found at least one block.
    pub lookups: u64,
    pub hit_lookups: u64,
    /// Tokens looked up, and those found cached.
    pub looked_up_tokens: u64,
    pub hit_tokens: u64,
    /// Blocks and bytes cached now.
    pub blocks: usize,
    pub bytes: u64,
    pub evictions: u64,
}

/// What [`PrefixCache::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Cached,
    /// The block was cached already (now the most recently used).
    AlreadyCached,
    /// Not cached: its parent is not cached, or the budget has no room after evicting every
    /// evictable block.
    Refused,
}

/// One rank's prefix cache of `B` blocks under a byte budget ([module docs](self)).
#[derive(Debug)]
pub struct PrefixCache<B> {
    block_tokens: usize,
    budget: u64,
    entries: HashMap<BlockHash, Entry<B>>,
    clock: u64,
    stats: CacheStats,
}

impl<B> PrefixCache<B> {
    /// An empty cache of `block_tokens`-token blocks holding at most `budget_bytes`.
    pub fn new(block_tokens: usize, budget_bytes: u64) -> PrefixCache<B> {
        PrefixCache {
            block_tokens: block_tokens.max(1),
            budget: budget_bytes,
            entries: HashMap::new(),
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The longest chain of cached blocks that starts `tokens` (whose blocks' keys are `chain`,
    /// [`block_chain`]) and covers at most `limit` tokens: each block's key and its cached block,
    /// marked as used now. Counts a lookup of `limit` tokens.
    pub fn lookup(
        &mut self,
        chain: &[BlockHash],
        tokens: &[u32],
        limit: usize,
    ) -> Vec<(BlockHash, Arc<B>)> {
        let limit = limit.min(tokens.len());
        let found = self.find(chain, tokens, limit);
        self.touch(found.iter().map(|(hash, _)| *hash));
        self.stats.lookups += 1;
        self.stats.looked_up_tokens += limit as u64;
        if !found.is_empty() {
            self.stats.hit_lookups += 1;
            self.stats.hit_tokens += (found.len() * self.block_tokens) as u64;
        }
        found
    }

    /// How many blocks [`PrefixCache::lookup`] would find now, without using or counting them.
    pub fn peek(&self, chain: &[BlockHash], tokens: &[u32], limit: usize) -> usize {
        self.find(chain, tokens, limit.min(tokens.len())).len()
    }

    /// The walk stops at the first block not cached.
    fn find(&self, chain: &[BlockHash], tokens: &[u32], limit: usize) -> Vec<(BlockHash, Arc<B>)> {
        let mut found = Vec::new();
        let mut parent = None;
        let blocks = tokens[..limit].chunks_exact(self.block_tokens);
        for (&hash, block_tokens) in chain.iter().zip(blocks) {
            match self.entries.get(&hash) {
                Some(e) if e.parent == parent && e.tokens == block_tokens => {
                    found.push((hash, e.block.clone()));
                    parent = Some(hash);
                }
                _ => break,
            }
        }
        found
    }

    /// Pins `hashes` (a request attaches them): they are not evicted until released.
    pub fn acquire(&mut self, hashes: &[BlockHash]) {
        for hash in hashes {
            if let Some(e) = self.entries.get_mut(hash) {
                e.refs += 1;
            }
        }
    }

    /// Unpins `hashes` (pinned by [`PrefixCache::acquire`]).
    pub fn release(&mut self, hashes: &[BlockHash]) {
        for hash in hashes {
            if let Some(e) = self.entries.get_mut(hash) {
                e.refs = e.refs.saturating_sub(1);
            }
        }
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// Caches `block` (its tokens `tokens`, its payload `bytes` bytes) under `hash`, continuing
    /// `parent` (`None` for a prompt's first block), evicting least recently used leaves while
    /// the budget has no room. Returns what it did and the blocks it evicted (also when it
    /// refused after evicting every evictable block).
    pub fn insert(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        block: B,
        bytes: u64,
    ) -> (Inserted, Vec<BlockHash>) {
        let mut evicted = Vec::new();
        if self.entries.contains_key(&hash) {
            self.touch([hash]);
            return (Inserted::AlreadyCached, evicted);
        }
        if parent.is_some_and(|p| !self.entries.contains_key(&p)) {
            return (Inserted::Refused, evicted);
        }
        let bytes = bytes + std::mem::size_of_val(tokens) as u64;
        if bytes > self.budget {
            return (Inserted::Refused, evicted);
        }
        while self.stats.bytes + bytes > self.budget {
            // The parent may not go: the new block is about to continue it.
            let victim = self
                .entries
                .iter()
                .filter(|(h, e)| e.refs == 0 && e.children == 0 && Some(**h) != parent)
                .min_by_key(|(h, e)| (e.last_used, **h))
                .map(|(h, _)| *h);
            match victim {
                Some(victim) => {
                    self.evict(victim);
                    evicted.push(victim);
                }
                None => return (Inserted::Refused, evicted),
            }
        }
        if let Some(p) = parent.and_then(|p| self.entries.get_mut(&p)) {
            p.children += 1;
        }
        self.clock += 1;
        self.entries.insert(
            hash,
            Entry {
                block: Arc::new(block),
                parent,
                tokens: tokens.to_vec(),
                bytes,
                refs: 0,
                children: 0,
                last_used: self.clock,
            },
        );
        self.stats.bytes += bytes;
        self.stats.blocks += 1;
        (Inserted::Cached, evicted)
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Every cached block.
    pub fn blocks(&self) -> impl Iterator<Item = &B> {
        self.entries.values().map(|e| e.block.as_ref())
    }

    pub fn budget_bytes(&self) -> u64 {
        self.budget
    }

    fn evict(&mut self, hash: BlockHash) {
        if let Some(e) = self.entries.remove(&hash) {
            if let Some(p) = e.parent.and_then(|p| self.entries.get_mut(&p)) {
                p.children -= 1;
            }
            self.stats.bytes -= e.bytes;
            self.stats.blocks -= 1;
            self.stats.evictions += 1;
        }
    }

    /// Marks `hashes` as used now, the later ones more recently (a chain's leaf is used last).
    fn touch(&mut self, hashes: impl IntoIterator<Item = BlockHash>) {
        for hash in hashes {
            if let Some(e) = self.entries.get_mut(&hash) {
                self.clock += 1;
                e.last_used = self.clock;
            }
        }
    }
}

/// Where a hit of `cached` tokens on a prompt of `prompt_len` starts its replay: `cached −
/// replay_tokens` rounded down to a multiple of `align` (every compression ratio). `None` (a
/// miss) when that is 0: the replay would prefill everything anyway.
pub fn plan_hit(cached: usize, replay_tokens: usize, align: usize) -> Option<usize> {
    let from = cached.saturating_sub(replay_tokens);
    let from = from - from % align.max(1);
    (from > 0).then_some(from)
}

/// The replay after which a hit is bitwise a cold prefill with decoder bounded replay on, when
/// the decoder start (`prompt − keep`) is at or after the hit: a layer's output at `p` reads its
/// window `[p − window + 1, p]`, so the layers below the decoder boundary (whose outputs feed the
/// compressors and the decoder) are exact from `replay start + boundary · (window − 1)` on, and
/// the window rings the hit leaves must also hold exact entries back to `window +
/// MAX_BACKTRACK` before it. Rounded up to `align` (every ratio). `None` without a decoder
/// boundary (every layer would then need the halo). vLLM's "exact halo" (PR #57281) is the same
/// idea; for V4.1-Flash (boundary 20, window 128) it is 2 674 tokens against the 140 of the
/// approximate rule.
pub fn exact_replay_tokens(cfg: &ModelConfig) -> Option<usize> {
    let boundary = cfg.compress_ratios.iter().position(|&r| r == 1)?;
    let halo = boundary * cfg.window_size.saturating_sub(1) + cfg.window_size + MAX_BACKTRACK;
    let align = alignment(cfg);
    Some(halo.div_ceil(align) * align)
}

/// The least common multiple of every compression ratio: a replay start is a multiple of it.
fn alignment(cfg: &ModelConfig) -> usize {
    cfg.compress_ratios.iter().fold(1, |a, &r| lcm(a, r.max(1)))
}

/// How a [`prefill`] replays and prefills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillRule {
    /// Tokens a hit replays (at least the window plus the largest rollback).
    pub replay_tokens: usize,
    /// Decoder bounded replay's kept tokens (`None`: off).
    pub decoder_keep: Option<usize>,
}

/// A prompt prefilled through the cache: the sequence, the logits rows the caller wanted (of
/// the positions fed: from `replay_from` on, or from the decoder start if later) and where the
/// hit ended.
#[derive(Debug)]
pub struct CachedPrefill {
    pub seq: SequenceState,
    pub logits: Vec<f32>,
    /// Tokens found cached (0 on a miss or an unadopted hit).
    pub hit_tokens: usize,
    /// The first position fed through the model.
    pub replay_from: usize,
}

/// Prefills `tokens` on `model` through `cache` (keyed by `salt`): attaches the longest cached
/// chain that ends at or before the decoder's kept suffix (or the last token), replays from [`plan_hit`]'s start, prefills
/// the rest in `chunk`-token pieces, and inserts every complete block it holds afterwards.
pub fn prefill(
    model: &Model,
    cache: &mut PrefixCache<PrefixBlock>,
    salt: u64,
    tokens: &[u32],
    rule: PrefillRule,
    chunk: usize,
    want: LogitsWanted,
) -> Result<CachedPrefill, ModelError> {
    let cfg = model.config();
    let minimum = cfg.window_size + MAX_BACKTRACK;
    if rule.replay_tokens < minimum {
        return Err(ModelError::Sequence {
            message: format!(
                "prefix cache: a hit replays {} tokens; at least window {} + max backtracking \
                 {MAX_BACKTRACK} = {minimum} are needed to rebuild the rings",
                rule.replay_tokens, cfg.window_size
            ),
        });
    }
    let ratios = &cfg.compress_ratios;
    let align = alignment(cfg);
    // The hit stops before the decoder's kept suffix (and the last token), so that the rows the
    // decoder runs on follow at least `replay_tokens` replayed positions.
    let limit = match rule.decoder_keep {
        Some(keep) => tokens.len().saturating_sub(keep.max(1)),
        None => tokens.len().saturating_sub(1),
    };
    let chain = block_chain(cache.block_tokens(), salt, tokens);
    let found = cache.lookup(&chain, tokens, limit);
    let cached = found.len() * cache.block_tokens();
    let mut seq = model.new_sequence();
    let replay_from = match plan_hit(cached, rule.replay_tokens, align) {
        Some(from) => {
            let hashes: Vec<BlockHash> = found.iter().map(|(h, _)| *h).collect();
            cache.acquire(&hashes);
            let blocks: Vec<&PrefixBlock> = found.iter().map(|(_, b)| b.as_ref()).collect();
            let attached = seq.attach_prefix(&blocks, from, ratios);
            cache.release(&hashes);
            attached?;
            from
        }
        None => 0,
    };
    let logits = feed(model, &mut seq, tokens, replay_from, rule, chunk, want)?;
    insert_blocks(cache, salt, tokens, &seq, ratios)?;
    Ok(CachedPrefill {
        seq,
        logits,
        hit_tokens: if replay_from > 0 { cached } else { 0 },
        replay_from,
    })
}

/// Feeds `tokens[from..]` in `chunk`-token pieces (decoder bounded replay per `rule`).
pub fn feed(
    model: &Model,
    seq: &mut SequenceState,
    tokens: &[u32],
    from: usize,
    rule: PrefillRule,
    chunk: usize,
    want: LogitsWanted,
) -> Result<Vec<f32>, ModelError> {
    let mut logits = Vec::new();
    for piece in tokens[from..].chunks(chunk.max(1)) {
        let entry = StepEntry {
            decoder_from: rule
                .decoder_keep
                .map(|keep| tokens.len().saturating_sub(keep)),
            ..StepEntry::new(seq, piece, want)
        };
        let rows = model
            .forward_step(&mut [entry], StepOptions::default())
            .and_then(EntryOutput::one_entry_logits)?;
        if want == LogitsWanted::Last && !rows.is_empty() {
            logits = rows;
        } else {
            logits.extend(rows);
        }
    }
    Ok(logits)
}

/// Caches every complete block of `tokens` that `seq` holds (the sequence has processed its
/// positions) and the cache does not hold yet.
pub fn insert_blocks(
    cache: &mut PrefixCache<PrefixBlock>,
    salt: u64,
    tokens: &[u32],
    seq: &SequenceState,
    ratios: &[usize],
) -> Result<(), ModelError> {
    let n = cache.block_tokens();
    let held = seq.len().min(tokens.len());
    let mut parent = None;
    let chain = block_chain(n, salt, &tokens[..held]);
    for (i, hash) in chain.into_iter().enumerate() {
        if !cache.contains(hash) {
            let block = seq.prefix_block(i * n, n, ratios)?;
            let bytes = block.held_bytes();
            let block_tokens = &tokens[i * n..(i + 1) * n];
            if cache.insert(hash, parent, block_tokens, block, bytes).0 == Inserted::Refused {
                break;
            }
        }
        parent = Some(hash);
    }
    Ok(())
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| i.wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// [`PrefixCache::lookup`] of `t`'s chain under `salt` (blocks of 4).
    fn lookup(cache: &mut PrefixCache<u32>, salt: u64, t: &[u32], limit: usize) -> Vec<BlockHash> {
        let found = cache.lookup(&block_chain(4, salt, t), t, limit);
        found.into_iter().map(|(hash, _)| hash).collect()
    }

    fn fill(cache: &mut PrefixCache<u32>, salt: u64, t: &[u32], bytes: u64) {
        let mut parent = None;
        for (i, hash) in block_chain(4, salt, t).into_iter().enumerate() {
            let block = &t[i * 4..(i + 1) * 4];
            cache.insert(hash, parent, block, i as u32, bytes);
            parent = Some(hash);
        }
    }

    #[test]
    fn a_lookup_finds_the_longest_chain_of_the_same_salt_and_tokens() {
        let mut cache = PrefixCache::new(4, 1 << 20);
        let a = tokens(12, 1);
        fill(&mut cache, 7, &a, 10);
        assert_eq!(cache.stats().blocks, 3);
        assert_eq!(lookup(&mut cache, 7, &a, 12).len(), 3);
        assert_eq!(
            lookup(&mut cache, 7, &a, 11).len(),
            2,
            "the limit cuts the last block"
        );
        let mut b = a.clone();
        b[5] += 1;
        assert_eq!(
            lookup(&mut cache, 7, &b, 12).len(),
            1,
            "diverges in block 1"
        );
        assert_eq!(lookup(&mut cache, 8, &a, 12).len(), 0, "another salt");
        assert_eq!(
            lookup(&mut cache, 7, &a[4..], 8).len(),
            0,
            "keys chain from the start"
        );
        let s = cache.stats();
        assert_eq!((s.lookups, s.hit_lookups), (5, 3));
        assert_eq!(
            (s.looked_up_tokens, s.hit_tokens),
            (12 + 11 + 12 + 12 + 8, 24)
        );
    }

    #[test]
    fn eviction_keeps_the_budget_pinned_blocks_and_chains() {
        // Each block: 10 payload bytes + 16 token bytes.
        let mut cache = PrefixCache::new(4, 26 * 5);
        let a = tokens(12, 1);
        fill(&mut cache, 0, &a, 10);
        let pinned = lookup(&mut cache, 0, &a, 12);
        cache.acquire(&pinned);
        fill(&mut cache, 0, &tokens(12, 2), 10);
        assert_eq!(cache.stats().bytes, 26 * 5);
        assert_eq!(lookup(&mut cache, 0, &a, 12).len(), 3, "pinned blocks stay");
        assert_eq!(
            lookup(&mut cache, 0, &tokens(12, 2), 12).len(),
            2,
            "no room"
        );
        cache.release(&pinned);
        fill(&mut cache, 0, &tokens(8, 3), 10);
        // The least recently used leaves went first: never a parent before its child.
        assert_eq!(lookup(&mut cache, 0, &tokens(8, 3), 8).len(), 2);
        assert!(cache.stats().bytes <= 26 * 5);
        assert!(cache.stats().evictions >= 2);
        let (big, evicted) = cache.insert(BlockHash(1), None, &[1; 4], 9, 1000);
        assert_eq!(big, Inserted::Refused, "larger than the budget");
        assert!(
            evicted.is_empty(),
            "nothing is evicted for a block that never fits"
        );
        assert!(cache.stats().bytes > 0);
    }

    /// A key whose entry holds other tokens (a hash collision) is a miss, never a wrong hit.
    #[test]
    fn a_colliding_key_is_a_miss() {
        let mut cache = PrefixCache::new(4, 1000);
        let (a, b) = (tokens(4, 1), tokens(4, 2));
        let key = block_chain(4, 0, &a)[0];
        assert_eq!(cache.insert(key, None, &b, 0, 1).0, Inserted::Cached);
        assert!(lookup(&mut cache, 0, &a, 4).is_empty());
    }

    #[test]
    fn a_block_without_its_parent_is_refused() {
        let mut cache: PrefixCache<u32> = PrefixCache::new(4, 1000);
        let insert = cache.insert(BlockHash(5), Some(BlockHash(4)), &[0; 4], 0, 1);
        assert_eq!(insert, (Inserted::Refused, Vec::new()));
    }

    #[test]
    fn hits_replay_an_aligned_suffix_or_are_misses() {
        assert_eq!(plan_hit(128, 140, 2), None);
        assert_eq!(plan_hit(192, 140, 2), Some(52));
        assert_eq!(plan_hit(193, 140, 4), Some(52));
        assert_eq!(plan_hit(256, 22, 2), Some(234));
    }

    #[test]
    fn the_exact_replay_covers_the_encoder_halo_and_the_rings() {
        let cfg = deepinfer_model::config::ModelConfig::tiny_v41();
        assert_eq!(
            (
                cfg.window_size,
                cfg.compress_ratios.iter().position(|&r| r == 1)
            ),
            (16, Some(6))
        );
        assert_eq!(exact_replay_tokens(&cfg), Some(6 * 15 + 16 + 6));
    }
}
