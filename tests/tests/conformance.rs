//! The conformance harness checked on the CPU (no GPU needed): every op case of
//! `deepinfer_tests::conformance::cases` run with `CpuBackend` on both sides conforms in both
//! modes, and a backend with one op nudged (`Nudged`) fails the cases of that op — in `exact`
//! numerics at a one-ulp change, in `fast` numerics only beyond the op's bound — while the cases
//! of the other ops still pass (the harness can fail, and fails where it should).

use deepinfer_model::backend::{Backend, CpuBackend};
use deepinfer_tests::conformance::{Case, Mode, assert_conforms, cases, check, rows, sampling};
use deepinfer_tests::nudged::Nudged;

/// Every op family of the harness.
fn families() -> Vec<(&'static str, Vec<Case>)> {
    vec![
        ("linears", cases::linears()),
        ("gemms", cases::gemms()),
        ("quantised_linears", cases::quantised_linears()),
        ("rms_norms", cases::rms_norms()),
        ("ropes", cases::ropes()),
        ("qdqs", cases::qdqs()),
        ("rope_qdqs", cases::rope_qdqs()),
        ("attention_one", cases::attention_one()),
        ("attention_rows", cases::attention_rows()),
        ("index_scores_one", cases::index_scores_one()),
        ("index_scores_rows", cases::index_scores_rows()),
        ("hc_one", cases::hc_one()),
        ("hc_rows", cases::hc_rows()),
        ("routers", cases::routers()),
        ("selections", cases::selections()),
        ("sample_rows", sampling::sample_rows()),
        (
            "sample_rows_at_the_real_vocab",
            sampling::sample_rows_at_the_real_vocab(),
        ),
        ("sample_masked", sampling::sample_masked()),
        ("token_logprobs_masked", sampling::token_logprobs_masked()),
        ("sample_linear", sampling::sample_linear()),
        ("scale_at", rows::scale_at()),
        ("stream_means", rows::stream_means()),
        ("gated_pool", rows::gated_pool()),
        ("engram_inject", rows::engram_inject()),
        ("engram_gather", rows::engram_gather()),
        ("table_rows", rows::table_rows()),
        ("split_launches", rows::split_launches()),
        ("hyper_heads", rows::hyper_heads()),
    ]
}

/// The cases of `cases` that fail against the reference in `mode` on `device`.
fn failing(cases: &[Case], device: &dyn Backend, mode: Mode) -> Vec<String> {
    cases
        .iter()
        .filter(|case| check(case, &CpuBackend, device, mode).is_err())
        .map(|case| case.name.clone())
        .collect()
}

#[test]
fn every_case_conforms_on_the_reference_in_both_modes() {
    for (family, cases) in families() {
        for mode in [Mode::Exact, Mode::Fast] {
            let checked = assert_conforms(&cases, &CpuBackend, &CpuBackend, mode);
            assert!(checked.values > 0, "{family}: no values compared");
            assert_eq!(
                checked.worst, 0.0,
                "{family}: the reference differs from itself"
            );
        }
    }
}

/// Ops without a fast path (RMSNorm, the router): a one-ulp change of one value fails their cases
/// in both modes, and no case of another op.
#[test]
fn a_nudged_op_fails_every_case_of_its_own_and_no_other() {
    let nudged = Nudged::new("rms_norm", f32::EPSILON);
    for mode in [Mode::Exact, Mode::Fast] {
        let norms = cases::rms_norms();
        assert_eq!(failing(&norms, &nudged, mode), names(&norms), "{mode:?}");
        assert!(
            failing(&cases::ropes(), &nudged, mode).is_empty(),
            "{mode:?}"
        );
        assert!(
            failing(&cases::linears(), &nudged, mode).is_empty(),
            "{mode:?}"
        );
    }
    let nudged = Nudged::new("route_experts", f32::EPSILON);
    for mode in [Mode::Exact, Mode::Fast] {
        let routers = cases::routers();
        assert_eq!(
            failing(&routers, &nudged, mode),
            names(&routers),
            "{mode:?}"
        );
    }
}

/// Ops with a fast path: a change far inside the bound (2^-12 relative, the bound allows 2^-8 of
/// the value) fails `exact` but passes `fast`; a change beyond it (10^30 added, or a NaN) fails
/// both. The fp32 linears (no fast path) pass untouched.
#[test]
fn fast_bounds_admit_small_errors_and_catch_large_ones() {
    assert_bounded("linear_bf16", &cases::linears(), 18);
    assert_bounded("gemm_fp8", &cases::gemms(), 16);
}

/// V4's hyper head (its fast path sums the squares by a tree, within 6·2^-23 of the value and of
/// its magnitude): a weight moved by one ulp fails `exact` and stays inside the `fast` bound — the
/// one-row case passes; the others fail on their batch-invariance check, which sees the change in
/// the batch's call and not in the row's own — and a move of 2^-12, or a NaN, fails every case.
#[test]
fn the_hyper_head_bound_admits_an_ulp_and_catches_more() {
    const OP: &str = "hyper_head_weights_rows";
    let heads = rows::hyper_heads();
    let all = names(&heads);
    let batched: Vec<String> = all
        .iter()
        .filter(|n| !n.starts_with("hyper_head_weights_rows 1 rows"))
        .cloned()
        .collect();
    assert_eq!(batched.len(), all.len() - 1);
    let ulp = Nudged::new(OP, f32::EPSILON);
    assert_eq!(failing(&heads, &ulp, Mode::Exact), all);
    assert_eq!(failing(&heads, &ulp, Mode::Fast), batched);
    for large in [
        Nudged::new(OP, 2f32.powi(-12)),
        Nudged::shifted(OP, f32::NAN),
    ] {
        assert_eq!(failing(&heads, &large, Mode::Fast), all);
    }
}

/// The `count` cases of `op` among `cases` fail `exact` and pass `fast` with `op` nudged by 2^-12,
/// and fail `fast` with 10^30 added or a NaN; the other cases pass.
fn assert_bounded(op: &'static str, cases: &[Case], count: usize) {
    let of_op: Vec<String> = names(cases)
        .into_iter()
        .filter(|n| n.starts_with(op))
        .collect();
    assert_eq!(of_op.len(), count, "{op}");
    let small = Nudged::new(op, 2f32.powi(-12));
    assert_eq!(failing(cases, &small, Mode::Exact), of_op, "{op} exact");
    assert!(failing(cases, &small, Mode::Fast).is_empty(), "{op} fast");
    for shift in [1e30, f32::NAN] {
        let large = Nudged::shifted(op, shift);
        assert_eq!(failing(cases, &large, Mode::Fast), of_op, "{op} + {shift}");
    }
}

/// A case's invariant broken on a backend (a row of a batch that is not the op on that row
/// alone) fails the case in both modes, naming the side; outputs of another length, or ids that
/// differ, fail too.
#[test]
fn broken_invariants_and_mismatched_outputs_fail() {
    use deepinfer_tests::conformance::Op;
    let broken = Case::new("broken invariant", Op::RmsNorm, |_, o| {
        o.same("row 0 alone", &[1.0, 2.0], &[1.0, 2.5]);
        o.values("y", vec![1.0]);
    });
    for mode in [Mode::Exact, Mode::Fast] {
        let failures = check(&broken, &CpuBackend, &CpuBackend, mode).expect_err("broken");
        assert_eq!(failures.len(), 2, "{failures:?}");
        assert!(failures[0].starts_with("reference cpu"), "{failures:?}");
        assert!(
            failures[0].contains("1 of 2 values differ; first at 1"),
            "{failures:?}"
        );
    }
    let by_backend = Case::new("ids by backend", Op::RouteExperts, |b, o| {
        o.ids("ids", vec![b.name().len() as u32]);
        o.values("y", vec![0.5; b.name().len()]);
    });
    let nudged = Nudged::new("none", 0.0);
    let failures = check(&by_backend, &CpuBackend, &nudged, Mode::Fast).expect_err("differ");
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(
        failures[0].starts_with("ids: device Ids([10]) reference Ids([3])"),
        "{failures:?}"
    );
    assert!(
        failures[1].starts_with("y: 10 values, 3 wanted"),
        "{failures:?}"
    );
}

fn names(cases: &[Case]) -> Vec<String> {
    cases.iter().map(|c| c.name.clone()).collect()
}
