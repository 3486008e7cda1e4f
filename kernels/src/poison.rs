//! Uninitialised output buffers and the poison mode that checks them.
//!
//! A launch that writes every element of its output needs no zero fill first (a memset: a driver
//! call and a kernel). Such outputs are allocated uninitialised by
//! `KernelRuntime::alloc_written`; with
//! `DEEPINFER_CUDA_POISON=1` ([`POISON_ENV`], read when the runtime opens) they are filled with
//! 0xFF bytes instead, so an element a kernel forgets to write reads as NaN (every float type:
//! f32, f64, bf16 and E4M3 all-ones are NaN) or as the integer maximum, deterministically: the
//! GPU tests run poisoned (`tests/gpu-suite.sh run`).

use std::ffi::OsStr;

/// The environment variable that turns the poison mode on (value `1`) when the runtime opens.
pub const POISON_ENV: &str = "DEEPINFER_CUDA_POISON";

/// The byte every element of a poisoned buffer is filled with.
pub const POISON_BYTE: u8 = 0xFF;

/// What `KernelRuntime::alloc_written` leaves in a new
/// buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Poison {
    /// Whatever the memory held (production: no fill at all).
    #[default]
    Off,
    /// [`POISON_BYTE`] in every byte (tests: unwritten outputs show).
    On,
}

impl Poison {
    /// The mode of a [`POISON_ENV`] value: on for `1` alone, as `DEEPINFER_CUDA_PROFILE`.
    pub fn from_env_value(value: Option<&OsStr>) -> Poison {
        if value.is_some_and(|v| v == "1") {
            Poison::On
        } else {
            Poison::Off
        }
    }

    /// The mode this process's environment asks for.
    pub fn from_env() -> Poison {
        Poison::from_env_value(std::env::var_os(POISON_ENV).as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_turns_the_poison_on() {
        let mode = |v: Option<&str>| Poison::from_env_value(v.map(OsStr::new));
        assert_eq!(mode(Some("1")), Poison::On);
        for off in [
            None,
            Some(""),
            Some("0"),
            Some("true"),
            Some(" 1"),
            Some("11"),
        ] {
            assert_eq!(mode(off), Poison::Off, "{off:?}");
        }
        assert_eq!(Poison::default(), Poison::Off);
    }

    #[test]
    fn the_poison_byte_is_nan_in_every_float_type() {
        let b = POISON_BYTE;
        assert!(f32::from_bits(u32::from_ne_bytes([b; 4])).is_nan());
        assert!(f64::from_bits(u64::from_ne_bytes([b; 8])).is_nan());
        assert!(half::bf16::from_bits(u16::from_ne_bytes([b; 2])).is_nan());
        // E4M3 (fn): S.1111.111 is its only NaN.
        assert_eq!(b & 0x7F, 0x7F);
    }
}
