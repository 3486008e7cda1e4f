//! A step's device-only time: a one-thread kernel holds the stream for a head start while the
//! host issues the whole step behind it, so the step's kernels then run back to back, with no
//! wait for the host between them — the step as a captured CUDA graph would replay it. The step's
//! wall time less the head start is its device time plus the hold's own launch and exit (a few
//! µs, so the figure is an upper bound). Beside the ordinary step it says how much of that step
//! is the host issuing launches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deepinfer_kernels::compile::Compiler;
use deepinfer_kernels::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use deepinfer_kernels::cudarc::nvrtc::Ptx;
use deepinfer_kernels::runtime::KernelRuntime;

const SOURCE: &str = r#"
extern "C" __global__ void hold_stream(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"#;

/// The hold kernel on the runtime's stream.
pub struct HeadStart {
    function: CudaFunction,
    stream: Arc<CudaStream>,
}

impl HeadStart {
    pub fn new(rt: &KernelRuntime) -> Result<HeadStart> {
        let compiler = Compiler::new().context("finding NVRTC")?;
        let cubin = compiler
            .compile_text("hold_stream.cu", SOURCE, rt.arch())
            .context("compiling the stream hold")?;
        let module = rt
            .context()
            .load_module(Ptx::from_binary(cubin))
            .context("loading the stream hold")?;
        let function = module
            .load_function("hold_stream")
            .context("loading hold_stream")?;
        Ok(HeadStart {
            function,
            stream: rt.stream().clone(),
        })
    }

    /// Holds the stream for `hold` from when the kernel starts; returns when it is queued.
    pub fn hold(&self, hold: Duration) -> Result<()> {
        let ns = u64::try_from(hold.as_nanos()).context("a hold past u64 nanoseconds")?;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: hold_stream takes one u64 by value and touches no memory.
        unsafe {
            self.stream
                .launch_builder(&self.function)
                .arg(&ns)
                .launch(config)
        }
        .context("launching the stream hold")?;
        Ok(())
    }

    /// Each step's seconds less `hold`: `step` runs once per entry of the result, behind a hold.
    pub fn device_only(
        &self,
        steps: usize,
        hold: Duration,
        mut step: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        let mut seconds = Vec::with_capacity(steps);
        for _ in 0..steps {
            let started = Instant::now();
            self.hold(hold)?;
            step()?;
            seconds.push((started.elapsed().saturating_sub(hold)).as_secs_f64());
        }
        Ok(seconds)
    }
}
