//! The `DSparkActor`'s state machine: turns the proposals ranks drafted into what the verifier
//! schedules with, and drops what is stale.
//!
//! Per batch (one per rank step that drafted anything): the raw confidence-head logits become
//! probabilities `sigmoid(c / T)` (DeepInfer's calibration, `T` = 1 by default), proposals are cut
//! to `max_draft_tokens`, a proposal with a non-finite confidence is dropped (the verifier then
//! verifies no drafts for that request), and a batch drafted after a step no newer than the last
//! one forwarded for that rank is stale and dropped whole.

use deepinfer_topology::{DpRank, StepId};

use crate::messages::dspark::{CalibratedProposal, DraftedBatch, ProposalBatch};

/// DeepInfer's default confidence-head temperature (`DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE`).
pub const CONFIDENCE_TEMPERATURE: f32 = 1.0;

/// A batch the actor cannot route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DSparkError {
    #[error("proposals from {dp}, but the engine has {ranks} DP ranks")]
    UnknownRank { dp: DpRank, ranks: usize },
}

/// What the actor did with a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Routed {
    /// Forward to the rank's verifier.
    Forward(DpRank, ProposalBatch),
    /// Dropped: drafted after a step no newer than the last forwarded one.
    Stale,
}

/// Calibration and staleness per DP rank.
#[derive(Debug, Clone)]
pub struct DSparkState {
    max_draft_tokens: usize,
    temperature: f32,
    /// Per rank, the step after which the last forwarded batch was drafted.
    newest: Vec<Option<StepId>>,
    stale_batches: u64,
    dropped_proposals: u64,
}

/// `sigmoid(raw / temperature)`, or `None` for a non-finite input.
fn calibrate(raw: f32, temperature: f32) -> Option<f32> {
    let x = raw / temperature;
    x.is_finite().then(|| 1.0 / (1.0 + (-x).exp()))
}

impl DSparkState {
    pub fn new(dp_ranks: usize, max_draft_tokens: usize) -> Self {
        DSparkState {
            max_draft_tokens,
            temperature: CONFIDENCE_TEMPERATURE,
            newest: vec![None; dp_ranks],
            stale_batches: 0,
            dropped_proposals: 0,
        }
    }

    /// Calibrates a batch, or drops it as stale.
    pub fn on_drafted(&mut self, batch: DraftedBatch) -> Result<Routed, DSparkError> {
        let ranks = self.newest.len();
        let newest = self
            .newest
            .get_mut(batch.dp.index())
            .ok_or(DSparkError::UnknownRank {
                dp: batch.dp,
                ranks,
            })?;
        if newest.is_some_and(|n| batch.drafted_after <= n) {
            self.stale_batches += 1;
            return Ok(Routed::Stale);
        }
        *newest = Some(batch.drafted_after);
        let mut proposals = Vec::with_capacity(batch.drafts.len());
        for draft in batch.drafts {
            let usable = &draft.confidences[..draft.confidences.len().min(self.max_draft_tokens)];
            let calibrated: Option<Vec<f32>> = usable
                .iter()
                .map(|&c| calibrate(c, self.temperature))
                .collect();
            match calibrated {
                Some(confidences) => proposals.push(CalibratedProposal {
                    id: draft.id,
                    confidences,
                }),
                None => {
                    tracing::warn!(id = %draft.id, "DSpark proposal with a non-finite confidence dropped");
                    self.dropped_proposals += 1;
                }
            }
        }
        Ok(Routed::Forward(
            batch.dp,
            ProposalBatch {
                for_step: batch.drafted_after.next(),
                proposals,
            },
        ))
    }

    /// Batches dropped as stale so far.
    pub fn stale_batches(&self) -> u64 {
        self.stale_batches
    }

    /// Proposals dropped for a non-finite confidence so far.
    pub fn dropped_proposals(&self) -> u64 {
        self.dropped_proposals
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::rank::DraftSummary;
    use deepinfer_topology::RequestId;

    fn batch(dp: u16, step: u64, confidences: Vec<f32>) -> DraftedBatch {
        DraftedBatch {
            dp: DpRank(dp),
            drafted_after: StepId(step),
            drafts: vec![DraftSummary {
                id: RequestId(7),
                confidences,
            }],
        }
    }

    #[test]
    fn confidences_are_calibrated_cut_and_tagged_with_the_next_step() {
        let mut s = DSparkState::new(2, 3);
        let routed = s
            .on_drafted(batch(1, 4, vec![0.0, 2.0, -2.0, 9.0]))
            .unwrap();
        let Routed::Forward(dp, out) = routed else {
            panic!("forwarded expected, got {routed:?}");
        };
        assert_eq!((dp, out.for_step), (DpRank(1), StepId(5)));
        let c = &out.proposals[0].confidences;
        assert_eq!(c.len(), 3);
        assert_eq!(c[0], 0.5);
        assert!(
            (c[1] - 0.880_797).abs() < 1e-5 && (c[2] - 0.119_203).abs() < 1e-5,
            "{c:?}"
        );
    }

    #[test]
    fn stale_batches_are_dropped_per_rank() {
        let mut s = DSparkState::new(2, 5);
        assert!(matches!(
            s.on_drafted(batch(0, 6, vec![1.0])),
            Ok(Routed::Forward(..))
        ));
        // An older (or repeated) step of the same rank is stale; another rank is independent.
        assert_eq!(s.on_drafted(batch(0, 5, vec![1.0])), Ok(Routed::Stale));
        assert_eq!(s.on_drafted(batch(0, 6, vec![1.0])), Ok(Routed::Stale));
        assert!(matches!(
            s.on_drafted(batch(1, 2, vec![1.0])),
            Ok(Routed::Forward(..))
        ));
        assert!(matches!(
            s.on_drafted(batch(0, 7, vec![1.0])),
            Ok(Routed::Forward(..))
        ));
        assert_eq!(s.stale_batches(), 2);
        assert_eq!(
            s.on_drafted(batch(2, 1, vec![1.0])),
            Err(DSparkError::UnknownRank {
                dp: DpRank(2),
                ranks: 2
            })
        );
    }

    #[test]
    fn non_finite_confidences_drop_the_proposal() {
        let mut s = DSparkState::new(1, 5);
        let Ok(Routed::Forward(_, out)) = s.on_drafted(batch(0, 1, vec![1.0, f32::NAN])) else {
            panic!("forwarded expected");
        };
        assert!(out.proposals.is_empty());
        assert_eq!(s.dropped_proposals(), 1);
    }
}
