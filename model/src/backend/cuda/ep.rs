//! Expert parallelism on the device: the fused MoE ([`Backend::moe_rows`] of V4.1's FP4/FP8
//! experts, [`Backend::moe_rows_exact`] of the V4 family's exact fp32 ones) when this backend
//! is one EP rank of several ([`ExpertRank`]), the routed rows moving between ranks through a
//! [`RowTransport`] (`ep_transport.rs`: device copies between ranks sharing a device; `nccl.rs`:
//! NCCL).
//!
//! Per MoE layer, every rank (with rows or none: an idle rank still calls it, see
//! `ExpertHost::idle_expert_step`) runs the same three collectives:
//! 1. Dispatch: the router runs here (a hash layer's experts come with the rows); each routed
//!    slot (row, pick) goes to the EP rank of the replica that serves it; the rows for each rank
//!    are gathered into one device buffer and sent with their counts, receiver-local expert ids
//!    and route weights; each rank runs its experts on the rows it received, by the kernels of
//!    one rank (`moe.rs` `routed_slots`, `v4.rs` `exact_slots`: a slot's bits do not depend on
//!    the slots it runs with, so not on the rank that runs it).
//! 2. Combine: the output rows (f32) go back the same way; every sender gathers its slots' rows
//!    into slot order and runs the same shared expert and combine as one rank does
//!    (`moe_combine`: a row's slots in increasing logical expert id, then the shared expert, one
//!    rounding), so every placement gives the bits of `ep = 1`.
//! 3. Finish: the buffers offered to peers may be freed.
//!
//! A rank's experts of each layer ([`SlotExperts`]) are of the kind its checkpoint holds and the
//! backend's numerics take: FP4/FP8 tables (V4.1), the V4 family's FP4 experts on the fast
//! routed chain (fast numerics), or exact tables (the V4 family: dense, FP8 or FP4 weights
//! dequantised exactly); the collectives are the same for all, and each kind runs the kernels of
//! one rank in the same numerics (`moe.rs`, `v4.rs`).
//! Activations never leave the device; only route ids and weights reach the host. Each rank
//! counts the rows its slots receive ([`ExpertRank::take_loads`], what the EPLB measures).
//! Replica choice: the replica on this rank when it holds one, else replica `dp % replicas`: a
//! pure function of (layer, expert, DP rank), independent of the batch and the timing.
//! Placement epochs: an [`ExpertRank`] serves one epoch; a new placement is a new rank object
//! (its experts uploaded when built) swapped in between steps through [`ExpertSlot`]; the epoch
//! is part of every collective's tag, so ranks on different epochs fail instead of mixing.
//! Failure: any error of the op aborts the transport (every peer fails at once; the supervisor
//! then stops the engine, its rule 3).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, RwLock};

use deepinfer_kernels::ops::key_table::key_row_address;
use deepinfer_kernels::ops::routed::moe_combine;
use deepinfer_topology::{EpRank, ExpertPlacement};

use super::ep_transport::{RowExchange, RowMeta, RowTransport};
use super::moe::DeviceExperts;
use super::v4::DeviceExactExperts;
use super::*;
use crate::backend::weights::{ExpertLinear, ExpertWeights};
use crate::expert_exchange::{ExchangePhase, ExchangeTag};

/// One EP rank of one placement epoch: its experts on this device, the placement, the transport.
pub struct ExpertRank {
    rank: usize,
    dp: usize,
    epoch: u32,
    placement: Arc<ExpertPlacement>,
    transport: Arc<dyn RowTransport>,
    /// MoE layer calls so far (shared with the rank's later epochs).
    rounds: Arc<AtomicU64>,
    /// Host address and length of each backbone layer's expert list → layer index.
    layers: HashMap<(usize, usize), usize>,
    /// This rank's experts of each layer, in slot order.
    tables: Vec<SlotExperts>,
    /// Routed rows each of its slots received since the last `take_loads`, `[layer][slot]`
    /// flattened (the EPLB's measure).
    loads: Vec<AtomicU64>,
}

impl std::fmt::Debug for ExpertRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertRank")
            .field("rank", &self.rank)
            .field("dp", &self.dp)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl ExpertRank {
    /// EP rank `rank` (serving DP rank `dp`) of `placement` at `epoch` for the backbone layers'
    /// experts `lists` (one list per MoE layer, `ExpertHost::expert_lists`): its experts (FP4/FP8
    /// or exact, [`SlotExperts`]) uploaded to `backend`'s device, only those its slots hold; its
    /// rows moved by `transport`.
    pub fn new(
        backend: &CudaBackend,
        lists: &[&[ExpertWeights<ExpertLinear>]],
        placement: Arc<ExpertPlacement>,
        epoch: u32,
        rank: usize,
        dp: usize,
        transport: Arc<dyn RowTransport>,
    ) -> Result<ExpertRank, CudaBackendError> {
        const OP: &str = "expert rank";
        check_placement(&placement, lists.len(), transport.ranks(), rank)
            .map_err(|message| shape_err(OP, message))?;
        let per_rank = placement.slots_per_gpu;
        let tables = lists
            .iter()
            .zip(&placement.layers)
            .enumerate()
            .map(|(layer, (experts, lp))| {
                let mine: Vec<&ExpertWeights<ExpertLinear>> = lp.phy2log
                    [rank * per_rank..(rank + 1) * per_rank]
                    .iter()
                    .map(|e| &experts[e.index()])
                    .collect();
                backend.slot_experts(OP, layer, &mine)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let layers = lists
            .iter()
            .enumerate()
            .map(|(layer, experts)| ((experts.as_ptr() as usize, experts.len()), layer))
            .collect();
        let loads = (0..lists.len() * per_rank)
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(ExpertRank {
            rank,
            dp,
            epoch,
            placement,
            transport,
            rounds: Arc::new(AtomicU64::new(0)),
            layers,
            tables,
            loads,
        })
    }

    /// The same rank on a new placement (the next epoch), continuing its collective count.
    /// Experts it already held stay where they are (the backend's weight cache); the others are
    /// uploaded now, before the epoch is committed.
    pub fn next_epoch(
        &self,
        backend: &CudaBackend,
        lists: &[&[ExpertWeights<ExpertLinear>]],
        placement: Arc<ExpertPlacement>,
        epoch: u32,
    ) -> Result<ExpertRank, CudaBackendError> {
        let transport = self.transport.clone();
        let next = Self::new(
            backend, lists, placement, epoch, self.rank, self.dp, transport,
        )?;
        Ok(ExpertRank {
            rounds: self.rounds.clone(),
            ..next
        })
    }

    /// After this epoch was committed in place of `previous`: drops from `backend`'s weight
    /// cache the experts `previous` held and this epoch does not
    /// (`ExpertPlacement::released_by`), so that the device keeps only this rank's experts
    /// (their memory is freed when `previous`'s last step ends). Returns how many (layer,
    /// expert) pairs were released.
    pub fn release_moved(
        &self,
        backend: &CudaBackend,
        lists: &[&[ExpertWeights<ExpertLinear>]],
        previous: &ExpertRank,
    ) -> usize {
        let released = previous
            .placement
            .released_by(&self.placement, EpRank(self.rank as u16));
        for &(layer, expert) in &released {
            if let Some(weights) = lists.get(layer).and_then(|experts| experts.get(expert)) {
                backend.forget_expert(weights);
            }
        }
        released.len()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// MoE layer collectives this rank (and its earlier epochs) took part in.
    pub fn collectives(&self) -> u64 {
        self.rounds.load(AtomicOrdering::Relaxed)
    }

    /// Routed rows each of this rank's slots received since the last call, `[layer][slot]`,
    /// the counters reset.
    pub fn take_loads(&self) -> Vec<Vec<u64>> {
        let per_rank = self.placement.slots_per_gpu;
        let counts: Vec<u64> = self
            .loads
            .iter()
            .map(|c| c.swap(0, AtomicOrdering::Relaxed))
            .collect();
        counts
            .chunks(per_rank.max(1))
            .map(<[u64]>::to_vec)
            .collect()
    }

    /// The placement this rank serves.
    pub fn placement(&self) -> &Arc<ExpertPlacement> {
        &self.placement
    }

    /// Logical experts whose weights this rank holds on its device, per layer.
    pub fn resident_experts(&self) -> Vec<usize> {
        self.tables.iter().map(SlotExperts::n_experts).collect()
    }

    /// The physical slot that serves `expert` of `layer` for this rank's rows (module doc).
    fn replica_slot(&self, layer: usize, expert: usize) -> usize {
        let per_rank = self.placement.slots_per_gpu;
        let replicas = &self.placement.layers[layer].log2phy[expert];
        replicas
            .iter()
            .map(|&s| s as usize)
            .find(|s| s / per_rank == self.rank)
            .unwrap_or_else(|| replicas[self.dp % replicas.len()] as usize)
    }
}

/// `placement` spans `ranks` ranks for `layers` backbone layers; every expert has a replica in
/// range.
fn check_placement(
    placement: &ExpertPlacement,
    layers: usize,
    ranks: usize,
    rank: usize,
) -> Result<(), String> {
    let slots = placement.slots_per_gpu * ranks;
    if rank >= ranks {
        return Err(format!("EP rank {rank} of {ranks}"));
    }
    if placement.layers.len() != layers {
        return Err(format!(
            "the placement has {} layers, the model {layers}",
            placement.layers.len()
        ));
    }
    for (layer, lp) in placement.layers.iter().enumerate() {
        if lp.phy2log.len() != slots {
            return Err(format!(
                "layer {layer}: {} slots, {ranks} ranks of {} expected",
                lp.phy2log.len(),
                placement.slots_per_gpu
            ));
        }
        if let Some(expert) = lp
            .log2phy
            .iter()
            .position(|r| r.is_empty() || r.iter().any(|&s| s as usize >= slots))
        {
            return Err(format!(
                "layer {layer}: expert {expert} has no replica in range"
            ));
        }
    }
    Ok(())
}

/// One layer's experts of an EP rank on its device, in slot order.
pub(super) enum SlotExperts {
    /// V4.1's FP4 or FP8 experts (`moe_rows`).
    Quantised(DeviceExperts),
    /// The V4 family's FP4 experts on the fast routed chain (`moe_rows_exact`, fast numerics).
    V4Fast(DeviceExperts),
    /// The V4 family's exact experts (`moe_rows_exact`).
    Exact(DeviceExactExperts),
}

impl SlotExperts {
    fn n_experts(&self) -> usize {
        match self {
            SlotExperts::Quantised(experts) | SlotExperts::V4Fast(experts) => {
                experts.table.n_experts()
            }
            SlotExperts::Exact(experts) => experts.table.n_experts(),
        }
    }

    /// The op whose collectives these experts serve, for errors.
    fn op(&self) -> &'static str {
        match self {
            SlotExperts::Quantised(_) => "moe_rows (expert parallel)",
            SlotExperts::V4Fast(_) | SlotExperts::Exact(_) => "moe_rows_exact (expert parallel)",
        }
    }
}

/// The expert rank a backend serves as, swapped between steps (shared: keep a clone after the
/// backend was handed to a model).
#[derive(Debug, Default)]
pub struct ExpertSlot(RwLock<Option<Arc<ExpertRank>>>);

impl ExpertSlot {
    /// Serve as `rank` from the next MoE layer on (call between steps); `None`: all experts here.
    pub fn set(&self, rank: Option<Arc<ExpertRank>>) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = rank;
    }

    pub fn get(&self) -> Option<Arc<ExpertRank>> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Where this rank's routed slots go, per destination rank: the slots (in slot order), their
/// destination-local expert and route weight.
#[derive(Default)]
struct Dispatch {
    slots: Vec<usize>,
    meta: RowMeta,
}

impl CudaBackend {
    /// This backend's expert-rank slot.
    pub fn expert_slot(&self) -> Arc<ExpertSlot> {
        self.experts.clone()
    }

    /// The expert rank serving `experts` (a backbone layer's list) and that layer's index.
    fn expert_rank_of(
        &self,
        experts: &[ExpertWeights<ExpertLinear>],
    ) -> Option<(Arc<ExpertRank>, usize)> {
        let ep = self.experts.get()?;
        let layer = *ep.layers.get(&(experts.as_ptr() as usize, experts.len()))?;
        Some((ep, layer))
    }

    /// This rank's `experts` of one layer (those of its slots, in slot order) on the device, of
    /// the kind they are: FP4/FP8 tables, V4 FP4 experts on the fast chain (fast numerics), or
    /// exact ones — what one rank of these numerics takes for them; an error naming `layer`
    /// otherwise.
    fn slot_experts(
        &self,
        op: &'static str,
        layer: usize,
        experts: &[&ExpertWeights<ExpertLinear>],
    ) -> Result<SlotExperts, CudaBackendError> {
        if self.numerics == Numerics::Fast
            && let Some(table) = self.v4_fast_expert_table_of(op, experts)?
        {
            return Ok(SlotExperts::V4Fast(table));
        }
        if let Some(table) = self.expert_table_of(op, experts)? {
            return Ok(SlotExperts::Quantised(table));
        }
        if let Some(table) = self.exact_expert_table_of(op, experts)? {
            return Ok(SlotExperts::Exact(table));
        }
        Err(shape_err(
            op,
            format!(
                "layer {layer}: experts neither all FP4 or all FP8 with 32x32 tiles, nor all \
                 exact with each projection in one format and shape"
            ),
        ))
    }

    /// The fused MoE (`moe_rows`, or `moe_rows_exact` with a hash layer's `hashed` experts) as
    /// this device's EP rank when `layer`'s experts are one of its backbone layers' (module doc),
    /// else `None`; an error aborts the transport so that no peer waits for this rank.
    pub(super) fn moe_rows_on_expert_rank(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
    ) -> Option<Result<Tensor, CudaBackendError>> {
        let (ep, layer_index) = self.expert_rank_of(layer.experts)?;
        let result = self.moe_rows_ep(x, layer, hashed, &ep, layer_index);
        if let Err(err) = &result {
            ep.transport.abort(ep.rank, &err.to_string());
        }
        Some(result)
    }

    fn moe_rows_ep(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
        ep: &ExpertRank,
        layer_index: usize,
    ) -> Result<Tensor, CudaBackendError> {
        let experts = ep.tables.get(layer_index).ok_or_else(|| {
            shape_err(
                "moe_rows (expert parallel)",
                format!("layer {layer_index} of {}", ep.tables.len()),
            )
        })?;
        let op = experts.op();
        let n_experts = layer.bias.len();
        let dim = layer.gate.len() / n_experts;
        let rows = x.len() / dim;
        let row_bytes = (dim * std::mem::size_of::<f32>()) as u64;
        let round = ep.rounds.fetch_add(1, AtomicOrdering::Relaxed);
        let tag = |phase| ExchangeTag {
            round,
            layer: layer_index,
            epoch: ep.epoch,
            phase,
        };
        let ranks = ep.transport.ranks();
        let per_rank = ep.placement.slots_per_gpu;

        // 1. Route, then gather each destination's rows (destination-major) into `send`.
        let mut plan: Vec<Dispatch> = (0..ranks).map(|_| Dispatch::default()).collect();
        let mut routes = None;
        let mut send = None;
        if rows > 0 {
            let (ids, weights, k) = self.routes(op, x, layer, hashed, rows)?;
            const ROUTES_TO_HOST: &str = "copying the routes to the host";
            let ids_host = self.to_host(op, &ids, ROUTES_TO_HOST)?;
            let weights_host = self.to_host(op, &weights, ROUTES_TO_HOST)?;
            for (slot, (&expert, &weight)) in ids_host.iter().zip(&weights_host).enumerate() {
                if expert as usize >= n_experts {
                    continue;
                }
                let phys = ep.replica_slot(layer_index, expert as usize);
                let to = &mut plan[phys / per_rank];
                to.slots.push(slot);
                to.meta.experts.push((phys % per_rank) as u32);
                to.meta.weights.push(weight);
            }
            let dx = self.input(op, x)?;
            let base = key_row_address(&self.rt, &dx, 0, dim).map_err(op_err(op))?;
            let addresses: Vec<u64> = plan
                .iter()
                .flat_map(|d| d.slots.iter().map(|&s| base + (s / k) as u64 * row_bytes))
                .collect();
            send = self.gathered(op, &addresses, dim)?;
            routes = Some((ids, k));
        }
        let counts: Vec<usize> = plan.iter().map(|d| d.slots.len()).collect();
        let meta = plan.iter().map(|d| d.meta.clone()).collect();
        let dispatch = RowExchange {
            rank: ep.rank,
            tag: tag(ExchangePhase::Dispatch),
            rows: send.as_ref(),
            width: dim,
            counts: &counts,
            meta,
        };
        let inbox = ep.transport.all_to_all_rows(self, dispatch)?;

        // 2. Run this rank's experts on what it received; send the outputs back.
        let mut outbox = None;
        if let Some(received) = &inbox.rows {
            let n = received.len() / dim;
            let ids_in: Vec<u32> = inbox.meta.iter().flat_map(|m| m.experts.clone()).collect();
            for &slot in &ids_in {
                if let Some(count) = ep.loads.get(layer_index * per_rank + slot as usize) {
                    count.fetch_add(1, AtomicOrdering::Relaxed);
                }
            }
            let weights_in: Vec<f32> = inbox.meta.iter().flat_map(|m| m.weights.clone()).collect();
            if ids_in.len() != n || weights_in.len() != n {
                return Err(shape_err(
                    op,
                    format!(
                        "received {n} rows with {} expert ids and {} weights",
                        ids_in.len(),
                        weights_in.len()
                    ),
                ));
            }
            let ids_in = self
                .rt
                .htod(&ids_in)
                .map_err(driver_err(op, "uploading received expert ids"))?;
            let weights_in = self.upload(op, &weights_in)?;
            outbox = Some(self.received_slots(
                op,
                experts,
                received,
                dim,
                &ids_in,
                &weights_in,
                layer,
            )?);
        }
        let combine = RowExchange {
            rank: ep.rank,
            tag: tag(ExchangePhase::Combine),
            rows: outbox.as_ref(),
            width: dim,
            counts: &inbox.counts,
            meta: vec![RowMeta::default(); ranks],
        };
        let back = ep.transport.all_to_all_rows(self, combine)?;
        if back.counts != counts {
            return Err(shape_err(
                op,
                format!("sent rows {counts:?}, got outputs {:?}", back.counts),
            ));
        }

        // 3. Slot outputs in slot order, the shared expert, the combine of one rank.
        let mut result = Tensor::empty();
        if let (Some((ids, k)), Some(outputs)) = (&routes, &back.rows) {
            let base = key_row_address(&self.rt, outputs, 0, dim).map_err(op_err(op))?;
            // A dropped slot (id beyond the experts, skipped by the combine) reads row 0.
            let mut addresses = vec![base; rows * k];
            let mut position = 0u64;
            for d in &plan {
                for &slot in &d.slots {
                    addresses[slot] = base + position * row_bytes;
                    position += 1;
                }
            }
            let slot_out = self
                .gathered(op, &addresses, dim)?
                .ok_or_else(|| shape_err(op, "rows without routed slots".to_string()))?;
            result = self.combined(op, experts, x, layer, &slot_out, ids)?;
        }
        ep.transport.finish(ep.rank, tag(ExchangePhase::Done))?;
        drop((send, outbox));
        Ok(result)
    }

    /// This rank's `experts` on the `received` rows `[n, dim]` (f32): row `j` through its
    /// local expert `ids[j]` weighted by `weights[j]`, as one rank runs a slot → f32 `[n, dim]`
    /// (the same quantiser and kernels on the same row values: the same bits).
    #[allow(clippy::too_many_arguments)]
    fn received_slots(
        &self,
        op: &'static str,
        experts: &SlotExperts,
        received: &CudaSlice<f32>,
        dim: usize,
        ids: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        layer: &MoeLayer<'_>,
    ) -> Result<CudaSlice<f32>, CudaBackendError> {
        let n = ids.len();
        match experts {
            SlotExperts::Quantised(experts) => {
                let a = quantize_act_fp8(&self.rt, received, n, dim, ActGroup::G32)
                    .map_err(op_err(op))?;
                let out = self.routed_slots(
                    op,
                    &a,
                    ids,
                    1,
                    weights,
                    &experts.table,
                    layer.swiglu_limit,
                    rounding(layer.precision),
                )?;
                // SAFETY: bf16_to_f32's grid-stride loop writes every value.
                let mut wide = unsafe { self.alloc_written(op, out.len()) }?;
                bf16_to_f32(&self.rt, &out, &mut wide).map_err(op_err(op))?;
                Ok(wide)
            }
            SlotExperts::V4Fast(experts) => {
                let a = quantize_act_fp8(&self.rt, received, n, dim, ActGroup::G32)
                    .map_err(op_err(op))?;
                let limit = layer.swiglu_limit;
                let table = &experts.table;
                self.routed_slots::<f32>(op, &a, ids, 1, weights, table, limit, Rounding::F32)
            }
            SlotExperts::Exact(experts) => {
                if experts.table.dim() != dim {
                    return Err(shape_err(
                        op,
                        format!("experts of width {}, rows of {dim}", experts.table.dim()),
                    ));
                }
                self.exact_slots(
                    op,
                    received,
                    ids,
                    1,
                    weights,
                    &experts.table,
                    layer.swiglu_limit,
                )
            }
        }
    }

    /// The shared expert on the rows `x` and the combine with their slots' outputs `slot_out`
    /// (f32, slot order, experts `ids`), as one rank runs them for the kind of `experts`.
    fn combined(
        &self,
        op: &'static str,
        experts: &SlotExperts,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        slot_out: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
    ) -> Result<Tensor, CudaBackendError> {
        if let SlotExperts::Exact(_) | SlotExperts::V4Fast(_) = experts {
            return self.v4_shared_combine(op, x, layer, slot_out, ids);
        }
        let n_experts = layer.bias.len();
        let dim = layer.gate.len() / n_experts;
        let rounding = rounding(layer.precision);
        let a = self.quantised_activations(op, x, dim, ActGroup::G32)?;
        let shared = self.shared_expert(op, &a, layer.shared, layer.swiglu_limit, rounding)?;
        // SAFETY: bf16_to_f32's grid-stride loop writes every value.
        let mut shared_wide = unsafe { self.alloc_written(op, shared.len()) }?;
        bf16_to_f32(&self.rt, &shared, &mut shared_wide).map_err(op_err(op))?;
        // SAFETY: moe_combine runs one block per row and covers every column.
        let mut out = unsafe { self.alloc_written(op, x.len()) }?;
        moe_combine(
            &self.rt,
            slot_out,
            ids,
            n_experts,
            &shared_wide,
            dim,
            rounding,
            &mut out,
        )
        .map_err(op_err(op))?;
        Ok(self.tensor(out))
    }

    /// `[addresses.len(), width]` f32 rows gathered from device addresses; `None` for none.
    pub(super) fn gathered(
        &self,
        op: &'static str,
        addresses: &[u64],
        width: usize,
    ) -> Result<Option<CudaSlice<f32>>, CudaBackendError> {
        if addresses.is_empty() {
            return Ok(None);
        }
        // SAFETY: gather_ptrs_f32 strides over every piece and every value of it.
        let mut out = unsafe { self.alloc_written(op, addresses.len() * width) }?;
        gather_addresses_f32(&self.rt, addresses, width, &mut out).map_err(op_err(op))?;
        Ok(Some(out))
    }
}
