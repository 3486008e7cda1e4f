//! The traffic of a simulation: a trace of requests (JSONL) and the built-in generator.
//!
//! One JSON object per line (blank lines are skipped, unknown fields refused):
//!
//! ```text
//! {"arrival_s": 0.125, "prompt_tokens": 1024, "output_tokens": 256, "prefix_id": 7}
//! ```
//!
//! - `arrival_s`: arrival time, virtual seconds from the start of the run (finite, >= 0; lines
//!   may come in any order, the run sorts them).
//! - `prompt_tokens`: prompt length (tokens, >= 1).
//! - `output_tokens`: tokens generated (>= 1; the stand-in model never ends a request early).
//! - `prefix_id` (optional): requests with the same id share their prompt's leading tokens
//!   (a prompt token is a pure function of the id and its position); without it every prompt is
//!   its own.

use std::path::Path;

use serde::Deserialize;

use crate::rank::fake::hash2;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    pub arrival_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    #[serde(default)]
    pub prefix_id: Option<u64>,
}

impl TraceRequest {
    /// The prompt's tokens, each below `vocab_size` and at least 3 (clear of BOS, EOS, pad):
    /// a function of (`prefix_id`, position), or of (`index`, position) without a prefix id.
    pub fn prompt(&self, index: usize, vocab_size: usize) -> Vec<u32> {
        let key = match self.prefix_id {
            Some(id) => hash2(id, 0x7072_6566),
            None => hash2(index as u64, 0x756e_6971),
        };
        let span = vocab_size.saturating_sub(3).max(1) as u64;
        (0..self.prompt_tokens)
            .map(|p| 3 + (hash2(key, u64::from(p)) % span) as u32)
            .collect()
    }
}

/// A trace that cannot be used: the line and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{origin}:{line}: {message}")]
    Line {
        origin: String,
        line: usize,
        message: String,
    },
    #[error("reading the trace {path}: {message}")]
    Read { path: String, message: String },
    #[error("{origin}: the trace has no request")]
    Empty { origin: String },
}

/// Reads and checks a JSONL trace file.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|e| TraceError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    parse_trace(&text, &path.display().to_string())
}

/// Parses and checks a JSONL trace; the requests come back sorted by arrival (stable).
pub fn parse_trace(text: &str, origin: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut requests = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| TraceError::Line {
            origin: origin.to_string(),
            line: index + 1,
            message,
        };
        let request: TraceRequest = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if !request.arrival_s.is_finite() || request.arrival_s < 0.0 {
            return Err(bad(format!(
                "arrival_s must be finite and >= 0, found {}",
                request.arrival_s
            )));
        }
        if request.prompt_tokens == 0 {
            return Err(bad("prompt_tokens must be >= 1".into()));
        }
        if request.output_tokens == 0 {
            return Err(bad("output_tokens must be >= 1".into()));
        }
        requests.push(request);
    }
    if requests.is_empty() {
        return Err(TraceError::Empty {
            origin: origin.to_string(),
        });
    }
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    Ok(requests)
}

/// The built-in generator's shape: Poisson arrivals, lengths uniform in their ranges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceShape {
    pub requests: usize,
    /// Mean arrivals per virtual second (> 0; infinite = all at time 0).
    pub rate_per_s: f64,
    /// Inclusive prompt length range (tokens).
    pub prompt_tokens: (u32, u32),
    /// Inclusive output length range (tokens).
    pub output_tokens: (u32, u32),
    /// Distinct shared prefixes the requests draw from (0 = every prompt its own).
    pub prefixes: u64,
    pub seed: u64,
}

/// A uniform draw in [0, 1) from `(seed, index, what)`.
fn unit(seed: u64, index: u64, what: u64) -> f64 {
    (hash2(hash2(seed, index), what) >> 11) as f64 / (1u64 << 53) as f64
}

fn in_range(u: f64, (low, high): (u32, u32)) -> u32 {
    let span = f64::from(high.saturating_sub(low)) + 1.0;
    low + ((u * span) as u32).min(high.saturating_sub(low))
}

/// Generates the trace `shape` describes (deterministic in `shape.seed`).
pub fn generate(shape: &TraceShape) -> Vec<TraceRequest> {
    let mut arrival = 0.0;
    (0..shape.requests as u64)
        .map(|i| {
            if shape.rate_per_s.is_finite() && i > 0 {
                arrival += -(1.0 - unit(shape.seed, i, 1)).ln() / shape.rate_per_s;
            }
            TraceRequest {
                arrival_s: arrival,
                prompt_tokens: in_range(unit(shape.seed, i, 2), shape.prompt_tokens),
                output_tokens: in_range(unit(shape.seed, i, 3), shape.output_tokens),
                prefix_id: (shape.prefixes > 0)
                    .then(|| (unit(shape.seed, i, 4) * shape.prefixes as f64) as u64),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_sort_and_bad_lines_name_their_line() {
        let text = "{\"arrival_s\": 1.5, \"prompt_tokens\": 8, \"output_tokens\": 4}\n\n\
                    {\"arrival_s\": 0.5, \"prompt_tokens\": 3, \"output_tokens\": 2, \"prefix_id\": 9}\n";
        let trace = parse_trace(text, "t.jsonl").expect("parses");
        assert_eq!(trace.len(), 2);
        assert_eq!(trace[0].arrival_s, 0.5);
        assert_eq!(trace[0].prefix_id, Some(9));
        let bad = "{\"arrival_s\": 0, \"prompt_tokens\": 1, \"output_tokens\": 1}\n\
                   {\"arrival_s\": -1, \"prompt_tokens\": 1, \"output_tokens\": 1}\n";
        let error = parse_trace(bad, "t.jsonl").unwrap_err().to_string();
        assert!(error.starts_with("t.jsonl:2: arrival_s"), "{error}");
        let unknown = "{\"arrival_s\": 0, \"prompt_tokens\": 1, \"output_tokens\": 1, \"x\": 1}";
        let error = parse_trace(unknown, "u").unwrap_err().to_string();
        assert!(
            error.contains("u:1:") && error.contains("unknown field"),
            "{error}"
        );
        assert!(parse_trace("\n", "e").is_err());
    }

    #[test]
    fn generated_traces_follow_their_shape() {
        let shape = TraceShape {
            requests: 2000,
            rate_per_s: 100.0,
            prompt_tokens: (10, 20),
            output_tokens: (5, 5),
            prefixes: 4,
            seed: 3,
        };
        let trace = generate(&shape);
        assert_eq!(trace, generate(&shape), "deterministic");
        assert!(trace.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        let span = trace.last().unwrap().arrival_s;
        assert!((span - 20.0).abs() < 2.0, "2000 arrivals at 100/s: {span}");
        assert!(trace.iter().all(|r| (10..=20).contains(&r.prompt_tokens)));
        assert!(trace.iter().any(|r| r.prompt_tokens == 20));
        assert!(trace.iter().all(|r| r.output_tokens == 5));
        assert!(trace.iter().all(|r| r.prefix_id.is_some_and(|p| p < 4)));
        // Shared prefixes share tokens.
        let a = TraceRequest {
            prefix_id: Some(1),
            ..trace[0]
        };
        let b = TraceRequest {
            prompt_tokens: 30,
            ..a
        };
        assert_eq!(
            a.prompt(0, 1000)[..],
            b.prompt(1, 1000)[..a.prompt_tokens as usize]
        );
        assert_ne!(
            trace[0].prompt(0, 1000),
            TraceRequest {
                prefix_id: None,
                ..a
            }
            .prompt(1, 1000)
        );
    }
}
