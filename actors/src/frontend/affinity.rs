//! Cache-affinity placement over several DP ranks: the frontend's mirror of each rank's prefix
//! cache, for choosing where a request's prompt is most likely cached.
//!
//! The mirror of a rank is a `PrefixCache<()>` with the rank's budget and block bytes, fed the
//! prompts the frontend placed there (every complete block, in order, by the keys the frontend
//! computed once for the request, `RequestSpec::prefix_chain`, which the rank's index walks too;
//! least recently used leaves evicted as the rank's index does). It does not see the rank's
//! pins, its refused inserts or the bound on hits (decoder start, last token), so it is an
//! estimate: placement only, never correctness (the rank's own index decides every hit).
//!
//! The rule ([`crate::frontend::state::Admission::admit`]): a request goes to the live rank
//! whose mirror holds its longest cached prefix, unless that rank is overloaded: its
//! outstanding work exceeds the least-loaded live rank's by more than the cached tokens (what
//! the hit would save). Otherwise, and when no rank holds a block of it, the least-loaded rank.

use crate::prefix_cache::{BlockHash, PrefixCache};
use crate::scheduler::prefix::PrefixSettings;

/// One mirror per DP rank ([module docs](self)).
#[derive(Debug)]
pub struct Affinity {
    ranks: Vec<PrefixCache<()>>,
    block_bytes: u64,
}

impl Affinity {
    /// Mirrors of `ranks` caches of `settings`.
    pub fn new(ranks: usize, settings: &PrefixSettings) -> Affinity {
        let geometry = settings.geometry;
        Affinity {
            ranks: (0..ranks)
                .map(|_| PrefixCache::new(geometry.block_tokens, settings.budget_bytes))
                .collect(),
            block_bytes: geometry.block_bytes,
        }
    }

    /// Per rank, the tokens of `prompt`'s longest prefix its mirror holds (whole blocks; `chain`:
    /// the keys of its blocks, `RequestSpec::prefix_chain`).
    pub fn cached_tokens(&self, prompt: &[u32], chain: &[BlockHash]) -> Vec<usize> {
        self.ranks
            .iter()
            .map(|mirror| mirror.peek(chain, prompt, prompt.len()) * mirror.block_tokens())
            .collect()
    }

    /// `prompt` (its blocks' keys `chain`) was placed on `rank`: its complete blocks will be
    /// cached there.
    pub fn placed(&mut self, rank: usize, prompt: &[u32], chain: &[BlockHash]) {
        let Some(mirror) = self.ranks.get_mut(rank) else {
            return;
        };
        let n = mirror.block_tokens();
        let mut parent = None;
        for (i, &hash) in chain.iter().enumerate() {
            let tokens = &prompt[i * n..(i + 1) * n];
            let (inserted, _) = mirror.insert(hash, parent, tokens, (), self.block_bytes);
            if inserted == crate::prefix_cache::Inserted::Refused {
                break;
            }
            parent = Some(hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::prefix::tests::{keys, settings};

    #[test]
    fn mirrors_follow_placements_and_forget_least_recently_used_blocks() {
        let mut affinity = Affinity::new(2, &settings(3));
        let a: Vec<u32> = (0..10).collect();
        assert_eq!(affinity.cached_tokens(&a, &keys(&a)), [0, 0]);
        affinity.placed(1, &a, &keys(&a));
        assert_eq!(affinity.cached_tokens(&a, &keys(&a)), [0, 8]);
        let longer = [&a[..], &[50, 51, 52, 53]].concat();
        assert_eq!(affinity.cached_tokens(&longer, &keys(&longer)), [0, 8]);
        let newer: Vec<u32> = (100..112).collect();
        affinity.placed(1, &newer, &keys(&newer));
        assert_eq!(
            affinity.cached_tokens(&a, &keys(&a)),
            [0, 0],
            "evicted for the newer prompt"
        );
    }
}
