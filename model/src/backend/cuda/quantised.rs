//! The device forms of the quantised host weights ([`Fp8Weight`], [`Fp4Weight`]): the exact
//! kernels' layouts (`ops::gemm`) and the fast GEMMs' (`ops::gemm_fast`), any [`Fp8Form`] or
//! [`Fp4Form`] of the kernels. Each form is uploaded on
//! its first use and kept in the weight cache under the host bytes it was made from (the module
//! header of `mod.rs`), beside the weight's other forms.

use std::any::Any;
use std::sync::Arc;

use deepinfer_kernels::ops::gemm::{Fp4Bytes, Fp4Form, Fp8Bytes, Fp8Form};
use deepinfer_kernels::{KernelError, KernelRuntime};

use super::{CudaBackend, CudaBackendError, HostKey, op_err};
use crate::weights::{Fp4Weight, Fp8Weight};

/// A quantised host weight: its codes and scales, what its device forms are made from.
pub(super) trait QuantisedHost {
    /// The op an upload failure is reported under.
    const OP: &'static str;

    /// The weight's identity in the cache: its codes' key, then its scales'.
    fn key(&self) -> (HostKey, HostKey);
}

impl QuantisedHost for Fp8Weight {
    const OP: &'static str = "gemm_fp8";

    fn key(&self) -> (HostKey, HostKey) {
        (HostKey::bytes(&self.data), HostKey::bytes(&self.scales))
    }
}

impl QuantisedHost for Fp4Weight {
    const OP: &'static str = "gemm_fp4";

    fn key(&self) -> (HostKey, HostKey) {
        (HostKey::bytes(&self.packed), HostKey::bytes(&self.scales))
    }
}

impl<'a> From<&'a Fp8Weight> for Fp8Bytes<'a> {
    fn from(w: &'a Fp8Weight) -> Fp8Bytes<'a> {
        Fp8Bytes {
            out: w.out,
            inp: w.inp,
            tile: w.block,
            codes: &w.data,
            scales: &w.scales,
        }
    }
}

impl<'a> From<&'a Fp4Weight> for Fp4Bytes<'a> {
    fn from(w: &'a Fp4Weight) -> Fp4Bytes<'a> {
        Fp4Bytes {
            out: w.out,
            inp: w.inp,
            packed: &w.packed,
            scales: &w.scales,
        }
    }
}

/// One device form of the host weight `W`.
pub(super) trait DeviceForm<W>: Any + Send + Sync + Sized {
    fn upload(rt: &KernelRuntime, w: &W) -> Result<Self, KernelError>;
}

impl<D: Fp8Form + Any + Send + Sync> DeviceForm<Fp8Weight> for D {
    fn upload(rt: &KernelRuntime, w: &Fp8Weight) -> Result<D, KernelError> {
        D::upload(rt, w.into())
    }
}

impl<D: Fp4Form + Any + Send + Sync> DeviceForm<Fp4Weight> for D {
    fn upload(rt: &KernelRuntime, w: &Fp4Weight) -> Result<D, KernelError> {
        D::upload(rt, w.into())
    }
}

/// The device forms made of one quantised host weight so far, at most one of each type.
pub(super) type Forms = Vec<Arc<dyn Any + Send + Sync>>;

impl CudaBackend {
    /// The device form `D` of `w`, uploaded on its first use and cached.
    pub(super) fn device_form<D: DeviceForm<W>, W: QuantisedHost>(
        &self,
        w: &W,
    ) -> Result<Arc<D>, CudaBackendError> {
        let key = w.key();
        let mut cache = self.lock_weights();
        let found = cache.quantised.get(&key).and_then(|forms| {
            forms
                .iter()
                .find_map(|form| form.clone().downcast::<D>().ok())
        });
        if let Some(found) = found {
            return Ok(found);
        }
        let uploaded = Arc::new(D::upload(&self.rt, w).map_err(op_err(W::OP))?);
        cache
            .quantised
            .entry(key)
            .or_default()
            .push(uploaded.clone());
        Ok(uploaded)
    }
}
