//! Balance of context parallelism (`deepinfer_model::v41::context_parallel`): per CP rank, the
//! attention FLOPs of its rows of a long prompt (the cost model's `token_parts` at every
//! position, one V4.1-Flash block at the real widths: window 128, ratio-2 compressed KV, the
//! indexer over every visible compressed key) and the CPU wall time outside the collectives of a
//! real CP prefill (the narrow block, the CPU reference), for the mirror split against the
//! contiguous split. Prints each rank's share as a deviation from the mean; the mirror split's
//! FLOPs must stay within 5% of the mean (the run fails otherwise).
//!
//! `cargo bench -p deepinfer-bench --bench cp_balance` (or `--profile dev`: the model crate is
//! optimised in dev builds too).

use std::time::Duration;

use deepinfer_bench::block::{BlockFamily, BlockWidth, block_config};
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::cost::token_parts;
use deepinfer_model::v41::context_parallel::{CpSplit, rank_rows};
use deepinfer_model::{LogitsWanted, Model};

/// The attention FLOPs of a 128k-token prompt are balanced within this fraction of the mean.
const MIRROR_TOLERANCE: f64 = 0.05;

/// Each value's deviation from the mean (fraction) and the largest one.
fn deviations(values: &[f64]) -> (Vec<f64>, f64) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let devs: Vec<f64> = values.iter().map(|v| v / mean - 1.0).collect();
    let worst = devs.iter().fold(0.0f64, |w, d| w.max(d.abs()));
    (devs, worst)
}

fn show(devs: &[f64]) -> String {
    let cells: Vec<String> = devs.iter().map(|d| format!("{:+.1}%", 100.0 * d)).collect();
    cells.join(" ")
}

fn main() -> anyhow::Result<()> {
    let prompt = 128 * 1024;
    let cfg = block_config(BlockFamily::V41, BlockWidth::Real, 1024, prompt);
    let flops: Vec<f64> = (0..prompt)
        .map(|p| token_parts(&cfg, p).attention.flops)
        .collect();
    println!("attention FLOPs per CP rank, {prompt}-token prompt, one V4.1-Flash block:");
    let mut worst_mirror: f64 = 0.0;
    for ranks in [2, 4, 8] {
        for split in [CpSplit::Mirror, CpSplit::Contiguous] {
            let per_rank: Vec<f64> = (0..ranks)
                .map(|r| {
                    rank_rows(prompt, ranks, r, split)
                        .iter()
                        .map(|&o| flops[o])
                        .sum()
                })
                .collect();
            let (devs, worst) = deviations(&per_rank);
            if split == CpSplit::Mirror {
                worst_mirror = worst_mirror.max(worst);
            }
            println!(
                "  cp {ranks} {:<10}  max |dev| {:>6.1}%   per rank: {}",
                format!("{split:?}"),
                100.0 * worst,
                show(&devs)
            );
        }
    }

    let len = 4096;
    let dir = tempfile::tempdir()?;
    let narrow = block_config(BlockFamily::V41, BlockWidth::Narrow, 512, len);
    write_random_checkpoint(&narrow, 7, dir.path(), 1)?;
    let model = Model::load(dir.path())?;
    let tokens: Vec<u32> = (0..len as u32).map(|i| 3 + i * 7919 % 509).collect();
    println!(
        "CPU wall time per CP rank outside the collectives, {len}-token prefill, narrow block:"
    );
    for ranks in [2, 4] {
        for split in [CpSplit::Mirror, CpSplit::Contiguous] {
            let run = model.prefill_context_parallel(
                &model.new_sequence(),
                &tokens,
                LogitsWanted::Last,
                ranks,
                split,
                Duration::from_secs(600),
                None,
            )?;
            let secs: Vec<f64> = run.busy.iter().map(Duration::as_secs_f64).collect();
            let (devs, worst) = deviations(&secs);
            println!(
                "  cp {ranks} {:<10}  max |dev| {:>6.1}%   per rank: {}   ({:.2} s mean)",
                format!("{split:?}"),
                100.0 * worst,
                show(&devs),
                secs.iter().sum::<f64>() / secs.len() as f64
            );
        }
    }
    anyhow::ensure!(
        worst_mirror <= MIRROR_TOLERANCE,
        "the mirror split's attention FLOPs deviate {:.1}% from the mean (> {:.0}%)",
        100.0 * worst_mirror,
        100.0 * MIRROR_TOLERANCE
    );
    Ok(())
}
