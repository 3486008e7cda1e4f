//! What every component of either family needs to run ([`Ctx`]): the config, the backend, the
//! RoPE tables, and per block where its routed experts run and how image rows route.

use crate::backend::{Backend, Precision, RmsNorm};
use crate::config::ModelConfig;
use crate::expert_dispatch::RoutedExperts;
use crate::layers::moe::ImageRouting;
use crate::layers::rope::RopeTables;

/// What every component needs to run: the config, the backend and the RoPE tables; `routed`
/// (backbone blocks only) runs the routed experts elsewhere.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub cfg: &'a ModelConfig,
    pub backend: &'a dyn Backend,
    pub rope: &'a RopeTables,
    pub routed: Option<RoutedSite<'a>>,
    /// Image-span rows of the block being run: the router's `bias_vl` choice (spec §3.6).
    pub image_routing: Option<ImageRouting<'a>>,
}

impl Ctx<'_> {
    /// The model's RMSNorm by `weight`: its `norm_eps`, rounded at `precision`.
    pub fn norm<'w>(&self, weight: &'w [f32], precision: Precision) -> RmsNorm<'w> {
        RmsNorm {
            weight,
            eps: self.cfg.norm_eps,
            precision,
        }
    }
}

/// Where the routed experts of one backbone block run.
#[derive(Clone, Copy)]
pub(crate) struct RoutedSite<'a> {
    pub experts: &'a dyn RoutedExperts,
    pub layer: usize,
}

/// `ctx` for backbone block `layer`: its routed experts go to `experts` when given.
pub(crate) fn at_layer<'a>(
    ctx: Ctx<'a>,
    experts: Option<&'a dyn RoutedExperts>,
    layer: usize,
) -> Ctx<'a> {
    Ctx {
        routed: experts.map(|experts| RoutedSite { experts, layer }),
        ..ctx
    }
}
