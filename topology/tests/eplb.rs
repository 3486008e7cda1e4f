//! DeepSeek's EPLB: the README example reproduced exactly, error cases, and properties of
//! every plan (replica counts, slot layout, log2phy consistency, GPU load bounds).

use deepinfer_topology::{
    EplbPolicy, ExpertPlacement, PlacementError, PlacementShape, eplb_plan_json, rebalance_experts,
};
use proptest::prelude::*;

fn readme_loads() -> Vec<Vec<f64>> {
    vec![
        vec![
            90., 132., 40., 61., 104., 165., 39., 4., 73., 56., 183., 86.,
        ],
        vec![
            20., 107., 104., 64., 19., 197., 187., 157., 172., 86., 16., 27.,
        ],
    ]
}

const README_SHAPE: PlacementShape = PlacementShape {
    num_replicas: 16,
    num_groups: 4,
    num_nodes: 2,
    num_gpus: 8,
};

fn phy2log_of(placement: &ExpertPlacement) -> Vec<Vec<u16>> {
    placement
        .layers
        .iter()
        .map(|l| l.phy2log.iter().map(|e| e.get()).collect())
        .collect()
}

#[test]
fn reproduces_the_deepseek_eplb_readme_example() {
    let placement = rebalance_experts(&readme_loads(), README_SHAPE).unwrap();
    assert_eq!(placement.policy, EplbPolicy::Hierarchical);
    assert_eq!(
        phy2log_of(&placement),
        vec![
            vec![5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            vec![7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
        ]
    );
    // Layer 0: experts 1, 4, 5, 10 have two copies.
    assert_eq!(
        placement.layers[0].logcnt(),
        vec![1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
    );
    assert_eq!(placement.layers[0].log2phy[5], vec![0, 2]);
    // Ordered by replica rank: the original copy of expert 1 sits in slot 15.
    assert_eq!(placement.layers[0].log2phy[1], vec![15, 13]);
}

/// What a rank's device holds (distinct experts, increasing) and what it releases or uploads
/// when a placement replaces another, on the README example (8 ranks of 2 slots).
#[test]
fn held_and_released_experts_follow_the_slots() {
    use deepinfer_topology::{EpRank, ExpertId};
    let placement = rebalance_experts(&readme_loads(), README_SHAPE).unwrap();
    assert_eq!(placement.held_experts(0, EpRank(0)), vec![5, 6]);
    assert_eq!(placement.held_experts(0, EpRank(7)), vec![1, 11]);
    assert_eq!(placement.held_experts(1, EpRank(1)), vec![6, 8]);
    assert!(placement.released_by(&placement, EpRank(3)).is_empty());
    // Rank 0 of layer 0 now holds expert 5 twice, rank 3 of layer 1 expert 2 instead of 9.
    let mut next = placement.clone();
    next.layers[0].phy2log[1] = ExpertId(5);
    next.layers[1].phy2log[6] = ExpertId(2);
    assert_eq!(next.held_experts(0, EpRank(0)), vec![5]);
    assert_eq!(placement.released_by(&next, EpRank(0)), vec![(0, 6)]);
    assert!(next.released_by(&placement, EpRank(0)).is_empty());
    assert_eq!(placement.released_by(&next, EpRank(3)), vec![(1, 8)]);
    assert_eq!(next.released_by(&placement, EpRank(3)), vec![(1, 2)]);
    for rank in [1, 2, 4, 5, 6, 7] {
        assert!(placement.released_by(&next, EpRank(rank)).is_empty());
    }
}

#[test]
fn rebalancing_beats_the_uniform_placement_on_skewed_load() {
    let loads = readme_loads();
    let uniform = ExpertPlacement::uniform(2, 12, README_SHAPE).unwrap();
    let balanced = rebalance_experts(&loads, README_SHAPE).unwrap();
    let before = uniform.balancedness(&loads).unwrap();
    let after = balanced.balancedness(&loads).unwrap();
    for layer in 0..2 {
        assert!(after[layer] > before[layer], "{after:?} vs {before:?}");
        assert!(after[layer] <= 1.0);
    }
    // Layer 0, GPU by GPU from the README phy2log: GPU 0 holds experts 5 (165 / 2 copies)
    // and 6 (39) = 121.5; GPU 6 holds 0 (90) and 1 (132 / 2) = 156, the busiest.
    let gpu = balanced.gpu_loads(&loads).unwrap();
    assert_eq!(
        gpu[0],
        vec![121.5, 86.5, 125.0, 113.0, 147.5, 131.5, 156.0, 152.0]
    );
    assert!((after[0] - 1033.0 / 8.0 / 156.0).abs() < 1e-12);
}

#[test]
fn plan_json_has_deepseek_shapes_and_padding() {
    let text = serde_json::to_string(&readme_loads()).unwrap();
    let plan = eplb_plan_json(&text, README_SHAPE).unwrap();
    assert_eq!(plan["phy2log"][1][0], 7);
    assert_eq!(plan["logcnt"][0].as_array().unwrap().len(), 12);
    let log2phy = plan["log2phy"][0].as_array().unwrap();
    assert_eq!(log2phy.len(), 12);
    // Width = largest replica count (2); single-copy experts are padded with -1.
    assert_eq!(log2phy[5], serde_json::json!([0, 2]));
    assert_eq!(log2phy[0], serde_json::json!([12, -1]));
}

#[test]
fn global_policy_when_groups_do_not_divide_over_nodes() {
    let shape = PlacementShape {
        num_groups: 3,
        ..README_SHAPE
    };
    let placement = rebalance_experts(&readme_loads(), shape).unwrap();
    assert_eq!(placement.policy, EplbPolicy::Global);
    // Global replication: the four heaviest load-per-copy picks of layer 0 are experts
    // 10 (183), 5 (165), 1 (132), 4 (104).
    assert_eq!(
        placement.layers[0].logcnt(),
        vec![1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
    );
}

#[test]
fn bad_inputs_are_named() {
    let shape = README_SHAPE;
    let ragged = vec![vec![1.0; 12], vec![1.0; 11]];
    assert_eq!(
        rebalance_experts(&ragged, shape).unwrap_err(),
        PlacementError::RaggedLoads {
            layer: 1,
            expected: 12,
            got: 11
        }
    );
    let mut negative = readme_loads();
    negative[1][3] = -2.0;
    assert_eq!(
        rebalance_experts(&negative, shape).unwrap_err().to_string(),
        "loads[1][3]: -2 is not a finite load >= 0"
    );
    let uneven = PlacementShape {
        num_replicas: 18,
        ..shape
    };
    assert_eq!(
        rebalance_experts(&readme_loads(), uneven)
            .unwrap_err()
            .to_string(),
        "num_replicas = 18 is not a multiple of num_gpus = 8"
    );
    let few = PlacementShape {
        num_replicas: 8,
        ..shape
    };
    assert!(matches!(
        rebalance_experts(&readme_loads(), few),
        Err(PlacementError::TooFewReplicas {
            replicas: 8,
            experts: 12
        })
    ));
    let zero = PlacementShape {
        num_gpus: 0,
        ..shape
    };
    assert_eq!(
        rebalance_experts(&readme_loads(), zero).unwrap_err(),
        PlacementError::ZeroCount { name: "num_gpus" }
    );
    let groups = PlacementShape {
        num_groups: 8,
        ..shape
    };
    assert!(matches!(
        rebalance_experts(&readme_loads(), groups),
        Err(PlacementError::NotDivisible {
            divisor_name: "num_groups",
            ..
        })
    ));
    let empty: Vec<Vec<f64>> = Vec::new();
    assert_eq!(
        rebalance_experts(&empty, shape).unwrap_err(),
        PlacementError::NoLayers
    );
}

#[test]
fn bad_json_is_positioned() {
    let shape = README_SHAPE;
    let message = |text: &str| eplb_plan_json(text, shape).unwrap_err().to_string();
    assert!(message("{\"a\": 1}").contains("expected an array of layers"));
    assert_eq!(
        message("[[1, 2], [3, \"x\"]]"),
        "loads JSON[1][1]: expected a number, got \"x\""
    );
    assert_eq!(
        message("[[1, 2], 3]"),
        "loads JSON[1]: expected an array of expert loads"
    );
    assert!(message("[[1, 2],").contains("not valid JSON"));
    assert!(message("[[1, 2], [3]]").contains("ragged rows"));
}

#[test]
fn uniform_placement_and_rank_lookup() {
    let shape = PlacementShape {
        num_replicas: 448,
        num_groups: 1,
        num_nodes: 8,
        num_gpus: 64,
    };
    let placement = ExpertPlacement::uniform(2, 384, shape).unwrap();
    assert_eq!(placement.slots_per_gpu, 7);
    assert_eq!(placement.rank_of_slot(447).get(), 63);
    assert_eq!(placement.rank_of_slot(7).get(), 1);
    assert_eq!(
        placement
            .experts_on_rank(1, deepinfer_topology::EpRank(63))
            .len(),
        7
    );
    assert!(
        placement
            .experts_on_rank(2, deepinfer_topology::EpRank(0))
            .is_empty()
    );
    assert!(
        placement.layers[0]
            .logcnt()
            .iter()
            .all(|&c| c == 1 || c == 2)
    );
}

/// A random placement problem: shape first, then loads of matching width.
fn problem() -> impl Strategy<Value = (Vec<Vec<f64>>, PlacementShape)> {
    (
        1usize..=4,
        1usize..=4,
        1usize..=3,
        1usize..=4,
        0usize..=3,
        1usize..=3,
    )
        .prop_flat_map(
            |(nodes, gpus_per_node, groups_per_node, group_size, extra_per_gpu, layers)| {
                let gpus = nodes * gpus_per_node;
                // Groups are a multiple of nodes (hierarchical) or one less (global when > 1 node).
                let groups = nodes * groups_per_node;
                let experts = groups * group_size;
                // Enough slots: round experts up to a multiple of gpus, then add extras.
                let base = experts.div_ceil(gpus) * gpus;
                let replicas = base + extra_per_gpu * gpus;
                let row = prop::collection::vec(
                    prop_oneof![Just(0.0), 0.0f64..1000.0, (0u32..5).prop_map(f64::from)],
                    experts,
                );
                (
                    prop::collection::vec(row, layers),
                    Just(PlacementShape {
                        num_replicas: replicas,
                        num_groups: groups,
                        num_nodes: nodes,
                        num_gpus: gpus,
                    }),
                    any::<bool>(),
                )
                    .prop_map(|(loads, shape, force_global)| {
                        let shape = if force_global && shape.num_nodes > 1 {
                            // Groups that do not divide over nodes force the global policy.
                            PlacementShape {
                                num_groups: 1,
                                ..shape
                            }
                        } else {
                            shape
                        };
                        (loads, shape)
                    })
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_plan_is_a_consistent_layout((loads, shape) in problem()) {
        let placement = rebalance_experts(&loads, shape).unwrap();
        let experts = loads[0].len();
        let slots_per_gpu = shape.num_replicas / shape.num_gpus;
        prop_assert_eq!(placement.slots_per_gpu, slots_per_gpu);
        for layer in &placement.layers {
            prop_assert_eq!(layer.phy2log.len(), shape.num_replicas);
            let counts = layer.logcnt();
            prop_assert_eq!(counts.len(), experts);
            prop_assert!(counts.iter().all(|&c| c >= 1), "an expert has no replica");
            prop_assert_eq!(counts.iter().sum::<usize>(), shape.num_replicas);
            // log2phy and phy2log are inverse: each slot appears once, under its expert.
            let mut seen = vec![false; shape.num_replicas];
            for (expert, slots) in layer.log2phy.iter().enumerate() {
                for &slot in slots {
                    prop_assert!(!seen[slot as usize], "slot {} listed twice", slot);
                    seen[slot as usize] = true;
                    prop_assert_eq!(layer.phy2log[slot as usize].index(), expert);
                }
            }
            prop_assert!(seen.iter().all(|&s| s));
            // Every GPU gets exactly slots_per_gpu slots.
            for gpu in 0..shape.num_gpus {
                let held = (0..shape.num_replicas).filter(|s| s / slots_per_gpu == gpu).count();
                prop_assert_eq!(held, slots_per_gpu);
            }
            // Hierarchical: all copies of an expert stay on one node.
            if placement.policy == EplbPolicy::Hierarchical {
                let slots_per_node = shape.num_replicas / shape.num_nodes;
                for slots in &layer.log2phy {
                    let node = slots[0] as usize / slots_per_node;
                    prop_assert!(slots.iter().all(|&s| s as usize / slots_per_node == node));
                }
            }
        }
    }

    #[test]
    fn busiest_gpu_is_within_one_replica_of_the_ideal((loads, shape) in problem()) {
        let placement = rebalance_experts(&loads, shape).unwrap();
        let gpu_loads = placement.gpu_loads(&loads).unwrap();
        let experts = loads[0].len();
        for (layer, (row, per_gpu)) in loads.iter().zip(&gpu_loads).enumerate() {
            let total: f64 = row.iter().sum();
            let counts = placement.layers[layer].logcnt();
            let heaviest_replica = row
                .iter()
                .zip(&counts)
                .map(|(w, &c)| w / c as f64)
                .fold(0.0, f64::max);
            let busiest = per_gpu.iter().copied().fold(0.0, f64::max);
            let tolerance = 1e-9 * (1.0 + total);
            // Load is conserved.
            prop_assert!((per_gpu.iter().sum::<f64>() - total).abs() <= tolerance);
            let bound = if placement.policy == EplbPolicy::Hierarchical {
                // Node packing is within one group of the node average, GPU packing within
                // one replica of the node's GPU average.
                let group_size = experts / shape.num_groups;
                let heaviest_group = row
                    .chunks(group_size)
                    .map(|g| g.iter().sum::<f64>())
                    .fold(0.0, f64::max);
                let gpus_per_node = (shape.num_gpus / shape.num_nodes) as f64;
                (total / shape.num_nodes as f64 + heaviest_group) / gpus_per_node
                    + heaviest_replica
            } else {
                total / shape.num_gpus as f64 + heaviest_replica
            };
            prop_assert!(busiest <= bound + tolerance, "busiest {} > bound {}", busiest, bound);
            // Versus the naive contiguous placement without replicas (experts split evenly
            // over GPUs in index order; only defined when GPUs divide the experts).
            if placement.policy == EplbPolicy::Global && experts % shape.num_gpus == 0 {
                let per = experts / shape.num_gpus;
                let naive_busiest = row
                    .chunks(per)
                    .map(|c| c.iter().sum::<f64>())
                    .fold(0.0, f64::max);
                prop_assert!(busiest <= naive_busiest + heaviest_replica + tolerance);
            }
        }
    }

    #[test]
    fn solving_is_deterministic((loads, shape) in problem()) {
        let first = rebalance_experts(&loads, shape).unwrap();
        let second = rebalance_experts(&loads, shape).unwrap();
        prop_assert_eq!(first, second);
    }
}
