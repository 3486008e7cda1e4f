//! Typed launchers, one module per operation. Each checks its buffers' lengths against the shape
//! it is given and returns [`crate::KernelError::Shape`] before launching anything.

pub mod gemm;
pub mod norm;
pub mod quant;
pub mod rope;

use crate::error::KernelError;

/// `value` as a u32 kernel dimension, or a shape error naming it.
pub(crate) fn dim(op: &'static str, what: &str, value: usize) -> Result<u32, KernelError> {
    u32::try_from(value).map_err(|_| KernelError::Shape {
        op,
        message: format!("{what} = {value} exceeds u32"),
    })
}

/// A shape error unless `found == expected`.
pub(crate) fn expect_len(
    op: &'static str,
    what: &str,
    found: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if found == expected {
        Ok(())
    } else {
        Err(KernelError::Shape {
            op,
            message: format!("{what} has {found} elements, expected {expected}"),
        })
    }
}
