//! The device time of a step: peak rates per GPU architecture, the fraction of them each op class
//! reaches (`Efficiency`, calibrated against the H200 `device_bench` measurements in
//! bench/README.md), and the MoE dispatch/combine over the scale-up and scale-out fabric.
//!
//! A class's time is its roofline floor with the peaks scaled by the efficiencies,
//! `max(bytes / (HBM · e_bytes), FLOPs / (peak · e_flops))` (dense GEMMs at the FP8 peak,
//! attention at bf16, routed experts at FP4), plus a fixed time per layer (launches and the
//! host's part). The
//! fabric moves the routed rows whose expert is on another GPU; DeepEP-style two-batch overlap
//! is assumed, so a step takes `max(compute, fabric)`.

use super::Cost;
use super::step::StepWork;

/// Peak rates of one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DevicePeaks {
    pub name: &'static str,
    /// HBM bytes per second (read + write counted).
    pub hbm_bytes_per_s: f64,
    /// Dense bf16 tensor-core FLOP/s (attention cores, head).
    pub bf16_flops: f64,
    /// Dense FP8 tensor-core FLOP/s (the FP8 dense weights).
    pub fp8_flops: f64,
    /// Dense FP4 tensor-core FLOP/s (the routed experts); Hopper has none and runs them at FP8.
    pub fp4_flops: f64,
    /// Scale-up (NVLink) bytes per second per GPU and direction.
    pub scale_up_bytes_per_s: f64,
    /// Scale-out (NIC) bytes per second per GPU and direction.
    pub scale_out_bytes_per_s: f64,
}

impl DevicePeaks {
    /// H200 SXM. HBM copy 4.28 TB/s, bf16 790 TFLOP/s (cuBLAS 4096³) and FP8 1216 TFLOP/s dense
    /// are measured on the test machine (shared/tools/gpu.md, bench/README.md); NVLink 4
    /// 900 GB/s bidirectional and a 400 Gb/s ConnectX-7 per GPU are NVIDIA's published figures
    /// (H200 and DGX H200 datasheets).
    pub const H200: DevicePeaks = DevicePeaks {
        name: "H200",
        hbm_bytes_per_s: 4.28e12,
        bf16_flops: 790e12,
        fp8_flops: 1216e12,
        fp4_flops: 1216e12,
        scale_up_bytes_per_s: 450e9,
        scale_out_bytes_per_s: 50e9,
    };

    /// H100 SXM (80 GB HBM3), as measured on the test machines: device-to-device copy 3.0 TB/s
    /// counting bytes read and written (the device tool's machine record, 2026-11-13; counted as
    /// the H200's 4.28), bf16 798 TFLOP/s (an 8192³ matrix product, same record) and FP8 1316 TFLOP/s
    /// (cuBLASLt per-tensor FP8 on 5120 → 6144 at M = 1024, bench/README.md, session 17); NVLink
    /// 4 and the NIC as the H200's. What [`Efficiency::MEASURED_FAST`] was fitted against.
    pub const H100: DevicePeaks = DevicePeaks {
        name: "H100",
        hbm_bytes_per_s: 3.0e12,
        bf16_flops: 798e12,
        fp8_flops: 1316e12,
        fp4_flops: 1316e12,
        scale_up_bytes_per_s: 450e9,
        scale_out_bytes_per_s: 50e9,
    };

    /// B200 (sm_100), NVIDIA's published dense figures (DGX B200 / HGX B200 datasheets, 2025):
    /// HBM3e 8 TB/s, bf16 2.25 PFLOP/s, FP8 4.5 PFLOP/s, FP4 9 PFLOP/s, NVLink 5 1.8 TB/s
    /// bidirectional, 400 Gb/s ConnectX-7 per GPU. Not measured here.
    pub const B200: DevicePeaks = DevicePeaks {
        name: "B200",
        hbm_bytes_per_s: 8.0e12,
        bf16_flops: 2.25e15,
        fp8_flops: 4.5e15,
        fp4_flops: 9.0e15,
        scale_up_bytes_per_s: 900e9,
        scale_out_bytes_per_s: 50e9,
    };
}

/// The fraction of the peaks an implementation reaches, and its fixed time per layer. A class's
/// time is `max(bytes / (HBM · bytes), FLOPs / (peak · flops))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// Seconds per backbone layer and step whatever the work (launches, host, small ops).
    pub per_layer_s: f64,
    /// Fraction of the HBM rate reached.
    pub bytes: f64,
    /// Fraction of the tensor-core peak reached.
    pub flops: f64,
}

impl Efficiency {
    /// Every class at its roofline floor, nothing per layer: the bound no implementation beats.
    pub const ROOFLINE: Efficiency = Efficiency {
        per_layer_s: 0.0,
        bytes: 1.0,
        flops: 1.0,
    };

    /// This engine's CUDA kernels in the `fast` numerics (the serving default), measured on an
    /// H100: the real-width V4.1 block's 1024-token prefill and decode at B = 1, 8, 64
    /// (bench/README.md, "Cost model calibration"), against [`DevicePeaks::H100`], fitted to the
    /// four points (deepinfer-bench `cost_tests::calibration_predicts_the_measured_steps` prints
    /// prediction against measurement). Decode is a fixed time per layer (its ~77 launches of
    /// small kernels: 0.415 ms) plus the weights at 83 % of the HBM rate; the prefill is bound by
    /// its FLOPs at 8.6 % of the tensor peak. Four points of a one-block model cannot tell the op
    /// classes apart (one bytes and one FLOPs fraction for all) nor a per-step from a per-layer
    /// overhead (charged per layer, the pessimistic choice). Fractions of the peaks: applied to
    /// another device's peaks (the simulator's H200 or B200) they assume the kernels reach the
    /// same fractions there, which is not measured.
    pub const MEASURED_FAST: Efficiency = Efficiency {
        per_layer_s: 0.415e-3,
        bytes: 1.0 / 1.2,
        flops: 1.0 / 11.6,
    };
}

/// Where the GPUs of an expert-parallel deployment sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricLayout {
    /// EP ranks (one per GPU).
    pub gpus: usize,
    /// GPUs sharing a scale-up domain (a node).
    pub gpus_per_node: usize,
}

impl FabricLayout {
    /// Fractions of a uniformly placed pick that stay on the GPU, cross the scale-up fabric,
    /// and cross the scale-out fabric.
    pub fn fractions(&self) -> (f64, f64, f64) {
        let gpus = self.gpus.max(1) as f64;
        let node = self.gpus_per_node.clamp(1, self.gpus.max(1)) as f64;
        (1.0 / gpus, (node - 1.0) / gpus, (gpus - node) / gpus)
    }
}

/// A GPU model: peaks and achieved efficiencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceModel {
    pub peaks: DevicePeaks,
    pub efficiency: Efficiency,
}

/// A step's modelled time, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTime {
    /// Dense + attention + routed + per-layer overhead (seconds).
    pub compute: f64,
    /// Dispatch and combine over the fabric (seconds).
    pub fabric: f64,
}

impl StepTime {
    /// `max(compute, fabric)`: the fabric overlaps the compute (two-batch overlap).
    pub fn seconds(&self) -> f64 {
        self.compute.max(self.fabric)
    }
}

impl DeviceModel {
    /// Seconds of the step's compute on this device, over `layers` backbone layers.
    pub fn compute_seconds(&self, work: &StepWork, layers: usize) -> f64 {
        let p = &self.peaks;
        layers as f64 * self.efficiency.per_layer_s
            + self.class_seconds(&work.dense, p.fp8_flops)
            + self.class_seconds(&work.attention, p.bf16_flops)
            + self.class_seconds(&work.routed, p.fp4_flops)
    }

    /// One op class: `max(bytes / (HBM · e.bytes), FLOPs / (peak · e.flops))`.
    fn class_seconds(&self, cost: &Cost, peak_flops: f64) -> f64 {
        let e = &self.efficiency;
        (cost.bytes() / (self.peaks.hbm_bytes_per_s * e.bytes))
            .max(cost.flops / (peak_flops * e.flops))
    }

    /// Seconds to move `bytes` of routed rows out of (and as many into) one GPU over `layout`.
    pub fn fabric_seconds(&self, bytes: f64, layout: FabricLayout) -> f64 {
        let (_, up, out) = layout.fractions();
        bytes * up / self.peaks.scale_up_bytes_per_s
            + bytes * out / self.peaks.scale_out_bytes_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_leave_the_gpu_over_the_domain_they_reach() {
        let hgx = FabricLayout {
            gpus: 64,
            gpus_per_node: 8,
        };
        let (local, up, out) = hgx.fractions();
        assert_eq!((local * 64.0, up * 64.0, out * 64.0), (1.0, 7.0, 56.0));
        let b200 = DeviceModel {
            peaks: DevicePeaks::B200,
            efficiency: Efficiency::ROOFLINE,
        };
        // 64 GB leaving one GPU: 7 GB over NVLink at 900 GB/s, 56 GB over the NIC at 50 GB/s.
        let seconds = b200.fabric_seconds(64e9, hgx);
        assert!(
            (seconds - (7.0 / 900.0 + 56.0 / 50.0)).abs() < 1e-12,
            "{seconds}"
        );
        let rack = FabricLayout {
            gpus: 64,
            gpus_per_node: 64,
        };
        assert!((b200.fabric_seconds(64e9, rack) - 63.0 / 900.0).abs() < 1e-12);
        let time = StepTime {
            compute: 2.0,
            fabric: 3.0,
        };
        assert_eq!(time.seconds(), 3.0, "the fabric overlaps the compute");
    }
}
