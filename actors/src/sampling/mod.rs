//! Token sampling for the runtime: greedy, temperature, top-k, top-p, with deterministic noise.
//!
//! The math lives in one place, `deepinfer_model::sampling` (re-exported here), so the CPU path
//! and the device's sampling kernel (`Backend::sample_rows`) pick the same tokens. This module
//! adds what only the runtime needs: a parameter error as the request's [`ValidationError`].

use crate::error::ValidationError;

pub use deepinfer_model::sampling::{
    MAX_TOP_LOGPROBS, SamplingParamError, SamplingParams, TokenLogprobs, gumbel, sample,
    token_logprobs, uniform, uniform_seed,
};

impl From<SamplingParamError> for ValidationError {
    fn from(err: SamplingParamError) -> Self {
        ValidationError::OutOfRange {
            field: err.field,
            value: err.value,
            expected: err.expected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_parameter_is_a_validation_error_naming_the_field() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.0,
            seed: 0,
        };
        let err = params.validate().map_err(ValidationError::from).err();
        assert!(
            matches!(
                &err,
                Some(ValidationError::OutOfRange { field: "top_p", value, .. }) if value == "0"
            ),
            "{err:?}"
        );
        assert!(SamplingParams::greedy().validate().is_ok());
    }
}
