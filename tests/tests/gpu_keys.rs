//! GPU tests of the key pointer tables (`deepinfer_kernels::ops::key_table`): the sink attention
//! and the indexer scores with key rows read through a device pointer table
//! (`KeyRows::Table` in `sparse_attention_sink_rows_f32`, `index_scores_rows_f32`).
//!
//! The key rows are scattered over several separately allocated device buffers at odd element
//! offsets, with filler values between them (a wrong address reads filler, not a neighbouring
//! key), and the table repeats some rows' addresses. Each result is compared bitwise with the
//! flat rows (`KeyRows::Flat`) on the same keys gathered into one buffer and with
//! `CpuBackend::sparse_attention_rows` / `index_scores_rows_at`, over heads 1/3/64 × head_dim
//! 32/96/512, 0/1/7/300 keys per query (and repeated keys), both roundings. Negative controls: one
//! table entry moved by one element changes exactly the results that read it; bad tables and
//! rows are shape errors. Key lists composed on the device from runs of rows and device
//! selections (`DeviceKeyLists::compose`) are the explicit lists they describe; a key list's
//! device mirror (`KeyList`, the CUDA backend's `key_tables`) follows its appends and
//! truncations (read by the index scores and by attention over prefixes of the list), and a window ring's (`PositionRing`) its slides, rollbacks, gaps, growth, shrinking
//! and copies.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a CUDA driver every test fails, naming why.
#![cfg(feature = "cuda")]

use deepinfer_kernels::KernelError;
use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::attention::{
    AttentionRows, DeviceKeyLists, ListSegment, sparse_attention_sink_rows_f32,
};
use deepinfer_kernels::ops::index::{DeviceVisiblePrefixes, IndexRows, index_scores_rows_f32};
use deepinfer_kernels::ops::key_table::{DeviceKeyTable, KeyRows, key_row_address};
use deepinfer_model::backend::{
    AttentionQueries, Backend, CompressedKeys, CpuBackend, IndexQueries, KeyList, PositionRing,
    Precision, QueryKeys, SelectPart, Tensor,
};
use deepinfer_model::quant;

mod gpu_support;
use gpu_support::{PRECISIONS, Rng, assert_bitwise, bf16_unit, cuda_backend, rounding_of, runtime};

const SHAPES: [(usize, usize); 9] = [
    (1, 32),
    (1, 96),
    (1, 512),
    (3, 32),
    (3, 96),
    (3, 512),
    (64, 32),
    (64, 96),
    (64, 512),
];
/// Rows of every key table: more than the longest list, so lists pick among them.
const TABLE_ROWS: usize = 310;
/// Separately allocated buffers the rows are spread over.
const BUFFERS: usize = 5;
/// The value between and around the rows: far from every key value, so a misplaced read shows.
const FILLER: f32 = 1000.0;

/// `TABLE_ROWS` key rows of `head_dim` values scattered over [`BUFFERS`] device buffers, and the
/// same rows gathered into one flat buffer.
struct ScatteredKeys {
    /// Kept alive while launches read the table (its addresses point into them).
    buffers: Vec<CudaSlice<f32>>,
    /// `(buffer, element offset)` of each table row.
    places: Vec<(usize, usize)>,
    table: DeviceKeyTable,
    /// Host copy of the rows in table order, `[TABLE_ROWS, head_dim]`.
    flat: Vec<f32>,
    flat_device: CudaSlice<f32>,
}

impl ScatteredKeys {
    /// Rows go to random buffers, each after a gap of 1..=5 filler values (so offsets are odd
    /// and not multiples of `head_dim`); every 9th row repeats the address of an earlier row.
    fn new(rt: &KernelRuntime, rng: &mut Rng, head_dim: usize) -> ScatteredKeys {
        let mut contents: Vec<Vec<f32>> = vec![Vec::new(); BUFFERS];
        let mut places = Vec::with_capacity(TABLE_ROWS);
        for row in 0..TABLE_ROWS {
            if row % 9 == 8 {
                places.push(places[rng.below(row as u64) as usize]);
                continue;
            }
            let buffer = rng.below(BUFFERS as u64) as usize;
            let gap = 1 + rng.below(5) as usize;
            let data = &mut contents[buffer];
            data.extend(std::iter::repeat_n(FILLER, gap));
            places.push((buffer, data.len()));
            data.extend(bf16_unit(rng, head_dim));
        }
        for data in &mut contents {
            data.extend(std::iter::repeat_n(FILLER, 3)); // also keeps every buffer non-empty
        }
        let stream = rt.stream();
        let buffers: Vec<CudaSlice<f32>> = contents
            .iter()
            .map(|data| stream.clone_htod(data).expect("uploading a key buffer"))
            .collect();
        let flat: Vec<f32> = places
            .iter()
            .flat_map(|&(b, at)| contents[b][at..at + head_dim].iter().copied())
            .collect();
        let addresses: Vec<u64> = places
            .iter()
            .map(|&(b, at)| key_row_address(rt, &buffers[b], at, head_dim).expect("row address"))
            .collect();
        // SAFETY: every address is a head_dim row inside one of `buffers`, which this struct
        // keeps alive for as long as the table (the launches run before it is dropped and the
        // tests synchronise when they download the results).
        let table = unsafe { DeviceKeyTable::upload(rt, &addresses, head_dim) }
            .expect("uploading the key table");
        let flat_device = stream.clone_htod(&flat).expect("uploading the flat keys");
        ScatteredKeys {
            buffers,
            places,
            table,
            flat,
            flat_device,
        }
    }

    fn row(&self, r: usize, head_dim: usize) -> &[f32] {
        &self.flat[r * head_dim..(r + 1) * head_dim]
    }
}

/// Key lists of 0, 1, 7 and 300 rows, plus one row repeated 7 times; rows repeat within lists.
fn key_lists(rng: &mut Rng) -> Vec<Vec<u32>> {
    let mut lists: Vec<Vec<u32>> = [0usize, 1, 7, 300]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| rng.below(TABLE_ROWS as u64) as u32)
                .collect()
        })
        .collect();
    lists.push(vec![rng.below(TABLE_ROWS as u64) as u32; 7]);
    lists
}

/// The pointer-table attention, the flat attention on the gathered keys (both on the device)
/// and the CPU reference, for `lists` over `keys`.
struct AttentionRun {
    ptr: Vec<f32>,
    flat: Vec<f32>,
    cpu: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_attention(
    rt: &KernelRuntime,
    keys: &ScatteredKeys,
    table: &DeviceKeyTable,
    lists: &[Vec<u32>],
    q: &[f32],
    sink: &[f32],
    head_dim: usize,
    precision: Precision,
) -> AttentionRun {
    let stream = rt.stream();
    let scale = (head_dim as f32).powf(-0.5);
    let device_lists = DeviceKeyLists::upload(rt, lists, TABLE_ROWS).expect("key lists");
    let q_device = stream.clone_htod(q).expect("q");
    let sink_device = stream.clone_htod(sink).expect("sink");
    let mut out_ptr = stream.alloc_zeros::<f32>(q.len()).expect("out");
    let mut out_flat = stream.alloc_zeros::<f32>(q.len()).expect("out");
    let rows = AttentionRows {
        q: &q_device,
        lists: &device_lists,
        sink: &sink_device,
        head_dim,
        scale,
        rounding: rounding_of(precision),
    };
    sparse_attention_sink_rows_f32(rt, rows, KeyRows::Table(table), &mut out_ptr)
        .expect("pointer-table attention");
    sparse_attention_sink_rows_f32(rt, rows, KeyRows::Flat(&keys.flat_device), &mut out_flat)
        .expect("flat attention");
    let key_rows = Tensor::from(&keys.flat[..]).split_rows(head_dim);
    let key_refs: Vec<QueryKeys<'_>> = lists
        .iter()
        .map(|list| QueryKeys::listed(list.iter().map(|&r| &key_rows[r as usize]).collect()))
        .collect();
    AttentionRun {
        ptr: stream.clone_dtoh(&out_ptr).expect("download"),
        flat: stream.clone_dtoh(&out_flat).expect("download"),
        cpu: CpuBackend::new()
            .sparse_attention_rows(
                AttentionQueries {
                    q: &Tensor::from(q),
                    sink,
                    scale,
                    precision,
                },
                &key_refs,
            )
            .into_vec(),
    }
}

#[test]
fn pointer_table_attention_matches_the_flat_launcher_and_the_cpu() {
    let rt = runtime("pointer_table_attention_matches_the_flat_launcher_and_the_cpu");
    let mut rng = Rng(7);
    let mut checked = 0usize;
    for (heads, head_dim) in SHAPES {
        let keys = ScatteredKeys::new(&rt, &mut rng, head_dim);
        let lists = key_lists(&mut rng);
        let q = bf16_unit(&mut rng, lists.len() * heads * head_dim);
        let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
        for precision in PRECISIONS {
            let what = format!("attention h{heads} d{head_dim} {precision:?}");
            let run = run_attention(
                &rt,
                &keys,
                &keys.table,
                &lists,
                &q,
                &sink,
                head_dim,
                precision,
            );
            checked += assert_bitwise(&format!("{what}: table vs flat"), &run.ptr, &run.flat);
            assert_bitwise(&format!("{what}: table vs cpu"), &run.ptr, &run.cpu);
            // The query with no keys has only the sink: its output is exactly 0.
            assert!(run.ptr[..heads * head_dim].iter().all(|&v| v == 0.0));
        }
    }
    println!(
        "pointer-table attention: {checked} values bitwise equal to the flat launcher and the CPU"
    );
}

/// Index scores of the queries' key windows (query `t`: `visible[t]` rows from row `first[t]`)
/// over `keys` through the table and flat (device), and the CPU's (each query alone over its
/// window).
struct IndexRun {
    ptr: Vec<f32>,
    flat: Vec<f32>,
    cpu: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_index(
    rt: &KernelRuntime,
    keys: &ScatteredKeys,
    table: &DeviceKeyTable,
    first: &[usize],
    visible: &[usize],
    q: &[f32],
    w: &[f32],
    heads: usize,
    head_dim: usize,
    precision: Precision,
) -> IndexRun {
    let stream = rt.stream();
    let prefixes =
        DeviceVisiblePrefixes::upload_from(rt, first, visible, TABLE_ROWS).expect("prefixes");
    let q_device = stream.clone_htod(q).expect("q");
    let w_device = stream.clone_htod(w).expect("w");
    let len = prefixes.total().max(1);
    let mut scores_ptr = stream.alloc_zeros::<f32>(len).expect("scores");
    let mut scores_flat = stream.alloc_zeros::<f32>(len).expect("scores");
    let rows = IndexRows {
        q: &q_device,
        w: &w_device,
        visible: &prefixes,
        heads,
        head_dim,
    };
    let rounding = rounding_of(precision);
    index_scores_rows_f32(rt, rows, KeyRows::Table(table), &mut scores_ptr, rounding)
        .expect("pointer-table index scores");
    let flat = KeyRows::Flat(&keys.flat_device);
    index_scores_rows_f32(rt, rows, flat, &mut scores_flat, rounding).expect("flat index scores");
    let total = prefixes.total();
    let mut ptr = stream.clone_dtoh(&scores_ptr).expect("download");
    let mut flat = stream.clone_dtoh(&scores_flat).expect("download");
    ptr.truncate(total);
    flat.truncate(total);
    let key_rows = Tensor::from(&keys.flat[..]).split_rows(head_dim);
    let cpu: Vec<f32> = (0..visible.len())
        .flat_map(|t| {
            let part_keys = KeyList::from(key_rows[first[t]..].to_vec());
            CpuBackend::new()
                .index_scores_rows_at(
                    IndexQueries {
                        q: &Tensor::from(&q[t * heads * head_dim..(t + 1) * heads * head_dim]),
                        weights: &Tensor::from(&w[t * heads..(t + 1) * heads]),
                        head_dim,
                        precision,
                    },
                    SelectPart {
                        keys: &part_keys,
                        visible: &visible[t..=t],
                    },
                )
                .concat()
        })
        .collect();
    IndexRun { ptr, flat, cpu }
}

#[test]
fn pointer_table_index_scores_match_the_flat_launcher_and_the_cpu() {
    let rt = runtime("pointer_table_index_scores_match_the_flat_launcher_and_the_cpu");
    let mut rng = Rng(11);
    let mut checked = 0usize;
    // 0, 1, 7 and 300 keys, and the whole table (with its repeated rows).
    let visible = [0usize, 1, 7, 300, TABLE_ROWS];
    for (heads, head_dim) in SHAPES {
        let keys = ScatteredKeys::new(&rt, &mut rng, head_dim);
        let q = bf16_unit(&mut rng, visible.len() * heads * head_dim);
        let w: Vec<f32> = (0..visible.len() * heads)
            .map(|_| quant::round_bf16(rng.uniform()))
            .collect();
        for precision in PRECISIONS {
            let what = format!("index h{heads} d{head_dim} {precision:?}");
            let run = run_index(
                &rt,
                &keys,
                &keys.table,
                &[0; 5],
                &visible,
                &q,
                &w,
                heads,
                head_dim,
                precision,
            );
            assert_eq!(run.ptr.len(), visible.iter().sum::<usize>(), "{what}");
            checked += assert_bitwise(&format!("{what}: table vs flat"), &run.ptr, &run.flat);
            assert_bitwise(&format!("{what}: table vs cpu"), &run.ptr, &run.cpu);
            // A repeated row scores the same as the row it repeats (query 4 sees every row).
            let last = &run.ptr[run.ptr.len() - TABLE_ROWS..];
            for row in (8..TABLE_ROWS).step_by(9) {
                let original = keys.places.iter().position(|&p| p == keys.places[row]);
                let original = original.expect("the repeated place is in the table");
                assert_eq!(last[row].to_bits(), last[original].to_bits(), "{what}");
            }
            // Windows that start past row 0 (the queries of several sequences over one table):
            // each query scores exactly its window.
            let first = [3, TABLE_ROWS - 1, 100, 9, 0];
            let windows = [2, 1, 7, 300, TABLE_ROWS];
            // Query 4 asks what query 1 asks, over the whole table.
            let (row, mut q_same, mut w_same) = (heads * head_dim, q.clone(), w.clone());
            q_same.copy_within(row..2 * row, 4 * row);
            w_same.copy_within(heads..2 * heads, 4 * heads);
            let run = run_index(
                &rt,
                &keys,
                &keys.table,
                &first,
                &windows,
                &q_same,
                &w_same,
                heads,
                head_dim,
                precision,
            );
            assert_eq!(run.ptr.len(), windows.iter().sum::<usize>(), "{what}");
            checked += assert_bitwise(
                &format!("{what}: windows, table vs flat"),
                &run.ptr,
                &run.flat,
            );
            assert_bitwise(
                &format!("{what}: windows, table vs cpu"),
                &run.ptr,
                &run.cpu,
            );
            // Query 1's one key is the table's last row, which query 4 (the same query over the
            // whole table) scores last.
            let last_row = run.ptr[2];
            assert_eq!(
                last_row.to_bits(),
                run.ptr[run.ptr.len() - 1].to_bits(),
                "{what}"
            );
        }
    }
    println!(
        "pointer-table index scores: {checked} values bitwise equal to the flat launcher and the CPU"
    );
}

/// A table whose row `moved` points one element past its key: the results that read that row
/// change, the others stay bitwise equal (the tests above would catch a wrong address).
#[test]
fn a_moved_table_entry_changes_exactly_the_results_that_read_it() {
    let rt = runtime("a_moved_table_entry_changes_exactly_the_results_that_read_it");
    let (heads, head_dim) = (3usize, 96usize);
    let mut rng = Rng(13);
    let keys = ScatteredKeys::new(&rt, &mut rng, head_dim);
    let moved = 5usize;
    let addresses: Vec<u64> = keys
        .places
        .iter()
        .enumerate()
        .map(|(r, &(b, at))| {
            let at = if r == moved { at + 1 } else { at };
            key_row_address(&rt, &keys.buffers[b], at, head_dim).expect("row address")
        })
        .collect();
    // SAFETY: as in ScatteredKeys::new; the moved row still lies inside its buffer (every row is
    // followed by at least one filler value).
    let table = unsafe { DeviceKeyTable::upload(&rt, &addresses, head_dim) }.expect("table");

    let lists = vec![vec![1u32, 2, 3], vec![4, moved as u32, 6], vec![]];
    let q = bf16_unit(&mut rng, lists.len() * heads * head_dim);
    let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
    let run = run_attention(
        &rt,
        &keys,
        &table,
        &lists,
        &q,
        &sink,
        head_dim,
        Precision::Bf16,
    );
    let width = heads * head_dim;
    assert_bitwise(
        "query 0 (does not read the row)",
        &run.ptr[..width],
        &run.flat[..width],
    );
    assert_bitwise(
        "query 2 (no keys)",
        &run.ptr[2 * width..],
        &run.flat[2 * width..],
    );
    let changed = (width..2 * width)
        .filter(|&i| run.ptr[i].to_bits() != run.flat[i].to_bits())
        .count();
    assert!(
        changed > width / 2,
        "only {changed} of {width} outputs changed"
    );

    // Every head of every query is the moved row's key, so its true logits are positive (|k|²)
    // and a misread row cannot score the same by a ReLU tie at 0.
    let visible = [moved, moved + 1, TABLE_ROWS];
    let q = keys.row(moved, head_dim).repeat(visible.len() * heads);
    let w: Vec<f32> = (0..visible.len() * heads)
        .map(|_| quant::round_bf16(0.5 + 0.25 * rng.uniform()))
        .collect();
    let run = run_index(
        &rt,
        &keys,
        &table,
        &[0; 3],
        &visible,
        &q,
        &w,
        heads,
        head_dim,
        Precision::F32,
    );
    let differing: Vec<usize> = (0..run.ptr.len())
        .filter(|&i| run.ptr[i].to_bits() != run.flat[i].to_bits())
        .collect();
    // Query 0 sees rows 0..5 (not the moved row); query 1 sees it at its score 5, query 2 at
    // score 5 of its own range (which starts after 5 + 6 scores).
    assert_eq!(differing, vec![moved + moved, moved + (moved + 1) + moved]);
    println!("a moved table entry: changed {changed} of {width} attention outputs and 2 scores");
}

#[test]
fn pointer_tables_reject_bad_rows_and_shapes() {
    let rt = runtime("pointer_tables_reject_bad_rows_and_shapes");
    let stream = rt.stream();
    let buffer = stream.clone_htod(&[0.5f32; 40]).expect("buffer");
    shape_error(
        "row past the end",
        key_row_address(&rt, &buffer, 33, 8).map(|_| ()),
        "does not fit",
    );
    shape_error(
        "empty row",
        key_row_address(&rt, &buffer, 0, 0).map(|_| ()),
        "does not fit",
    );
    shape_error(
        "offset overflow",
        key_row_address(&rt, &buffer, usize::MAX, 8).map(|_| ()),
        "does not fit",
    );
    let base = key_row_address(&rt, &buffer, 0, 8).expect("row 0");
    assert_eq!(
        key_row_address(&rt, &buffer, 32, 8).expect("row 4"),
        base + 128
    );
    // SAFETY: rejected before anything is uploaded; nothing is launched with it.
    let null = unsafe { DeviceKeyTable::upload(&rt, &[base, 0], 8) };
    shape_error("null address", null.map(|_| ()), "row 1");
    // SAFETY: as above.
    let misaligned = unsafe { DeviceKeyTable::upload(&rt, &[base + 2], 8) };
    shape_error("misaligned address", misaligned.map(|_| ()), "row 0");
    // SAFETY: rows 0..4 of `buffer`, alive until the end of the test.
    let table = unsafe { DeviceKeyTable::upload(&rt, &[base, base + 32, base + 64, base + 96], 8) }
        .expect("table");
    let (q, sink) = (
        stream.clone_htod(&[0.25f32; 8]).expect("q"),
        stream.clone_htod(&[0.0f32]).expect("sink"),
    );
    let mut out = stream.alloc_zeros::<f32>(8).expect("out");
    let lists = DeviceKeyLists::upload(&rt, &[vec![0u32, 4]], 5).expect("lists");
    let rows = AttentionRows {
        q: &q,
        lists: &lists,
        sink: &sink,
        head_dim: 8,
        scale: 1.0,
        rounding: Rounding::F32,
    };
    shape_error(
        "lists beyond the table",
        sparse_attention_sink_rows_f32(&rt, rows, KeyRows::Table(&table), &mut out),
        "the key table has 4 rows of 8 values; the launch needs 5 rows of 8",
    );
    let lists = DeviceKeyLists::upload(&rt, &[vec![0u32, 3]], 4).expect("lists");
    let mut wide_out = stream.alloc_zeros::<f32>(4).expect("out");
    let rows = AttentionRows {
        q: &stream.clone_htod(&[0.25f32; 4]).expect("q"),
        lists: &lists,
        head_dim: 4,
        ..rows
    };
    shape_error(
        "row width differs from head_dim",
        sparse_attention_sink_rows_f32(&rt, rows, KeyRows::Table(&table), &mut wide_out),
        "rows of 8 values; the launch needs 4 rows of 4",
    );
    let w = stream.clone_htod(&[1.0f32]).expect("w");
    // One query of one head of 8 over the first `visible` rows of the table into `visible` scores.
    let index = |visible: usize| -> Result<Vec<f32>, KernelError> {
        let prefixes = DeviceVisiblePrefixes::upload(&rt, &[visible], visible).expect("prefixes");
        let mut scores = stream.alloc_zeros::<f32>(visible).expect("scores");
        let rows = IndexRows {
            q: &q,
            w: &w,
            visible: &prefixes,
            heads: 1,
            head_dim: 8,
        };
        index_scores_rows_f32(
            &rt,
            rows,
            KeyRows::Table(&table),
            &mut scores,
            Rounding::F32,
        )?;
        Ok(stream.clone_dtoh(&scores).expect("download"))
    };
    shape_error(
        "visible beyond the table",
        index(5).map(drop),
        "needs 5 rows of 8",
    );
    // The accepted shapes run and agree with the keys' values: q · k = 8 · 0.25 · 0.5 = 1.
    assert_eq!(index(4).expect("valid index launch"), vec![1.0; 4]);
}

/// The attention over `lists` composed on the device (`DeviceKeyLists::compose`).
fn attention_with(
    rt: &KernelRuntime,
    keys: &ScatteredKeys,
    lists: &DeviceKeyLists,
    q: &[f32],
    sink: &[f32],
    head_dim: usize,
) -> Vec<f32> {
    let stream = rt.stream();
    let mut out = stream.alloc_zeros::<f32>(q.len()).expect("out");
    let rows = AttentionRows {
        q: &stream.clone_htod(q).expect("q"),
        lists,
        sink: &stream.clone_htod(sink).expect("sink"),
        head_dim,
        scale: (head_dim as f32).powf(-0.5),
        rounding: Rounding::Bf16,
    };
    sparse_attention_sink_rows_f32(rt, rows, KeyRows::Table(&keys.table), &mut out)
        .expect("attention");
    stream.clone_dtoh(&out).expect("download")
}

#[test]
fn composed_key_lists_are_the_lists_they_describe() {
    let rt = runtime("composed_key_lists_are_the_lists_they_describe");
    let stream = rt.stream();
    let mut rng = Rng(11);
    let (heads, head_dim) = (3, 96);
    let keys = ScatteredKeys::new(&rt, &mut rng, head_dim);
    // Query 0: a run, then a device selection from table row 100; query 1: nothing; query 2:
    // two runs; query 3: a selection alone (repeated positions).
    let picks = stream.clone_htod(&[3u32, 0, 7, 7, 9]).expect("selection");
    let picks_at = key_row_address_u32(&rt, &picks);
    // Query 0's selection reads from table row `first`.
    let segments = |first: u32| {
        [
            ListSegment::rows(0, 5, 7),
            ListSegment::selected(7, first, 4, picks_at),
            ListSegment::rows(11, 200, 3),
            ListSegment::rows(14, 50, 2),
            ListSegment::selected(16, 300, 5, picks_at),
        ]
    };
    let row_starts = [0u32, 11, 11, 16, 21];
    let explicit: Vec<Vec<u32>> = vec![
        (5..12).chain([103, 100, 107, 107]).collect(),
        vec![],
        vec![200, 201, 202, 50, 51],
        vec![303, 300, 307, 307, 309],
    ];
    // SAFETY: `picks` holds 5 positions, all below TABLE_ROWS - 300, alive until the downloads.
    let composed = unsafe { DeviceKeyLists::compose(&rt, &segments(100), &row_starts, TABLE_ROWS) }
        .expect("composed lists");
    let uploaded = DeviceKeyLists::upload(&rt, &explicit, TABLE_ROWS).expect("explicit lists");
    let q = bf16_unit(&mut rng, explicit.len() * heads * head_dim);
    let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
    let from_segments = attention_with(&rt, &keys, &composed, &q, &sink, head_dim);
    let from_lists = attention_with(&rt, &keys, &uploaded, &q, &sink, head_dim);
    let checked = assert_bitwise("composed vs explicit lists", &from_segments, &from_lists);
    // The negative control: one selected position off changes query 0's output.
    // SAFETY: as above (positions below TABLE_ROWS - 301).
    let moved = unsafe { DeviceKeyLists::compose(&rt, &segments(101), &row_starts, TABLE_ROWS) }
        .expect("shifted lists");
    let differs = attention_with(&rt, &keys, &moved, &q, &sink, head_dim);
    let width = heads * head_dim;
    assert_ne!(
        differs[..width],
        from_lists[..width],
        "query 0 reads other rows"
    );
    assert_eq!(
        differs[width..],
        from_lists[width..],
        "the other queries are unchanged"
    );
    // Segments that leave a gap, overlap, run past the table or miss positions are refused.
    let refused = |segments: &[ListSegment], starts: &[u32], expected: &str| {
        // SAFETY: rejected before anything is launched.
        let result = unsafe { DeviceKeyLists::compose(&rt, segments, starts, TABLE_ROWS) };
        shape_error("compose", result.map(|_| ()), expected);
    };
    refused(
        &[ListSegment::rows(1, 0, 2)],
        &[0, 3],
        "do not follow position 0",
    );
    refused(
        &[ListSegment::rows(0, 0, 2), ListSegment::rows(1, 0, 2)],
        &[0, 3],
        "do not follow position 2",
    );
    refused(
        &[ListSegment::rows(0, TABLE_ROWS as u32 - 1, 2)],
        &[0, 2],
        "of a 310-row table",
    );
    refused(&[ListSegment::rows(0, 0, 2)], &[0, 3], "cover 2 of 3");
    refused(&[], &[1, 1], "start at 0");
    println!("composed key lists: {checked} values bitwise equal to the explicit lists");
}

/// The device address of a u32 buffer's first value.
fn key_row_address_u32(rt: &KernelRuntime, values: &CudaSlice<u32>) -> u64 {
    use deepinfer_kernels::cudarc::driver::DevicePtr;
    let (address, _sync) = values.device_ptr(rt.stream());
    address
}

/// Asserts `result` is a shape error whose message contains `needle`.
fn shape_error(what: &str, result: Result<(), KernelError>, needle: &str) {
    match result {
        Err(KernelError::Shape { message, .. }) => {
            assert!(message.contains(needle), "{what}: {message}")
        }
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
}

/// The index scores of three queries (all of the list, half of it, its first row) over `keys`.
fn scores_over(backend: &dyn Backend, keys: &KeyList, q: &Tensor, w: &Tensor) -> Vec<Vec<f32>> {
    let n = keys.len();
    backend.index_scores_rows_at(
        IndexQueries {
            q,
            weights: w,
            head_dim: MIRROR_HEAD_DIM,
            precision: Precision::Bf16,
        },
        SelectPart {
            keys,
            visible: &[n, n / 2, n.min(1)],
        },
    )
}

const MIRROR_HEAD_DIM: usize = 32;

/// The sink attention (2 heads, the mirror tests' sinks and scale) of `queries` over `q`.
fn attend(backend: &dyn Backend, q: &Tensor, queries: &[QueryKeys<'_>]) -> Vec<f32> {
    let attention = AttentionQueries {
        q,
        sink: &[0.25, -0.5],
        scale: (MIRROR_HEAD_DIM as f32).powf(-0.5),
        precision: Precision::Bf16,
    };
    backend.sparse_attention_rows(attention, queries).into_vec()
}

/// The sink attention of three queries (2 heads) over the first `n`, `n / 2` and `min(n, 1)`
/// rows of `keys` (a V4 layer without an indexer: a prefix of the compressed list, one run of
/// its rows).
fn prefixes_over(backend: &dyn Backend, keys: &KeyList, q: &Tensor) -> Vec<f32> {
    let n = keys.len();
    let queries: Vec<QueryKeys<'_>> = [n, n / 2, n.min(1)]
        .into_iter()
        .map(|count| QueryKeys {
            window: None,
            listed: Vec::new(),
            compressed: Some(CompressedKeys::prefix(keys, count)),
        })
        .collect();
    attend(backend, q, &queries)
}

#[test]
fn a_key_lists_device_mirror_follows_its_appends_and_truncations() {
    let gpu = cuda_backend("a_key_lists_device_mirror_follows_its_appends_and_truncations");
    let cpu = CpuBackend::new();
    let mut rng = Rng(13);
    let heads = 2;
    let q = Tensor::from(bf16_unit(&mut rng, 3 * heads * MIRROR_HEAD_DIM));
    let w = Tensor::from(bf16_unit(&mut rng, 3 * heads));
    // The same rows as device tensors (each its own buffer, as a decode step leaves them) in
    // the list the GPU scores, and on the host in the CPU's.
    let (mut device, mut host) = (KeyList::new(), KeyList::new());
    let push = |device: &mut KeyList, host: &mut KeyList, rows: usize, rng: &mut Rng| {
        for _ in 0..rows {
            let row = Tensor::from(bf16_unit(rng, MIRROR_HEAD_DIM));
            device.push(gpu.gather(&[(&row, 0)], MIRROR_HEAD_DIM));
            host.push(row);
        }
    };
    let mut checked = 0;
    let mut check = |device: &KeyList, host: &KeyList, what: &str| {
        let on_gpu = scores_over(&gpu, device, &q, &w);
        let on_cpu = scores_over(&cpu, host, &q, &w);
        for (t, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
            checked += assert_bitwise(&format!("{what}: query {t}"), g, c);
        }
        checked += assert_bitwise(
            &format!("{what}: attention over prefixes"),
            &prefixes_over(&gpu, device, &q),
            &prefixes_over(&cpu, host, &q),
        );
        assert_eq!(
            device.mirror().covers,
            device.len(),
            "{what}: the mirror covers the list"
        );
    };
    push(&mut device, &mut host, 5, &mut rng);
    check(&device, &host, "5 rows (a new mirror)");
    check(&device, &host, "the same 5 rows (all from the mirror)");
    push(&mut device, &mut host, 1, &mut rng);
    check(&device, &host, "one appended (written into the mirror)");
    push(&mut device, &mut host, 70, &mut rng);
    check(&device, &host, "76 rows (the mirror grown and moved)");
    // Dropped rows free their buffers; new rows may take their addresses, so a mirror that still
    // claimed the old rows would read other values.
    device.truncate(20);
    host.truncate(20);
    assert_eq!(device.mirror().covers, 20);
    push(&mut device, &mut host, 3, &mut rng);
    check(&device, &host, "truncated to 20, then 3 new rows");
    device.truncate(0);
    host.truncate(0);
    push(&mut device, &mut host, 2, &mut rng);
    check(&device, &host, "emptied, then 2 new rows");
    let copy = device.clone();
    assert_eq!(copy.mirror().covers, 0, "a copy starts without a mirror");
    check(&copy, &host, "a copy of the list");
    println!(
        "key-list mirror: {checked} scores and attention outputs bitwise equal to the CPU through \
         appends and truncations"
    );
}

/// The sink attention of four queries (2 heads) over windows of `ring`: the newest 8 positions,
/// the 8 before the newest, the oldest two with the 3 positions before them (none held), and the
/// newest 8 in the order of 8 ring slots (DSpark's context: two runs, split where the slots wrap).
fn windows_over(backend: &dyn Backend, ring: &PositionRing, q: &Tensor) -> Vec<f32> {
    let last = ring.end() - 1;
    let windows = [
        ring.window(last.saturating_sub(7), last),
        ring.window(last.saturating_sub(8), last - 1),
        ring.window(ring.start().saturating_sub(3), ring.start() + 1),
        ring.slot_window(last.saturating_sub(7), last, 8),
    ];
    let queries: Vec<QueryKeys<'_>> = windows
        .into_iter()
        .map(|window| QueryKeys {
            window: Some(window),
            listed: Vec::new(),
            compressed: None,
        })
        .collect();
    attend(backend, q, &queries)
}

#[test]
fn a_window_rings_device_mirror_follows_its_slides_rollbacks_gaps_and_copies() {
    let gpu =
        cuda_backend("a_window_rings_device_mirror_follows_its_slides_rollbacks_gaps_and_copies");
    let cpu = CpuBackend::new();
    let mut rng = Rng(17);
    let q = Tensor::from(bf16_unit(&mut rng, 4 * 2 * MIRROR_HEAD_DIM));
    // The same rows as device tensors (each its own buffer, as a decode step leaves them) in
    // the ring the GPU reads, and on the host in the CPU's.
    let (mut device, mut host) = (PositionRing::default(), PositionRing::default());
    let push_at = |device: &mut PositionRing, host: &mut PositionRing, at: usize, rng: &mut Rng| {
        let row = Tensor::from(bf16_unit(rng, MIRROR_HEAD_DIM));
        device.push_at(at, gpu.gather(&[(&row, 0)], MIRROR_HEAD_DIM));
        host.push_at(at, row);
    };
    let mut checked = 0;
    let mut check = |device: &PositionRing, host: &PositionRing, what: &str| {
        assert_eq!((device.start(), device.end()), (host.start(), host.end()));
        let on_gpu = windows_over(&gpu, device, &q);
        let on_cpu = windows_over(&cpu, host, &q);
        checked += assert_bitwise(what, &on_gpu, &on_cpu);
        assert_eq!(
            device.mirror().covers,
            device.start()..device.end(),
            "{what}: the mirror covers the ring"
        );
    };
    for p in 0..12 {
        push_at(&mut device, &mut host, p, &mut rng);
    }
    check(&device, &host, "12 rows (a new mirror)");
    check(&device, &host, "the same 12 rows (all from the mirror)");
    // Decode steps: one row in, the oldest out; the slots wrap around the mirror's 64 more than
    // once, so a slot taken by the wrong position would show.
    for step in 0..150 {
        let at = device.end();
        push_at(&mut device, &mut host, at, &mut rng);
        device.trim(10);
        host.trim(10);
        check(&device, &host, &format!("decode step {step}"));
    }
    // A rollback: dropped rows free their buffers, and new rows may take their addresses.
    let end = device.end();
    device.truncate(end - 3);
    host.truncate(end - 3);
    assert_eq!(
        device.mirror().covers.end,
        end - 3,
        "a rollback narrows the mirror"
    );
    for _ in 0..2 {
        let at = device.end();
        push_at(&mut device, &mut host, at, &mut rng);
    }
    check(&device, &host, "3 rows rolled back, 2 new ones");
    // A gap (a bounded replay) restarts the ring.
    let resume = device.end() + 5;
    for p in resume..resume + 4 {
        push_at(&mut device, &mut host, p, &mut rng);
    }
    check(&device, &host, "a gap of 5 positions, then 4 rows");
    // Compacting copies the rows into one buffer: new addresses, which the mirror must take.
    device.compact(&gpu);
    host.compact(&cpu);
    assert!(
        device.mirror().covers.is_empty(),
        "a compact empties the mirror"
    );
    check(&device, &host, "compacted");
    // More rows than the mirror holds (a long chunk): it is replaced by a larger one; trimmed
    // back to a window, by a smaller one again.
    for _ in 0..300 {
        let at = device.end();
        push_at(&mut device, &mut host, at, &mut rng);
    }
    check(&device, &host, "304 rows (a larger mirror)");
    device.trim(10);
    host.trim(10);
    check(&device, &host, "trimmed to 10 rows (a smaller mirror)");
    let copy = device.clone();
    assert!(
        copy.mirror().device.is_none(),
        "a copy starts without a mirror"
    );
    check(&copy, &host, "a copy of the ring");
    println!(
        "window-ring mirror: {checked} outputs bitwise equal to the CPU through 150 slides, a rollback, a gap, a compact, a growth, a shrink and a copy"
    );
}
