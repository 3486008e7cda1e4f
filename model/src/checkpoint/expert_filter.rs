//! `ExpertFilter`: which backbone routed experts a load reads from the checkpoint.
//!
//! A plain predicate over (backbone layer, logical expert) given by the caller: an expert-parallel
//! process passes the experts of the EP ranks it owns (their placement's slots, redundant replicas
//! included) and reads nothing else of the routed experts; every other tensor (attention, router,
//! shared expert, DSpark stages with their own experts, Engram) loads as for a whole model. A model
//! loaded with a filter that leaves experts out refuses to run them itself (`Model::forward`
//! without an expert hook fails naming the first expert it lacks) and hands out only those it
//! holds (`Model::routed_expert`); the CUDA path can pass the same predicate for its ranks' GPUs.

use std::fmt;
use std::sync::Arc;

/// Whether a load keeps routed expert `expert` of backbone layer `layer`.
#[derive(Clone)]
pub struct ExpertFilter {
    keeps: Option<Arc<dyn Fn(usize, usize) -> bool + Send + Sync>>,
}

impl ExpertFilter {
    /// Every routed expert (a whole model).
    pub fn all() -> ExpertFilter {
        ExpertFilter { keeps: None }
    }

    /// The experts for which `keeps(layer, expert)` is true.
    pub fn new(keeps: impl Fn(usize, usize) -> bool + Send + Sync + 'static) -> ExpertFilter {
        ExpertFilter {
            keeps: Some(Arc::new(keeps)),
        }
    }

    /// Whether routed expert `expert` of backbone layer `layer` is loaded.
    pub fn keeps(&self, layer: usize, expert: usize) -> bool {
        self.keeps.as_ref().is_none_or(|keeps| keeps(layer, expert))
    }

    /// Whether this is [`ExpertFilter::all`].
    pub fn is_all(&self) -> bool {
        self.keeps.is_none()
    }
}

impl Default for ExpertFilter {
    fn default() -> Self {
        ExpertFilter::all()
    }
}

impl fmt::Debug for ExpertFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_all() {
            "ExpertFilter(all)"
        } else {
            "ExpertFilter(predicate)"
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keeps_everything_and_a_predicate_what_it_says() {
        assert!(ExpertFilter::all().keeps(3, 7) && ExpertFilter::all().is_all());
        let even = ExpertFilter::new(|layer, expert| (layer + expert) % 2 == 0);
        assert!(!even.is_all());
        assert!(even.keeps(1, 1) && !even.keeps(1, 2));
    }
}
