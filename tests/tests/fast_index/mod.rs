//! The `fast` indexer scores (`ops::index::index_scores_rows_ptr_fast`, tensor-core dot products)
//! against the exact kernel (`index_scores_rows_f32`, bitwise the CPU reference) on the
//! indexer's inputs: q and keys `Q4e`-QDQ'd by the model's own `quant::q4_qdq_e8m0_group32`,
//! each 32-group of a row uniform in [-1, 1) times 2^-2 … 2^2 before the QDQ (so a head's four
//! group scale products lie within 2^8 of each other: every dot product is exact in fp32, the
//! condition `index_scores_fast.cuh` states) — the scores are bitwise equal, at V4.1's 32 heads ×
//! 128, V4's 64 and 20 (a partial 16-head tile), over the keys of two sequences in separate
//! buffers read through one key table, queries of both interleaved (a block restages its keys)
//! with 0 … 700 visible keys (tile edges 127, 128, 129 included). Negative control: q left
//! un-QDQ'd (fp32 values that bf16 cannot hold) gives other scores.
//!
//! Deterministic and batch invariant: a second run gives the same bits, and every query alone
//! gives the bits it has among the batch's others (another block, group position and key
//! staging). Through `CudaBackend` in `Numerics::Fast`: `index_scores_rows_at` at the bf16
//! rounding points equals the CPU reference bitwise and runs on tensor cores (the op profile);
//! fp32 precision and the exact numerics do not.

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::index::{
    DeviceVisiblePrefixes, IndexRows, index_scores_rows_f32, index_scores_rows_ptr_fast,
};
use deepinfer_kernels::ops::key_table::{DeviceKeyTable, KeyRows, key_row_address};
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::backend::{
    Backend, CpuBackend, IndexQueries, KeyList, Precision, SelectPart, Tensor,
};
use deepinfer_model::quant;

use deepinfer_tests::data::fp32_values;

use crate::gpu_support::{Rng, assert_bitwise, differing};

const HEAD_DIM: usize = 128;
/// V4.1's indexer heads, V4's, and a partial 16-head tile.
const HEADS: [usize; 3] = [32, 64, 20];
/// Keys of the two sequences.
const SEQUENCE_KEYS: [usize; 2] = [700, 300];
/// The queries: (sequence, visible keys), the sequences interleaved; more than two blocks' 8.
const QUERIES: [(usize, usize); 20] = [
    (0, 0),
    (0, 1),
    (1, 5),
    (0, 127),
    (0, 128),
    (1, 129),
    (0, 129),
    (0, 300),
    (1, 300),
    (1, 0),
    (0, 512),
    (0, 513),
    (1, 17),
    (1, 256),
    (0, 700),
    (0, 640),
    (1, 64),
    (0, 33),
    (1, 299),
    (0, 699),
];

/// `n` values Q4e-QDQ'd as the indexer's q and keys are: each 32-group uniform in [-1, 1) times
/// 2^e, e in -2..=2, then `quant::q4_qdq_e8m0_group32` (bf16 values, E2M1 times a power of two).
fn qdq_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut values = Vec::with_capacity(n);
    while values.len() < n {
        let scale = 2f32.powi(rng.below(5) as i32 - 2);
        for _ in 0..32.min(n - values.len()) {
            values.push(rng.uniform() * scale);
        }
    }
    quant::q4_qdq_e8m0_group32(&mut values);
    values
}

/// A batch of queries over the keys of several sequences.
#[derive(Clone)]
struct IndexCase {
    heads: usize,
    /// Each sequence's keys `[n, HEAD_DIM]`, one device buffer each.
    keys: Vec<Vec<f32>>,
    /// Each query's (sequence, visible keys).
    queries: Vec<(usize, usize)>,
    /// `[queries, heads, HEAD_DIM]`, `[queries, heads]`.
    q: Vec<f32>,
    w: Vec<f32>,
}

/// Which kernel a run takes.
#[derive(Clone, Copy, Debug)]
enum Kernel {
    Exact,
    /// The tensor-core kernel with its queries a block (`None`: the launcher's choice).
    Fast(Option<usize>),
}

impl IndexCase {
    fn new(rng: &mut Rng, heads: usize) -> IndexCase {
        let keys = SEQUENCE_KEYS
            .iter()
            .map(|&n| qdq_values(rng, n * HEAD_DIM))
            .collect();
        IndexCase {
            heads,
            keys,
            queries: QUERIES.to_vec(),
            q: qdq_values(rng, QUERIES.len() * heads * HEAD_DIM),
            w: (0..QUERIES.len() * heads)
                .map(|_| quant::round_bf16(rng.uniform()))
                .collect(),
        }
    }

    /// Query `t` alone.
    fn alone(&self, t: usize) -> IndexCase {
        let width = self.heads * HEAD_DIM;
        IndexCase {
            queries: vec![self.queries[t]],
            q: self.q[t * width..(t + 1) * width].to_vec(),
            w: self.w[t * self.heads..(t + 1) * self.heads].to_vec(),
            ..self.clone()
        }
    }

    /// The flat scores (query after query) of one launch of `kernel`, the sequences' key rows
    /// read through one table (sequence after sequence); the scores start as NaN.
    fn run(&self, rt: &KernelRuntime, kernel: Kernel) -> Vec<f32> {
        let stream = rt.stream();
        let buffers: Vec<_> = self
            .keys
            .iter()
            .map(|keys| stream.clone_htod(keys).expect("keys"))
            .collect();
        let mut addresses = Vec::new();
        let mut starts = Vec::new();
        for buffer in &buffers {
            starts.push(addresses.len());
            for r in 0..buffer.len() / HEAD_DIM {
                addresses.push(key_row_address(rt, buffer, r * HEAD_DIM, HEAD_DIM).expect("row"));
            }
        }
        // SAFETY: every address is a HEAD_DIM row of `buffers`, alive until the download below
        // has synchronised the stream.
        let table = unsafe { DeviceKeyTable::upload(rt, &addresses, HEAD_DIM) }.expect("table");
        let first: Vec<usize> = self.queries.iter().map(|&(s, _)| starts[s]).collect();
        let visible: Vec<usize> = self.queries.iter().map(|&(_, v)| v).collect();
        let prefixes = DeviceVisiblePrefixes::upload_from(rt, &first, &visible, addresses.len())
            .expect("prefixes");
        let q = stream.clone_htod(&self.q).expect("q");
        let w = stream.clone_htod(&self.w).expect("w");
        let total = prefixes.total();
        let mut scores = stream
            .clone_htod(&vec![f32::NAN; total.max(1)])
            .expect("scores");
        let rows = IndexRows {
            q: &q,
            w: &w,
            visible: &prefixes,
            heads: self.heads,
            head_dim: HEAD_DIM,
        };
        match kernel {
            Kernel::Exact => {
                let keys = KeyRows::Table(&table);
                index_scores_rows_f32(rt, rows, keys, &mut scores, Rounding::Bf16)
            }
            Kernel::Fast(queries_per_block) => {
                index_scores_rows_ptr_fast(rt, rows, &table, &mut scores, queries_per_block)
            }
        }
        .unwrap_or_else(|err| panic!("{kernel:?} index scores: {err}"));
        let mut got = stream.clone_dtoh(&scores).expect("download");
        drop(buffers);
        got.truncate(total);
        got
    }
}

#[test]
fn fast_index_scores_equal_the_exact_kernel_on_qdq_inputs() {
    let rt = crate::open();
    let mut rng = Rng(17);
    for heads in HEADS {
        let case = IndexCase::new(&mut rng, heads);
        let exact = case.run(&rt, Kernel::Exact);
        let fast = case.run(&rt, Kernel::Fast(None));
        assert_eq!(
            exact.len(),
            QUERIES.iter().map(|&(_, v)| v).sum::<usize>(),
            "h{heads}"
        );
        assert!(
            exact.iter().all(|s| s.is_finite()) && exact.iter().any(|&s| s != 0.0),
            "h{heads}: the exact scores are not a meaningful reference"
        );
        let checked = assert_bitwise(&format!("h{heads}: fast vs exact"), &fast, &exact);
        // Negative control: q as fp32 values bf16 cannot hold (the fast kernel rounds them to
        // bf16, the exact one multiplies them as they are) gives other scores.
        let raw = IndexCase {
            q: fp32_values(&mut rng, case.q.len()),
            ..case.clone()
        };
        let changed = differing(
            &raw.run(&rt, Kernel::Fast(None)),
            &raw.run(&rt, Kernel::Exact),
        );
        assert!(
            changed > 0,
            "h{heads}: un-QDQ'd q gave the exact kernel's scores"
        );
        println!(
            "fast index h{heads}: {checked} scores bitwise the exact kernel's; un-QDQ'd q: \
             {changed} differ"
        );
    }
}

#[test]
fn fast_index_scores_are_deterministic_and_batch_invariant() {
    let rt = crate::open();
    let mut rng = Rng(19);
    for heads in HEADS {
        let case = IndexCase::new(&mut rng, heads);
        let all = case.run(&rt, Kernel::Fast(None));
        assert_eq!(
            differing(&all, &case.run(&rt, Kernel::Fast(None))),
            0,
            "h{heads}: run to run"
        );
        // A block's queries (1 to 8: a decode step's one, a prefill's eight) change no score.
        for group in [1, 2, 3, 8] {
            assert_eq!(
                differing(&all, &case.run(&rt, Kernel::Fast(Some(group)))),
                0,
                "h{heads}: {group} queries a block"
            );
        }
        let mut offset = 0;
        for (t, &(sequence, visible)) in case.queries.iter().enumerate() {
            let alone = case.alone(t).run(&rt, Kernel::Fast(None));
            assert_eq!(
                differing(&alone, &all[offset..offset + visible]),
                0,
                "h{heads} query {t} (sequence {sequence}, {visible} keys): alone vs in the batch"
            );
            offset += visible;
        }
    }
}

/// `index_scores_rows_at` of `backend` on `queries` over `keys` (each query `visible[t]` keys),
/// with the op's tensor-core launches.
fn profiled_scores(
    backend: &CudaBackend,
    queries: IndexQueries<'_>,
    part: SelectPart<'_>,
) -> (Vec<f32>, u64) {
    let profile = backend.op_profile();
    profile.set_enabled(true);
    let scores = backend.index_scores_rows_at(queries, part).concat();
    profile.set_enabled(false);
    let launches = profile
        .take()
        .get("index_scores_rows_at")
        .map_or(0, |s| s.tensor_core_launches);
    (scores, launches)
}

#[test]
fn the_fast_backend_scores_on_tensor_cores_with_the_cpu_bits() {
    let fast = CudaBackend::open(0, Numerics::Fast).expect("the fast backend");
    let exact = CudaBackend::open(0, Numerics::Exact).expect("the exact backend");
    let cpu = CpuBackend::new();
    let mut rng = Rng(23);
    let heads = 32;
    let case = IndexCase::new(&mut rng, heads);
    let keys = KeyList::from(Tensor::from(&case.keys[0][..]).split_rows(HEAD_DIM));
    let visible: Vec<usize> = QUERIES.iter().map(|&(_, v)| v).collect();
    let (q, w) = (Tensor::from(&case.q[..]), Tensor::from(&case.w[..]));
    for precision in [Precision::Bf16, Precision::F32] {
        let queries = IndexQueries {
            q: &q,
            weights: &w,
            head_dim: HEAD_DIM,
            precision,
        };
        let part = SelectPart {
            keys: &keys,
            visible: &visible,
        };
        let reference = cpu.index_scores_rows_at(queries, part).concat();
        let (got, launches) = profiled_scores(&fast, queries, part);
        assert_bitwise(
            &format!("fast backend {precision:?} vs cpu"),
            &got,
            &reference,
        );
        match precision {
            Precision::Bf16 => assert!(
                launches > 0,
                "the fast backend's bf16 scores ran no tensor-core kernel"
            ),
            Precision::F32 => assert_eq!(launches, 0, "fp32 scores ran on tensor cores"),
        }
        let (got, launches) = profiled_scores(&exact, queries, part);
        assert_bitwise(
            &format!("exact backend {precision:?} vs cpu"),
            &got,
            &reference,
        );
        assert_eq!(launches, 0, "the exact numerics ran on tensor cores");
    }
}
