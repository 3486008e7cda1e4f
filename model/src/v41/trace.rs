//! Optional intermediate tensors of one forward call, for golden tests and debugging. Filled only
//! when a caller passes a trace; the numbers are the ones the forward pass itself uses.

/// Per-layer intermediates of one chunk (row-major, chunk rows in order).
#[derive(Debug, Clone, Default)]
pub struct ForwardTrace {
    /// `[layer] → [n, hc, dim]`: the hc streams after every block.
    pub layer_out: Vec<Vec<f32>>,
    /// `[layer] → [n, hc]`: the FFN-site `pre` each block returns.
    pub layer_pre: Vec<Vec<f32>>,
    /// `[layer] → [n, hc, dim]`: the streams right after an Engram (empty for other layers).
    pub engram_out: Vec<Vec<f32>>,
    /// `[layer] → [n, head_dim]`: window K=V entries.
    pub window_kv: Vec<Vec<f32>>,
    /// `[layer] → per query`: compressed positions attended (empty for window-only layers).
    pub topk: Vec<Vec<Vec<usize>>>,
    /// `[layer] → per query`: routed experts in selection order.
    pub route_idx: Vec<Vec<Vec<usize>>>,
    /// `[layer] → per query`: their weights.
    pub route_w: Vec<Vec<Vec<f32>>>,
    /// `[n, dim]`: the head input `RMSNorm(collapse(X, pre))`.
    pub final_hidden: Vec<f32>,
    /// `[n, targets · dim]`: DSpark taps.
    pub main_hidden: Vec<f32>,
    /// Recorded discrete decisions to use instead of computing them (golden tests pin the
    /// reference's selections this way to compare everything downstream of them).
    pub inject: Injection,
}

/// Discrete decisions forced into a forward call, per backbone layer and chunk row.
#[derive(Debug, Clone, Default)]
pub struct Injection {
    /// `[layer] → per query`: compressed positions an index source selects.
    pub topk: Vec<Option<Vec<Vec<usize>>>>,
    /// `[layer] → per query`: routed experts in selection order.
    pub routes: Vec<Option<Vec<Vec<usize>>>>,
    /// `[layer] → [n, hc, dim]`: streams entering block `layer` (before its Engram); index
    /// `n_layers` replaces the streams entering the final collapse.
    pub streams: Vec<Option<Vec<f32>>>,
    /// `[layer] → [n, hc]`: the collapse weights entering block `layer` (same indexing).
    pub pre: Vec<Option<Vec<f32>>>,
    /// `[n, targets · dim]`: DSpark taps.
    pub main_hidden: Option<Vec<f32>>,
}

impl ForwardTrace {
    /// Clears the recorded fields (keeps `inject`) and sizes them for `n_layers`.
    pub(crate) fn reset(&mut self, n_layers: usize) {
        let inject = std::mem::take(&mut self.inject);
        *self = ForwardTrace {
            layer_out: vec![Vec::new(); n_layers],
            layer_pre: vec![Vec::new(); n_layers],
            engram_out: vec![Vec::new(); n_layers],
            window_kv: vec![Vec::new(); n_layers],
            topk: vec![Vec::new(); n_layers],
            route_idx: vec![Vec::new(); n_layers],
            route_w: vec![Vec::new(); n_layers],
            final_hidden: Vec::new(),
            main_hidden: Vec::new(),
            inject,
        };
    }
}
