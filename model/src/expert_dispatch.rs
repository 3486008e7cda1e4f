//! The routed-expert hook of the MoE: who computes a token's routed experts.
//!
//! The router and the combine stay in the model (`layers/moe.rs`): for every token of one layer it
//! chooses the (logical expert, weight) picks, hands the layer's rows and picks (each token's in
//! increasing expert id) to a [`RoutedExperts`] in one call, and sums each token's returned
//! outputs in that order, then adds the shared expert. So where
//! an expert runs (which EP rank, which replica) can never change a bit of the result, as long as
//! every copy of an expert holds the model's weights and runs [`Model::run_routed_expert`].
//!
//! Without a hook (`StepOptions::experts` unset) the model runs its own weights. The runtime's expert
//! parallelism (`deepinfer-actors`' `LocalComm`) implements the trait over per-EP-rank copies
//! obtained through [`ExpertHost`], which both families' models are (V4.1 and V4: a V4 hash
//! layer's picks come from its token ids, the rest is the same). DSpark stages and the V4 MTP
//! block always run their own experts locally.

use crate::backend::weights::{ExpertLinear, ExpertWeights};
use crate::error::ModelError;

/// One routed pick of a token: the logical expert and its routing weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertPick {
    /// Logical expert id within the layer (`< n_routed_experts`).
    pub expert: usize,
    /// The normalised, scaled routing weight (multiplies the activation before `w2`).
    pub weight: f32,
}

/// Runs the routed experts of one backbone layer's rows (one call per layer and forward, so an
/// expert-parallel transport can send each EP rank all of its rows at once).
///
/// Contract: `run` returns, for every row `r` of `x`, exactly one output row (`dim` wide) per
/// pick of `picks[r]`, in pick order, each equal to
/// `model.run_routed_expert(&model.routed_expert(layer, pick.expert)?, row, pick.weight)`
/// ([`ExpertHost`]).
/// Implementations validate their placement when built, so every (layer, expert) of the model can
/// be served. A transport that fails (a peer gone) cannot stop the forward from here: it returns
/// rows of zeros and reports the failure to its own caller, which discards the forward's outputs.
pub trait RoutedExperts: Sync {
    /// Outputs of every row's `picks` (each sorted by increasing expert id) for the normed MoE
    /// input `x` (`[picks.len(), dim]`) of backbone layer `layer`: `out[r][k]` is pick `k` of
    /// row `r`.
    fn run(&self, layer: usize, x: &[f32], picks: &[Vec<ExpertPick>]) -> Vec<Vec<Vec<f32>>>;
}

/// A clonable copy of one routed expert's weights (SwiGLU `w1`, `w3`, `w2`; FP4 or FP8), what an
/// expert shard holds.
#[derive(Debug, Clone)]
pub struct RoutedExpert(pub(crate) ExpertWeights<ExpertLinear>);

/// A loaded model of either family as expert parallelism sees it: its backbone layers' routed
/// experts, copies of them for an expert shard, and running one exactly as the model's MoE
/// does. Every [`crate::Loaded`] model is one (`layers/expert_hook.rs`), so the runtime's shards
/// and EP ranks hold `&dyn ExpertHost` (`AnyModel::experts`) whatever the family.
pub trait ExpertHost: Send + Sync {
    /// A copy of routed expert `expert` of backbone layer `layer`; an expert this model was
    /// loaded without (its `ExpertFilter`) is an error naming it.
    fn routed_expert(&self, layer: usize, expert: usize) -> Result<RoutedExpert, ModelError>;

    /// Copies of the routed experts `wanted` ((backbone layer, expert) pairs, in that order):
    /// those this model holds from memory, the others read from the checkpoint it was loaded
    /// from (a model loaded with an `ExpertFilter` keeps it open). An expert it neither
    /// holds nor can read is an error naming it.
    fn copy_routed_experts(
        &self,
        wanted: &[(usize, usize)],
    ) -> Result<Vec<RoutedExpert>, ModelError>;

    /// One routed expert on one token exactly as the model's MoE computes it (SwiGLU with the
    /// config's clamp, `weight` applied before `w2`), on this model's backend.
    fn run_routed_expert(&self, expert: &RoutedExpert, x: &[f32], weight: f32) -> Vec<f32>;

    /// [`ExpertHost::run_routed_expert`] with this model's own weights of routed expert `expert`
    /// of backbone layer `layer`, `held = (layer, expert)` (`None`: it does not hold that expert).
    fn run_held_expert(&self, held: (usize, usize), x: &[f32], weight: f32) -> Option<Vec<f32>>;

    /// Whether this model holds routed expert `expert` of backbone layer `layer` (an
    /// `ExpertFilter` may have left it out).
    fn holds_routed_expert(&self, layer: usize, expert: usize) -> bool;

    /// Whether this model holds every backbone routed expert (no `ExpertFilter` left one out).
    fn holds_every_expert(&self) -> bool;

    /// Host bytes of the backbone routed experts this model holds, and how many (layer,
    /// expert) pairs they are.
    fn routed_expert_bytes(&self) -> (u64, usize);

    /// Each backbone layer's routed experts (the lists an expert rank places), entry `e` being
    /// expert `e` in a model that holds every expert ([`ExpertHost::holds_every_expert`]).
    fn expert_lists(&self) -> Vec<&[ExpertWeights<ExpertLinear>]>;

    /// Takes part in one step's expert-parallel collectives with no rows of its own: every
    /// backbone layer's MoE over zero rows, so that the backend (an EP rank, see
    /// `backend::cuda::ep`) serves its experts to the other ranks. A no-op on a backend that
    /// runs every expert itself. Every DP rank calls this on a step it has nothing to run.
    fn idle_expert_step(&self);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Model;
    use crate::checkpoint::ExpertFilter;
    use crate::checkpoint::synth::write_random_checkpoint;
    use crate::config::ModelConfig;
    use crate::v41::{EntryOutput, LogitsWanted, StepEntry, StepOptions};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Every logits row of `tokens` as a fresh sequence's one-entry step, the routed experts
    /// run by `experts` when given.
    fn all_logits(
        model: &Model,
        tokens: &[u32],
        experts: Option<&dyn RoutedExperts>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut seq = model.new_sequence();
        let options = StepOptions {
            experts,
            ..StepOptions::default()
        };
        let entry = StepEntry::new(&mut seq, tokens, LogitsWanted::All);
        model
            .forward_step(&mut [entry], options)
            .and_then(EntryOutput::one_entry_logits)
    }

    fn tiny_model() -> (tempfile::TempDir, Model) {
        let mut cfg = ModelConfig::tiny_v41();
        cfg.engram = None;
        let dir = tempfile::tempdir().expect("tempdir");
        write_random_checkpoint(&cfg, 7, dir.path(), 1).expect("checkpoint written");
        let model = Model::load(dir.path()).expect("model loads");
        (dir, model)
    }

    /// Serves every pick from copies of the weights and counts what it ran.
    struct Copies<'m> {
        model: &'m dyn ExpertHost,
        experts: Vec<Vec<RoutedExpert>>,
        calls: AtomicUsize,
        reverse: bool,
    }

    impl<'m> Copies<'m> {
        /// Copies of every routed expert of `model` (`layers` × `experts`), computed in pick
        /// order or, with `reverse`, backwards.
        fn of(model: &'m dyn ExpertHost, (layers, experts): (usize, usize), reverse: bool) -> Self {
            Copies {
                model,
                experts: (0..layers)
                    .map(|l| {
                        (0..experts)
                            .map(|e| model.routed_expert(l, e).expect("in range"))
                            .collect()
                    })
                    .collect(),
                calls: AtomicUsize::new(0),
                reverse,
            }
        }
    }

    impl RoutedExperts for Copies<'_> {
        fn run(&self, layer: usize, x: &[f32], picks: &[Vec<ExpertPick>]) -> Vec<Vec<Vec<f32>>> {
            let dim = x.len() / picks.len().max(1);
            // Computing in another order must not matter: outputs come back in pick order.
            let mut order: Vec<(usize, usize)> = picks
                .iter()
                .enumerate()
                .flat_map(|(r, row)| (0..row.len()).map(move |k| (r, k)))
                .collect();
            self.calls.fetch_add(order.len(), Ordering::Relaxed);
            if self.reverse {
                order.reverse();
            }
            let mut out: Vec<Vec<Vec<f32>>> = picks
                .iter()
                .map(|row| vec![Vec::new(); row.len()])
                .collect();
            for (r, k) in order {
                let pick = picks[r][k];
                out[r][k] = self.model.run_routed_expert(
                    &self.experts[layer][pick.expert],
                    &x[r * dim..(r + 1) * dim],
                    pick.weight,
                );
            }
            out
        }
    }

    #[test]
    fn copies_of_the_experts_give_the_same_bits() {
        let (_dir, model) = tiny_model();
        let cfg = model.config().clone();
        let tokens = [3u32, 9, 4, 1, 7, 7, 2];
        let plain = all_logits(&model, &tokens, None).expect("forward");
        for reverse in [false, true] {
            let copies = Copies::of(&model, (cfg.n_layers, cfg.n_routed_experts), reverse);
            let hooked = all_logits(&model, &tokens, Some(&copies)).expect("forward with experts");
            assert_eq!(
                plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                hooked.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            assert_eq!(
                copies.calls.load(Ordering::Relaxed),
                tokens.len() * cfg.n_layers * cfg.n_activated_experts,
                "every routed pick of every backbone layer goes through the hook"
            );
        }
    }

    /// Returns fixed rows by pick rank: `[1, B, -B, 0, ...]` (B = 2^30), or zeros.
    struct Fixed {
        zeros: bool,
    }

    impl RoutedExperts for Fixed {
        fn run(&self, _layer: usize, x: &[f32], picks: &[Vec<ExpertPick>]) -> Vec<Vec<Vec<f32>>> {
            let dim = x.len() / picks.len().max(1);
            let big = (1u32 << 30) as f32;
            picks
                .iter()
                .map(|row| {
                    assert!(
                        row.windows(2).all(|w| w[0].expert < w[1].expert),
                        "picks come in increasing expert id: {row:?}"
                    );
                    (0..row.len())
                        .map(|rank| {
                            let value = match (self.zeros, rank) {
                                (true, _) => 0.0,
                                (false, 0) => 1.0,
                                (false, 1) => big,
                                (false, 2) => -big,
                                (false, _) => 0.0,
                            };
                            vec![value; dim]
                        })
                        .collect()
                })
                .collect()
        }
    }

    /// The combine sums in increasing expert id: `((1 + B) - B) + 0 = 0` exactly in fp32, so the
    /// logits equal those of all-zero expert outputs; any other order (e.g. `((0 - B) + B) + 1`)
    /// leaves a 1 in every element and moves them.
    #[test]
    fn combine_sums_in_increasing_expert_id() {
        let mut cfg = ModelConfig::tiny_v41();
        cfg.engram = None;
        cfg.n_activated_experts = 4;
        let dir = tempfile::tempdir().expect("tempdir");
        write_random_checkpoint(&cfg, 3, dir.path(), 1).expect("checkpoint written");
        let model = Model::load(dir.path()).expect("model loads");
        let tokens = [11u32, 5, 300];
        let run = |zeros: bool| {
            all_logits(&model, &tokens, Some(&Fixed { zeros }))
                .expect("forward")
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(false), run(true));
    }

    /// A load with an `ExpertFilter` reads only the routed experts it keeps (bit for bit those of
    /// the whole model), holds their share of the routed-expert bytes, refuses to run its experts
    /// itself or to hand out one it lacks, and with the missing experts served through a hook
    /// gives the whole model's logits (everything but the routed experts loaded as usual).
    #[test]
    fn a_filtered_load_holds_only_the_kept_experts() {
        let (dir, whole) = tiny_model();
        let cfg = whole.config().clone();
        let keeps = |layer: usize, expert: usize| (layer + expert) % 4 == 1;
        let partial = Model::load_experts(dir.path(), None, &ExpertFilter::new(keeps))
            .expect("filtered load");
        assert!(whole.holds_every_expert() && !partial.holds_every_expert());
        let mut kept = 0;
        for layer in 0..cfg.n_layers {
            for expert in 0..cfg.n_routed_experts {
                match partial.routed_expert(layer, expert) {
                    Ok(held) => {
                        assert!(
                            keeps(layer, expert),
                            "layer {layer} expert {expert} was read"
                        );
                        let original = whole.routed_expert(layer, expert).expect("whole");
                        assert_eq!(format!("{:?}", held.0), format!("{:?}", original.0));
                        kept += 1;
                    }
                    Err(err) => {
                        assert!(
                            !keeps(layer, expert),
                            "layer {layer} expert {expert} missing"
                        );
                        let message = err.to_string();
                        assert!(message.contains("expert filter"), "{message}");
                        assert!(
                            message.contains(&format!("routed expert {expert} of layer {layer}")),
                            "{message}"
                        );
                    }
                }
            }
        }
        let total = cfg.n_layers * cfg.n_routed_experts;
        assert!(kept > 0 && kept < total);
        // What it does not hold it reads from its checkpoint when asked (an EPLB staging).
        let every: Vec<(usize, usize)> = (0..cfg.n_layers)
            .flat_map(|l| (0..cfg.n_routed_experts).map(move |e| (l, e)))
            .collect();
        let copies = partial.copy_routed_experts(&every).expect("copies");
        for (&(layer, expert), copy) in every.iter().zip(&copies) {
            let original = whole.routed_expert(layer, expert).expect("whole");
            assert_eq!(format!("{:?}", copy.0), format!("{:?}", original.0));
        }
        assert!(partial.copy_routed_experts(&[(cfg.n_layers, 0)]).is_err());
        let (whole_bytes, whole_count) = whole.routed_expert_bytes();
        let (held_bytes, held_count) = partial.routed_expert_bytes();
        assert_eq!((whole_count, held_count), (total, kept));
        // Every expert has the same shapes: the held bytes are exactly the kept share.
        assert_eq!(held_bytes * total as u64, whole_bytes * kept as u64);
        println!("routed expert bytes held: {held_bytes} of {whole_bytes} ({kept} of {total})");

        let tokens = [3u32, 9, 4, 1, 7];
        let mut seq = partial.new_sequence();
        let refused = partial
            .forward_step(
                &mut [StepEntry::new(&mut seq, &tokens, LogitsWanted::All)],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect_err("a partial model cannot run its routed experts itself");
        assert!(refused.to_string().contains("expert filter"), "{refused}");
        assert!(
            seq.is_empty(),
            "a refused forward leaves the sequence as it was"
        );

        let copies = Copies::of(&whole, (cfg.n_layers, cfg.n_routed_experts), false);
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let expected = all_logits(&whole, &tokens, None).expect("whole");
        let hooked = all_logits(&partial, &tokens, Some(&copies))
            .expect("partial model with an expert hook");
        assert_eq!(bits(hooked), bits(expected));
    }

    #[test]
    fn out_of_range_expert_is_an_error() {
        let (_dir, model) = tiny_model();
        let layers = model.config().n_layers;
        let experts = model.config().n_routed_experts;
        assert!(model.routed_expert(layers, 0).is_err());
        let err = model.routed_expert(0, experts).expect_err("out of range");
        assert!(
            err.to_string()
                .contains(&format!("routed expert {experts}"))
        );
    }

    /// The V4 family's filtered load: it holds only the kept routed experts (bit for bit the
    /// whole model's), reads the others from its checkpoint when asked, refuses to run its
    /// experts itself, and with every expert served through a hook gives the whole model's
    /// logits (hash layers included).
    #[test]
    fn a_filtered_v4_load_holds_only_the_kept_experts() {
        use crate::v4;
        let dir = tempfile::tempdir().expect("tempdir");
        write_random_checkpoint(&ModelConfig::tiny_v4(), 8, dir.path(), 1).expect("written");
        let whole = v4::Model::load(dir.path()).expect("whole V4 model");
        let cfg = whole.config().clone();
        let keeps = |layer: usize, expert: usize| (layer + expert).is_multiple_of(3);
        let partial =
            v4::Model::load_experts(dir.path(), &ExpertFilter::new(keeps)).expect("filtered");
        assert!(whole.holds_every_expert() && !partial.holds_every_expert());
        let every: Vec<(usize, usize)> = (0..cfg.n_layers)
            .flat_map(|l| (0..cfg.n_routed_experts).map(move |e| (l, e)))
            .collect();
        for &(layer, expert) in &every {
            assert_eq!(
                partial.holds_routed_expert(layer, expert),
                keeps(layer, expert)
            );
        }
        let copies = partial.copy_routed_experts(&every).expect("copies");
        for (&(layer, expert), copy) in every.iter().zip(&copies) {
            let original = whole.routed_expert(layer, expert).expect("whole");
            assert_eq!(format!("{:?}", copy.0), format!("{:?}", original.0));
        }

        let tokens = [3u32, 9, 4, 1, 7, 300];
        let step = |model: &v4::Model, experts: Option<&dyn RoutedExperts>| {
            let mut seq = model.new_sequence();
            let options = crate::StepOptions {
                experts,
                ..crate::StepOptions::default()
            };
            let entry = v4::StepEntry::new(&mut seq, &tokens, LogitsWanted::All);
            model
                .forward_step(&mut [entry], options)
                .and_then(EntryOutput::one_entry_logits)
        };
        let refused = step(&partial, None).expect_err("a partial model runs no experts itself");
        assert!(refused.to_string().contains("expert filter"), "{refused}");
        let hook = Copies::of(&whole, (cfg.n_layers, cfg.n_routed_experts), true);
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let expected = bits(step(&whole, None).expect("whole"));
        assert_eq!(bits(step(&partial, Some(&hook)).expect("hooked")), expected);
        assert_eq!(
            hook.calls.load(Ordering::Relaxed),
            tokens.len() * cfg.n_layers * cfg.n_activated_experts,
            "every pick of every layer, hash layers included, goes through the hook"
        );
    }
}
