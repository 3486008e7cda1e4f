//! The routed experts on the device from device routes (`deepinfer_kernels::ops::routed`): the
//! whole MoE chain — route (`route_experts_f32`) → quantise → routed `w1`/`w3` → SwiGLU with route
//! weights → quantise → routed `w2` → combine with the shared expert — with no copy to the host,
//! bitwise equal to the host math of `deepinfer_model::layers::moe::forward_rows` (grouped experts,
//! `quant::gemm_fp4` / `gemm_fp8`, `quant::exp_f32`, rows added in increasing expert id, then the
//! shared expert, then one rounding).
//!
//! - Small shapes (16 experts, dim 96, inter 64, top-4/6, 1/5/33 rows, both roundings, clamp on
//!   and off, one row per block, 8-row tiles and the expert-major 32-row tiles) and hand-made
//!   routes with a repeated expert and out-of-range ids (dropped; their GEMM rows are written as
//!   zeros over NaN-filled buffers).
//! - Expert-major tiles on hand-made routes: 70 rows all on the same two experts (three tiles per
//!   expert) and 20 rows whose 40 slots all pick different experts, at K = 5280 (a second chunk
//!   of weight loads) and 96.
//! - Negative controls: the same host math with the slot outputs added in slot order, or the
//!   shared expert added first, differs from the device result somewhere.
//! - K order inside the routed GEMM: weights whose k-group partials are +2^25, -2^25 and 2^-5
//!   at chosen groups, so that any other order of a column's additions changes the output
//!   (a bf16 output hides most fp32 order changes; these do not).
//! - FP8 experts through the same routed GEMM, row for row against `quant::gemm_fp8`.
//! - The SwiGLU quantiser (`swiglu_act_quant_fp8`: SwiGLU and the FP8 quantisation of `w2`'s
//!   activations in one kernel) against the host SwiGLU then `quant::quantize_act_fp8`, codes and
//!   scales bitwise, bf16 and f32 rows, on zero groups, signed zeros, clamps, subnormal values
//!   under the 1e-4 floor and wide groups.
//! - Extreme activations (`fp4_gemms_are_exact_on_extreme_activations`): the FP4 group sum
//!   (two FMA accumulators split by activation magnitude, gemm_block_scaled.cuh's `fp4_dot`) on
//!   E4M3 maxima ±448, subnormals, values around the split point, mixed signs and cancelling
//!   halves, each column's partial laid bare in its bf16 output by two correction groups; every
//!   dense split and routed kernel against `quant::gemm_fp4`.
//! - Real width (dim 5120, inter 2304, 384 experts, top-6, rows 1/8/64): bitwise, and the device
//!   time of the chain and of the routed w1 alone is printed per kernel; then a 1024-token
//!   prefill (6144 routed rows): the three kernels bitwise equal to each other, timed.
//!
//! Measured on the H200 (2026-11-30, helper speed2, FP4 sums with two FMA accumulators): all 7
//! pass; the extreme-activation test compares 448 columns × (4 dense splits × 9 rows + 3 routed
//! bodies × 18 rows), and a plain FMA chain would change 13 of its columns; the chain after routing
//! takes (rows / tiles / expert-major) 1 row 240 / 339 / 278 µs, 8 rows 1.40 / 1.53 / 1.51 ms,
//! 64 rows 10.7 / 8.11 / 8.39 ms, the 1024-token prefill 170 / 103 / 99.3 ms.
//! Measured on the H200 (2026-11-30, helper moespeed): all 6 pass; 26 208 small-shape outputs,
//! 5120 / 40 960 / 327 680 at real width and 5 242 880 in the prefill bitwise; other combine
//! orders differ in 354 (slot order) and 196 (shared first) outputs; the expert-major kernel with
//! its 32 partials of a step added in reverse fails the K-order test (43 of 64 outputs, 0 for
//! 2^-5). The chain after routing takes, per kernel (rows per block / 8-row tiles / expert-major
//! tiles): 1 row 325 / 438 / 384 µs, 8 rows 2.07 / 2.18 / 2.17 ms, 64 rows 16.1 / 10.2 / 10.4 ms,
//! the 1024-token prefill 256 / 119 / 107 ms; the routed w1 alone reaches at most 10% of the
//! copy bandwidth (issue-bound on the exact CUDA-core arithmetic, see bench/README.md).
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a CUDA driver every test fails, naming why.
#![cfg(feature = "cuda")]

use std::time::Instant;

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, Fp4Form, Fp8Form, GemmSplit, gemm_fp4, gemm_fp8,
};
use deepinfer_kernels::ops::moe::{Selection, route_experts_f32};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8_into};
use deepinfer_kernels::ops::routed::{
    DeviceExpertTable, ExpertGroups, ExpertProjection, ExpertRefs, RoutedBlocks, RoutedRows,
    gemm_routed, moe_combine, swiglu_act_quant_fp8,
};
use deepinfer_model::backend::{Backend, CpuBackend, ExpertSelection, Precision, Routing};
use deepinfer_model::quant;
use deepinfer_model::weights::{Fp4Weight, Fp8Weight, e2m1_to_f32};
use half::bf16;

mod gpu_support;
use gpu_support::{Rng, assert_bitwise, differing, precision_of, runtime};

/// `n` random bytes.
fn bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(n);
    out
}

/// A bf16 activation of magnitude 2^-8 .. 2^2, a few exact zeros.
fn moe_activation(rng: &mut Rng) -> f32 {
    if rng.below(40) == 0 {
        return 0.0;
    }
    let exponent = rng.below(11) as i32 - 8;
    quant::round_bf16(rng.uniform() * 2f32.powi(exponent))
}

/// A UE8M0 weight scale 2^-9 .. 2^-3 (gate/up values around the SwiGLU's interesting range).
fn scale_byte(rng: &mut Rng) -> u8 {
    (118 + rng.below(7)) as u8
}

/// An FP4 weight whose scales are `2^shift` times the usual ones.
fn fp4_weight(rng: &mut Rng, out: usize, inp: usize, shift: u8) -> Fp4Weight {
    Fp4Weight {
        out,
        inp,
        packed: bytes(rng, out * inp / 2),
        scales: (0..out * inp / 32)
            .map(|_| scale_byte(rng) + shift)
            .collect(),
    }
}

fn fp8_weight(rng: &mut Rng, out: usize, inp: usize) -> Fp8Weight {
    let scales = out.div_ceil(32) * inp.div_ceil(32);
    Fp8Weight {
        out,
        inp,
        block: 32,
        // 0x7f / 0xff are E4M3 NaN codes: map them to ±0.
        data: bytes(rng, out * inp)
            .into_iter()
            .map(|b| if b & 0x7f == 0x7f { b & 0x80 } else { b })
            .collect(),
        scales: (0..scales).map(|_| scale_byte(rng)).collect(),
    }
}

/// One SwiGLU expert's weights on the host.
struct HostExpert<W> {
    w1: W,
    w3: W,
    w2: W,
}

/// The references of a routed table to each expert's three projections.
fn expert_refs<W>(experts: &[HostExpert<W>]) -> Vec<ExpertRefs<'_, W>> {
    experts
        .iter()
        .map(|e| ExpertRefs {
            w1: &e.w1,
            w3: &e.w3,
            w2: &e.w2,
        })
        .collect()
}

trait HostGemm {
    fn apply(&self, x: &[f32]) -> Vec<f32>;
}

impl HostGemm for Fp4Weight {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        quant::gemm_fp4(x, self)
    }
}

impl HostGemm for Fp8Weight {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        quant::gemm_fp8(x, self)
    }
}

/// `layers::moe::expert` on the host: the same clamps, `g / (1 + exp_f32(-g)) * u`, route weight,
/// rounding, then `w2`. Also counts the clamped gate values (to show the clamp path ran).
fn host_expert<W: HostGemm>(
    e: &HostExpert<W>,
    x: &[f32],
    rows: usize,
    weights: Option<&[f32]>,
    limit: f32,
    precision: Precision,
) -> (Vec<f32>, usize) {
    let gate = e.w1.apply(x);
    let up = e.w3.apply(x);
    let inter = gate.len() / rows.max(1);
    let (hidden, clamped) = host_swiglu(&gate, &up, inter, weights, limit, precision);
    (e.w2.apply(&hidden), clamped)
}

/// The SwiGLU rows of `layers::moe::expert` on the host (`gate`, `up` `[rows, inter]`): the
/// clamps at `limit` (none at 0), `g / (1 + exp_f32(-g)) * u`, the row's route weight, rounded at
/// `precision`; and how many gate values the clamp cut.
fn host_swiglu(
    gate: &[f32],
    up: &[f32],
    inter: usize,
    weights: Option<&[f32]>,
    limit: f32,
    precision: Precision,
) -> (Vec<f32>, usize) {
    let mut clamped = 0;
    let hidden = gate
        .iter()
        .zip(up)
        .enumerate()
        .map(|(i, (&g, &u))| {
            let (g, u) = if limit > 0.0 {
                clamped += usize::from(g > limit);
                (g.min(limit), u.clamp(-limit, limit))
            } else {
                (g, u)
            };
            let a = g / (1.0 + quant::exp_f32(-g)) * u;
            let weight = weights.and_then(|w| w.get(i / inter.max(1)));
            precision.round(weight.map_or(a, |w| w * a))
        })
        .collect();
    (hidden, clamped)
}

/// How the host reference adds a token's outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CombineOrder {
    /// `forward_rows`: routed outputs in increasing expert id, then the shared expert.
    Reference,
    /// Negative control: routed outputs in slot order.
    Slots,
    /// Negative control: the shared expert first.
    SharedFirst,
}

/// `forward_rows` (no expert parallelism) over given routes: every expert runs once on the rows
/// that chose it (in parallel host threads: the rows never interact), then each row adds its
/// outputs in `order`, then rounds. Returns the output and the clamped-gate count.
#[allow(clippy::too_many_arguments)]
fn host_moe<W: HostGemm + Sync>(
    x: &[f32],
    dim: usize,
    routes: &[(Vec<u32>, Vec<f32>)],
    experts: &[&HostExpert<Fp4Weight>],
    shared: &HostExpert<W>,
    limit: f32,
    precision: Precision,
    order: CombineOrder,
) -> (Vec<f32>, usize) {
    let rows = routes.len();
    // users[e]: (row, slot, weight) of every slot that chose expert e, rows ascending.
    let mut users: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); experts.len()];
    for (t, (ids, weights)) in routes.iter().enumerate() {
        for (s, (&e, &w)) in ids.iter().zip(weights).enumerate() {
            if let Some(list) = users.get_mut(e as usize) {
                list.push((t, s, w));
            }
        }
    }
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let busy: Vec<usize> = (0..experts.len())
        .filter(|&e| !users[e].is_empty())
        .collect();
    let outputs: Vec<(usize, Vec<f32>, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = busy
            .chunks(busy.len().div_ceil(threads).max(1))
            .map(|chunk| {
                let users = &users;
                scope.spawn(move || {
                    chunk
                        .iter()
                        .map(|&e| {
                            let xe: Vec<f32> = users[e]
                                .iter()
                                .flat_map(|&(t, _, _)| x[t * dim..(t + 1) * dim].iter().copied())
                                .collect();
                            let scale: Vec<f32> = users[e].iter().map(|&(_, _, w)| w).collect();
                            let (out, clamped) = host_expert(
                                experts[e],
                                &xe,
                                users[e].len(),
                                Some(&scale),
                                limit,
                                precision,
                            );
                            (e, out, clamped)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("host expert thread"))
            .collect()
    });
    let (shared_out, shared_clamped) = host_expert(shared, x, rows, None, limit, precision);
    // Per row: (expert id, slot, output row) of each routed slot.
    let mut per_row: Vec<Vec<(usize, usize, &[f32])>> = vec![Vec::new(); rows];
    let mut clamped = shared_clamped;
    for (e, out, c) in &outputs {
        clamped += c;
        for (&(t, s, _), row) in users[*e].iter().zip(out.chunks_exact(dim)) {
            per_row[t].push((*e, s, row));
        }
    }
    let mut y = vec![0.0f32; rows * dim];
    for (t, slots) in per_row.iter_mut().enumerate() {
        match order {
            CombineOrder::Reference | CombineOrder::SharedFirst => {
                slots.sort_by_key(|&(e, s, _)| (e, s))
            }
            CombineOrder::Slots => slots.sort_by_key(|&(_, s, _)| s),
        }
        let acc = &mut y[t * dim..(t + 1) * dim];
        let shared_row = &shared_out[t * dim..(t + 1) * dim];
        if order == CombineOrder::SharedFirst {
            acc.iter_mut().zip(shared_row).for_each(|(a, v)| *a += v);
        }
        for (_, _, out) in slots.iter() {
            acc.iter_mut().zip(*out).for_each(|(a, v)| *a += v);
        }
        if order != CombineOrder::SharedFirst {
            acc.iter_mut().zip(shared_row).for_each(|(a, v)| *a += v);
        }
    }
    (y.into_iter().map(|v| precision.round(v)).collect(), clamped)
}

/// Device buffers of the whole chain for `rows` tokens with `k` slots each.
struct DeviceMoe {
    blocks: RoutedBlocks,
    k: usize,
    dim: usize,
    inter: usize,
    shared_inter: usize,
    x: CudaSlice<bf16>,
    qx: DeviceActFp8,
    experts: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    gate: CudaSlice<bf16>,
    up: CudaSlice<bf16>,
    qh: DeviceActFp8,
    routed: CudaSlice<bf16>,
    shared_gate: CudaSlice<bf16>,
    shared_up: CudaSlice<bf16>,
    shared_qh: DeviceActFp8,
    shared_out: CudaSlice<bf16>,
    y: CudaSlice<f32>,
}

/// The shared expert on the device (FP8, 32×32 tiles).
struct DeviceShared {
    w1: DeviceFp8Weight,
    w3: DeviceFp8Weight,
    w2: DeviceFp8Weight,
}

/// `n` bf16 NaNs: outputs a kernel must write (zero rows included) cannot pass unwritten.
fn nan_bf16(rt: &KernelRuntime, n: usize) -> CudaSlice<bf16> {
    rt.stream()
        .clone_htod(&vec![bf16::NAN; n])
        .expect("NaN-filled buffer")
}

fn upload_fp8(rt: &KernelRuntime, w: &Fp8Weight) -> DeviceFp8Weight {
    DeviceFp8Weight::upload(rt, w.into()).expect("upload FP8")
}

fn upload_fp4(rt: &KernelRuntime, w: &Fp4Weight) -> DeviceFp4Weight {
    DeviceFp4Weight::upload(rt, w.into()).expect("upload FP4")
}

impl DeviceMoe {
    fn new(
        rt: &KernelRuntime,
        x: &[f32],
        (rows, k, dim, inter, shared_inter): (usize, usize, usize, usize, usize),
    ) -> DeviceMoe {
        let s = rt.stream();
        let host: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let m = rows * k;
        DeviceMoe {
            blocks: RoutedBlocks::Auto,
            k,
            dim,
            inter,
            shared_inter,
            x: s.clone_htod(&host).expect("upload x"),
            qx: DeviceActFp8::alloc(rt, rows, dim, ActGroup::G32).expect("qx"),
            experts: s.alloc_zeros(m).expect("experts"),
            weights: s.alloc_zeros(m).expect("weights"),
            gate: nan_bf16(rt, m * inter),
            up: nan_bf16(rt, m * inter),
            qh: DeviceActFp8::alloc(rt, m, inter, ActGroup::G32).expect("qh"),
            routed: nan_bf16(rt, m * dim),
            shared_gate: s.alloc_zeros(rows * shared_inter).expect("shared gate"),
            shared_up: s.alloc_zeros(rows * shared_inter).expect("shared up"),
            shared_qh: DeviceActFp8::alloc(rt, rows, shared_inter, ActGroup::G32)
                .expect("shared qh"),
            shared_out: s.alloc_zeros(rows * dim).expect("shared out"),
            y: s.alloc_zeros(rows * dim).expect("y"),
        }
    }

    /// Routes from gate logits on the device into `experts` / `weights`.
    fn route(&mut self, rt: &KernelRuntime, logits: &[f32], bias: &[f32], route_scale: f32) {
        let s = rt.stream();
        let logits = s.clone_htod(logits).expect("upload logits");
        let bias = s.clone_htod(bias).expect("upload bias");
        route_experts_f32(
            rt,
            &logits,
            &bias,
            Selection::TopK(self.k),
            route_scale,
            &mut self.experts,
            &mut self.weights,
        )
        .expect("route");
    }

    /// The whole chain after routing; nothing leaves the device.
    fn run(
        &mut self,
        rt: &KernelRuntime,
        table: &DeviceExpertTable,
        shared: &DeviceShared,
        limit: f32,
        rounding: Rounding,
    ) {
        assert_eq!((table.dim(), table.inter()), (self.dim, self.inter));
        assert_eq!(shared.w1.out, self.shared_inter);
        quantize_act_fp8_into(rt, &self.x, &mut self.qx).expect("quantise x");
        let k = self.k;
        // Grouped once for the three routed GEMMs, as `moe_rows` does.
        let groups =
            ExpertGroups::blocks(rt, &self.experts, table, self.blocks).expect("group slots");
        gemm_routed(
            rt,
            RoutedRows {
                x: &self.qx,
                groups: &groups,
                x_row_div: k,
                which: ExpertProjection::W1,
            },
            table,
            &mut self.gate,
        )
        .expect("routed w1");
        gemm_routed(
            rt,
            RoutedRows {
                x: &self.qx,
                groups: &groups,
                x_row_div: k,
                which: ExpertProjection::W3,
            },
            table,
            &mut self.up,
        )
        .expect("routed w3");
        swiglu_act_quant_fp8(
            rt,
            &self.gate.slice(..),
            &self.up.slice(..),
            Some(&self.weights),
            limit,
            rounding,
            &mut self.qh,
        )
        .expect("routed swiglu, quantised");
        gemm_routed(
            rt,
            RoutedRows {
                x: &self.qh,
                groups: &groups,
                x_row_div: 1,
                which: ExpertProjection::W2,
            },
            table,
            &mut self.routed,
        )
        .expect("routed w2");
        // The shared expert: the production launch (its kernel and split chosen by the shape).
        let split = GemmSplit::Auto;
        gemm_fp8(rt, &self.qx, &shared.w1, &mut self.shared_gate, split).expect("shared w1");
        gemm_fp8(rt, &self.qx, &shared.w3, &mut self.shared_up, split).expect("shared w3");
        swiglu_act_quant_fp8(
            rt,
            &self.shared_gate.slice(..),
            &self.shared_up.slice(..),
            None,
            limit,
            rounding,
            &mut self.shared_qh,
        )
        .expect("shared swiglu, quantised");
        gemm_fp8(rt, &self.shared_qh, &shared.w2, &mut self.shared_out, split).expect("shared w2");
        moe_combine(
            rt,
            &self.routed,
            &self.experts,
            table.n_experts(),
            &self.shared_out,
            self.dim,
            rounding,
            &mut self.y,
        )
        .expect("combine");
    }

    /// (experts, weights) of every row, read back for the host reference.
    fn routes(&self, rt: &KernelRuntime) -> Vec<(Vec<u32>, Vec<f32>)> {
        let ids = rt.stream().clone_dtoh(&self.experts).expect("download ids");
        let weights = rt.stream().clone_dtoh(&self.weights).expect("download w");
        ids.chunks_exact(self.k)
            .zip(weights.chunks_exact(self.k))
            .map(|(i, w)| (i.to_vec(), w.to_vec()))
            .collect()
    }

    fn output(&self, rt: &KernelRuntime) -> Vec<f32> {
        rt.stream().clone_dtoh(&self.y).expect("download y")
    }

    /// `ExpertProjection::GateUp` of the last run's slots (grouped the same way) into a buffer of
    /// NaNs; with the run's gate and up rows: `(gate_up, gate, up)`.
    fn gate_up(
        &self,
        rt: &KernelRuntime,
        table: &DeviceExpertTable,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let groups =
            ExpertGroups::blocks(rt, &self.experts, table, self.blocks).expect("group slots");
        let mut both = nan_bf16(rt, 2 * self.gate.len());
        gemm_routed(
            rt,
            RoutedRows {
                x: &self.qx,
                groups: &groups,
                x_row_div: self.k,
                which: ExpertProjection::GateUp,
            },
            table,
            &mut both,
        )
        .expect("routed w1 and w3");
        let download = |y: &CudaSlice<bf16>| -> Vec<f32> {
            let values = rt.stream().clone_dtoh(y).expect("download");
            values.iter().map(|v| v.to_f32()).collect()
        };
        (download(&both), download(&self.gate), download(&self.up))
    }
}

/// The layer's host experts and their device copies; `pool` distinct weights shared out
/// cyclically (each expert still has its own device copy).
struct Layer {
    host: Vec<HostExpert<Fp4Weight>>,
    device: Vec<HostExpert<DeviceFp4Weight>>,
    shared_host: HostExpert<Fp8Weight>,
    shared: DeviceShared,
    n_experts: usize,
}

impl Layer {
    fn new(
        rt: &KernelRuntime,
        rng: &mut Rng,
        (n_experts, pool, dim, inter): (usize, usize, usize, usize),
    ) -> Layer {
        // Output magnitudes 2^0 .. 2^15 apart between experts: a token's sum then loses bits,
        // so its order shows in the result.
        let host: Vec<HostExpert<Fp4Weight>> = (0..pool)
            .map(|p| HostExpert {
                w1: fp4_weight(rng, inter, dim, 0),
                w3: fp4_weight(rng, inter, dim, 0),
                w2: fp4_weight(rng, dim, inter, 3 * (p % 6) as u8),
            })
            .collect();
        let device = (0..n_experts)
            .map(|e| {
                let h = &host[e % pool];
                HostExpert {
                    w1: upload_fp4(rt, &h.w1),
                    w3: upload_fp4(rt, &h.w3),
                    w2: upload_fp4(rt, &h.w2),
                }
            })
            .collect();
        let shared_host = HostExpert {
            w1: fp8_weight(rng, inter, dim),
            w3: fp8_weight(rng, inter, dim),
            w2: fp8_weight(rng, dim, inter),
        };
        let shared = DeviceShared {
            w1: upload_fp8(rt, &shared_host.w1),
            w3: upload_fp8(rt, &shared_host.w3),
            w2: upload_fp8(rt, &shared_host.w2),
        };
        Layer {
            host,
            device,
            shared_host,
            shared,
            n_experts,
        }
    }

    fn table(&self, rt: &KernelRuntime) -> DeviceExpertTable {
        // SAFETY: the table is used only while `self` (which owns the weights) is alive.
        unsafe { DeviceExpertTable::fp4(rt, &expert_refs(&self.device)) }.expect("expert table")
    }

    /// The routed MoE of `x` (`rows` rows, top-`k`, experts of width `inter`) over the routes
    /// `(ids, weights)` on the device in `blocks` (route scale 10, bf16), and the host MoE of the
    /// routes the device read: (the device run, its output, the host's).
    fn routed(
        &self,
        rt: &KernelRuntime,
        table: &DeviceExpertTable,
        x: &[f32],
        (rows, k, inter): (usize, usize, usize),
        (ids, weights): (&[u32], &[f32]),
        blocks: RoutedBlocks,
    ) -> (DeviceMoe, Vec<f32>, Vec<f32>) {
        let dim = x.len() / rows;
        let mut moe = DeviceMoe::new(rt, x, (rows, k, dim, inter, inter));
        moe.blocks = blocks;
        moe.experts = rt.stream().clone_htod(ids).expect("ids");
        moe.weights = rt.stream().clone_htod(weights).expect("weights");
        moe.run(rt, table, &self.shared, 10.0, Rounding::Bf16);
        let routes = moe.routes(rt);
        let gpu = moe.output(rt);
        let (want, _) = host_moe(
            x,
            dim,
            &routes,
            &self.host_refs(),
            &self.shared_host,
            10.0,
            Precision::Bf16,
            CombineOrder::Reference,
        );
        (moe, gpu, want)
    }

    fn host_refs(&self) -> Vec<&HostExpert<Fp4Weight>> {
        (0..self.n_experts)
            .map(|e| &self.host[e % self.host.len()])
            .collect()
    }
}

/// A gate or up value of magnitude class `class` (one per 32-group of the hidden rows), rounded
/// to bf16 when `bf16`: zeros; gates below -104 (exp_f32 overflows: the value is a signed zero);
/// beyond the clamp of 10; near bf16's smallest (subnormal hidden values under the 1e-4 floor);
/// the usual 2^-8 .. 2^4; a group spanning 2^-24 .. 2^8 (codes down to zero); large (2^10 ..
/// 2^20); negative gates (small sigmoids).
fn swiglu_input(rng: &mut Rng, class: usize, gate: bool, bf16: bool) -> f32 {
    let sign = if rng.below(2) == 0 { -1.0 } else { 1.0 };
    let unit = 0.5 + 0.5 * rng.uniform().abs();
    let magnitude = |rng: &mut Rng, lo: i32, hi: i32| {
        unit * 2f32.powi(lo + rng.below((hi - lo + 1) as u64) as i32)
    };
    let v = match class {
        0 => 0.0,
        1 if gate => -(104.5 + 64.0 * unit),
        2 => sign * (10.0 + 30.0 * unit),
        3 => sign * magnitude(rng, -66, -60),
        4 | 1 => sign * magnitude(rng, -8, 4),
        5 => sign * magnitude(rng, -24, 8),
        6 => sign * magnitude(rng, 10, 20),
        _ if gate => -magnitude(rng, -2, 4),
        _ => sign * magnitude(rng, -4, 2),
    };
    if bf16 { quant::round_bf16(v) } else { v }
}

/// The SwiGLU quantiser (`swiglu_act_quant_fp8`, one kernel) against the host: the hidden values
/// of `layers::moe::expert` (clamps, `quant::exp_f32`, the route weight, the rounding) quantised
/// by `quant::quantize_act_fp8` in 32-groups, codes and scales bitwise — what `swiglu_rows` then
/// `quantize_act_fp8` gave. bf16 and f32 gate/up rows, route weights or none, clamp on and off,
/// both roundings, on [`swiglu_input`]'s classes, 5 rows of 96 (the last warp holds 96 of its 128
/// values).
#[test]
fn swiglu_quantiser_matches_the_cpu_bitwise() {
    let rt = runtime("swiglu_quantiser_matches_the_cpu_bitwise");
    let mut rng = Rng(29);
    let (rows, inter) = (5usize, 96usize);
    let n = rows * inter;
    let s = rt.stream();
    let (mut checked, mut floors, mut negative_zeros, mut clamped) = (0, 0, 0, 0);
    for bf16_rows in [true, false] {
        let inputs = |rng: &mut Rng, gate: bool| -> Vec<f32> {
            (0..n)
                .map(|i| swiglu_input(rng, (i / 32) % 8, gate, bf16_rows))
                .collect()
        };
        let (gate, up) = (inputs(&mut rng, true), inputs(&mut rng, false));
        let route_weights: Vec<f32> = (0..rows)
            .map(|_| 0.05 + 0.95 * rng.uniform().abs())
            .collect();
        let d_weights = s.clone_htod(&route_weights).expect("route weights");
        for (limit, rounding, weighted) in [
            (10.0f32, Rounding::Bf16, true),
            (0.0, Rounding::Bf16, false),
            (10.0, Rounding::F32, false),
            (0.0, Rounding::F32, true),
        ] {
            let what = format!(
                "{} rows, limit {limit}, {rounding:?}, weighted {weighted}",
                if bf16_rows { "bf16" } else { "f32" }
            );
            let precision = precision_of(rounding);
            let host_weights = weighted.then_some(route_weights.as_slice());
            let (hidden, cut) = host_swiglu(&gate, &up, inter, host_weights, limit, precision);
            clamped += cut;
            negative_zeros += hidden.iter().filter(|v| v.to_bits() == 0x8000_0000).count();
            floors += hidden
                .chunks_exact(32)
                .filter(|g| g.iter().all(|v| v.abs() < 1e-4))
                .count();
            let (want_codes, want_scales) = quant::quantize_act_fp8(&hidden, 32);
            let mut q = DeviceActFp8::alloc(&rt, rows, inter, ActGroup::G32).expect("alloc");
            let weights = weighted.then_some(&d_weights);
            if bf16_rows {
                let upload = |v: &[f32]| {
                    s.clone_htod(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())
                        .expect("upload")
                };
                let (dg, du) = (upload(&gate), upload(&up));
                swiglu_act_quant_fp8(
                    &rt,
                    &dg.slice(..),
                    &du.slice(..),
                    weights,
                    limit,
                    rounding,
                    &mut q,
                )
            } else {
                let (dg, du) = (
                    s.clone_htod(&gate).expect("gate"),
                    s.clone_htod(&up).expect("up"),
                );
                swiglu_act_quant_fp8(
                    &rt,
                    &dg.slice(..),
                    &du.slice(..),
                    weights,
                    limit,
                    rounding,
                    &mut q,
                )
            }
            .expect("swiglu_act_quant_fp8");
            let codes = s.clone_dtoh(&q.codes).expect("codes");
            let scales = s.clone_dtoh(&q.scales).expect("scales");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&scales), bits(&want_scales), "{what}: scales");
            for (i, (c, w)) in codes.iter().zip(&want_codes).enumerate() {
                assert_eq!(
                    c,
                    w,
                    "{what}: code {i} (hidden {:e}, scale {:e})",
                    hidden[i],
                    want_scales[i / 32]
                );
            }
            assert_eq!(codes.len(), want_codes.len());
            checked += codes.len();
        }
    }
    assert!(
        floors > 0 && negative_zeros > 0 && clamped > 0,
        "edges not reached: {floors} floor groups, {negative_zeros} -0 values, {clamped} clamps"
    );
    println!(
        "SwiGLU quantiser: {checked} codes (and their scales) bitwise the host's; {floors} groups \
         at the 1e-4 floor, {negative_zeros} hidden -0 values, {clamped} gates clamped"
    );
}

#[test]
fn routed_moe_chain_matches_the_cpu_bitwise() {
    let rt = runtime("routed_moe_chain_matches_the_cpu_bitwise");
    let (n_experts, dim, inter) = (16, 96, 64);
    let mut rng = Rng(41);
    let layer = Layer::new(&rt, &mut rng, (n_experts, n_experts, dim, inter));
    let table = layer.table(&rt);
    let experts = layer.host_refs();
    let cpu = CpuBackend::new();
    let (mut checked, mut clamped, mut slot_order_differs, mut shared_first_differs) = (0, 0, 0, 0);
    for (rows, k) in [(1usize, 6usize), (5, 4), (33, 6)] {
        let x: Vec<f32> = (0..rows * dim).map(|_| moe_activation(&mut rng)).collect();
        let logits: Vec<f32> = (0..rows * n_experts).map(|_| rng.uniform() * 4.0).collect();
        let bias: Vec<f32> = (0..n_experts).map(|_| rng.uniform() * 0.25).collect();
        for (rounding, limit, blocks) in [
            (Rounding::Bf16, 10.0f32, RoutedBlocks::Rows),
            (Rounding::Bf16, 10.0f32, RoutedBlocks::Tiles),
            (Rounding::Bf16, 0.0, RoutedBlocks::Tiles),
            (Rounding::F32, 10.0, RoutedBlocks::Rows),
            (Rounding::F32, 10.0, RoutedBlocks::Tiles),
            (Rounding::Bf16, 10.0, RoutedBlocks::Experts),
            (Rounding::F32, 0.0, RoutedBlocks::Experts),
        ] {
            let what = format!("{rows} rows top-{k} {rounding:?} limit {limit} {blocks:?}");
            let precision = precision_of(rounding);
            let mut moe = DeviceMoe::new(&rt, &x, (rows, k, dim, inter, inter));
            moe.blocks = blocks;
            moe.route(&rt, &logits, &bias, 1.5);
            moe.run(&rt, &table, &layer.shared, limit, rounding);
            let routes = moe.routes(&rt);
            // The device routes are the CPU router's.
            let cpu_routes = cpu.route_experts(
                &logits.as_slice().into(),
                Routing {
                    bias: &bias,
                    selection: ExpertSelection::TopK(k),
                    route_scale: 1.5,
                },
            );
            for (t, (ids, weights)) in routes.iter().enumerate() {
                let want: Vec<u32> = cpu_routes[t].experts.iter().map(|&e| e as u32).collect();
                assert_eq!(ids, &want, "{what}: row {t} experts");
                assert_bitwise(&what, weights, &cpu_routes[t].weights);
            }
            let gpu = moe.output(&rt);
            let reference = |order| {
                host_moe(
                    &x,
                    dim,
                    &routes,
                    &experts,
                    &layer.shared_host,
                    limit,
                    precision,
                    order,
                )
            };
            let (want, c) = reference(CombineOrder::Reference);
            assert_bitwise(&what, &gpu, &want);
            checked += gpu.len();
            clamped += c;
            slot_order_differs += differing(&gpu, &reference(CombineOrder::Slots).0);
            shared_first_differs += differing(&gpu, &reference(CombineOrder::SharedFirst).0);
        }
    }
    assert!(clamped > 0, "the SwiGLU clamp never ran");
    assert!(
        slot_order_differs > 0 && shared_first_differs > 0,
        "negative controls: another combine order was not seen ({slot_order_differs}, {shared_first_differs})"
    );
    println!(
        "routed MoE chain: {checked} outputs bitwise equal to the CPU ({clamped} gate values \
         clamped); other orders differ in {slot_order_differs} (slot order) and \
         {shared_first_differs} (shared first) outputs"
    );
}

#[test]
fn routed_gemm_handles_repeats_and_unknown_experts_like_the_cpu() {
    let rt = runtime("routed_gemm_handles_repeats_and_unknown_experts_like_the_cpu");
    let (n_experts, dim, inter, k) = (16, 96, 64, 4);
    let mut rng = Rng(7);
    let layer = Layer::new(&rt, &mut rng, (n_experts, n_experts, dim, inter));
    let table = layer.table(&rt);
    let rows = 3;
    let x: Vec<f32> = (0..rows * dim).map(|_| moe_activation(&mut rng)).collect();
    // Row 0 takes expert 5 twice (slot order decides), row 1 an unknown id (dropped), row 2
    // descending ids (the combine reorders them).
    let ids: Vec<u32> = vec![5, 2, 5, 9, 3, 99, 0, 16, 15, 11, 4, 1];
    let weights: Vec<f32> = (0..rows * k)
        .map(|_| quant::round_bf16(0.5 + rng.uniform() * 0.25))
        .collect();
    for blocks in [
        RoutedBlocks::Rows,
        RoutedBlocks::Tiles,
        RoutedBlocks::Experts,
    ] {
        let routes = (ids.as_slice(), weights.as_slice());
        let (moe, gpu, want) = layer.routed(&rt, &table, &x, (rows, k, inter), routes, blocks);
        assert_bitwise("repeats and unknown ids", &gpu, &want);
        // w1 and w3 as one GateUp call: each plane the bits of its own launch.
        let (both, gate, up) = moe.gate_up(&rt, &table);
        let plane = gate.len();
        assert_bitwise("GateUp's w1 plane", &both[..plane], &gate);
        assert_bitwise("GateUp's w3 plane", &both[plane..], &up);
        assert!(differing(&gate, &up) > 0, "w1 and w3 give the same rows");
        // An unknown id's rows are zero in every projection.
        let gate: Vec<f32> = rt
            .stream()
            .clone_dtoh(&moe.gate)
            .expect("gate")
            .iter()
            .map(|v| v.to_f32())
            .collect();
        for slot in [5usize, 7] {
            assert!(
                gate[slot * inter..(slot + 1) * inter]
                    .iter()
                    .all(|&v| v.to_bits() == 0),
                "slot {slot} (id {}) has a gate row",
                ids[slot]
            );
        }
        assert!(gate[..inter].iter().any(|&v| v != 0.0));
        println!(
            "routed GEMM ({blocks:?}): repeated and unknown expert ids as the CPU ({} outputs); \
             GateUp's planes bitwise the w1 and w3 launches",
            gpu.len()
        );
    }
}

#[test]
fn routed_fp8_gemm_matches_the_cpu_rows() {
    let rt = runtime("routed_fp8_gemm_matches_the_cpu_rows");
    let (n_experts, dim, inter, rows, k) = (5, 160, 96, 7, 3);
    let mut rng = Rng(8);
    let host: Vec<HostExpert<Fp8Weight>> = (0..n_experts)
        .map(|_| HostExpert {
            w1: fp8_weight(&mut rng, inter, dim),
            w3: fp8_weight(&mut rng, inter, dim),
            w2: fp8_weight(&mut rng, dim, inter),
        })
        .collect();
    let device: Vec<HostExpert<DeviceFp8Weight>> = host
        .iter()
        .map(|h| HostExpert {
            w1: upload_fp8(&rt, &h.w1),
            w3: upload_fp8(&rt, &h.w3),
            w2: upload_fp8(&rt, &h.w2),
        })
        .collect();
    // SAFETY: `device` outlives every launch below.
    let table = unsafe { DeviceExpertTable::fp8(&rt, &expert_refs(&device)) }.expect("FP8 table");
    let x: Vec<f32> = (0..rows * dim).map(|_| moe_activation(&mut rng)).collect();
    let ids: Vec<u32> = (0..rows * k)
        .map(|_| rng.below(n_experts as u64 + 1) as u32)
        .collect();
    let s = rt.stream();
    let dx = s
        .clone_htod(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>())
        .expect("x");
    let mut qx = DeviceActFp8::alloc(&rt, rows, dim, ActGroup::G32).expect("qx");
    quantize_act_fp8_into(&rt, &dx, &mut qx).expect("quantise");
    let d_ids = s.clone_htod(&ids).expect("ids");
    for blocks in [
        RoutedBlocks::Rows,
        RoutedBlocks::Tiles,
        RoutedBlocks::Experts,
    ] {
        let mut out = nan_bf16(&rt, rows * k * inter);
        let groups = ExpertGroups::blocks(&rt, &d_ids, &table, blocks).expect("group slots");
        gemm_routed(
            &rt,
            RoutedRows {
                x: &qx,
                groups: &groups,
                x_row_div: k,
                which: ExpertProjection::W3,
            },
            &table,
            &mut out,
        )
        .expect("fp8");
        let gpu: Vec<f32> = s
            .clone_dtoh(&out)
            .expect("out")
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let mut unknown = 0;
        for (j, &e) in ids.iter().enumerate() {
            let t = j / k;
            let row = &gpu[j * inter..(j + 1) * inter];
            let want = match host.get(e as usize) {
                Some(h) => quant::gemm_fp8(&x[t * dim..(t + 1) * dim], &h.w3),
                None => {
                    unknown += 1;
                    vec![0.0; inter]
                }
            };
            assert_bitwise(
                &format!("FP8 routed row {j} expert {e} {blocks:?}"),
                row,
                &want,
            );
        }
        println!(
            "routed FP8 GEMM ({blocks:?}): {} rows bitwise equal to quant::gemm_fp8 ({unknown} unknown ids zero)",
            rows * k
        );
    }
}

#[test]
fn routed_moe_at_real_width_matches_the_cpu_and_is_timed() {
    let rt = runtime("routed_moe_at_real_width_matches_the_cpu_and_is_timed");
    // V4.1: dim 5120, 384 routed experts of inter 2304, top-6; 25 distinct host weight sets
    // shared out cyclically (every expert has its own device copy: 384 × 18.8 MB).
    let (n_experts, pool, dim, inter, k) = (384, 25, 5120, 2304, 6);
    let mut rng = Rng(5120);
    let started = Instant::now();
    let layer = Layer::new(&rt, &mut rng, (n_experts, pool, dim, inter));
    let table = layer.table(&rt);
    rt.synchronize().expect("sync");
    println!(
        "real width: {n_experts} experts uploaded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let experts = layer.host_refs();
    let expert_bytes = 3 * (inter * dim / 2 + inter * dim / 32);
    for rows in [1usize, 8, 64] {
        let x: Vec<f32> = (0..rows * dim).map(|_| moe_activation(&mut rng)).collect();
        let logits: Vec<f32> = (0..rows * n_experts).map(|_| rng.uniform() * 4.0).collect();
        let bias: Vec<f32> = (0..n_experts).map(|_| rng.uniform() * 0.25).collect();
        let mut moe = DeviceMoe::new(&rt, &x, (rows, k, dim, inter, inter));
        moe.route(&rt, &logits, &bias, 1.5);
        moe.run(&rt, &table, &layer.shared, 10.0, Rounding::Bf16);
        let routes = moe.routes(&rt);
        let gpu = moe.output(&rt);
        let (want, _) = host_moe(
            &x,
            dim,
            &routes,
            &experts,
            &layer.shared_host,
            10.0,
            Precision::Bf16,
            CombineOrder::Reference,
        );
        assert_bitwise(&format!("real width, {rows} rows"), &gpu, &want);
        // Timing: the chain after routing (quantise, routed w1/w3, SwiGLU, quantise, routed w2,
        // the shared expert, combine), averaged over repeated launches.
        let mut distinct: Vec<u32> = routes.iter().flat_map(|(ids, _)| ids.clone()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let bytes = distinct.len() * expert_bytes + 3 * inter * dim;
        println!(
            "real width, {rows} rows (top-{k}, {} distinct experts): bitwise equal ({} outputs)",
            distinct.len(),
            gpu.len()
        );
        for blocks in [
            RoutedBlocks::Experts,
            RoutedBlocks::Rows,
            RoutedBlocks::Tiles,
        ] {
            moe.blocks = blocks;
            moe.run(&rt, &table, &layer.shared, 10.0, Rounding::Bf16);
            assert_bitwise(
                &format!("real width, {rows} rows, {blocks:?}"),
                &moe.output(&rt),
                &want,
            );
            let iterations = 20;
            rt.synchronize().expect("sync");
            let t0 = Instant::now();
            for _ in 0..iterations {
                moe.run(&rt, &table, &layer.shared, 10.0, Rounding::Bf16);
            }
            rt.synchronize().expect("sync");
            let per_step = t0.elapsed().as_secs_f64() / iterations as f64;
            println!(
                "  {blocks:?}: device chain {:.1} µs per step, {:.2} TB/s of distinct expert + \
                 shared weights",
                per_step * 1e6,
                bytes as f64 / per_step / 1e12
            );
            let w1 = time_routed_w1(&rt, &mut moe, &table, iterations);
            let w1_bytes = distinct.len() * (inter * dim / 2 + inter * dim / 32);
            println!(
                "  {blocks:?}: routed w1 alone {:.1} µs, {:.2} TB/s of distinct w1 bytes ({:.0}% of \
                 the 4.28 TB/s copy roofline)",
                w1 * 1e6,
                w1_bytes as f64 / w1 / 1e12,
                w1_bytes as f64 / w1 / 4.28e12 * 100.0
            );
        }
    }
    prefill_matches_the_row_kernel(&rt, &layer, &table, &mut rng);
}

/// Seconds per launch of the routed `w1` GEMM of `moe`'s rows with `moe.blocks`.
fn time_routed_w1(
    rt: &KernelRuntime,
    moe: &mut DeviceMoe,
    table: &DeviceExpertTable,
    iterations: usize,
) -> f64 {
    let launch = |moe: &mut DeviceMoe| {
        let groups =
            ExpertGroups::blocks(rt, &moe.experts, table, moe.blocks).expect("group slots");
        gemm_routed(
            rt,
            RoutedRows {
                x: &moe.qx,
                groups: &groups,
                x_row_div: moe.k,
                which: ExpertProjection::W1,
            },
            table,
            &mut moe.gate,
        )
        .expect("routed w1");
    };
    launch(moe);
    rt.synchronize().expect("sync");
    let t0 = Instant::now();
    for _ in 0..iterations {
        launch(moe);
    }
    rt.synchronize().expect("sync");
    t0.elapsed().as_secs_f64() / iterations as f64
}

/// Hand-made routes for the expert-major tiles: every row on the same two experts (more rows
/// than one 32-row tile, so an expert spans several tiles) and every slot on a different expert
/// (one-row tiles), at K = 5280 (165 k-groups: a second chunk of weight loads) and K = 96.
#[test]
fn routed_gemm_tiles_crowded_and_scattered_experts_like_the_cpu() {
    let rt = runtime("routed_gemm_tiles_crowded_and_scattered_experts_like_the_cpu");
    let (n_experts, dim, inter, k) = (40, 5280, 96, 2);
    let mut rng = Rng(4141);
    let layer = Layer::new(&rt, &mut rng, (n_experts, 7, dim, inter));
    let table = layer.table(&rt);
    let crowded_rows = 70;
    let crowded: Vec<u32> = (0..crowded_rows * k)
        .map(|j| if j % 2 == 0 { 3 } else { 17 })
        .collect();
    let scattered_rows = n_experts / k;
    let scattered: Vec<u32> = (0..scattered_rows * k)
        .map(|j| ((j * 7 + 5) % n_experts) as u32)
        .collect();
    let mut distinct = scattered.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), scattered.len(), "every slot its own expert");
    for (what, rows, ids) in [
        ("crowded", crowded_rows, crowded),
        ("scattered", scattered_rows, scattered),
    ] {
        let x: Vec<f32> = (0..rows * dim).map(|_| moe_activation(&mut rng)).collect();
        let weights: Vec<f32> = (0..rows * k)
            .map(|_| quant::round_bf16(0.5 + rng.uniform() * 0.25))
            .collect();
        let mut outputs = Vec::new();
        for blocks in [RoutedBlocks::Experts, RoutedBlocks::Rows] {
            let routes = (ids.as_slice(), weights.as_slice());
            let (_, gpu, want) = layer.routed(&rt, &table, &x, (rows, k, inter), routes, blocks);
            assert_bitwise(&format!("{what} experts, {blocks:?}"), &gpu, &want);
            outputs.push(gpu);
        }
        println!(
            "routed GEMM, {what} experts ({rows} rows, top-{k}, K = {dim} and {inter}): \
             Experts and Rows bitwise equal to the CPU ({} outputs)",
            outputs[0].len()
        );
    }
}

/// A 1024-token prefill at real width (6144 routed rows, every expert busy) on the real-width
/// layer: the expert-major tiles against the one-row-per-block and 8-row-tile kernels (checked
/// against the CPU at 1 / 8 / 64 rows), bitwise, and timed.
fn prefill_matches_the_row_kernel(
    rt: &KernelRuntime,
    layer: &Layer,
    table: &DeviceExpertTable,
    rng: &mut Rng,
) {
    let (n_experts, dim, inter, k, rows) = (layer.n_experts, table.dim(), table.inter(), 6, 1024);
    let x: Vec<f32> = (0..rows * dim).map(|_| moe_activation(rng)).collect();
    let logits: Vec<f32> = (0..rows * n_experts).map(|_| rng.uniform() * 4.0).collect();
    let bias: Vec<f32> = (0..n_experts).map(|_| rng.uniform() * 0.25).collect();
    let mut moe = DeviceMoe::new(rt, &x, (rows, k, dim, inter, inter));
    moe.route(rt, &logits, &bias, 1.5);
    let mut outputs = Vec::new();
    for blocks in [
        RoutedBlocks::Experts,
        RoutedBlocks::Rows,
        RoutedBlocks::Tiles,
    ] {
        moe.blocks = blocks;
        moe.run(rt, table, &layer.shared, 10.0, Rounding::Bf16);
        outputs.push(moe.output(rt));
        let iterations = 3;
        rt.synchronize().expect("sync");
        let t0 = Instant::now();
        for _ in 0..iterations {
            moe.run(rt, table, &layer.shared, 10.0, Rounding::Bf16);
        }
        rt.synchronize().expect("sync");
        let per_step = t0.elapsed().as_secs_f64() / iterations as f64;
        let w1 = time_routed_w1(rt, &mut moe, table, iterations);
        println!(
            "prefill {rows} tokens, {blocks:?}: device chain {:.2} ms, routed w1 alone {:.2} ms",
            per_step * 1e3,
            w1 * 1e3
        );
    }
    assert_bitwise("prefill, Experts vs Rows", &outputs[0], &outputs[1]);
    assert_bitwise("prefill, Experts vs Tiles", &outputs[0], &outputs[2]);
    println!(
        "prefill {rows} tokens: Experts, Rows and Tiles bitwise equal ({} outputs)",
        outputs[0].len()
    );
}

/// UE8M0 byte of 2^e.
fn ue8m0(e: i32) -> u8 {
    (127 + e) as u8
}

/// An all-zero FP4 weight `[out, inp]` (the routed table's w2 slot where only w1 runs).
fn zero_fp4(out: usize, inp: usize) -> Fp4Weight {
    Fp4Weight {
        out,
        inp,
        packed: vec![0; out * inp / 2],
        scales: vec![ue8m0(0); out * inp / 32],
    }
}

/// Runs the routed W1 GEMM of `qx` (`slots` output rows a row) over `n` experts that all hold
/// `w1` (and `w2`), output row `j` routed to expert `j % n`, in every block layout (rows, tiles,
/// experts), into a NaN-filled output; asserts every output row bitwise `want_row`.
fn assert_routed_w1_rows(
    rt: &KernelRuntime,
    qx: &DeviceActFp8,
    (w1, w2, n): (&DeviceFp4Weight, &DeviceFp4Weight, usize),
    slots: usize,
    want_row: &[f32],
    what: &str,
) {
    let refs: Vec<ExpertRefs<'_, DeviceFp4Weight>> =
        (0..n).map(|_| ExpertRefs { w1, w3: w1, w2 }).collect();
    // SAFETY: the weights outlive every launch below.
    let table = unsafe { DeviceExpertTable::fp4(rt, &refs) }.expect("table");
    let ids: Vec<u32> = (0..qx.rows * slots).map(|j| (j % n) as u32).collect();
    let ids = rt.stream().clone_htod(&ids).expect("ids");
    let outputs = ids.len() * want_row.len();
    for blocks in [
        RoutedBlocks::Rows,
        RoutedBlocks::Tiles,
        RoutedBlocks::Experts,
    ] {
        let mut out = nan_bf16(rt, outputs);
        let groups = ExpertGroups::blocks(rt, &ids, &table, blocks).expect("group slots");
        gemm_routed(
            rt,
            RoutedRows {
                x: qx,
                groups: &groups,
                x_row_div: slots,
                which: ExpertProjection::W1,
            },
            &table,
            &mut out,
        )
        .expect("routed w1");
        let gpu: Vec<f32> = rt
            .stream()
            .clone_dtoh(&out)
            .expect("out")
            .iter()
            .map(|v| v.to_f32())
            .collect();
        for (j, row) in gpu.chunks_exact(want_row.len()).enumerate() {
            assert_bitwise(
                &format!("{what}, {blocks:?}, output row {j}"),
                row,
                want_row,
            );
        }
    }
}

/// A routed GEMM whose K-order shows in every output: x = 1 everywhere (E4M3 code 256, scale
/// 2^-8) and weights that are zero except k-groups of +1 or -1 codes scaled so that a group's
/// partial is +P = 2^25, -P or s = 2^-5. Column n % 3 = 0: groups 0, 1, 2 = +P, -P, s (in K order
/// the sum is s; any other order inside the first 32 groups loses s to 0); n % 3 = 1: groups
/// 0, 40, 70 = +P, s, -P (0; -P before s gives s); n % 3 = 2: groups 3, 163, 164 = +P, -P, s at
/// K = 5280 (s; the last groups lie in a second chunk of weight loads). Every kernel must give
/// exactly the CPU's s or 0, column for column.
#[test]
fn routed_gemm_adds_k_groups_in_k_order() {
    let rt = runtime("routed_gemm_adds_k_groups_in_k_order");
    let (n_experts, dim, inter, rows, k) = (2, 5280, 64, 5, 2);
    let groups = dim / 32;
    let (big, small) = (20, -10);
    // (group, code nibble, scale exponent) per pattern.
    let patterns: [[(usize, u8, i32); 3]; 3] = [
        [(0, 0x2, big), (1, 0xA, big), (2, 0x2, small)],
        [(0, 0x2, big), (40, 0x2, small), (70, 0xA, big)],
        [(3, 0x2, big), (163, 0xA, big), (164, 0x2, small)],
    ];
    let mut packed = vec![0u8; inter * dim / 2];
    let mut scales = vec![ue8m0(0); inter * groups];
    for n in 0..inter {
        for &(group, nibble, exponent) in &patterns[n % 3] {
            let start = n * dim / 2 + group * 16;
            packed[start..start + 16].fill(nibble | (nibble << 4));
            scales[n * groups + group] = ue8m0(exponent);
        }
    }
    let w1 = Fp4Weight {
        out: inter,
        inp: dim,
        packed,
        scales,
    };
    let zero_w2 = zero_fp4(dim, inter);
    let (d_w1, d_w2) = (upload_fp4(&rt, &w1), upload_fp4(&rt, &zero_w2));
    let x = vec![1.0f32; rows * dim];
    let want_row = quant::gemm_fp4(&x[..dim], &w1);
    let s_value = 2f32.powi(-5);
    for (n, &v) in want_row.iter().enumerate() {
        let expected = if n % 3 == 1 { 0.0 } else { s_value };
        assert_eq!(v, expected, "CPU column {n}");
    }
    let s = rt.stream();
    let dx = s
        .clone_htod(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>())
        .expect("x");
    let mut qx = DeviceActFp8::alloc(&rt, rows, dim, ActGroup::G32).expect("qx");
    quantize_act_fp8_into(&rt, &dx, &mut qx).expect("quantise");
    let experts = (&d_w1, &d_w2, n_experts);
    assert_routed_w1_rows(&rt, &qx, experts, k, &want_row, "K-order pattern");
    println!(
        "routed GEMM (rows, tiles, experts blocks): {} outputs of the K-order patterns as the CPU",
        rows * k * inter
    );
}

/// The E4M3 value of `code` (never a NaN code here).
fn e4m3(code: u8) -> f32 {
    quant::e4m3_table()[usize::from(code)]
}

/// The significand bits of `v` from its leading one down `bits` bits (toward zero) and the rest:
/// `v = head + tail` exactly, `head` has at most `bits` significant bits.
fn split_top_bits(v: f32, bits: u32) -> (f32, f32) {
    if v == 0.0 {
        return (0.0, 0.0);
    }
    let head = f32::from_bits(v.to_bits() & !((1u32 << (24 - bits)) - 1));
    (head, v - head)
}

/// A group of 32 weights and activations whose partial is `-head` exactly: activations 2^i
/// (i < 8) and 448 (which fixes the group's activation scale at 1), weights ±1 on the bits of
/// head's 8-bit significand and 0 on the 448, the weight scale 2^q with head = ±m · 2^q.
fn correction_group(head: f32) -> ([f32; 32], [u8; 32], u8) {
    let mut x = [0.0f32; 32];
    let mut nibbles = [0u8; 32];
    for (i, value) in x.iter_mut().take(8).enumerate() {
        *value = (1u32 << i) as f32;
    }
    x[8] = 448.0;
    if head == 0.0 {
        return (x, nibbles, ue8m0(0));
    }
    // head = ±m · 2^q with m < 256 an integer.
    let exponent = ((head.to_bits() >> 23) & 0xff) as i32 - 127;
    let q = exponent - 7;
    let m = (head.abs() / 2f32.powi(q)) as u32;
    assert!(
        m < 256 && m as f32 * 2f32.powi(q) == head.abs(),
        "head {head:e}"
    );
    let minus_one = if head > 0.0 { 0xA } else { 0x2 };
    for (i, nibble) in nibbles.iter_mut().take(8).enumerate() {
        if m & (1 << i) != 0 {
            *nibble = minus_one;
        }
    }
    (x, nibbles, ue8m0(q))
}

/// The partial of one group in the order of a naive kernel (one fp32 FMA chain, no split): what
/// the exact group sum would lose without fp4_dot's split.
fn naive_partial(x: &[f32], w: &[f32]) -> f32 {
    x.iter()
        .zip(w)
        .fold(0.0f32, |acc, (a, b)| a.mul_add(*b, acc))
}

/// Extreme E4M3 activations through every FP4 GEMM kernel, with each output showing the low bits
/// of its column's group partial. The activation row holds DATA data groups and two correction
/// groups; column n uses data group n % DATA (its other data groups have zero weights): each data
/// group has one ±448 (so its activation scale is exactly 2^e, e per group, and every code is
/// the chosen one) and 31 codes of one class: random codes (all 254 non-NaN), maxima and the
/// smallest subnormals against weights ±6 / ±0.5 (the exact sum needs ~27 bits), values
/// 0.2 .. 0.3 around the split point 2^-2, or a half of large codes cancelled by their negations
/// leaving a subnormal tail. The two correction groups subtract the top 8 and the next 8
/// significant bits of the column's scaled partial P, so the bf16 output is P's last 8 bits
/// exactly: any other rounding of the group sum changes it (the host shows a plain FMA chain
/// would in some columns).
#[test]
fn fp4_gemms_are_exact_on_extreme_activations() {
    const DATA: usize = 14;
    let groups = DATA + 2;
    let k = 32 * groups;
    let n_cols = 32 * DATA;
    let mut rng = Rng(0x5eed_f4e4);
    let random_code = |rng: &mut Rng| loop {
        let c = rng.below(256) as u8;
        if c & 0x7f != 0x7f {
            break c;
        }
    };
    // Data groups: activation values (E4M3 values times 2^e) and the class of each.
    let mut x = vec![0.0f32; k];
    let mut class_of = [0usize; DATA];
    for (d, class) in class_of.iter_mut().enumerate() {
        *class = d % 4;
        let e = d as i32 - 8;
        let mut codes = [0u8; 32];
        for (i, code) in codes.iter_mut().enumerate().skip(1) {
            let sign = (rng.below(2) as u8) << 7;
            *code = match *class {
                0 => random_code(&mut rng),
                // Odd: the two largest codes (448, 416); even: subnormals 2^-9, 2^-8.
                1 => {
                    sign | if i % 2 == 1 {
                        0x7e - rng.below(2) as u8
                    } else {
                        1 + rng.below(2) as u8
                    }
                }
                // 0.203125 .. 0.3125: codes 0x2a .. 0x32 (exponent fields 4 and 5).
                2 => sign | (0x2a + rng.below(9) as u8),
                _ => 0,
            };
        }
        if *class == 3 {
            // Codes 1 .. 15: 15 large codes, their negations, and a subnormal tail.
            for i in 1..16 {
                codes[i] = (0x60 + rng.below(30) as u8) | ((rng.below(2) as u8) << 7);
                codes[i + 15] = codes[i] ^ 0x80;
            }
            codes[31] = 1 + rng.below(7) as u8;
        }
        codes[0] = 0x7e | ((rng.below(2) as u8) << 7);
        for (i, &code) in codes.iter().enumerate() {
            x[32 * d + i] = e4m3(code) * 2f32.powi(e);
        }
    }
    // Weights: column n's data group gets random nibbles (class 1: ±6 against the maxima and
    // ±0.5 against the subnormals; class 3: each cancelling pair shares its weight).
    let mut nibbles = vec![0u8; n_cols * k];
    let mut scales = vec![ue8m0(0); n_cols * groups];
    let mut naive_differs = 0;
    for n in 0..n_cols {
        let d = n % DATA;
        let row = &mut nibbles[n * k..(n + 1) * k];
        for i in 0..32 {
            let sign = (rng.below(2) as u8) << 3;
            row[32 * d + i] = match class_of[d] {
                1 => sign | if i % 2 == 1 { 7 } else { 1 },
                _ => rng.below(16) as u8,
            };
        }
        if class_of[d] == 3 {
            for i in 1..16 {
                row[32 * d + i + 15] = row[32 * d + i];
            }
        }
        // P: the data group's scaled partial as the reference computes it (weight scale 1).
        let act: Vec<f32> = (0..32)
            .map(|i| x[32 * d + i] / 2f32.powi(d as i32 - 8))
            .collect();
        let w: Vec<f32> = (0..32).map(|i| e2m1_to_f32(row[32 * d + i])).collect();
        let p = quant::dot_f32(&act, &w) * 2f32.powi(d as i32 - 8);
        let (head1, rest1) = split_top_bits(p, 8);
        let (head2, rest2) = split_top_bits(rest1, 8);
        for (slot, head) in [(DATA, head1), (DATA + 1, head2)] {
            let (cx, cw, scale) = correction_group(head);
            x[32 * slot..32 * (slot + 1)].copy_from_slice(&cx);
            row[32 * slot..32 * (slot + 1)].copy_from_slice(&cw);
            scales[n * groups + slot] = scale;
        }
        let naive = naive_partial(&act, &w) * 2f32.powi(d as i32 - 8);
        if quant::round_bf16((naive - head1) - head2) != quant::round_bf16(rest2) {
            naive_differs += 1;
        }
    }
    // The correction groups' activations are the same for every column: written once above.
    let packed: Vec<u8> = nibbles
        .chunks_exact(2)
        .map(|pair| pair[0] | (pair[1] << 4))
        .collect();
    let weight = Fp4Weight {
        out: n_cols,
        inp: k,
        packed,
        scales,
    };
    let want_row = quant::gemm_fp4(&x, &weight);
    // The construction: each output is its partial's low bits, exactly (bf16 holds 8 bits).
    let mut lowest_bits_shown = 0;
    for (n, &v) in want_row.iter().enumerate() {
        let d = n % DATA;
        let act: Vec<f32> = (0..32)
            .map(|i| x[32 * d + i] / 2f32.powi(d as i32 - 8))
            .collect();
        let row = &nibbles[n * k..(n + 1) * k];
        let w: Vec<f32> = (0..32).map(|i| e2m1_to_f32(row[32 * d + i])).collect();
        let p = quant::dot_f32(&act, &w) * 2f32.powi(d as i32 - 8);
        let rest = split_top_bits(split_top_bits(p, 8).1, 8).1;
        assert_eq!(v.to_bits(), rest.to_bits(), "CPU column {n}: partial {p:e}");
        lowest_bits_shown += usize::from(rest != 0.0);
    }
    assert!(
        naive_differs > 0,
        "the data must defeat a plain FMA chain somewhere"
    );
    println!(
        "extreme activations: {lowest_bits_shown} of {n_cols} columns show nonzero low bits; a plain \
         FMA chain would change {naive_differs}"
    );

    // The host checks above run everywhere; the kernels need the GPU.
    let rt = runtime("fp4_gemms_are_exact_on_extreme_activations");
    let d_weight = upload_fp4(&rt, &weight);
    // The routed table's w2 slot ([k, n_cols]); only w1 runs here.
    let zero_w2 = zero_fp4(k, n_cols);
    let d_w2 = upload_fp4(&rt, &zero_w2);
    let s = rt.stream();
    for rows in [1usize, 8] {
        let xs: Vec<f32> = x.iter().copied().cycle().take(rows * k).collect();
        let dx = s.clone_htod(&xs).expect("x");
        let mut qx = DeviceActFp8::alloc(&rt, rows, k, ActGroup::G32).expect("qx");
        quantize_act_fp8_into(&rt, &dx, &mut qx).expect("quantise");
        for split in [
            GemmSplit::Auto,
            GemmSplit::ColumnPerWarp,
            GemmSplit::WarpsPerColumn(1),
            GemmSplit::WarpsPerColumn(2),
        ] {
            let mut y = nan_bf16(&rt, rows * n_cols);
            gemm_fp4(&rt, &qx, &d_weight, &mut y, split).expect("gemm_fp4");
            let gpu: Vec<f32> = s
                .clone_dtoh(&y)
                .expect("y")
                .iter()
                .map(|v| v.to_f32())
                .collect();
            for r in 0..rows {
                assert_bitwise(
                    &format!("dense gemm_fp4 {split:?}, {rows} rows, row {r}"),
                    &gpu[r * n_cols..(r + 1) * n_cols],
                    &want_row,
                );
            }
        }
        // Routed: every expert is this weight; rows / slot pairs over the experts.
        let n_experts = 3;
        let slots = 2;
        let what = format!("routed gemm_fp4, {rows} rows");
        let experts = (&d_weight, &d_w2, n_experts);
        assert_routed_w1_rows(&rt, &qx, experts, slots, &want_row, &what);
    }
    println!("extreme activations: every FP4 kernel bitwise equal to quant::gemm_fp4");
}
