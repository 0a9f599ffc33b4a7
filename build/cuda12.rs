//! The CUDA 12 compiler libraries the build script drives: NVRTC (`libnvrtc.so.12`), which
//! compiles a kernel source to SASS for one GPU architecture or to PTX, and nvFatbin
//! (`libnvfatbin.so.12`), which packs those images into one fatbin. Both are loaded from
//! the paths the caller found, with libloading; nothing else of CUDA is needed to build.

use libloading::Library;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;

type NvrtcProgram = *mut c_void;
type NvFatbinHandle = *mut c_void;

/// The NVRTC and nvFatbin entry points the build uses, looked up once.
pub struct Cuda12 {
    version: (i32, i32),
    create_program: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile_program: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int,
    program_log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    program_log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    destroy_program: unsafe extern "C" fn(*mut NvrtcProgram) -> c_int,
    nvrtc_error: unsafe extern "C" fn(c_int) -> *const c_char,
    fatbin_create: unsafe extern "C" fn(*mut NvFatbinHandle, *const *const c_char, usize) -> c_int,
    fatbin_add_cubin: unsafe extern "C" fn(
        NvFatbinHandle,
        *const c_void,
        usize,
        *const c_char,
        *const c_char,
    ) -> c_int,
    fatbin_add_ptx: unsafe extern "C" fn(
        NvFatbinHandle,
        *const c_char,
        usize,
        *const c_char,
        *const c_char,
        *const c_char,
    ) -> c_int,
    fatbin_size: unsafe extern "C" fn(NvFatbinHandle, *mut usize) -> c_int,
    fatbin_get: unsafe extern "C" fn(NvFatbinHandle, *mut c_void) -> c_int,
    fatbin_destroy: unsafe extern "C" fn(*mut NvFatbinHandle) -> c_int,
    fatbin_error: unsafe extern "C" fn(c_int) -> *const c_char,
    // The libraries stay loaded as long as the function pointers above are used.
    _nvrtc: Library,
    _fatbin: Library,
}

/// One image of a kernel source: SASS for a real architecture, or PTX for a virtual one.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// `sm_<n>` SASS, e.g. `Sass(90)`.
    Sass(u32),
    /// `compute_<n>` PTX, JIT-compiled by the driver on GPUs without matching SASS.
    Ptx(u32),
}

impl Target {
    fn nvrtc_arch(self) -> String {
        match self {
            Target::Sass(n) => format!("--gpu-architecture=sm_{n}"),
            Target::Ptx(n) => format!("--gpu-architecture=compute_{n}"),
        }
    }
}

/// A compiled image, ready for [`Cuda12::fatbin`].
pub struct Image {
    target: Target,
    bytes: Vec<u8>,
}

/// Looks `name` up in `lib` as a `T`.
///
/// # Safety
/// `T` must be the function pointer type of the C declaration of `name`.
unsafe fn symbol<T: Copy>(lib: &Library, path: &Path, name: &str) -> Result<T, String> {
    // SAFETY: the caller gives the symbol's C type.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{} has no {name}: {e}", path.display()))
}

/// `Ok` for a result of 0, else the library's text for it (`nvrtcGetErrorString` or
/// `nvFatbinGetErrorString`: both take any value and return a static NUL-terminated string).
fn checked(
    what: &str,
    result: c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
) -> Result<(), String> {
    if result == 0 {
        return Ok(());
    }
    // SAFETY: takes any value.
    let text = unsafe { error_string(result) };
    // SAFETY: a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    Err(format!("{what} failed: {}", text.to_string_lossy()))
}

/// `symbol` for a field of [`Cuda12`], whose type is the symbol's C type.
macro_rules! field {
    ($lib:expr, $path:expr, $name:literal) => {
        // SAFETY: each field of `Cuda12` has the type of its symbol's declaration in nvrtc.h or
        // nvFatbin.h of CUDA 12 (`nvrtcResult` and `nvFatbinResult` are `int`-sized enums).
        unsafe { symbol(&$lib, $path, $name) }?
    };
}

impl Cuda12 {
    /// Loads `libnvrtc.so.12` and `libnvfatbin.so.12` from these paths.
    pub fn load(nvrtc: &Path, fatbin: &Path) -> Result<Cuda12, String> {
        let open = |p: &Path| {
            // SAFETY: loading NVIDIA's libraries runs only their initialisers, which have no
            // preconditions.
            unsafe { Library::new(p) }.map_err(|e| format!("cannot load {}: {e}", p.display()))
        };
        let (nv, fb) = (open(nvrtc)?, open(fatbin)?);
        let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
            field!(nv, nvrtc, "nvrtcVersion");
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { version_fn(&mut major, &mut minor) };
        Ok(Cuda12 {
            version: (major, minor),
            create_program: field!(nv, nvrtc, "nvrtcCreateProgram"),
            compile_program: field!(nv, nvrtc, "nvrtcCompileProgram"),
            program_log_size: field!(nv, nvrtc, "nvrtcGetProgramLogSize"),
            program_log: field!(nv, nvrtc, "nvrtcGetProgramLog"),
            cubin_size: field!(nv, nvrtc, "nvrtcGetCUBINSize"),
            cubin: field!(nv, nvrtc, "nvrtcGetCUBIN"),
            ptx_size: field!(nv, nvrtc, "nvrtcGetPTXSize"),
            ptx: field!(nv, nvrtc, "nvrtcGetPTX"),
            destroy_program: field!(nv, nvrtc, "nvrtcDestroyProgram"),
            nvrtc_error: field!(nv, nvrtc, "nvrtcGetErrorString"),
            fatbin_create: field!(fb, fatbin, "nvFatbinCreate"),
            fatbin_add_cubin: field!(fb, fatbin, "nvFatbinAddCubin"),
            fatbin_add_ptx: field!(fb, fatbin, "nvFatbinAddPTX"),
            fatbin_size: field!(fb, fatbin, "nvFatbinSize"),
            fatbin_get: field!(fb, fatbin, "nvFatbinGet"),
            fatbin_destroy: field!(fb, fatbin, "nvFatbinDestroy"),
            fatbin_error: field!(fb, fatbin, "nvFatbinGetErrorString"),
            _nvrtc: nv,
            _fatbin: fb,
        })
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    fn nvrtc_check(&self, what: &str, result: c_int) -> Result<(), String> {
        checked(what, result, self.nvrtc_error)
    }

    fn fatbin_check(&self, what: &str, result: c_int) -> Result<(), String> {
        checked(what, result, self.fatbin_error)
    }

    /// Compiles `source` (named `name` in diagnostics) for `target` with `options`; on
    /// failure the error holds NVRTC's log.
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        target: Target,
        options: &[String],
    ) -> Result<Image, String> {
        let c = |s: &str| CString::new(s).map_err(|_| format!("{name}: a NUL byte in {s:?}"));
        let (src, cname) = (c(source)?, c(name)?);
        let mut opts = vec![c(&target.nvrtc_arch())?];
        for o in options {
            opts.push(c(o)?);
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no in-memory headers (count 0, NULL lists).
        let created = unsafe {
            (self.create_program)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.nvrtc_check("nvrtcCreateProgram", created)?;
        let result = self.compile_created(prog, name, target, &opt_ptrs);
        // SAFETY: `prog` was created above and is destroyed once.
        unsafe { (self.destroy_program)(&mut prog) };
        result
    }

    fn compile_created(
        &self,
        prog: NvrtcProgram,
        name: &str,
        target: Target,
        opts: &[*const c_char],
    ) -> Result<Image, String> {
        let count = c_int::try_from(opts.len()).map_err(|_| "too many options".to_owned())?;
        // SAFETY: `prog` is live; `opts` holds `count` valid strings.
        let compiled = unsafe { (self.compile_program)(prog, count, opts.as_ptr()) };
        if compiled != 0 {
            let log = self.read(prog, self.program_log_size, self.program_log)?;
            return Err(format!(
                "NVRTC failed on {name} for {target:?}:\n{}",
                String::from_utf8_lossy(&log).trim_end_matches('\0')
            ));
        }
        let bytes = match target {
            Target::Sass(_) => self.read(prog, self.cubin_size, self.cubin)?,
            Target::Ptx(_) => self.read(prog, self.ptx_size, self.ptx)?,
        };
        Ok(Image { target, bytes })
    }

    /// One of NVRTC's size-then-copy outputs.
    fn read(
        &self,
        prog: NvrtcProgram,
        size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
        get: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    ) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: `prog` is live; one out-pointer.
        self.nvrtc_check("reading NVRTC's output size", unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it writes.
        self.nvrtc_check("reading NVRTC's output", unsafe {
            get(prog, buf.as_mut_ptr().cast())
        })?;
        Ok(buf)
    }

    /// Packs `images` (named `name` inside) into one fatbin.
    pub fn fatbin(&self, name: &str, images: &[Image]) -> Result<Vec<u8>, String> {
        let mut handle: NvFatbinHandle = std::ptr::null_mut();
        // SAFETY: one out-pointer, no options.
        self.fatbin_check("nvFatbinCreate", unsafe {
            (self.fatbin_create)(&mut handle, std::ptr::null(), 0)
        })?;
        let result = self.fill_fatbin(handle, name, images);
        // SAFETY: `handle` was created above and is destroyed once.
        unsafe { (self.fatbin_destroy)(&mut handle) };
        result
    }

    fn fill_fatbin(
        &self,
        handle: NvFatbinHandle,
        name: &str,
        images: &[Image],
    ) -> Result<Vec<u8>, String> {
        let ident = CString::new(name).map_err(|_| format!("{name:?} has a NUL byte"))?;
        for image in images {
            let (arch, len) = match image.target {
                Target::Sass(n) | Target::Ptx(n) => (n.to_string(), image.bytes.len()),
            };
            let arch = CString::new(arch).map_err(|_| "arch".to_owned())?;
            let added = match image.target {
                // SAFETY: `len` bytes of a cubin; NUL-terminated arch and identifier.
                Target::Sass(_) => unsafe {
                    (self.fatbin_add_cubin)(
                        handle,
                        image.bytes.as_ptr().cast(),
                        len,
                        arch.as_ptr(),
                        ident.as_ptr(),
                    )
                },
                // SAFETY: NVRTC's PTX, NUL-terminated within `len`; no JIT options.
                Target::Ptx(_) => unsafe {
                    (self.fatbin_add_ptx)(
                        handle,
                        image.bytes.as_ptr().cast(),
                        len,
                        arch.as_ptr(),
                        ident.as_ptr(),
                        std::ptr::null(),
                    )
                },
            };
            self.fatbin_check(&format!("adding {:?} of {name}", image.target), added)?;
        }
        let mut n = 0usize;
        // SAFETY: live handle, one out-pointer.
        self.fatbin_check("nvFatbinSize", unsafe {
            (self.fatbin_size)(handle, &mut n)
        })?;
        let mut out = vec![0u8; n];
        // SAFETY: `out` holds the `n` bytes nvFatbin said it writes.
        self.fatbin_check("nvFatbinGet", unsafe {
            (self.fatbin_get)(handle, out.as_mut_ptr().cast())
        })?;
        Ok(out)
    }
}
