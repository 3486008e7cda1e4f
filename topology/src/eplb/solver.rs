//! `rebalance_experts`: input checks, the policy choice, and the hierarchical routine (groups
//! onto nodes, replication inside each node, replicas onto the node's GPUs). The global
//! policy is the same routine with one group and one node.

use super::packing::{balanced_packing, replicate_experts};
use super::{EplbPolicy, ExpertPlacement, LayerPlacement, PlacementShape};
use crate::error::PlacementError;
use crate::ids::ExpertId;

/// Solves a placement for every layer of `loads` (`[layer][logical expert]`, finite and
/// >= 0). Deterministic: equal inputs give equal placements (tie rules in `packing`).
pub fn rebalance_experts<Row: AsRef<[f64]>>(
    loads: &[Row],
    shape: PlacementShape,
) -> Result<ExpertPlacement, PlacementError> {
    let experts = check_loads(loads)?;
    check_shape(shape, experts)?;
    let policy = shape.policy();
    let (groups, nodes) = match policy {
        EplbPolicy::Hierarchical => (shape.num_groups, shape.num_nodes),
        EplbPolicy::Global => (1, 1),
    };
    if !experts.is_multiple_of(groups) {
        return Err(PlacementError::NotDivisible {
            dividend_name: "logical experts",
            dividend: experts,
            divisor_name: "num_groups",
            divisor: groups,
        });
    }
    let dims = Dims {
        experts,
        slots: shape.num_replicas,
        groups,
        nodes,
        gpus: shape.num_gpus,
    };
    let layers = loads
        .iter()
        .map(|row| place_layer(row.as_ref(), &dims))
        .collect();
    Ok(ExpertPlacement {
        policy,
        slots_per_gpu: shape.slots_per_gpu(),
        layers,
    })
}

/// Checks the table is rectangular, non-empty and finite non-negative; returns the expert count.
fn check_loads<Row: AsRef<[f64]>>(loads: &[Row]) -> Result<usize, PlacementError> {
    let first = loads.first().ok_or(PlacementError::NoLayers)?.as_ref();
    let experts = first.len();
    if experts == 0 {
        return Err(PlacementError::NoExperts);
    }
    let max = usize::from(u16::MAX) + 1;
    if experts > max {
        return Err(PlacementError::TooManyExperts { experts, max });
    }
    for (layer, row) in loads.iter().enumerate() {
        let row = row.as_ref();
        if row.len() != experts {
            return Err(PlacementError::RaggedLoads {
                layer,
                expected: experts,
                got: row.len(),
            });
        }
        if let Some((expert, &value)) = row
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite() || **v < 0.0)
        {
            return Err(PlacementError::BadLoad {
                layer,
                expert,
                value,
            });
        }
    }
    Ok(experts)
}

fn check_shape(shape: PlacementShape, experts: usize) -> Result<(), PlacementError> {
    for (name, value) in [
        ("num_replicas", shape.num_replicas),
        ("num_groups", shape.num_groups),
        ("num_nodes", shape.num_nodes),
        ("num_gpus", shape.num_gpus),
    ] {
        if value == 0 {
            return Err(PlacementError::ZeroCount { name });
        }
    }
    if shape.num_replicas < experts {
        return Err(PlacementError::TooFewReplicas {
            replicas: shape.num_replicas,
            experts,
        });
    }
    if u32::try_from(shape.num_replicas).is_err() {
        return Err(PlacementError::TooFewReplicas {
            replicas: shape.num_replicas,
            experts,
        });
    }
    let divisible = |dividend_name, dividend: usize, divisor_name, divisor: usize| {
        if dividend.is_multiple_of(divisor) {
            Ok(())
        } else {
            Err(PlacementError::NotDivisible {
                dividend_name,
                dividend,
                divisor_name,
                divisor,
            })
        }
    };
    divisible(
        "num_replicas",
        shape.num_replicas,
        "num_gpus",
        shape.num_gpus,
    )?;
    divisible("num_gpus", shape.num_gpus, "num_nodes", shape.num_nodes)
}

/// The effective counts of one solve (groups and nodes are 1 under the global policy).
struct Dims {
    experts: usize,
    slots: usize,
    groups: usize,
    nodes: usize,
    gpus: usize,
}

/// The hierarchical routine for one layer.
fn place_layer(loads: &[f64], dims: &Dims) -> LayerPlacement {
    let group_size = dims.experts / dims.groups;
    let groups_per_node = dims.groups / dims.nodes;
    let experts_per_node = dims.experts / dims.nodes;
    let slots_per_node = dims.slots / dims.nodes;
    let gpus_per_node = dims.gpus / dims.nodes;
    let slots_per_gpu = dims.slots / dims.gpus;

    // 1. Groups onto nodes; node-major ("mlog") numbering: node k owns
    //    mlog ids [k * experts_per_node, (k + 1) * experts_per_node).
    let group_loads: Vec<f64> = loads
        .chunks(group_size)
        .map(|group| group.iter().sum())
        .collect();
    let group_places = balanced_packing(&group_loads, dims.nodes);
    let mut mlog_to_log = vec![0_usize; dims.experts];
    for expert in 0..dims.experts {
        let place = group_places[expert / group_size];
        let mlog =
            (place.pack * groups_per_node + place.rank_in_pack) * group_size + expert % group_size;
        mlog_to_log[mlog] = expert;
    }

    let mut phy2log = vec![ExpertId(0); dims.slots];
    let mut slot_rank = vec![0_usize; dims.slots];
    let mut count = vec![0_usize; dims.experts];
    for node in 0..dims.nodes {
        let node_experts = &mlog_to_log[node * experts_per_node..(node + 1) * experts_per_node];
        let node_loads: Vec<f64> = node_experts.iter().map(|&e| loads[e]).collect();

        // 2. Replicate inside the node.
        let replication = replicate_experts(&node_loads, slots_per_node);

        // 3. Replicas onto the node's GPUs, by load per replica.
        let replica_loads: Vec<f64> = replication
            .slot_expert
            .iter()
            .map(|&local| node_loads[local] / replication.count[local] as f64)
            .collect();
        let replica_places = balanced_packing(&replica_loads, gpus_per_node);

        // 4. Back to global logical ids and global slots.
        for (replica, place) in replica_places.iter().enumerate() {
            let slot = node * slots_per_node + place.pack * slots_per_gpu + place.rank_in_pack;
            let expert = node_experts[replication.slot_expert[replica]];
            // `check_loads` bounds the expert count by u16::MAX + 1.
            phy2log[slot] = ExpertId(expert as u16);
            slot_rank[slot] = replication.slot_rank[replica];
        }
        for (local, &expert) in node_experts.iter().enumerate() {
            count[expert] = replication.count[local];
        }
    }

    let mut log2phy: Vec<Vec<u32>> = count.iter().map(|&c| vec![0; c]).collect();
    for (slot, expert) in phy2log.iter().enumerate() {
        // `check_shape` bounds the slot count by u32::MAX.
        log2phy[expert.index()][slot_rank[slot]] = slot as u32;
    }
    LayerPlacement { phy2log, log2phy }
}
