//! The kernel registry: [`KernelId`] names every kernel, the C symbol it has and the source file
//! ([`SourceFile`]) that defines it; [`Arch`] is a compilation target.

use std::fmt;

/// A GPU architecture the kernels are compiled for. `Sm90a` (H100/H200) is tested on hardware;
/// `Sm100a` (B200/GB200, the deploy target) compiles but has not run on sm100 hardware yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Sm90a,
    Sm100a,
}

impl Arch {
    /// Every arch the sources must compile for.
    pub const ALL: [Arch; 2] = [Arch::Sm90a, Arch::Sm100a];

    /// The arch for a device of compute capability `major.minor`.
    pub fn from_compute_capability(major: i32, minor: i32) -> Option<Arch> {
        match (major, minor) {
            (9, 0) => Some(Arch::Sm90a),
            (10, 0) => Some(Arch::Sm100a),
            _ => None,
        }
    }

    /// The NVRTC `--gpu-architecture` value (a real arch, so NVRTC emits a CUBIN).
    pub fn nvrtc_name(self) -> &'static str {
        match self {
            Arch::Sm90a => "sm_90a",
            Arch::Sm100a => "sm_100a",
        }
    }

    /// Whether kernels built for this arch have been run on such hardware (conformance tests).
    pub fn tested_on_hardware(self) -> bool {
        matches!(self, Arch::Sm90a)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.nvrtc_name())
    }
}

/// A `.cu` translation unit; each is compiled to one CUBIN (one module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceFile {
    ActQuant,
    GemmFp8,
    GemmFast,
    GemmFp4,
    RmsNorm,
    Rope,
    Qdq,
    Linear,
    Attention,
    Mhc,
    Indexer,
    Sampling,
    Moe,
    Engram,
    Rows,
    MoeRouted,
    TopK,
    Movement,
    V4,
}

impl SourceFile {
    pub const ALL: [SourceFile; 19] = [
        SourceFile::ActQuant,
        SourceFile::GemmFp8,
        SourceFile::GemmFast,
        SourceFile::GemmFp4,
        SourceFile::RmsNorm,
        SourceFile::Rope,
        SourceFile::Qdq,
        SourceFile::Linear,
        SourceFile::Attention,
        SourceFile::Mhc,
        SourceFile::Indexer,
        SourceFile::Sampling,
        SourceFile::Moe,
        SourceFile::Engram,
        SourceFile::Rows,
        SourceFile::MoeRouted,
        SourceFile::TopK,
        SourceFile::Movement,
        SourceFile::V4,
    ];

    /// Path under `kernels/cuda/`.
    pub fn path(self) -> &'static str {
        match self {
            SourceFile::ActQuant => "quant/act_quant.cu",
            SourceFile::GemmFp8 => "gemm/gemm_fp8.cu",
            SourceFile::GemmFast => "gemm/gemm_fast.cu",
            SourceFile::GemmFp4 => "gemm/gemm_fp4.cu",
            SourceFile::RmsNorm => "norm/rms_norm.cu",
            SourceFile::Rope => "rope/rope.cu",
            SourceFile::Qdq => "quant/qdq.cu",
            SourceFile::Linear => "linear/linear_sgemm.cu",
            SourceFile::Attention => "attention/sparse_attention.cu",
            SourceFile::Mhc => "mhc/mhc.cu",
            SourceFile::Indexer => "indexer/index_scores.cu",
            SourceFile::Sampling => "sampling/sample_rows.cu",
            SourceFile::Moe => "moe/route.cu",
            SourceFile::Engram => "engram/engram.cu",
            SourceFile::Rows => "rows/rows.cu",
            SourceFile::MoeRouted => "moe/routed.cu",
            SourceFile::TopK => "indexer/topk.cu",
            SourceFile::Movement => "common/movement.cu",
            SourceFile::V4 => "v4/v4.cu",
        }
    }
}

/// Every kernel. The C symbol is derived from the id ([`KernelId::symbol`]), never typed at a
/// call site.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// Q8 activation quantisation, 32-groups (V4.1): bf16 -> E4M3 codes + f32 power-of-two scales.
    ActQuantFp8G32,
    /// Q8 activation quantisation, 128-groups (V4).
    ActQuantFp8G128,
    /// Q8 activation quantisation, 32-groups, from f32 storage.
    ActQuantFp8G32F32,
    /// Q8 activation quantisation, 128-groups, from f32 storage.
    ActQuantFp8G128F32,
    /// FP8 GEMM, 32x32 weight tiles, 32-group activations (V4.1 dense linears).
    GemmFp8T32G32,
    /// FP8 GEMM, 128x128 weight tiles, 128-group activations (V4 dense linears).
    GemmFp8T128G128,
    /// FP4-expert GEMM: E2M1 weights with 1x32 UE8M0 scales, 32-group FP8 activations.
    GemmFp4G32,
    /// `GemmFp8T32G32` with one warp per output column over all of K (few rows).
    GemmFp8T32G32Warp,
    /// `GemmFp8T128G128` with one warp per output column over all of K (few rows).
    GemmFp8T128G128Warp,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 32x32 weight tiles, 8 token rows per block.
    GemmFp8FastT32B8,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 32x32 weight tiles, 32 token rows per block.
    GemmFp8FastT32B32,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 32x32 weight tiles, 64 token rows per block.
    GemmFp8FastT32B64,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 32x32 weight tiles, 128 token rows per block.
    GemmFp8FastT32B128,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 128x128 weight tiles, 8 token rows per block.
    GemmFp8FastT128B8,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 128x128 weight tiles, 32 token rows per block.
    GemmFp8FastT128B32,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 128x128 weight tiles, 64 token rows per block.
    GemmFp8FastT128B64,
    /// Fast FP8 GEMM (tensor cores, `fast` numerics), 128x128 weight tiles, 128 token rows per block.
    GemmFp8FastT128B128,
    /// Fast FP4 GEMM (E2M1 codes as E4M3 on tensor cores, `fast` numerics), 8 token rows per block.
    GemmFp4FastB8,
    /// Fast FP4 GEMM, 32 token rows per block.
    GemmFp4FastB32,
    /// Fast FP4 GEMM, 64 token rows per block.
    GemmFp4FastB64,
    /// Fast FP4 GEMM, 128 token rows per block.
    GemmFp4FastB128,
    /// Fast routed-expert FP4 GEMM over tiles of up to 8 rows of one expert (`GroupRoutedRows`).
    GemmFp4FastRoutedB8,
    /// Fast routed-expert FP4 GEMM over tiles of up to 32 rows of one expert.
    GemmFp4FastRoutedB32,
    /// Fast routed-expert FP4 GEMM over tiles of up to 64 rows of one expert.
    GemmFp4FastRoutedB64,
    /// Fast routed-expert FP4 GEMM over tiles of up to 128 rows of one expert.
    GemmFp4FastRoutedB128,
    /// The fast GEMMs' K-part sums added in part order and rounded to bf16.
    GemmFastReduce,
    /// `GemmFp4G32` with one warp per output column over all of K (few rows).
    GemmFp4G32Warp,
    /// RMSNorm on f32 storage (the model's host layout), outputs rounded to bf16.
    RmsNormF32,
    /// `RmsNormF32` that also quantises its outputs to FP8 in groups of 32 (the next GEMM's input).
    RmsNormActQuantG32F32,
    /// Interleaved-pair partial RoPE on f32 storage, outputs rounded to bf16, in place.
    RopeInterleavedF32,
    /// RMSNorm (optional), RoPE and `Q8` QDQ in one pass (the window entries).
    RopeQdqQ8F32,
    /// RMSNorm (optional), RoPE and `Q4e` QDQ in one pass (the indexer's queries and keys).
    RopeQdqQ4eF32,
    /// RMSNorm (optional), RoPE and `Q4m` QDQ in one pass (the compressed entries).
    RopeQdqQ4mF32,
    /// RMSNorm on f32 storage with fp32 outputs (no rounding).
    RmsNormF32Exact,
    /// Interleaved-pair partial RoPE on f32 storage with fp32 outputs, in place.
    RopeInterleavedF32Exact,
    /// `Q8` QDQ in place (groups of 32, UE8M0 scales, E4M3 values), f32 storage.
    Q8QdqF32,
    /// `Q4e` QDQ in place (groups of 32, UE8M0 scales, E2M1 values), f32 storage.
    Q4eQdqF32,
    /// `Q4m` QDQ in place (groups of 16, E4M3 scales, E2M1 values), f32 storage.
    Q4mQdqF32,
    /// fp32 linear `x · Wᵀ` in the CPU sgemm summation order, f32 or bf16-rounded output.
    LinearSgemmF32,
    /// The `fast` bf16 linear on tensor cores, one 16 x 8 mma tile per warp (up to 16 rows).
    LinearBf16FastT1x1,
    /// The `fast` bf16 linear, 2 x 2 mma tiles per warp (17 to 64 rows).
    LinearBf16FastT2x2,
    /// The `fast` bf16 linear, 4 x 2 mma tiles per warp (more rows, too few for the wide tile).
    LinearBf16FastT4x2,
    /// The `fast` bf16 linear's prefill tile: 128 x 256 outputs a block, each warp all of K.
    LinearBf16FastWide,
    /// The `fast` split-x bf16x3 linear (x in three bf16 pieces: fp32-level accuracy) on tensor
    /// cores, the tiles of the bf16 linear: one 16 x 8 mma tile per warp.
    LinearBf16x3FastT1x1,
    /// The split-x bf16x3 linear, 2 x 2 mma tiles per warp.
    LinearBf16x3FastT2x2,
    /// The split-x bf16x3 linear, 4 x 2 mma tiles per warp.
    LinearBf16x3FastT4x2,
    /// The split-x bf16x3 linear's prefill tile.
    LinearBf16x3FastWide,
    /// The bf16 linear's prefill tile over one K part a block (part sums for
    /// `LinearFastReduce`): prefill shapes with too few wide blocks.
    LinearBf16FastWidePart,
    /// The split-x bf16x3 linear's one-part prefill tile.
    LinearBf16x3FastWidePart,
    /// The fast linears' part sums added in part order.
    LinearFastReduce,
    /// The pairwise tree over the block partials of `LinearSgemmF32`.
    LinearSgemmReduceF32,
    /// Rows of an FP8 weight dequantised to f32.
    DequantFp8RowsF32,
    /// Rows of an FP4 weight dequantised to f32.
    DequantFp4RowsF32,
    /// The sink attention of many queries in one launch, each over its own list of key rows.
    SparseAttentionSinkRowsF32,
    /// The row-batched sink attention with key rows read through a device pointer table.
    SparseAttentionSinkRowsPtrF32,
    /// The same on tensor cores (`fast` numerics, bf16 rounding points), a query's keys in
    /// splits.
    SparseAttentionSinkRowsPtrFast,
    /// The same with one block per query running all of its splits (launches of many queries).
    SparseAttentionSinkRowsPtrFastWhole,
    /// The fast attention of f32 operands (V4's plain f32 precision), each split into two bf16
    /// pieces on the tensor cores (fp32-level accuracy), the output unrounded.
    SparseAttentionSinkRowsPtrFastF32,
    /// The f32 fast attention with one block per query running all of its splits.
    SparseAttentionSinkRowsPtrFastF32Whole,
    /// Merges the splits of the fast attention's queries of several splits.
    SparseAttentionSplitCombine,
    /// mHC projection partials (one fixed-order chain per projection and K block) and the
    /// sum of squares, many blocks per token.
    HcMixesPartialsF32,
    /// mHC pre/post/comb coefficients of each token from its partials (sums, sigmoids, Sinkhorn).
    HcMixesF32,
    /// mHC collapse of the streams into one bf16 row.
    HcCollapseF32,
    /// mHC expansion of a sublayer output back into the streams.
    HcExpandF32,
    /// Indexer scores of one query against compressed keys.
    IndexScoresF32,
    /// Indexer scores of many queries in one launch, each against its own prefix of the keys.
    IndexScoresRowsF32,
    /// The row-batched indexer scores with key rows read through a device pointer table.
    IndexScoresRowsPtrF32,
    /// `IndexScoresRowsPtrF32` at the bf16 rounding points with the dot products on tensor cores
    /// (`fast` numerics; the exact kernel's bits on Q4e-QDQ'd q and keys).
    IndexScoresRowsPtrFast,
    /// One token per logit row: greedy, or Gumbel-max with temperature, top-k and top-p.
    SampleRowsF32,
    /// Grammar masks: logits whose bit in the row's allowed-token bitset is clear become -inf.
    MaskLogitsF32,
    /// Log-probabilities of sampled tokens and their most likely alternatives.
    TokenLogprobsF32,
    /// MoE router after the gate linear: sqrt-softplus scores, biased top-k, normalised weights.
    RouteExpertsF32,
    /// Engram table row ids of hashed n-gram contexts.
    EngramHashRows,
    /// Engram table rows (FP8 codes x UE8M0 row scales) gathered and dequantised to bf16.
    EngramGatherF32,
    /// `round(mean over hc streams)` of every token, the CPU's fold order.
    StreamMeansF32,
    /// `round(x · scale)` in place.
    ScaleRoundF32,
    /// f32 `exp` bit for bit as Rust's std (glibc's expf, FMA build), in place.
    ExpStdF32,
    /// Gated pooling of compressor groups over member rows given by device address.
    GatedPoolF32,
    /// The Engram gate and injection of the live tokens into their hc streams.
    EngramInjectF32,
    /// Output rows of a routed GEMM bucketed by expert and cut into tiles (device routes).
    GroupRoutedRows,
    /// Routed-expert FP4 GEMM, one output row per block with its own expert's weight.
    GemmFp4RoutedRowsG32,
    /// Routed-expert FP4 GEMM over tiles of up to 8 rows of one expert (from `GroupRoutedRows`).
    GemmFp4RoutedTilesG32,
    /// Routed-expert FP8 GEMM (32x32 weight tiles), one output row per block.
    GemmFp8T32RoutedRowsG32,
    /// Routed-expert FP8 GEMM (32x32 weight tiles) over tiles of one expert.
    GemmFp8T32RoutedTilesG32,
    /// Routed-expert FP4 GEMM, one warp per column over tiles of up to 32 rows of one expert.
    GemmFp4RoutedExpertsG32,
    /// Routed-expert FP8 GEMM (32x32 weight tiles), one warp per column over tiles of one expert.
    GemmFp8T32RoutedExpertsG32,
    /// SwiGLU of routed/shared expert rows (bf16 gate/up) with clamps and route weights,
    /// quantised to FP8 in 32-groups in the same kernel (the `w2` GEMM's activations).
    SwigluActQuantFp8G32,
    /// [`KernelId::SwigluActQuantFp8G32`] over f32 gate/up rows (V4's experts, fast numerics).
    SwigluActQuantFp8G32F32,
    /// MoE combine: slot outputs in increasing expert id, then the shared expert, one rounding.
    MoeCombineF32,
    /// Exact fp32 routed-expert linear (V4: dense/FP8/FP4 weights dequantised exactly), the
    /// sgemm-order block partials of tiles of one expert (reduced by `LinearSgemmReduceF32`).
    GemmExactRoutedPartialsF32,
    /// SwiGLU of f32 gate/up rows with clamps and route weights, f32 output (V4's exact
    /// experts and shared expert, unquantised).
    SwigluExactRowsF32,
    /// [`KernelId::MoeCombineF32`] over f32 slot and shared outputs.
    MoeCombineExactF32,
    /// The indexer's top-k of many queries' scores (largest, ties to the lower index, ascending).
    TopKRowsF32,
    /// The candidate mask (level one of the two-level top-k) of many queries' scores.
    CandidateMaskRowsF32,
    /// Scores outside a candidate mask set to -inf, many queries.
    ApplyMaskRowsF32,
    /// Fixed-width pieces gathered from device addresses into one f32 buffer.
    GatherPtrsF32,
    /// bf16 values widened to f32 storage.
    Bf16ToF32,
    /// Attention key lists written from runs of table rows and device selections.
    ComposeKeyLists,
    /// Key-table addresses copied between device lists.
    CopyAddresses,
    /// `x += y` elementwise in fp32.
    AddF32,
    /// V4 compressor pooling: softmax of biased gates over slots given by device address, fp32.
    V4PoolF32,
    /// V4 hyper-head collapse weights (sigmoid of the normed projection), fp32, the squares
    /// summed in the reference's order (exact numerics).
    V4HyperHeadF32,
    /// The same with the squares summed by a fixed tree (fast numerics).
    V4HyperHeadTreeF32,
}

impl KernelId {
    pub const ALL: [KernelId; 103] = [
        KernelId::ActQuantFp8G32,
        KernelId::ActQuantFp8G128,
        KernelId::ActQuantFp8G32F32,
        KernelId::ActQuantFp8G128F32,
        KernelId::GemmFp8T32G32,
        KernelId::GemmFp8T128G128,
        KernelId::GemmFp4G32,
        KernelId::GemmFp8T32G32Warp,
        KernelId::GemmFp8T128G128Warp,
        KernelId::GemmFp8FastT32B8,
        KernelId::GemmFp8FastT32B32,
        KernelId::GemmFp8FastT32B64,
        KernelId::GemmFp8FastT32B128,
        KernelId::GemmFp8FastT128B8,
        KernelId::GemmFp8FastT128B32,
        KernelId::GemmFp8FastT128B64,
        KernelId::GemmFp8FastT128B128,
        KernelId::GemmFp4FastB8,
        KernelId::GemmFp4FastB32,
        KernelId::GemmFp4FastB64,
        KernelId::GemmFp4FastB128,
        KernelId::GemmFp4FastRoutedB8,
        KernelId::GemmFp4FastRoutedB32,
        KernelId::GemmFp4FastRoutedB64,
        KernelId::GemmFp4FastRoutedB128,
        KernelId::GemmFastReduce,
        KernelId::GemmFp4G32Warp,
        KernelId::RmsNormF32,
        KernelId::RmsNormActQuantG32F32,
        KernelId::RopeInterleavedF32,
        KernelId::RopeQdqQ8F32,
        KernelId::RopeQdqQ4eF32,
        KernelId::RopeQdqQ4mF32,
        KernelId::RmsNormF32Exact,
        KernelId::RopeInterleavedF32Exact,
        KernelId::Q8QdqF32,
        KernelId::Q4eQdqF32,
        KernelId::Q4mQdqF32,
        KernelId::LinearSgemmF32,
        KernelId::LinearBf16FastT1x1,
        KernelId::LinearBf16FastT2x2,
        KernelId::LinearBf16FastT4x2,
        KernelId::LinearBf16FastWide,
        KernelId::LinearBf16x3FastT1x1,
        KernelId::LinearBf16x3FastT2x2,
        KernelId::LinearBf16x3FastT4x2,
        KernelId::LinearBf16x3FastWide,
        KernelId::LinearBf16FastWidePart,
        KernelId::LinearBf16x3FastWidePart,
        KernelId::LinearFastReduce,
        KernelId::LinearSgemmReduceF32,
        KernelId::DequantFp8RowsF32,
        KernelId::DequantFp4RowsF32,
        KernelId::SparseAttentionSinkRowsF32,
        KernelId::SparseAttentionSinkRowsPtrF32,
        KernelId::SparseAttentionSinkRowsPtrFast,
        KernelId::SparseAttentionSinkRowsPtrFastWhole,
        KernelId::SparseAttentionSinkRowsPtrFastF32,
        KernelId::SparseAttentionSinkRowsPtrFastF32Whole,
        KernelId::SparseAttentionSplitCombine,
        KernelId::HcMixesPartialsF32,
        KernelId::HcMixesF32,
        KernelId::HcCollapseF32,
        KernelId::HcExpandF32,
        KernelId::IndexScoresF32,
        KernelId::IndexScoresRowsF32,
        KernelId::IndexScoresRowsPtrF32,
        KernelId::IndexScoresRowsPtrFast,
        KernelId::SampleRowsF32,
        KernelId::MaskLogitsF32,
        KernelId::TokenLogprobsF32,
        KernelId::RouteExpertsF32,
        KernelId::EngramHashRows,
        KernelId::EngramGatherF32,
        KernelId::StreamMeansF32,
        KernelId::ScaleRoundF32,
        KernelId::ExpStdF32,
        KernelId::GatedPoolF32,
        KernelId::EngramInjectF32,
        KernelId::GroupRoutedRows,
        KernelId::GemmFp4RoutedRowsG32,
        KernelId::GemmFp4RoutedTilesG32,
        KernelId::GemmFp8T32RoutedRowsG32,
        KernelId::GemmFp8T32RoutedTilesG32,
        KernelId::GemmFp4RoutedExpertsG32,
        KernelId::GemmFp8T32RoutedExpertsG32,
        KernelId::SwigluActQuantFp8G32,
        KernelId::SwigluActQuantFp8G32F32,
        KernelId::MoeCombineF32,
        KernelId::GemmExactRoutedPartialsF32,
        KernelId::SwigluExactRowsF32,
        KernelId::MoeCombineExactF32,
        KernelId::TopKRowsF32,
        KernelId::CandidateMaskRowsF32,
        KernelId::ApplyMaskRowsF32,
        KernelId::GatherPtrsF32,
        KernelId::Bf16ToF32,
        KernelId::ComposeKeyLists,
        KernelId::CopyAddresses,
        KernelId::AddF32,
        KernelId::V4PoolF32,
        KernelId::V4HyperHeadF32,
        KernelId::V4HyperHeadTreeF32,
    ];

    /// The `extern "C"` symbol in the source file.
    pub fn symbol(self) -> &'static str {
        match self {
            KernelId::ActQuantFp8G32 => "act_quant_fp8_g32_bf16",
            KernelId::ActQuantFp8G128 => "act_quant_fp8_g128_bf16",
            KernelId::ActQuantFp8G32F32 => "act_quant_fp8_g32_f32",
            KernelId::ActQuantFp8G128F32 => "act_quant_fp8_g128_f32",
            KernelId::GemmFp8T32G32 => "gemm_fp8_t32_g32_bf16",
            KernelId::GemmFp8T128G128 => "gemm_fp8_t128_g128_bf16",
            KernelId::GemmFp4G32 => "gemm_fp4_g32_bf16",
            KernelId::GemmFp8T32G32Warp => "gemm_fp8_t32_g32_warp_bf16",
            KernelId::GemmFp8T128G128Warp => "gemm_fp8_t128_g128_warp_bf16",
            KernelId::GemmFp8FastT32B8 => "gemm_fp8_fast_t32_b8",
            KernelId::GemmFp8FastT32B32 => "gemm_fp8_fast_t32_b32",
            KernelId::GemmFp8FastT32B64 => "gemm_fp8_fast_t32_b64",
            KernelId::GemmFp8FastT32B128 => "gemm_fp8_fast_t32_b128",
            KernelId::GemmFp8FastT128B8 => "gemm_fp8_fast_t128_b8",
            KernelId::GemmFp8FastT128B32 => "gemm_fp8_fast_t128_b32",
            KernelId::GemmFp8FastT128B64 => "gemm_fp8_fast_t128_b64",
            KernelId::GemmFp8FastT128B128 => "gemm_fp8_fast_t128_b128",
            KernelId::GemmFp4FastB8 => "gemm_fp4_fast_b8",
            KernelId::GemmFp4FastB32 => "gemm_fp4_fast_b32",
            KernelId::GemmFp4FastB64 => "gemm_fp4_fast_b64",
            KernelId::GemmFp4FastB128 => "gemm_fp4_fast_b128",
            KernelId::GemmFp4FastRoutedB8 => "gemm_fp4_fast_routed_b8",
            KernelId::GemmFp4FastRoutedB32 => "gemm_fp4_fast_routed_b32",
            KernelId::GemmFp4FastRoutedB64 => "gemm_fp4_fast_routed_b64",
            KernelId::GemmFp4FastRoutedB128 => "gemm_fp4_fast_routed_b128",
            KernelId::GemmFastReduce => "gemm_fast_reduce",
            KernelId::GemmFp4G32Warp => "gemm_fp4_g32_warp_bf16",
            KernelId::RmsNormF32 => "rms_norm_f32",
            KernelId::RmsNormActQuantG32F32 => "rms_norm_act_quant_g32_f32",
            KernelId::RopeInterleavedF32 => "rope_interleaved_f32",
            KernelId::RopeQdqQ8F32 => "rope_qdq_q8_f32",
            KernelId::RopeQdqQ4eF32 => "rope_qdq_q4e_f32",
            KernelId::RopeQdqQ4mF32 => "rope_qdq_q4m_f32",
            KernelId::RmsNormF32Exact => "rms_norm_f32_exact",
            KernelId::RopeInterleavedF32Exact => "rope_interleaved_f32_exact",
            KernelId::Q8QdqF32 => "q8_qdq_f32",
            KernelId::Q4eQdqF32 => "q4e_qdq_f32",
            KernelId::Q4mQdqF32 => "q4m_qdq_f32",
            KernelId::LinearSgemmF32 => "linear_sgemm_f32",
            KernelId::LinearBf16FastT1x1 => "linear_bf16_fast_t1x1",
            KernelId::LinearBf16FastT2x2 => "linear_bf16_fast_t2x2",
            KernelId::LinearBf16FastT4x2 => "linear_bf16_fast_t4x2",
            KernelId::LinearBf16FastWide => "linear_bf16_fast_wide",
            KernelId::LinearBf16x3FastT1x1 => "linear_bf16x3_fast_t1x1",
            KernelId::LinearBf16x3FastT2x2 => "linear_bf16x3_fast_t2x2",
            KernelId::LinearBf16x3FastT4x2 => "linear_bf16x3_fast_t4x2",
            KernelId::LinearBf16x3FastWide => "linear_bf16x3_fast_wide",
            KernelId::LinearBf16FastWidePart => "linear_bf16_fast_wide_part",
            KernelId::LinearBf16x3FastWidePart => "linear_bf16x3_fast_wide_part",
            KernelId::LinearFastReduce => "linear_fast_reduce",
            KernelId::LinearSgemmReduceF32 => "linear_sgemm_reduce_f32",
            KernelId::DequantFp8RowsF32 => "dequant_fp8_rows_f32",
            KernelId::DequantFp4RowsF32 => "dequant_fp4_rows_f32",
            KernelId::SparseAttentionSinkRowsF32 => "sparse_attention_sink_rows_f32",
            KernelId::SparseAttentionSinkRowsPtrF32 => "sparse_attention_sink_rows_ptr_f32",
            KernelId::SparseAttentionSinkRowsPtrFast => "sparse_attention_sink_rows_ptr_fast",
            KernelId::SparseAttentionSinkRowsPtrFastWhole => {
                "sparse_attention_sink_rows_ptr_fast_whole"
            }
            KernelId::SparseAttentionSinkRowsPtrFastF32 => {
                "sparse_attention_sink_rows_ptr_fast_f32"
            }
            KernelId::SparseAttentionSinkRowsPtrFastF32Whole => {
                "sparse_attention_sink_rows_ptr_fast_f32_whole"
            }
            KernelId::SparseAttentionSplitCombine => "sparse_attention_split_combine",
            KernelId::HcMixesPartialsF32 => "hc_mixes_partials_f32",
            KernelId::HcMixesF32 => "hc_mixes_f32",
            KernelId::HcCollapseF32 => "hc_collapse_f32",
            KernelId::HcExpandF32 => "hc_expand_f32",
            KernelId::IndexScoresF32 => "index_scores_f32",
            KernelId::IndexScoresRowsF32 => "index_scores_rows_f32",
            KernelId::IndexScoresRowsPtrF32 => "index_scores_rows_ptr_f32",
            KernelId::IndexScoresRowsPtrFast => "index_scores_rows_ptr_fast",
            KernelId::SampleRowsF32 => "sample_rows_f32",
            KernelId::MaskLogitsF32 => "mask_logits_f32",
            KernelId::TokenLogprobsF32 => "token_logprobs_f32",
            KernelId::RouteExpertsF32 => "route_experts_f32",
            KernelId::EngramHashRows => "engram_hash_rows",
            KernelId::EngramGatherF32 => "engram_gather_f32",
            KernelId::StreamMeansF32 => "stream_means_f32",
            KernelId::ScaleRoundF32 => "scale_round_f32",
            KernelId::ExpStdF32 => "exp_std_f32",
            KernelId::GatedPoolF32 => "gated_pool_f32",
            KernelId::EngramInjectF32 => "engram_inject_f32",
            KernelId::GroupRoutedRows => "group_routed_rows",
            KernelId::GemmFp4RoutedRowsG32 => "gemm_fp4_routed_rows_g32_bf16",
            KernelId::GemmFp4RoutedTilesG32 => "gemm_fp4_routed_tiles_g32_bf16",
            KernelId::GemmFp8T32RoutedRowsG32 => "gemm_fp8_t32_routed_rows_g32_bf16",
            KernelId::GemmFp8T32RoutedTilesG32 => "gemm_fp8_t32_routed_tiles_g32_bf16",
            KernelId::GemmFp4RoutedExpertsG32 => "gemm_fp4_routed_experts_g32_bf16",
            KernelId::GemmFp8T32RoutedExpertsG32 => "gemm_fp8_t32_routed_experts_g32_bf16",
            KernelId::SwigluActQuantFp8G32 => "swiglu_act_quant_fp8_g32_bf16",
            KernelId::SwigluActQuantFp8G32F32 => "swiglu_act_quant_fp8_g32_f32",
            KernelId::MoeCombineF32 => "moe_combine_f32",
            KernelId::GemmExactRoutedPartialsF32 => "gemm_exact_routed_partials_f32",
            KernelId::SwigluExactRowsF32 => "swiglu_exact_rows_f32",
            KernelId::MoeCombineExactF32 => "moe_combine_exact_f32",
            KernelId::TopKRowsF32 => "top_k_rows_f32",
            KernelId::CandidateMaskRowsF32 => "candidate_mask_rows_f32",
            KernelId::ApplyMaskRowsF32 => "apply_mask_rows_f32",
            KernelId::GatherPtrsF32 => "gather_ptrs_f32",
            KernelId::Bf16ToF32 => "bf16_to_f32",
            KernelId::ComposeKeyLists => "compose_key_lists",
            KernelId::CopyAddresses => "copy_addresses",
            KernelId::AddF32 => "add_f32",
            KernelId::V4PoolF32 => "v4_pool_f32",
            KernelId::V4HyperHeadF32 => "v4_hyper_head_f32",
            KernelId::V4HyperHeadTreeF32 => "v4_hyper_head_tree_f32",
        }
    }

    /// Whether the kernel runs on tensor cores (the `fast` numerics' GEMMs, bf16 linear, sink
    /// attention and indexer scores); every other kernel is a CUDA-core kernel of the exact
    /// numerics or shared by both (quantisation, SwiGLU, combine, movement). A kernel of the fast
    /// GEMMs' or the linears' translation unit runs on tensor cores unless listed `false` here.
    pub fn on_tensor_cores(self) -> bool {
        match self {
            KernelId::GemmFastReduce
            | KernelId::LinearFastReduce
            | KernelId::LinearSgemmF32
            | KernelId::LinearSgemmReduceF32
            | KernelId::DequantFp8RowsF32
            | KernelId::DequantFp4RowsF32 => false,
            KernelId::SparseAttentionSinkRowsPtrFast
            | KernelId::SparseAttentionSinkRowsPtrFastWhole
            | KernelId::SparseAttentionSinkRowsPtrFastF32
            | KernelId::SparseAttentionSinkRowsPtrFastF32Whole
            | KernelId::IndexScoresRowsPtrFast => true,
            id => matches!(id.source(), SourceFile::GemmFast | SourceFile::Linear),
        }
    }

    /// The translation unit that defines the kernel.
    pub fn source(self) -> SourceFile {
        match self {
            KernelId::ActQuantFp8G32
            | KernelId::ActQuantFp8G128
            | KernelId::ActQuantFp8G32F32
            | KernelId::ActQuantFp8G128F32 => SourceFile::ActQuant,
            KernelId::GemmFp8T32G32
            | KernelId::GemmFp8T128G128
            | KernelId::GemmFp8T32G32Warp
            | KernelId::GemmFp8T128G128Warp => SourceFile::GemmFp8,
            KernelId::GemmFp8FastT32B8
            | KernelId::GemmFp8FastT32B32
            | KernelId::GemmFp8FastT32B64
            | KernelId::GemmFp8FastT32B128
            | KernelId::GemmFp8FastT128B8
            | KernelId::GemmFp8FastT128B32
            | KernelId::GemmFp8FastT128B64
            | KernelId::GemmFp8FastT128B128
            | KernelId::GemmFp4FastB8
            | KernelId::GemmFp4FastB32
            | KernelId::GemmFp4FastB64
            | KernelId::GemmFp4FastB128
            | KernelId::GemmFp4FastRoutedB8
            | KernelId::GemmFp4FastRoutedB32
            | KernelId::GemmFp4FastRoutedB64
            | KernelId::GemmFp4FastRoutedB128
            | KernelId::GemmFastReduce => SourceFile::GemmFast,
            KernelId::GemmFp4G32 | KernelId::GemmFp4G32Warp => SourceFile::GemmFp4,
            KernelId::RmsNormF32
            | KernelId::RmsNormActQuantG32F32
            | KernelId::RmsNormF32Exact => SourceFile::RmsNorm,
            KernelId::RopeInterleavedF32
            | KernelId::RopeInterleavedF32Exact
            | KernelId::RopeQdqQ8F32
            | KernelId::RopeQdqQ4eF32
            | KernelId::RopeQdqQ4mF32 => SourceFile::Rope,
            KernelId::Q8QdqF32 | KernelId::Q4eQdqF32 | KernelId::Q4mQdqF32 => SourceFile::Qdq,
            KernelId::LinearSgemmF32
            | KernelId::LinearBf16FastT1x1
            | KernelId::LinearBf16FastT2x2
            | KernelId::LinearBf16FastT4x2
            | KernelId::LinearBf16FastWide
            | KernelId::LinearBf16x3FastT1x1
            | KernelId::LinearBf16x3FastT2x2
            | KernelId::LinearBf16x3FastT4x2
            | KernelId::LinearBf16x3FastWide
            | KernelId::LinearBf16FastWidePart
            | KernelId::LinearBf16x3FastWidePart
            | KernelId::LinearFastReduce
            | KernelId::LinearSgemmReduceF32
            | KernelId::DequantFp8RowsF32
            | KernelId::DequantFp4RowsF32 => SourceFile::Linear,
            KernelId::SparseAttentionSinkRowsF32
            | KernelId::SparseAttentionSinkRowsPtrF32
            | KernelId::SparseAttentionSinkRowsPtrFast
            | KernelId::SparseAttentionSinkRowsPtrFastWhole
            | KernelId::SparseAttentionSinkRowsPtrFastF32
            | KernelId::SparseAttentionSinkRowsPtrFastF32Whole
            | KernelId::SparseAttentionSplitCombine => SourceFile::Attention,
            KernelId::HcMixesPartialsF32
            | KernelId::HcMixesF32
            | KernelId::HcCollapseF32
            | KernelId::HcExpandF32 => SourceFile::Mhc,
            KernelId::IndexScoresF32
            | KernelId::IndexScoresRowsF32
            | KernelId::IndexScoresRowsPtrF32
            | KernelId::IndexScoresRowsPtrFast => SourceFile::Indexer,
            KernelId::SampleRowsF32 | KernelId::MaskLogitsF32 | KernelId::TokenLogprobsF32 => {
                SourceFile::Sampling
            }
            KernelId::RouteExpertsF32 => SourceFile::Moe,
            KernelId::EngramHashRows | KernelId::EngramGatherF32 => SourceFile::Engram,
            KernelId::StreamMeansF32
            | KernelId::ScaleRoundF32
            | KernelId::ExpStdF32
            | KernelId::GatedPoolF32
            | KernelId::EngramInjectF32 => SourceFile::Rows,
            KernelId::GroupRoutedRows
            | KernelId::GemmFp4RoutedRowsG32
            | KernelId::GemmFp4RoutedTilesG32
            | KernelId::GemmFp8T32RoutedRowsG32
            | KernelId::GemmFp8T32RoutedTilesG32
            | KernelId::GemmFp4RoutedExpertsG32
            | KernelId::GemmFp8T32RoutedExpertsG32
            | KernelId::SwigluActQuantFp8G32
            | KernelId::SwigluActQuantFp8G32F32
            | KernelId::MoeCombineF32
            | KernelId::GemmExactRoutedPartialsF32
            | KernelId::SwigluExactRowsF32
            | KernelId::MoeCombineExactF32 => SourceFile::MoeRouted,
            KernelId::TopKRowsF32 | KernelId::CandidateMaskRowsF32 | KernelId::ApplyMaskRowsF32 => {
                SourceFile::TopK
            }
            KernelId::GatherPtrsF32
            | KernelId::Bf16ToF32
            | KernelId::ComposeKeyLists
            | KernelId::CopyAddresses
            | KernelId::AddF32 => SourceFile::Movement,
            KernelId::V4PoolF32 | KernelId::V4HyperHeadF32 | KernelId::V4HyperHeadTreeF32 => {
                SourceFile::V4
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source;

    #[test]
    fn every_kernel_symbol_is_defined_in_its_source_file() {
        for id in KernelId::ALL {
            let text = source::text(id.source());
            assert!(
                text.contains(id.symbol()),
                "{} does not define {}",
                id.source().path(),
                id.symbol()
            );
        }
    }

    #[test]
    fn symbols_are_unique() {
        let mut symbols: Vec<_> = KernelId::ALL.iter().map(|id| id.symbol()).collect();
        symbols.sort_unstable();
        symbols.dedup();
        assert_eq!(symbols.len(), KernelId::ALL.len());
    }

    /// The tensor-core kernels are the `fast` ones (named so), less the part reductions of the
    /// fast GEMMs and linears (plain fp32 adds): 31 of them.
    #[test]
    fn tensor_core_kernels_are_the_fast_kernels_but_the_reductions() {
        for id in KernelId::ALL {
            let reduction = matches!(id, KernelId::GemmFastReduce | KernelId::LinearFastReduce);
            let fast = id.symbol().contains("fast") && !reduction;
            assert_eq!(id.on_tensor_cores(), fast, "{}", id.symbol());
        }
        let count = KernelId::ALL
            .iter()
            .filter(|id| id.on_tensor_cores())
            .count();
        assert_eq!(count, 31);
    }

    #[test]
    fn compute_capabilities_map_to_arches() {
        assert_eq!(Arch::from_compute_capability(9, 0), Some(Arch::Sm90a));
        assert_eq!(Arch::from_compute_capability(10, 0), Some(Arch::Sm100a));
        assert_eq!(Arch::from_compute_capability(8, 9), None);
        assert!(Arch::Sm90a.tested_on_hardware());
        assert!(!Arch::Sm100a.tested_on_hardware());
    }
}
