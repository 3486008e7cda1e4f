//! [`KernelRuntime`]: one CUDA context and stream on one device with every [`KernelId`] compiled
//! for the device's arch and loaded. Opening it on a machine without the NVIDIA driver returns
//! [`KernelError::NoDriver`]; cudarc's dynamic loading panics on a missing library, so the library
//! is probed first and every first call into it runs under `catch_unwind`.
//!
//! Every launch, copy, allocation and free of a runtime happens on its one stream, in order; so
//! cudarc's cross-stream event tracking is turned off (it cost host time per buffer, kernel
//! argument and key address). Buffers must not be shared with another stream or runtime.
//!
//! Allocations are stream-ordered from the device's default memory pool, which by default hands
//! every unused byte back to the driver at each synchronisation, so the next step maps it again.
//! The runtime raises the pool's release threshold to keep what a step freed
//! ([`keep_freed_memory`]); [`release_pooled_memory`] hands it back where free device memory is
//! measured.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use std::ffi::c_void;
use std::sync::atomic::AtomicBool;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, DriverError, LaunchConfig, result, sys,
};
use cudarc::nvrtc::Ptx;
use sys::CUevent_flags;

use crate::compile::{Compiler, panic_text};
use crate::error::KernelError;
use crate::id::{Arch, KernelId, SourceFile};
use crate::kernel_timer::KernelTimer;
use crate::poison::{POISON_BYTE, Poison};
use crate::staging::{PinnedStaging, STAGED_MIN_BYTES};

/// The default memory pool of `ctx`'s device, when the device allocates stream-ordered.
fn default_pool(ctx: &CudaContext) -> Result<Option<sys::CUmemoryPool>, KernelError> {
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    // SAFETY: the device is the context's own.
    unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }
        .map(Some)
        .map_err(KernelError::driver(
            "reading the device's default memory pool",
        ))
}

/// Makes `ctx`'s device keep the memory its stream-ordered frees return (release threshold: all
/// of it) instead of handing it to the driver at every synchronisation: a step's temporaries
/// are then reused by the next step without mapping memory again.
pub fn keep_freed_memory(ctx: &CudaContext) -> Result<(), KernelError> {
    let Some(pool) = default_pool(ctx)? else {
        return Ok(());
    };
    let mut threshold = u64::MAX;
    // SAFETY: the pool is the device's default one; the release threshold is a u64 attribute.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .map_err(KernelError::driver(
        "raising the memory pool's release threshold",
    ))
}

/// Hands the memory `stream`'s device keeps for reuse back to the driver (after the stream is
/// idle), so that the driver's free-memory figure counts it as free again.
pub fn release_pooled_memory(stream: &CudaStream) -> Result<(), KernelError> {
    stream
        .synchronize()
        .map_err(KernelError::driver("synchronising the stream"))?;
    let Some(pool) = default_pool(stream.context())? else {
        return Ok(());
    };
    // SAFETY: the pool is the device's default one and no allocation of the stream is pending.
    unsafe { result::mem_pool::trim_to(pool, 0) }
        .map_err(KernelError::driver("trimming the memory pool"))
}

/// Bytes of the stream-ordered pool of `stream`'s device: `(used, reserved)`, what live
/// allocations hold and what the pool has mapped (used plus what it keeps for reuse); `None`
/// where the device has no such pool.
pub fn pooled_memory(stream: &CudaStream) -> Result<Option<(u64, u64)>, KernelError> {
    let Some(pool) = default_pool(stream.context())? else {
        return Ok(None);
    };
    let read = |attr: sys::CUmemPool_attribute, what: &'static str| {
        let mut value = 0u64;
        // SAFETY: the pool is the device's default one; both attributes are u64 byte counts.
        unsafe { result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }
            .map(|()| value)
            .map_err(KernelError::driver(what))
    };
    let used = read(
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        "reading the memory pool's used bytes",
    )?;
    let reserved = read(
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        "reading the memory pool's reserved bytes",
    )?;
    Ok(Some((used, reserved)))
}

/// Whether the CUDA driver library (`libcuda`) can be loaded; never panics.
pub fn driver_available() -> Result<(), KernelError> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate names.
    let present = std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() })
        .unwrap_or(false);
    if present {
        Ok(())
    } else {
        Err(KernelError::NoDriver {
            tried: cudarc::get_lib_name_candidates("cuda").join(", "),
        })
    }
}

/// What opening the runtime did (for logs and the benchmark header).
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub device_name: String,
    pub arch: Arch,
    pub modules_compiled: usize,
    pub modules_from_cache: usize,
    pub compile_ms: f64,
}

/// A device context, its default stream and every kernel loaded.
pub struct KernelRuntime {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    /// The device's multiprocessors ([`KernelRuntime::multiprocessors`]).
    multiprocessors: usize,
    functions: HashMap<KernelId, CudaFunction>,
    report: LoadReport,
    counters: RuntimeCounters,
    /// The page-locked ring large uploads go through ([`crate::staging`]).
    staging: Mutex<PinnedStaging>,
    /// Device time per kernel, when turned on ([`crate::kernel_timer`]).
    timer: Arc<KernelTimer>,
    /// What [`KernelRuntime::alloc_written`] fills new buffers with ([`crate::poison`]).
    poison: Poison,
    /// Whether kernels launch as programmatic dependents of the stream's previous kernel
    /// ([`KernelRuntime::dependent_launch`]).
    dependent_launch: Arc<AtomicBool>,
    /// Whether a capture is under way ([`crate::graph`]): host-to-device copies and waits refuse.
    pub(crate) capturing: AtomicBool,
}

/// What the runtime's users asked of the device so far: kernel launches (every launcher looks its
/// kernel up through [`KernelRuntime::function`] right before launching it), those of them on
/// tensor cores ([`KernelId::on_tensor_cores`]: the `fast` numerics' kernels) and host-to-device
/// copies made through [`KernelRuntime::htod`]. For profiles; reading them costs nothing.
#[derive(Debug, Default)]
struct RuntimeCounters {
    launches: AtomicU64,
    tensor_core_launches: AtomicU64,
    htod_copies: AtomicU64,
    htod_bytes: AtomicU64,
}

/// A snapshot of the runtime's counters; the difference of two is what happened in between.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuntimeCounts {
    pub launches: u64,
    /// Launches of tensor-core kernels (the `fast` numerics'), counted in `launches` too.
    pub tensor_core_launches: u64,
    pub htod_copies: u64,
    pub htod_bytes: u64,
}

impl std::ops::Sub for RuntimeCounts {
    type Output = RuntimeCounts;
    fn sub(self, earlier: RuntimeCounts) -> RuntimeCounts {
        RuntimeCounts {
            launches: self.launches - earlier.launches,
            tensor_core_launches: self.tensor_core_launches - earlier.tensor_core_launches,
            htod_copies: self.htod_copies - earlier.htod_copies,
            htod_bytes: self.htod_bytes - earlier.htod_bytes,
        }
    }
}

impl std::fmt::Debug for KernelRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelRuntime")
            .field("report", &self.report)
            .finish()
    }
}

impl KernelRuntime {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its arch and
    /// loads them all.
    pub fn open(ordinal: usize) -> Result<KernelRuntime, KernelError> {
        driver_available()?;
        KernelRuntime::open_with(ordinal, &Compiler::new()?)
    }

    /// As [`KernelRuntime::open`], with a given compiler (cache directory).
    pub fn open_with(ordinal: usize, compiler: &Compiler) -> Result<KernelRuntime, KernelError> {
        driver_available()?;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|panic| KernelError::LibraryPanicked {
                during: "creating the CUDA context",
                message: panic_text(&panic),
            })?
            .map_err(KernelError::driver(format!(
                "creating a context on device {ordinal}"
            )))?;
        // One stream does all of this runtime's work, so cudarc's cross-stream event tracking
        // (two events created per allocation, one recorded per kernel argument and per address
        // taken) is pure host overhead: off before the stream and any buffer exist.
        // SAFETY: every buffer of this context is allocated, used and freed (stream-ordered) on
        // the runtime's one stream (module header), so no cross-stream ordering is lost.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(KernelError::driver("reading the compute capability"))?;
        let arch = Arch::from_compute_capability(major, minor)
            .ok_or(KernelError::UnsupportedArch { major, minor })?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(KernelError::driver("reading the multiprocessor count"))?
            .max(1) as usize;
        let device_name = ctx
            .name()
            .map_err(KernelError::driver("reading the device name"))?;
        let stream = ctx
            .new_stream()
            .map_err(KernelError::driver("creating a stream"))?;

        let mut functions = HashMap::new();
        let mut report = LoadReport {
            device_name,
            arch,
            modules_compiled: 0,
            modules_from_cache: 0,
            compile_ms: 0.0,
        };
        for file in SourceFile::ALL {
            let cubin = compiler.compile(file, arch)?;
            if cubin.from_cache {
                report.modules_from_cache += 1;
            } else {
                report.modules_compiled += 1;
                report.compile_ms += cubin.compile_ms;
            }
            let module =
                ctx.load_module(Ptx::from_binary(cubin.bytes))
                    .map_err(KernelError::driver(format!(
                        "loading the module of {}",
                        file.path()
                    )))?;
            for id in KernelId::ALL.into_iter().filter(|id| id.source() == file) {
                let function = module
                    .load_function(id.symbol())
                    .map_err(KernelError::driver(format!(
                        "loading kernel {} from {}",
                        id.symbol(),
                        file.path()
                    )))?;
                crate::ops::gemm_fast::allow_shared(id, &function)?;
                functions.insert(id, function);
            }
        }
        let staging_ctx = ctx.clone();
        Ok(KernelRuntime {
            ctx,
            stream,
            arch,
            multiprocessors,
            functions,
            report,
            counters: RuntimeCounters::default(),
            staging: Mutex::new(PinnedStaging::new(staging_ctx)),
            timer: Arc::default(),
            poison: Poison::from_env(),
            dependent_launch: Arc::new(AtomicBool::new(true)),
            capturing: AtomicBool::new(false),
        })
    }

    /// The switch between launching kernels as programmatic dependents of the stream's previous
    /// kernel (true, from `open`: every arch here is sm_90+) and plain stream-ordered launches
    /// (shared: keep a clone to flip it later). A dependent kernel is launched as the previous
    /// one's blocks exit (no kernel triggers its dependents earlier), so its launch overlaps that
    /// kernel's end; it waits for that kernel's completion and memory before touching global
    /// memory (`cuda/common/grid_dependency.cuh`),
    /// so the results are the same either way and only the gaps between kernels change
    /// (`device_bench` times both).
    pub fn dependent_launch(&self) -> Arc<AtomicBool> {
        self.dependent_launch.clone()
    }

    /// The per-kernel device times (off until turned on; shared: keep a clone to read them).
    pub fn kernel_timer(&self) -> Arc<KernelTimer> {
        self.timer.clone()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launcher in [`crate::ops`] launches on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The device's multiprocessor count: what launch choices that never change a result count
    /// waves in (the fast GEMMs' K-part folding, the wide linear tile).
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// The loaded kernel `id` (all ids are loaded by `open`).
    pub fn function(&self, id: KernelId) -> Result<&CudaFunction, KernelError> {
        self.counters.launches.fetch_add(1, Ordering::Relaxed);
        if id.on_tensor_cores() {
            self.counters
                .tensor_core_launches
                .fetch_add(1, Ordering::Relaxed);
        }
        self.functions.get(&id).ok_or(KernelError::NotLoaded {
            symbol: id.symbol(),
        })
    }

    /// A launch of kernel `id` on the runtime's stream: push its arguments, then
    /// [`Launch::launch`].
    pub(crate) fn launcher(&self, id: KernelId) -> Result<Launch<'_>, KernelError> {
        Ok(self.launcher_of(self.function(id)?, id.symbol()))
    }

    /// A launch of `function` (named `name` in errors) on the runtime's stream: a function this
    /// runtime looked up ([`KernelRuntime::function`], counted there) or one the caller loaded.
    pub(crate) fn launcher_of<'a>(
        &'a self,
        function: &'a CudaFunction,
        name: &'a str,
    ) -> Launch<'a> {
        Launch {
            function,
            stream: &self.stream,
            name,
            timer: &self.timer,
            dependent: self.dependent_launch.load(Ordering::Relaxed),
            args: Vec::with_capacity(16),
        }
    }

    /// Copies `values` into a new device buffer on the runtime's stream, counted in
    /// [`KernelRuntime::counts`]; from [`STAGED_MIN_BYTES`] on through page-locked memory, so that
    /// the call returns without waiting for the stream. Refused while a capture is under way
    /// ([`crate::graph`]).
    pub fn htod<T: DeviceRepr>(&self, values: &[T]) -> Result<CudaSlice<T>, DriverError> {
        if self.capturing() {
            return Err(crate::graph::capture_refusal());
        }
        let bytes = std::mem::size_of_val(values);
        self.counters.htod_copies.fetch_add(1, Ordering::Relaxed);
        self.counters
            .htod_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        if bytes >= STAGED_MIN_BYTES {
            let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(staged) = staging.upload(&self.stream, values)? {
                return Ok(staged);
            }
        }
        self.stream.clone_htod(values)
    }

    /// A new buffer of `len` values, uninitialised (no memset), or filled with
    /// [`POISON_BYTE`](crate::poison::POISON_BYTE) when the runtime was opened poisoned
    /// ([`crate::poison`]).
    ///
    /// # Safety
    ///
    /// The caller's launches on this stream write every element before anything reads one (the
    /// buffer holds whatever the memory held: any bits, never a zero to rely on).
    pub unsafe fn alloc_written<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, DriverError> {
        // SAFETY: the caller's contract: every element is written before it is read.
        let mut buffer = unsafe { self.stream.alloc::<T>(len) }?;
        if self.poison == Poison::On {
            let bytes = buffer.num_bytes();
            let (ptr, _record) = buffer.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` is the start of `buffer`'s `bytes` bytes, on this stream.
            unsafe { result::memset_d8_async(ptr, POISON_BYTE, bytes, self.stream.cu_stream()) }?;
        }
        Ok(buffer)
    }

    /// Whether new buffers of [`KernelRuntime::alloc_written`] are poisoned.
    pub fn poison(&self) -> Poison {
        self.poison
    }

    /// Kernel launches and host-to-device copies so far.
    pub fn counts(&self) -> RuntimeCounts {
        RuntimeCounts {
            launches: self.counters.launches.load(Ordering::Relaxed),
            tensor_core_launches: self.counters.tensor_core_launches.load(Ordering::Relaxed),
            htod_copies: self.counters.htod_copies.load(Ordering::Relaxed),
            htod_bytes: self.counters.htod_bytes.load(Ordering::Relaxed),
        }
    }

    /// Waits for the stream. Refused while a capture is under way ([`crate::graph`]).
    pub fn synchronize(&self) -> Result<(), KernelError> {
        if self.capturing() {
            return Err(KernelError::driver("synchronising the stream")(
                crate::graph::capture_refusal(),
            ));
        }
        self.stream
            .synchronize()
            .map_err(KernelError::driver("synchronising the stream"))
    }
}

/// A value a kernel takes by value (a scalar or a `#[repr(C)]` params struct of `params.rs` or an
/// op module): [`Launch::arg`] passes a pointer to it, and the driver copies its bytes.
///
/// # Safety
///
/// The type's bytes are the kernel parameter's (same size, layout and alignment as the C type).
pub(crate) unsafe trait KernelValue {}

// SAFETY: the C scalars of the same widths.
unsafe impl KernelValue for u32 {}
unsafe impl KernelValue for i32 {}
unsafe impl KernelValue for u64 {}
unsafe impl KernelValue for f32 {}

/// One argument of a [`Launch`]: a [`KernelValue`] by reference, or a device buffer (its address).
pub(crate) trait KernelArg<'a> {
    fn push_to(self, launch: &mut Launch<'a>);
}

impl<'a, 'b: 'a, T: KernelValue> KernelArg<'a> for &'b T {
    fn push_to(self, launch: &mut Launch<'a>) {
        launch
            .args
            .push(LaunchArg::Value(self as *const T as *mut c_void));
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'b CudaSlice<T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (address, _no_event) = self.device_ptr(launch.stream);
        launch.push_address(address);
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'b mut CudaSlice<T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (address, _no_event) = self.device_ptr_mut(launch.stream);
        launch.push_address(address);
    }
}

impl<'a, 'b: 'a, 'c: 'b, T> KernelArg<'a> for &'b CudaView<'c, T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (address, _no_event) = self.device_ptr(launch.stream);
        launch.push_address(address);
    }
}

impl<'a, 'b: 'a, 'c: 'b, T> KernelArg<'a> for &'b mut CudaViewMut<'c, T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (address, _no_event) = self.device_ptr_mut(launch.stream);
        launch.push_address(address);
    }
}

/// One kernel launch being prepared ([`KernelRuntime::launcher`]): its arguments in the order of
/// the kernel's signature, then [`Launch::launch`].
pub(crate) struct Launch<'a> {
    function: &'a CudaFunction,
    stream: &'a CudaStream,
    name: &'a str,
    timer: &'a KernelTimer,
    /// Launched as a programmatic dependent of the stream's previous kernel
    /// ([`KernelRuntime::dependent_launch`]).
    dependent: bool,
    /// The arguments, in signature order.
    args: Vec<LaunchArg>,
}

/// A kernel argument as [`Launch`] holds it until the launch: a pointer to a borrowed value, or
/// a buffer's device address (the driver is handed a pointer to it).
enum LaunchArg {
    Value(*mut c_void),
    Address(sys::CUdeviceptr),
}

impl<'a> Launch<'a> {
    /// Pushes the kernel's next argument.
    pub(crate) fn arg<A: KernelArg<'a>>(&mut self, arg: A) -> &mut Self {
        arg.push_to(self);
        self
    }

    fn push_address(&mut self, address: sys::CUdeviceptr) {
        self.args.push(LaunchArg::Address(address));
    }

    /// Launches the kernel with `cfg`; a driver failure names the kernel.
    ///
    /// Timed launches ([`KernelTimer`] on) record an event before and after the kernel.
    ///
    /// # Safety
    /// The arguments match the kernel's signature and every buffer holds what the kernel reads
    /// and writes under `cfg`; a dependent launch's kernel starts with `grid_dependency_sync()`
    /// (`cuda/common/grid_dependency.cuh`; the test `every_kernel_starts_with_the_grid_dependency_sync`).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), KernelError> {
        // The error's text is built only on failure (a launch is the hot path).
        let name = self.name;
        let failed = move |during: &'static str| {
            move |source| KernelError::Driver {
                during: format!("{during} {name}"),
                source,
            }
        };
        let start = if self.timer.enabled() {
            let event = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
            Some(event.map_err(failed("recording the start of"))?)
        } else {
            None
        };
        // SAFETY: zero is a valid value of every field of the attribute's union.
        let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attribute.id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attribute.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: u32::from(self.dependent),
        };
        self.stream
            .context()
            .bind_to_thread()
            .map_err(failed("binding the context for"))?;
        // One pointer per parameter: to the borrowed value, or to the address held in `args`
        // (not moved or changed until the call returns, which copies the parameters).
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|arg| match arg {
                LaunchArg::Value(value) => *value,
                LaunchArg::Address(address) => address as *const sys::CUdeviceptr as *mut c_void,
            })
            .collect();
        // SAFETY: the caller's contract above; `params` points at one value per parameter, alive
        // for the call (values borrowed for 'a, addresses in `self.args`), and the function is
        // the stream's context's.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(failed("launching"))?;
        if let Some(start) = start {
            let end = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
            self.timer.record(
                self.name,
                (start, end.map_err(failed("recording the end of"))?),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without the NVIDIA driver (CI), opening the runtime is a clear `NoDriver`
    /// error, not a panic; where the driver exists the check passes.
    #[test]
    fn a_missing_driver_is_a_clear_error_not_a_panic() {
        // SAFETY: only probes whether the library can be opened.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        match driver_available() {
            Ok(()) => assert!(present),
            Err(err) => {
                assert!(!present);
                assert!(matches!(err, KernelError::NoDriver { .. }));
                let text = err.to_string();
                assert!(text.starts_with("no CUDA driver"), "{text}");
                assert!(text.contains("libcuda.so"), "{text}");
            }
        }
        if !present {
            let opened = std::panic::catch_unwind(|| KernelRuntime::open(0));
            let result = opened.expect("KernelRuntime::open must not panic without a driver");
            assert!(matches!(
                result,
                Err(KernelError::NoDriver { .. })
                    | Err(KernelError::NoNvrtc { .. })
                    | Err(KernelError::NoIncludePath { .. })
            ));
        }
    }
}
