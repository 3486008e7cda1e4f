//! NVRTC compilation of the embedded sources to CUBIN for one [`Arch`], with an on-disk cache
//! keyed by a hash of the source (and every header), the arch, the NVRTC version and the flags.
//!
//! The CUDA include directory (for `cuda_bf16.h` / `cuda_fp8.h`, which NVRTC 13.0 does not bundle)
//! is found in `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`, or next to a
//! pip `nvidia/cu13/lib` directory on `LD_LIBRARY_PATH` (`nvidia/cu13/include`).

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::nvrtc::sys as nv;

use crate::error::KernelError;
use crate::id::{Arch, SourceFile};
use crate::source;

/// Whether `libnvrtc` can be loaded (a caught panic counts as "no").
pub fn nvrtc_available() -> Result<(), KernelError> {
    // SAFETY: `is_culib_present` only tries to dlopen the library names; it touches no state.
    let present = std::panic::catch_unwind(|| unsafe { nv::is_culib_present() }).unwrap_or(false);
    if present {
        Ok(())
    } else {
        Err(KernelError::NoNvrtc {
            tried: cudarc::get_lib_name_candidates("nvrtc").join(", "),
        })
    }
}

/// The NVRTC library version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    nvrtc_available()?;
    let mut major: c_int = 0;
    let mut minor: c_int = 0;
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    let result = std::panic::catch_unwind(move || unsafe {
        let status = nv::nvrtcVersion(&mut major, &mut minor);
        (status, major, minor)
    });
    match result {
        Ok((nv::nvrtcResult::NVRTC_SUCCESS, major, minor)) => Ok((major, minor)),
        Ok((status, _, _)) => Err(KernelError::Nvrtc {
            during: "nvrtcVersion",
            source_name: "-".to_string(),
            message: format!("{status:?}"),
        }),
        Err(panic) => Err(KernelError::LibraryPanicked {
            during: "nvrtcVersion",
            message: panic_text(&panic),
        }),
    }
}

/// The candidate CUDA include directories, in search order.
pub fn include_dir_candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            dirs.push(PathBuf::from(root).join("include"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        for lib in std::env::split_paths(&paths) {
            if lib.ends_with("cu13/lib")
                && let Some(parent) = lib.parent()
            {
                dirs.push(parent.join("include"));
            }
        }
    }
    dirs
}

/// The first candidate directory that holds `cuda_bf16.h` and `cuda_fp8.h`.
pub fn find_include_dir() -> Result<PathBuf, KernelError> {
    let tried = include_dir_candidates();
    tried
        .iter()
        .find(|dir| dir.join("cuda_bf16.h").is_file() && dir.join("cuda_fp8.h").is_file())
        .cloned()
        .ok_or(KernelError::NoIncludePath { tried })
}

/// Where CUBINs are cached: `$DEEPINFER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/deepinfer/kernels`,
/// else `$HOME/.cache/deepinfer/kernels`, else the temp dir.
pub fn default_cache_dir() -> PathBuf {
    let env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = env("DEEPINFER_KERNEL_CACHE") {
        return dir;
    }
    if let Some(dir) = env("XDG_CACHE_HOME") {
        return dir.join("deepinfer").join("kernels");
    }
    if let Some(home) = env("HOME") {
        return home.join(".cache").join("deepinfer").join("kernels");
    }
    std::env::temp_dir().join("deepinfer-kernels")
}

/// One compiled translation unit.
#[derive(Debug, Clone)]
pub struct Cubin {
    pub file: SourceFile,
    pub arch: Arch,
    pub bytes: Vec<u8>,
    /// True when the CUBIN came from the disk cache.
    pub from_cache: bool,
    /// Wall time of the NVRTC compilation (0 for a cache hit).
    pub compile_ms: f64,
}

/// Compiles sources with fixed flags for any [`Arch`], through the disk cache.
#[derive(Debug, Clone)]
pub struct Compiler {
    include_dir: PathBuf,
    nvrtc_version: (i32, i32),
    cache_dir: Option<PathBuf>,
}

impl Compiler {
    /// Finds NVRTC and the include directory; caches in [`default_cache_dir`].
    pub fn new() -> Result<Compiler, KernelError> {
        Compiler::with_cache(Some(default_cache_dir()))
    }

    /// As [`Compiler::new`], with an explicit cache directory (`None`: no cache).
    pub fn with_cache(cache_dir: Option<PathBuf>) -> Result<Compiler, KernelError> {
        let nvrtc_version = nvrtc_version()?;
        let include_dir = find_include_dir()?;
        Ok(Compiler {
            include_dir,
            nvrtc_version,
            cache_dir,
        })
    }

    pub fn include_dir(&self) -> &Path {
        &self.include_dir
    }

    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc_version
    }

    /// The NVRTC options for `arch`.
    pub fn options(&self, arch: Arch) -> Vec<String> {
        vec![
            format!("--gpu-architecture={}", arch.nvrtc_name()),
            "--std=c++17".to_string(),
            "--device-as-default-execution-space".to_string(),
            "--generate-line-info".to_string(),
            // No implicit a*b+c contraction: the reference-order kernels spell every rounding out.
            "--fmad=false".to_string(),
            format!("--include-path={}", self.include_dir.display()),
        ]
    }

    /// The cache key of `file` for `arch`: FNV-1a 64 over the source, every header, the arch, the
    /// NVRTC version and the options.
    pub fn cache_key(&self, file: SourceFile, arch: Arch) -> u64 {
        let mut hash = Fnv1a::new();
        hash.write(file.path().as_bytes());
        hash.write(source::text(file).as_bytes());
        for (name, text) in source::HEADERS {
            hash.write(name.as_bytes());
            hash.write(text.as_bytes());
        }
        hash.write(arch.nvrtc_name().as_bytes());
        hash.write(&self.nvrtc_version.0.to_le_bytes());
        hash.write(&self.nvrtc_version.1.to_le_bytes());
        for option in self.options(arch) {
            hash.write(option.as_bytes());
        }
        hash.finish()
    }

    fn cache_path(&self, file: SourceFile, arch: Arch) -> Option<PathBuf> {
        let stem = file.path().replace('/', "_").replace(".cu", "");
        let key = self.cache_key(file, arch);
        self.cache_dir
            .as_ref()
            .map(|dir| dir.join(format!("{stem}-{arch}-{key:016x}.cubin")))
    }

    /// The CUBIN of `file` for `arch`, from the cache or freshly compiled (then written to the
    /// cache; a cache that cannot be written is skipped, never an error).
    pub fn compile(&self, file: SourceFile, arch: Arch) -> Result<Cubin, KernelError> {
        let cache_path = self.cache_path(file, arch);
        if let Some(bytes) = cache_path
            .as_ref()
            .and_then(|path| std::fs::read(path).ok())
            && !bytes.is_empty()
        {
            return Ok(Cubin {
                file,
                arch,
                bytes,
                from_cache: true,
                compile_ms: 0.0,
            });
        }
        let started = Instant::now();
        let bytes = self.compile_uncached(file, arch)?;
        let compile_ms = started.elapsed().as_secs_f64() * 1e3;
        if let Some(path) = cache_path {
            write_atomically(&path, &bytes);
        }
        Ok(Cubin {
            file,
            arch,
            bytes,
            from_cache: false,
            compile_ms,
        })
    }

    /// The CUBIN of a generated source `text` named `source_name` (every project header is
    /// available to its `#include`s), uncached: the benchmark's tile variants of a kernel.
    pub fn compile_text(
        &self,
        source_name: &str,
        text: &str,
        arch: Arch,
    ) -> Result<Vec<u8>, KernelError> {
        let options = self.options(arch);
        std::panic::catch_unwind(|| {
            nvrtc_compile(source_name, text, arch, &options).map(|compiled| compiled.cubin)
        })
        .unwrap_or_else(|panic| {
                Err(KernelError::LibraryPanicked {
                    during: "NVRTC compilation",
                    message: panic_text(&panic),
                })
            })
    }

    /// Runs NVRTC on `file` for `arch`, bypassing the cache.
    pub fn compile_uncached(&self, file: SourceFile, arch: Arch) -> Result<Vec<u8>, KernelError> {
        let options = self.options(arch);
        let result = std::panic::catch_unwind(|| {
            nvrtc_compile(file.path(), source::text(file), arch, &options)
                .map(|compiled| compiled.cubin)
        });
        match result {
            Ok(outcome) => outcome,
            Err(panic) => Err(KernelError::LibraryPanicked {
                during: "NVRTC compilation",
                message: panic_text(&panic),
            }),
        }
    }
}

/// A successful compilation: the CUBIN and NVRTC's log (ptxas' notes, such as a kernel whose
/// warpgroup MMAs it serialised).
struct Compiled {
    cubin: Vec<u8>,
    #[cfg_attr(not(test), expect(dead_code, reason = "read by the tests"))]
    log: String,
}

fn nvrtc_compile(
    source_name: &str,
    text: &str,
    arch: Arch,
    options: &[String],
) -> Result<Compiled, KernelError> {
    let c_string = |text: &str, what: &'static str| {
        CString::new(text).map_err(|_| KernelError::Nvrtc {
            during: what,
            source_name: source_name.to_string(),
            message: "embedded NUL byte".to_string(),
        })
    };
    let src = c_string(text, "reading the source")?;
    let name = c_string(source_name, "reading the source name")?;
    let header_texts = source::HEADERS
        .iter()
        .map(|(_, text)| c_string(text, "reading a header"))
        .collect::<Result<Vec<_>, _>>()?;
    let header_names = source::HEADERS
        .iter()
        .map(|(name, _)| c_string(name, "reading a header name"))
        .collect::<Result<Vec<_>, _>>()?;
    let c_options = options
        .iter()
        .map(|o| c_string(o, "reading an option"))
        .collect::<Result<Vec<_>, _>>()?;
    let header_ptrs: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
    let option_ptrs: Vec<*const c_char> = c_options.iter().map(|s| s.as_ptr()).collect();
    let check = |status: nv::nvrtcResult, during: &'static str| {
        if status == nv::nvrtcResult::NVRTC_SUCCESS {
            Ok(())
        } else {
            Err(KernelError::Nvrtc {
                during,
                source_name: source_name.to_string(),
                message: format!("{status:?}"),
            })
        }
    };

    let mut program: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated C string owned above; the header arrays have
    // `HEADERS.len()` entries each.
    check(
        unsafe {
            nv::nvrtcCreateProgram(
                &mut program,
                src.as_ptr(),
                name.as_ptr(),
                header_ptrs.len() as c_int,
                header_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    let outcome = (|| {
        // SAFETY: `program` was created above; the option pointers are live C strings.
        let status = unsafe {
            nv::nvrtcCompileProgram(program, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        if status != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(KernelError::Compile {
                source_name: source_name.to_string(),
                arch,
                log: program_log(program),
            });
        }
        let mut size = 0usize;
        // SAFETY: `program` compiled successfully; `size` is valid for a write.
        check(
            unsafe { nv::nvrtcGetCUBINSize(program, &mut size) },
            "nvrtcGetCUBINSize",
        )?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
        check(
            unsafe { nv::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()) },
            "nvrtcGetCUBIN",
        )?;
        if cubin.is_empty() {
            return Err(KernelError::Nvrtc {
                during: "nvrtcGetCUBIN",
                source_name: source_name.to_string(),
                message: "NVRTC returned an empty CUBIN".to_string(),
            });
        }
        Ok(Compiled {
            cubin,
            log: program_log(program),
        })
    })();
    // SAFETY: `program` is a valid program handle, destroyed exactly once.
    unsafe { nv::nvrtcDestroyProgram(&mut program) };
    outcome
}

fn program_log(program: nv::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `program` is a valid handle; `size` is valid for a write.
    if unsafe { nv::nvrtcGetProgramLogSize(program, &mut size) } != nv::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return "(NVRTC gave no log)".to_string();
    }
    let mut log = vec![0 as c_char; size];
    // SAFETY: `log` has the `size` bytes NVRTC asked for, NUL included.
    if unsafe { nv::nvrtcGetProgramLog(program, log.as_mut_ptr()) }
        != nv::nvrtcResult::NVRTC_SUCCESS
    {
        return "(NVRTC log unreadable)".to_string();
    }
    // SAFETY: NVRTC NUL-terminates the log within `size` bytes.
    unsafe { CStr::from_ptr(log.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn write_atomically(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Text of a caught panic payload.
pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-text panic payload".to_string()
    }
}

/// 64-bit FNV-1a: a stable hash (unlike `DefaultHasher`, the same across Rust releases).
struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Fnv1a {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
        // Separate fields so that ("ab", "c") and ("a", "bc") hash differently.
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::KernelId;

    #[test]
    fn fnv1a_separates_fields_and_is_stable() {
        let hash = |parts: &[&str]| {
            let mut h = Fnv1a::new();
            for p in parts {
                h.write(p.as_bytes());
            }
            h.finish()
        };
        assert_ne!(hash(&["ab", "c"]), hash(&["a", "bc"]));
        assert_eq!(hash(&["sm_90a"]), hash(&["sm_90a"]));
        assert_ne!(hash(&["sm_90a"]), hash(&["sm_100a"]));
    }

    /// The compiler, or `None` after saying why where NVRTC or the CUDA headers are absent (the
    /// tests that need them then pass).
    fn nvrtc_compiler() -> Option<Compiler> {
        Compiler::with_cache(None)
            .inspect_err(|err| eprintln!("skipping: {err}"))
            .ok()
    }

    /// Compiles every source for every arch when NVRTC and the CUDA headers are present (the
    /// H200 machine, or a machine with the pip `nvidia-cuda-nvrtc` + `nvidia-cuda-runtime` wheels
    /// on `LD_LIBRARY_PATH`); says why and passes otherwise.
    #[test]
    fn every_source_compiles_for_every_arch_when_nvrtc_is_present() {
        let Some(compiler) = nvrtc_compiler() else {
            return;
        };
        for arch in Arch::ALL {
            for file in SourceFile::ALL {
                match compiler.compile_uncached(file, arch) {
                    Ok(cubin) => {
                        assert!(cubin.len() > 1000, "{} for {arch}: tiny CUBIN", file.path());
                        // Every kernel of the file is in it under its symbol (the CUBIN's
                        // symbol names are plain strings): a misspelt instantiation fails here,
                        // not at load time on a GPU.
                        for id in KernelId::ALL.iter().filter(|id| id.source() == file) {
                            let symbol = id.symbol().as_bytes();
                            assert!(
                                cubin.windows(symbol.len()).any(|w| w == symbol),
                                "{} for {arch}: no kernel {}",
                                file.path(),
                                id.symbol()
                            );
                        }
                    }
                    Err(err) => panic!("{err}"),
                }
            }
        }
    }

    /// No kernel's warpgroup MMAs are serialised: where ptxas cannot keep a wgmma in flight past
    /// the instructions after it (a loop it kept between a wgmma and its wait, a sum register
    /// written in between), it waits for every one at once and says so in the log (C7515,
    /// C7517). The fast GEMMs' overlap of one group's MMAs with the last group's promotion
    /// depends on it: the 8-row routed tile lost it to a 16-group loop ptxas did not unroll.
    #[test]
    fn no_kernel_has_its_warpgroup_mmas_serialised_when_nvrtc_is_present() {
        let Some(compiler) = nvrtc_compiler() else {
            return;
        };
        let arch = Arch::Sm90a;
        for file in SourceFile::ALL {
            let compiled = nvrtc_compile(
                file.path(),
                source::text(file),
                arch,
                &compiler.options(arch),
            )
            .unwrap_or_else(|err| panic!("{err}"));
            for note in ["C7515", "C7517"] {
                assert!(
                    !compiled.log.contains(note),
                    "{} for {arch}: ptxas serialised warpgroup MMAs:\n{}",
                    file.path(),
                    compiled.log
                );
            }
        }
    }

    /// A generated source (the benchmark's tile builds) sees the project headers; a broken one
    /// is a compile error naming it. Skipped, as above, where NVRTC is absent.
    #[test]
    fn generated_sources_compile_with_the_project_headers() {
        let Some(compiler) = nvrtc_compiler() else {
            return;
        };
        let tile = "#include \"gemm/gemm_fast.cuh\"\n\
                    GEMM_FAST(sweep_w4_s6_k1024, fastgemm::Fp8Chunks<32>, 32, 4, 8, 6, 1024)\n\
                    GEMM_FAST_ROUTED(sweep_b16_w4_s6_k512, fastgemm::Fp4Chunks, 4, 16, 6, 512)\n";
        let cubin = compiler
            .compile_text("tile.cu", tile, Arch::Sm90a)
            .unwrap_or_else(|err| panic!("{err}"));
        assert!(cubin.len() > 1000);
        let err = compiler
            .compile_text("broken.cu", "GEMM_FAST(x)\n", Arch::Sm90a)
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::Compile { source_name, .. } if source_name == "broken.cu"),
            "{err}"
        );
    }

    #[test]
    fn cache_key_depends_on_arch_and_source() {
        let compiler = Compiler {
            include_dir: PathBuf::from("/x"),
            nvrtc_version: (13, 0),
            cache_dir: None,
        };
        let a = compiler.cache_key(SourceFile::GemmFp8, Arch::Sm90a);
        assert_ne!(a, compiler.cache_key(SourceFile::GemmFp8, Arch::Sm100a));
        assert_ne!(a, compiler.cache_key(SourceFile::GemmFp4, Arch::Sm90a));
        let newer = Compiler {
            nvrtc_version: (13, 1),
            ..compiler.clone()
        };
        assert_ne!(a, newer.cache_key(SourceFile::GemmFp8, Arch::Sm90a));
    }
}
