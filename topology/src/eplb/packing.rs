//! The two greedy building blocks of DeepSeek's EPLB, with fixed tie rules:
//! `balanced_packing` (items onto packs of equal item count) and `replicate_experts` (hand
//! extra slots to the most loaded experts).

use std::cmp::Ordering;

/// Where `balanced_packing` put one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Packed {
    /// The pack (0-based).
    pub pack: usize,
    /// The item's position inside its pack, in placement order (0-based).
    pub rank_in_pack: usize,
}

/// Puts `weights.len()` items into `num_packs` packs of exactly `weights.len() / num_packs`
/// items each, heaviest item first, each into the lightest pack that is not full.
///
/// Tie rules: items of equal weight are taken in increasing index order (stable descending
/// sort); among non-full packs of equal weight the lowest pack index wins. With one item per
/// pack the identity mapping is returned. The caller guarantees `num_packs` divides the item
/// count and that the weights are finite.
pub(crate) fn balanced_packing(weights: &[f64], num_packs: usize) -> Vec<Packed> {
    let items_per_pack = weights.len() / num_packs;
    if items_per_pack == 1 {
        return (0..weights.len())
            .map(|pack| Packed {
                pack,
                rank_in_pack: 0,
            })
            .collect();
    }
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    let mut pack_weight = vec![0.0_f64; num_packs];
    let mut pack_items = vec![0_usize; num_packs];
    let mut placed = vec![
        Packed {
            pack: 0,
            rank_in_pack: 0
        };
        weights.len()
    ];
    for item in order {
        let mut best: Option<usize> = None;
        for pack in 0..num_packs {
            if pack_items[pack] == items_per_pack {
                continue;
            }
            // Strictly lighter wins, so an equal weight keeps the lower index.
            if best.is_none_or(|b| pack_weight[pack] < pack_weight[b]) {
                best = Some(pack);
            }
        }
        // A non-full pack always exists: fewer items were placed than the packs can hold.
        let pack = best.unwrap_or(0);
        placed[item] = Packed {
            pack,
            rank_in_pack: pack_items[pack],
        };
        pack_weight[pack] += weights[item];
        pack_items[pack] += 1;
    }
    placed
}

/// Result of `replicate_experts` for one set of experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Replication {
    /// Expert held by each slot; slots `0..experts` hold experts `0..experts` in order.
    pub slot_expert: Vec<usize>,
    /// Each slot's replica rank: its ordinal among the copies of its expert.
    pub slot_rank: Vec<usize>,
    /// Copies of each expert (>= 1).
    pub count: Vec<usize>,
}

/// Gives every expert one slot, then hands each of the `num_slots - experts` extra slots to
/// the expert with the largest `weight / count`.
///
/// Tie rule: on an equal `weight / count` the lowest expert index wins. The caller
/// guarantees `num_slots >= weights.len()` and finite weights.
pub(crate) fn replicate_experts(weights: &[f64], num_slots: usize) -> Replication {
    let experts = weights.len();
    let mut slot_expert: Vec<usize> = (0..experts).collect();
    let mut slot_rank = vec![0_usize; experts];
    let mut count = vec![1_usize; experts];
    for _ in experts..num_slots {
        let mut best = 0;
        for expert in 1..experts {
            let candidate = weights[expert] / count[expert] as f64;
            let incumbent = weights[best] / count[best] as f64;
            if candidate.total_cmp(&incumbent) == Ordering::Greater {
                best = expert;
            }
        }
        slot_expert.push(best);
        slot_rank.push(count[best]);
        count[best] += 1;
    }
    Replication {
        slot_expert,
        slot_rank,
        count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_fills_lightest_pack_with_lowest_index_on_ties() {
        // Sorted: 9 (item 1), 5 (item 0), 5 (item 3), 1 (item 2).
        let placed = balanced_packing(&[5.0, 9.0, 1.0, 5.0], 2);
        let packs: Vec<usize> = placed.iter().map(|p| p.pack).collect();
        // 9 -> pack 0; 5 (item 0) -> pack 1; 5 (item 3) -> pack 1 (5 < 9), full;
        // 1 -> pack 0.
        assert_eq!(packs, vec![1, 0, 0, 1]);
        let ranks: Vec<usize> = placed.iter().map(|p| p.rank_in_pack).collect();
        assert_eq!(ranks, vec![0, 0, 1, 1]);
    }

    #[test]
    fn packing_with_one_item_per_pack_is_identity() {
        let placed = balanced_packing(&[1.0, 7.0, 3.0], 3);
        assert_eq!(
            placed.iter().map(|p| p.pack).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn equal_packs_take_the_lowest_index() {
        let placed = balanced_packing(&[2.0, 2.0, 2.0, 2.0], 2);
        assert_eq!(
            placed.iter().map(|p| p.pack).collect::<Vec<_>>(),
            vec![0, 1, 0, 1]
        );
    }

    #[test]
    fn replication_follows_load_per_copy() {
        let replication = replicate_experts(&[10.0, 4.0, 6.0], 6);
        // 10/1 -> e0 (10/2=5); then max(5, 4, 6) -> e2 (6/2=3); then max(5,4,3) -> e0.
        assert_eq!(replication.slot_expert, vec![0, 1, 2, 0, 2, 0]);
        assert_eq!(replication.slot_rank, vec![0, 0, 0, 1, 1, 2]);
        assert_eq!(replication.count, vec![3, 1, 2]);
    }

    #[test]
    fn replication_ties_go_to_the_lowest_expert() {
        let replication = replicate_experts(&[3.0, 3.0], 3);
        assert_eq!(replication.slot_expert, vec![0, 1, 0]);
    }
}
