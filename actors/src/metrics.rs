//! Every metric name of the runtime, its help text and unit, and small typed recorders.
//!
//! Names follow `deepinfer_<subsystem>_<what>_<unit>`. Totals are counters (`_total`);
//! accumulated time is counted in whole microseconds (the facade's counters are integers). Labels are bounded: `dp` (rank),
//! `mode` (step mode), `outcome`, `code` (error code), `layer` (MoE layer), never a
//! request id. Recording goes through
//! the `metrics` facade; without an installed recorder (the library default) it costs nothing.
//! The Grafana dashboard in `configs/dashboards/` may only reference names in `ALL` (a test
//! checks this).

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::messages::rank::{StepMode, StepOutput};
use crate::messages::scheduler::{PrefixStats, SchedulerStats};

pub const FRONTEND_INFLIGHT_REQUESTS: &str = "deepinfer_frontend_inflight_requests";
pub const FRONTEND_REQUESTS_TOTAL: &str = "deepinfer_frontend_requests_total";
pub const FRONTEND_REQUEST_DURATION_SECONDS: &str = "deepinfer_frontend_request_duration_seconds";
pub const FRONTEND_OUTSTANDING_TOKENS: &str = "deepinfer_frontend_outstanding_tokens";
pub const FRONTEND_ABORTED_REQUESTS_TOTAL: &str = "deepinfer_frontend_aborted_requests_total";
pub const SCHEDULER_QUEUE_DEPTH: &str = "deepinfer_scheduler_queue_depth";
pub const SCHEDULER_RUNNING_REQUESTS: &str = "deepinfer_scheduler_running_requests";
pub const SCHEDULER_PROMPT_TOKENS_TOTAL: &str = "deepinfer_scheduler_prompt_tokens_total";
pub const SCHEDULER_GENERATED_TOKENS_TOTAL: &str = "deepinfer_scheduler_generated_tokens_total";
pub const SCHEDULER_STEPS_TOTAL: &str = "deepinfer_scheduler_steps_total";
pub const STEP_DURATION_SECONDS: &str = "deepinfer_step_duration_seconds";
pub const STEP_CPU_SCHEDULE_SECONDS: &str = "deepinfer_step_cpu_schedule_seconds";
pub const SCHEDULER_HIDDEN_SCHEDULE_MICROSECONDS_TOTAL: &str =
    "deepinfer_scheduler_hidden_schedule_microseconds_total";
pub const RANK_HOST_MICROSECONDS_TOTAL: &str = "deepinfer_rank_host_microseconds_total";
pub const RANK_HIDDEN_HOST_MICROSECONDS_TOTAL: &str =
    "deepinfer_rank_hidden_host_microseconds_total";
pub const SUPERVISOR_FAILED_RANKS: &str = "deepinfer_supervisor_failed_ranks";
pub const ERRORS_TOTAL: &str = "deepinfer_errors_total";
pub const EPLB_LAYER_IMBALANCE_RATIO: &str = "deepinfer_eplb_layer_imbalance_ratio";
pub const EPLB_REBALANCES_TOTAL: &str = "deepinfer_eplb_rebalances_total";
pub const EPLB_PLACEMENT_EPOCH: &str = "deepinfer_eplb_placement_epoch";
pub const DSPARK_PROPOSED_TOKENS_TOTAL: &str = "deepinfer_dspark_proposed_tokens_total";
pub const DSPARK_VERIFIED_TOKENS_TOTAL: &str = "deepinfer_dspark_verified_tokens_total";
pub const DSPARK_ACCEPTED_TOKENS_TOTAL: &str = "deepinfer_dspark_accepted_tokens_total";
pub const DSPARK_ACCEPTED_LENGTH_TOKENS: &str = "deepinfer_dspark_accepted_length_tokens";
pub const STATE_BLOCKS_USED: &str = "deepinfer_state_blocks_used";
pub const STATE_BLOCKS_FREE: &str = "deepinfer_state_blocks_free";
pub const SCHEDULER_PREEMPTIONS_TOTAL: &str = "deepinfer_scheduler_preemptions_total";
pub const SCHEDULER_RESUMED_TOTAL: &str = "deepinfer_scheduler_resumed_total";
pub const PREFIX_CACHE_REQUESTS_TOTAL: &str = "deepinfer_prefix_cache_requests_total";
pub const PREFIX_CACHE_HIT_REQUESTS_TOTAL: &str = "deepinfer_prefix_cache_hit_requests_total";
pub const PREFIX_CACHE_PROMPT_TOKENS_TOTAL: &str = "deepinfer_prefix_cache_prompt_tokens_total";
pub const PREFIX_CACHE_HIT_TOKENS_TOTAL: &str = "deepinfer_prefix_cache_hit_tokens_total";
pub const PREFIX_CACHE_SKIPPED_TOKENS_TOTAL: &str = "deepinfer_prefix_cache_skipped_tokens_total";
pub const PREFIX_CACHE_BYTES: &str = "deepinfer_prefix_cache_bytes";
pub const PREFIX_CACHE_EVICTIONS_TOTAL: &str = "deepinfer_prefix_cache_evictions_total";

/// Every metric name the runtime registers.
pub const ALL: &[&str] = &[
    FRONTEND_INFLIGHT_REQUESTS,
    FRONTEND_REQUESTS_TOTAL,
    FRONTEND_REQUEST_DURATION_SECONDS,
    FRONTEND_OUTSTANDING_TOKENS,
    FRONTEND_ABORTED_REQUESTS_TOTAL,
    SCHEDULER_QUEUE_DEPTH,
    SCHEDULER_RUNNING_REQUESTS,
    SCHEDULER_PROMPT_TOKENS_TOTAL,
    SCHEDULER_GENERATED_TOKENS_TOTAL,
    SCHEDULER_STEPS_TOTAL,
    STEP_DURATION_SECONDS,
    STEP_CPU_SCHEDULE_SECONDS,
    SCHEDULER_HIDDEN_SCHEDULE_MICROSECONDS_TOTAL,
    RANK_HOST_MICROSECONDS_TOTAL,
    RANK_HIDDEN_HOST_MICROSECONDS_TOTAL,
    SUPERVISOR_FAILED_RANKS,
    ERRORS_TOTAL,
    EPLB_LAYER_IMBALANCE_RATIO,
    EPLB_REBALANCES_TOTAL,
    EPLB_PLACEMENT_EPOCH,
    DSPARK_PROPOSED_TOKENS_TOTAL,
    DSPARK_VERIFIED_TOKENS_TOTAL,
    DSPARK_ACCEPTED_TOKENS_TOTAL,
    DSPARK_ACCEPTED_LENGTH_TOKENS,
    STATE_BLOCKS_USED,
    STATE_BLOCKS_FREE,
    SCHEDULER_PREEMPTIONS_TOTAL,
    SCHEDULER_RESUMED_TOTAL,
    PREFIX_CACHE_REQUESTS_TOTAL,
    PREFIX_CACHE_HIT_REQUESTS_TOTAL,
    PREFIX_CACHE_PROMPT_TOKENS_TOTAL,
    PREFIX_CACHE_HIT_TOKENS_TOTAL,
    PREFIX_CACHE_SKIPPED_TOKENS_TOTAL,
    PREFIX_CACHE_BYTES,
    PREFIX_CACHE_EVICTIONS_TOTAL,
];

/// Registers help text and units with the installed recorder (call once after installing it).
pub fn describe() {
    describe_counter!(
        PREFIX_CACHE_REQUESTS_TOTAL,
        Unit::Count,
        "Admissions looked up in the prefix cache, per DP rank."
    );
    describe_counter!(
        PREFIX_CACHE_HIT_REQUESTS_TOTAL,
        Unit::Count,
        "Admissions served from a prefix-cache hit, per DP rank."
    );
    describe_counter!(
        PREFIX_CACHE_PROMPT_TOKENS_TOTAL,
        Unit::Count,
        "Prompt tokens of the admissions looked up, per DP rank."
    );
    describe_counter!(
        PREFIX_CACHE_HIT_TOKENS_TOTAL,
        Unit::Count,
        "Cached prompt tokens the hits attached (the token hit rate's numerator), per DP rank."
    );
    describe_counter!(
        PREFIX_CACHE_SKIPPED_TOKENS_TOTAL,
        Unit::Count,
        "Hit tokens never fed (before the replay start), per DP rank."
    );
    describe_gauge!(
        PREFIX_CACHE_BYTES,
        Unit::Bytes,
        "Bytes of cached prefix blocks (at most prefix_cache.bytes_per_rank), per DP rank."
    );
    describe_counter!(
        PREFIX_CACHE_EVICTIONS_TOTAL,
        Unit::Count,
        "Prefix-cache blocks evicted for room, per DP rank."
    );
    describe_gauge!(
        STATE_BLOCKS_USED,
        Unit::Count,
        "State pool blocks held by sequences (or freed and not yet released), per DP rank."
    );
    describe_gauge!(
        STATE_BLOCKS_FREE,
        Unit::Count,
        "State pool blocks free, per DP rank."
    );
    describe_counter!(
        SCHEDULER_PREEMPTIONS_TOTAL,
        Unit::Count,
        "Requests preempted for state memory (resumed later by recompute), per DP rank."
    );
    describe_counter!(
        SCHEDULER_RESUMED_TOTAL,
        Unit::Count,
        "Preempted requests admitted again, per DP rank."
    );
    describe_gauge!(
        FRONTEND_INFLIGHT_REQUESTS,
        Unit::Count,
        "Admitted requests not yet finished."
    );
    describe_counter!(
        FRONTEND_REQUESTS_TOTAL,
        Unit::Count,
        "Requests seen by the frontend, by outcome (admitted, overloaded, invalid, shutting_down)."
    );
    describe_histogram!(
        FRONTEND_REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "From admission to the last event of a request."
    );
    describe_gauge!(
        FRONTEND_OUTSTANDING_TOKENS,
        Unit::Count,
        "Work placed on each DP rank and not yet finished (prompt + max_tokens of its admitted requests), per DP rank; placement picks the smallest."
    );
    describe_counter!(
        FRONTEND_ABORTED_REQUESTS_TOTAL,
        Unit::Count,
        "Admitted requests whose caller went away before the end (event stream dropped, e.g. an HTTP client disconnect); each is aborted in the engine."
    );
    describe_gauge!(
        SCHEDULER_QUEUE_DEPTH,
        Unit::Count,
        "Requests waiting for their first step, per DP rank."
    );
    describe_gauge!(
        SCHEDULER_RUNNING_REQUESTS,
        Unit::Count,
        "Requests being prefilled or decoded, per DP rank."
    );
    describe_counter!(
        SCHEDULER_PROMPT_TOKENS_TOTAL,
        Unit::Count,
        "Prompt tokens scheduled for prefill, per DP rank."
    );
    describe_counter!(
        SCHEDULER_GENERATED_TOKENS_TOTAL,
        Unit::Count,
        "Tokens generated and delivered, per DP rank."
    );
    describe_counter!(
        SCHEDULER_STEPS_TOTAL,
        Unit::Count,
        "Steps completed, per DP rank and mode (idle included)."
    );
    describe_histogram!(
        STEP_DURATION_SECONDS,
        Unit::Seconds,
        "Launch to results of one step on a rank, by mode."
    );
    describe_histogram!(
        STEP_CPU_SCHEDULE_SECONDS,
        Unit::Seconds,
        "CPU time the scheduler spent building one plan."
    );
    describe_counter!(
        SCHEDULER_HIDDEN_SCHEDULE_MICROSECONDS_TOTAL,
        Unit::Microseconds,
        "Scheduling CPU time spent while the rank had a step in flight (hidden by async scheduling)."
    );
    describe_counter!(
        RANK_HOST_MICROSECONDS_TOTAL,
        Unit::Microseconds,
        "Host time the rank threads spent preparing and launching steps."
    );
    describe_counter!(
        RANK_HIDDEN_HOST_MICROSECONDS_TOTAL,
        Unit::Microseconds,
        "Of the rank host time, the part overlapped with an earlier step on the device."
    );
    describe_gauge!(
        SUPERVISOR_FAILED_RANKS,
        Unit::Count,
        "DP ranks taken out of service by the supervisor."
    );
    describe_counter!(
        ERRORS_TOTAL,
        Unit::Count,
        "Errors delivered to requests, by error code."
    );
    describe_gauge!(
        EPLB_LAYER_IMBALANCE_RATIO,
        Unit::Count,
        "Per MoE layer: picks served by the busiest EP rank / the mean over EP ranks, over the last EPLB window (1 = even)."
    );
    describe_counter!(
        EPLB_REBALANCES_TOTAL,
        Unit::Count,
        "Expert placements committed by the EPLB."
    );
    describe_gauge!(
        EPLB_PLACEMENT_EPOCH,
        Unit::Count,
        "The expert placement epoch in use."
    );
    describe_counter!(
        DSPARK_PROPOSED_TOKENS_TOTAL,
        Unit::Count,
        "DSpark draft tokens proposed by the ranks, per DP rank."
    );
    describe_counter!(
        DSPARK_VERIFIED_TOKENS_TOTAL,
        Unit::Count,
        "DSpark draft tokens fed to the target model in verify entries, per DP rank."
    );
    describe_counter!(
        DSPARK_ACCEPTED_TOKENS_TOTAL,
        Unit::Count,
        "DSpark draft tokens accepted by verification, per DP rank."
    );
    describe_histogram!(
        DSPARK_ACCEPTED_LENGTH_TOKENS,
        Unit::Count,
        "Tokens one DSpark verify entry produced (accepted drafts + the bonus token); its mean is the mean accepted length per step."
    );
}

pub(crate) fn record_rank_step(output: &StepOutput) {
    let dp = output.dp.to_string();
    counter!(RANK_HOST_MICROSECONDS_TOTAL, "dp" => dp.clone())
        .increment(output.timing.host.as_micros() as u64);
    counter!(RANK_HIDDEN_HOST_MICROSECONDS_TOTAL, "dp" => dp)
        .increment(output.timing.hidden_host.as_micros() as u64);
    histogram!(STEP_DURATION_SECONDS, "mode" => output.mode.as_str())
        .record(output.timing.total.as_secs_f64());
}

pub(crate) fn record_step_done(dp: &str, mode: StepMode, generated: usize) {
    counter!(SCHEDULER_STEPS_TOTAL, "dp" => dp.to_string(), "mode" => mode.as_str()).increment(1);
    counter!(SCHEDULER_GENERATED_TOKENS_TOTAL, "dp" => dp.to_string()).increment(generated as u64);
}

pub(crate) fn record_dspark_step(dp: &str, output: &StepOutput) {
    let proposed: usize = output.drafts.iter().map(|d| d.confidences.len()).sum();
    if proposed == 0 && output.verified.is_empty() {
        return;
    }
    counter!(DSPARK_PROPOSED_TOKENS_TOTAL, "dp" => dp.to_string()).increment(proposed as u64);
    let verified: usize = output.verified.iter().map(|v| v.verified).sum();
    let accepted: usize = output.verified.iter().map(|v| v.accepted).sum();
    counter!(DSPARK_VERIFIED_TOKENS_TOTAL, "dp" => dp.to_string()).increment(verified as u64);
    counter!(DSPARK_ACCEPTED_TOKENS_TOTAL, "dp" => dp.to_string()).increment(accepted as u64);
    for outcome in &output.verified {
        histogram!(DSPARK_ACCEPTED_LENGTH_TOKENS).record((outcome.accepted + 1) as f64);
    }
}

pub(crate) fn record_plan(dp: &str, schedule_seconds: f64, hidden: bool, prompt_tokens: usize) {
    histogram!(STEP_CPU_SCHEDULE_SECONDS).record(schedule_seconds);
    if hidden {
        counter!(SCHEDULER_HIDDEN_SCHEDULE_MICROSECONDS_TOTAL, "dp" => dp.to_string())
            .increment((schedule_seconds * 1e6) as u64);
    }
    counter!(SCHEDULER_PROMPT_TOKENS_TOTAL, "dp" => dp.to_string()).increment(prompt_tokens as u64);
}

pub(crate) fn record_queue(dp: &str, waiting: usize, running: usize) {
    gauge!(SCHEDULER_QUEUE_DEPTH, "dp" => dp.to_string()).set(waiting as f64);
    gauge!(SCHEDULER_RUNNING_REQUESTS, "dp" => dp.to_string()).set(running as f64);
}

/// The state pool of a rank (blocks used and free) and its preemptions and resumptions so far.
pub(crate) fn record_state_pool(dp: &str, stats: &SchedulerStats) {
    if stats.state_blocks_total == 0 {
        return;
    }
    let free = stats.state_blocks_total - stats.state_blocks_used;
    gauge!(STATE_BLOCKS_USED, "dp" => dp.to_string()).set(stats.state_blocks_used as f64);
    gauge!(STATE_BLOCKS_FREE, "dp" => dp.to_string()).set(free as f64);
    counter!(SCHEDULER_PREEMPTIONS_TOTAL, "dp" => dp.to_string()).absolute(stats.preemptions);
    counter!(SCHEDULER_RESUMED_TOTAL, "dp" => dp.to_string()).absolute(stats.resumed);
}

pub(crate) fn record_prefix_cache(dp: &str, prefix: &PrefixStats) {
    if prefix.budget_bytes == 0 {
        return;
    }
    let c = &prefix.counters;
    for (name, value) in [
        (PREFIX_CACHE_REQUESTS_TOTAL, c.requests),
        (PREFIX_CACHE_HIT_REQUESTS_TOTAL, c.hit_requests),
        (PREFIX_CACHE_PROMPT_TOKENS_TOTAL, c.prompt_tokens),
        (PREFIX_CACHE_HIT_TOKENS_TOTAL, c.hit_tokens),
        (PREFIX_CACHE_SKIPPED_TOKENS_TOTAL, c.skipped_tokens),
        (PREFIX_CACHE_EVICTIONS_TOTAL, prefix.evictions),
    ] {
        counter!(name, "dp" => dp.to_string()).absolute(value);
    }
    gauge!(PREFIX_CACHE_BYTES, "dp" => dp.to_string()).set(prefix.cached_bytes as f64);
}

pub(crate) fn record_request(outcome: &'static str) {
    counter!(FRONTEND_REQUESTS_TOTAL, "outcome" => outcome).increment(1);
}

pub(crate) fn record_error(code: &'static str) {
    counter!(ERRORS_TOTAL, "code" => code).increment(1);
}

pub(crate) fn set_inflight(n: usize) {
    gauge!(FRONTEND_INFLIGHT_REQUESTS).set(n as f64);
}

pub(crate) fn set_outstanding_tokens(per_rank: &[usize]) {
    for (dp, tokens) in per_rank.iter().enumerate() {
        gauge!(FRONTEND_OUTSTANDING_TOKENS, "dp" => dp.to_string()).set(*tokens as f64);
    }
}

pub(crate) fn record_caller_abort() {
    counter!(FRONTEND_ABORTED_REQUESTS_TOTAL).increment(1);
}

pub(crate) fn record_request_duration(seconds: f64) {
    histogram!(FRONTEND_REQUEST_DURATION_SECONDS).record(seconds);
}

pub(crate) fn record_eplb_imbalance(per_layer: &[f64]) {
    for (layer, ratio) in per_layer.iter().enumerate() {
        gauge!(EPLB_LAYER_IMBALANCE_RATIO, "layer" => layer.to_string()).set(*ratio);
    }
}

pub(crate) fn record_eplb_commit(epoch: deepinfer_topology::PlacementEpoch) {
    if epoch.get() > 0 {
        counter!(EPLB_REBALANCES_TOTAL).increment(1);
    }
    gauge!(EPLB_PLACEMENT_EPOCH).set(f64::from(epoch.get()));
}

pub(crate) fn set_failed_ranks(n: usize) {
    gauge!(SUPERVISOR_FAILED_RANKS).set(n as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_convention_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for name in ALL {
            assert!(name.starts_with("deepinfer_"), "{name}");
            assert!(seen.insert(name), "duplicate {name}");
        }
    }

    /// A rank's prefix-cache stats become its counters and gauge, labelled by rank; a rank
    /// without the cache records nothing.
    #[test]
    fn prefix_cache_stats_are_recorded_per_rank() {
        use crate::scheduler::prefix::PrefixCounters;
        let recorder = crate::prometheus::local_recorder().expect("recorder");
        let stats = PrefixStats {
            counters: PrefixCounters {
                requests: 2,
                hit_requests: 1,
                prompt_tokens: 860,
                hit_tokens: 256,
                skipped_tokens: 116,
            },
            cached_bytes: 4096,
            cached_blocks: 4,
            evictions: 3,
            budget_bytes: 1 << 20,
        };
        metrics::with_local_recorder(&recorder, || {
            record_prefix_cache("1", &stats);
            record_prefix_cache("0", &PrefixStats::default());
        });
        let page = recorder.handle().render();
        for line in [
            "deepinfer_prefix_cache_requests_total{dp=\"1\"} 2",
            "deepinfer_prefix_cache_hit_requests_total{dp=\"1\"} 1",
            "deepinfer_prefix_cache_prompt_tokens_total{dp=\"1\"} 860",
            "deepinfer_prefix_cache_hit_tokens_total{dp=\"1\"} 256",
            "deepinfer_prefix_cache_skipped_tokens_total{dp=\"1\"} 116",
            "deepinfer_prefix_cache_evictions_total{dp=\"1\"} 3",
            "deepinfer_prefix_cache_bytes{dp=\"1\"} 4096",
        ] {
            assert!(page.contains(line), "{line} missing from\n{page}");
        }
        assert!(!page.contains("dp=\"0\""), "{page}");
    }
}
