//! `SimReport`: what a simulated run did, in virtual time, and its printed form.
//!
//! Throughput is output tokens over the span from the first arrival to the last token, per
//! GPU. TTFT is a request's first token time minus its arrival; inter-token latency is a
//! request's mean time per output token after the first, `(t_last − t_first) / (n − 1)`
//! (DSpark delivers several tokens per step, so per-token gaps would be mostly zeros).
//! Utilisation is a GPU's modelled compute time over the span (the rest it waits for the
//! slowest GPU of each step or for traffic).

use std::fmt;

/// Nearest-rank percentiles of a sample (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Percentiles {
    pub count: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut values: Vec<f64>) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let at =
            |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Percentiles {
            count: values.len(),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: values[values.len() - 1],
        }
    }
}

/// The EPLB during the run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EplbSummary {
    /// Rebalances the `EplbActor` ran on its own schedule during the run.
    pub automatic_rebalances: u64,
    /// Per placement epoch: (epoch, global steps with routed work, modelled imbalance = mean over
    /// layers of busiest EP rank / mean).
    pub epochs: Vec<(u32, u64, f64)>,
    /// The closing rebalance: imbalance the `EplbActor` measured from the shards' counters since
    /// its last measurement (mean over layers), and the imbalance its new placement plans for
    /// those loads.
    pub measured_before: f64,
    pub planned_after: f64,
}

/// DSpark's counters summed over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DSparkSummary {
    pub proposed: u64,
    pub verified: u64,
    pub accepted: u64,
    pub verify_entries: u64,
}

/// Scheduler snapshots taken while the clock was held at an arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueSamples {
    pub samples: usize,
    /// Snapshots in which a rank held no request while another had requests waiting (the
    /// frontend routes to the least-loaded rank, so this stays 0 while requests are short of
    /// the ranks' limits).
    pub idle_while_queued: usize,
}

/// The report of one simulated run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SimReport {
    pub topology: String,
    pub device: String,
    pub gpus: usize,
    pub submitted: usize,
    pub completed: usize,
    pub failed: usize,
    pub prompt_tokens: u64,
    /// Output tokens the trace asked for (completed requests).
    pub expected_output_tokens: u64,
    /// Output tokens the completed requests' streams delivered.
    pub output_tokens: u64,
    /// Output tokens the simulated devices timed for those requests (capped at each request's
    /// delivered count).
    pub timed_output_tokens: u64,
    /// Completed requests without token times.
    pub untimed: usize,
    /// Virtual seconds from the first arrival to the last token.
    pub span_s: f64,
    pub steps: u64,
    /// Steps without any prompt chunk that produced tokens: count, virtual seconds, tokens.
    pub decode_steps: u64,
    pub decode_seconds: f64,
    pub decode_tokens: u64,
    pub wall_s: f64,
    pub ttft: Percentiles,
    pub itl: Percentiles,
    /// Per GPU, in [0, 1].
    pub utilisation: Vec<f64>,
    pub eplb: Option<EplbSummary>,
    pub dspark: DSparkSummary,
    pub queues: QueueSamples,
}

impl SimReport {
    /// Output tokens per virtual second per GPU over the decode-only steps (DeepInfer's
    /// fixed-batch decode measurement).
    pub fn decode_tok_s_per_gpu(&self) -> f64 {
        if self.decode_seconds > 0.0 && self.gpus > 0 {
            self.decode_tokens as f64 / self.decode_seconds / self.gpus as f64
        } else {
            0.0
        }
    }

    /// Output tokens per virtual second per GPU.
    pub fn output_tok_s_per_gpu(&self) -> f64 {
        if self.span_s > 0.0 && self.gpus > 0 {
            self.output_tokens as f64 / self.span_s / self.gpus as f64
        } else {
            0.0
        }
    }
}

fn ms(p: &Percentiles) -> String {
    format!(
        "p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} requests)",
        p.p50 * 1e3,
        p.p90 * 1e3,
        p.p99 * 1e3,
        p.max * 1e3,
        p.count
    )
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulated {} on {} x{} (virtual time)",
            self.topology, self.device, self.gpus
        )?;
        writeln!(
            f,
            "requests: {} submitted, {} completed, {} failed; tokens: {} prompt, {} output of {} asked ({} timed)",
            self.submitted,
            self.completed,
            self.failed,
            self.prompt_tokens,
            self.output_tokens,
            self.expected_output_tokens,
            self.timed_output_tokens
        )?;
        writeln!(
            f,
            "span: {:.3} s virtual in {} steps ({:.1} s wall); output {:.0} tok/s per GPU",
            self.span_s,
            self.steps,
            self.wall_s,
            self.output_tok_s_per_gpu()
        )?;
        writeln!(
            f,
            "decode-only steps: {} ({:.3} s virtual, {} tokens): {:.0} tok/s per GPU",
            self.decode_steps,
            self.decode_seconds,
            self.decode_tokens,
            self.decode_tok_s_per_gpu()
        )?;
        writeln!(f, "TTFT: {}", ms(&self.ttft))?;
        writeln!(f, "inter-token latency: {}", ms(&self.itl))?;
        let (lo, hi) = self
            .utilisation
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), &u| {
                (lo.min(u), hi.max(u))
            });
        let mean = self.utilisation.iter().sum::<f64>() / self.utilisation.len().max(1) as f64;
        writeln!(
            f,
            "utilisation per GPU: mean {:.1}%, min {:.1}%, max {:.1}%",
            mean * 100.0,
            if lo.is_finite() { lo * 100.0 } else { 0.0 },
            hi * 100.0
        )?;
        match &self.eplb {
            Some(e) => {
                let epochs: Vec<String> = e
                    .epochs
                    .iter()
                    .map(|(epoch, steps, imbalance)| {
                        format!("epoch {epoch}: {steps} steps at {imbalance:.3}")
                    })
                    .collect();
                writeln!(
                    f,
                    "EPLB: {} automatic rebalances; modelled imbalance (max/mean EP load) {}; closing rebalance: measured {:.3} -> planned {:.3}",
                    e.automatic_rebalances,
                    epochs.join(", "),
                    e.measured_before,
                    e.planned_after
                )?;
            }
            None => writeln!(f, "EPLB: off (no expert parallelism)")?,
        }
        let d = &self.dspark;
        let rate = if d.verified > 0 {
            d.accepted as f64 / d.verified as f64
        } else {
            0.0
        };
        let length = if d.verify_entries > 0 {
            (d.accepted + d.verify_entries) as f64 / d.verify_entries as f64
        } else {
            0.0
        };
        writeln!(
            f,
            "DSpark: {} drafted, {} verified, {} accepted ({:.1}%), {:.2} tokens per verify",
            d.proposed,
            d.verified,
            d.accepted,
            rate * 100.0,
            length
        )?;
        write!(
            f,
            "queues: {} snapshots, {} with a rank empty while another had requests waiting",
            self.queues.samples, self.queues.idle_while_queued
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!(
            (p.count, p.p50, p.p90, p.p99, p.max),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(Percentiles::of(vec![]).count, 0);
        assert_eq!(Percentiles::of(vec![3.0]).p99, 3.0);
    }
}
