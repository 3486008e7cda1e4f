//! Grammar-constrained rows sampled where the logits are: an executor that leaves the rows of
//! constrained entries "on its device" (`RankExecutor::execute` returning
//! `EntryOutput::DeviceLogits`) and samples them after the masks arrive
//! (`RankExecutor::sample_logits`, here the CPU reference `Backend::sample_masked`) must give the
//! rank exactly the tokens of the host path (an executor returning host logits: the worker masks
//! them and samples them). Many seeds, greedy, temperature, top-k and top-p, one
//! constrained and one unconstrained request per step. The device path samples all of a step's
//! constrained rows in one call. A mask wider than
//! the executor's rows ends its request with EOS on both paths (the rank keeps running).

mod common;

use std::sync::{Arc, Mutex};

use common::grammar_set::{EOS, VOCAB, engine};
use deepinfer_actors::SamplingParams;
use deepinfer_actors::grammar::{Constraint, ConstraintStart, MaskWorkers};
use deepinfer_actors::messages::rank::{NewSeq, SeqGrammar, SeqInput, SeqWork, StepMode, StepPlan};
use deepinfer_actors::rank::executor::{ExecError, ExecStep, ExecutorLayer, Layered, RankExecutor};
use deepinfer_actors::rank::fake::{FakeConfig, FakeExecutor};
use deepinfer_actors::rank::worker::RankWorker;
use deepinfer_model::backend::{Backend, CpuBackend, MaskedRows, RowSampling, Tensor};
use deepinfer_model::sampling::AllowedTokens;
use deepinfer_model::{EntryOutput, LogitsRow};
use deepinfer_topology::{DpRank, RequestId, StepId};

/// What the device layer saw.
#[derive(Debug, Default)]
struct DeviceLog {
    /// Rows of every `sample_logits` call.
    sample_calls: Vec<usize>,
    /// Of those rows, the ones with a mask.
    masked_rows: usize,
}

/// The fake model's logits, kept "on the device": unsampled entries return
/// `EntryOutput::DeviceLogits`, sampled later by the CPU reference of `sample_masked`.
struct Device {
    log: Arc<Mutex<DeviceLog>>,
}

impl Device {
    /// A fake executor of `vocab_size` with this layer over it.
    fn over(self, vocab_size: usize) -> Box<dyn RankExecutor> {
        Box::new(Layered::new(Box::new(fake(vocab_size)), self))
    }
}

impl ExecutorLayer for Device {
    fn execute(
        &mut self,
        inner: &mut dyn RankExecutor,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let sampled = inner.execute(ExecStep { batch, sampling })?;
        Ok(sampled
            .into_iter()
            .map(|out| match out {
                EntryOutput::Logits(rows) => EntryOutput::DeviceLogits(Tensor::from(rows)),
                other => other,
            })
            .collect())
    }
    fn sample_logits(
        &mut self,
        inner: &mut dyn RankExecutor,
        rows: &[LogitsRow<'_>],
    ) -> Result<Vec<u32>, ExecError> {
        let vocab = inner.vocab_size();
        let pieces: Vec<(&Tensor, usize)> = rows.iter().map(|r| (r.logits, 0)).collect();
        let logits = CpuBackend.gather(&pieces, vocab);
        let sampling: Vec<RowSampling> = rows
            .iter()
            .map(|r| RowSampling {
                params: r.params,
                position: r.position,
            })
            .collect();
        let allowed: Vec<Option<&AllowedTokens>> = rows.iter().map(|r| r.allowed).collect();
        {
            let mut log = self.log.lock().expect("log");
            log.sample_calls.push(rows.len());
            log.masked_rows += allowed.iter().filter(|a| a.is_some()).count();
        }
        CpuBackend
            .sample_masked(MaskedRows {
                logits: &logits,
                vocab,
                rows: &sampling,
                allowed: &allowed,
            })
            .map_err(|e| ExecError::Backend(e.to_string()))
    }
}

/// Request 1 is constrained by `constraint`, request 2 is not; both prefill a short prompt and
/// decode until the constrained one ends (EOS) or `steps` steps have run. The tokens of each.
fn generate(
    executor: Box<dyn RankExecutor>,
    constraint: &Constraint,
    sampling: SamplingParams,
    steps: u64,
) -> (Vec<u32>, Vec<u32>) {
    let grammar = engine().compile(constraint).expect("compiles");
    let workers = Arc::new(MaskWorkers::new(1).expect("mask workers"));
    let mut rank = RankWorker::with_mask_workers(DpRank(0), executor, workers);
    let prompt = engine().token_env().tokenize_text("Answer:");
    let (constrained, free) = (RequestId(1), RequestId(2));
    let mut tokens = (Vec::new(), Vec::new());
    for step in 0..steps {
        let first = step == 0;
        let input = || {
            if first {
                SeqInput::Prefill {
                    tokens: prompt.clone(),
                    last: true,
                }
            } else {
                SeqInput::Decode
            }
        };
        let new_seq = |id, grammar: Option<Box<SeqGrammar>>| NewSeq {
            id,
            sampling,
            grammar,
            decoder_from: None,
            speculative: false,
            logprobs: None,
            prefix: None,
        };
        let plan = StepPlan {
            step: StepId(step),
            mode: StepMode::Mixed,
            new_seqs: if first {
                vec![
                    new_seq(
                        constrained,
                        Some(Box::new(SeqGrammar {
                            matcher: engine().matcher(&grammar, ConstraintStart::Answer),
                            end_token: EOS,
                        })),
                    ),
                    new_seq(free, None),
                ]
            } else {
                Vec::new()
            },
            work: vec![
                SeqWork {
                    id: constrained,
                    input: input(),
                },
                SeqWork {
                    id: free,
                    input: input(),
                },
            ],
            cache_ops: Vec::new(),
            finished: Vec::new(),
        };
        let output = rank.run_plan(&plan).expect("step runs");
        for (id, token) in output.sampled {
            if id == constrained {
                tokens.0.push(token);
            } else {
                tokens.1.push(token);
            }
        }
        if tokens.0.last() == Some(&EOS) {
            break;
        }
    }
    tokens
}

fn fake(vocab_size: usize) -> FakeExecutor {
    FakeExecutor::new(
        FakeConfig {
            vocab_size,
            ..FakeConfig::default()
        },
        0,
    )
}

#[test]
fn constrained_rows_sampled_on_the_device_equal_the_host_path() {
    let constraints = [
        Constraint::Regex("[a-z]{2,9}( [a-z]{1,6}){0,3}".to_string()),
        Constraint::Regex("(yes|no|maybe)".to_string()),
    ];
    let settings = [
        (0.0f32, 0usize, 1.0f32),
        (1.0, 0, 1.0),
        (0.8, 40, 1.0),
        (1.1, 0, 0.9),
    ];
    let mut compared = 0;
    let mut device_log = DeviceLog::default();
    for (c, constraint) in constraints.iter().enumerate() {
        for (i, &(temperature, top_k, top_p)) in settings.iter().enumerate() {
            for seed in 0..3u64 {
                let sampling = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: 1000 * seed + (10 * c + i) as u64,
                };
                let host = generate(Box::new(fake(VOCAB)), constraint, sampling, 14);
                let log = Arc::new(Mutex::new(DeviceLog::default()));
                let device = Device { log: log.clone() }.over(VOCAB);
                let on_device = generate(device, constraint, sampling, 14);
                assert_eq!(
                    on_device, host,
                    "constraint {c}, sampling {sampling:?}: device vs host tokens"
                );
                let text = engine()
                    .token_env()
                    .decode(host.0.strip_suffix(&[EOS]).unwrap_or(&host.0));
                assert!(!text.is_empty(), "constraint {c}: an answer");
                compared += host.0.len() + host.1.len();
                let log = std::mem::take(&mut *log.lock().expect("log"));
                // One call per step with exactly the constrained row, masked.
                assert!(log.sample_calls.iter().all(|&rows| rows == 1), "{log:?}");
                assert_eq!(log.sample_calls.len(), host.0.len(), "{log:?}");
                device_log.sample_calls.extend(log.sample_calls);
                device_log.masked_rows += log.masked_rows;
            }
        }
    }
    assert_eq!(device_log.masked_rows, device_log.sample_calls.len());
    println!(
        "{compared} tokens equal; {} constrained rows sampled on the device",
        device_log.masked_rows
    );
}

#[test]
fn a_mask_wider_than_the_rows_ends_the_request_on_both_paths() {
    let constraint = Constraint::Regex("[a-z]{3}".to_string());
    let sampling = SamplingParams {
        temperature: 1.0,
        seed: 3,
        ..SamplingParams::default()
    };
    // Rows of 1000 logits against the 129 280-token vocabulary's masks.
    let host = generate(Box::new(fake(1000)), &constraint, sampling, 5);
    let device = Device {
        log: Arc::new(Mutex::new(DeviceLog::default())),
    }
    .over(1000);
    let on_device = generate(device, &constraint, sampling, 5);
    assert_eq!(host.0, vec![EOS], "the request ends at once");
    assert_eq!(on_device, host);
    assert_eq!(host.1.len(), 1, "the unconstrained request got its token");
}
