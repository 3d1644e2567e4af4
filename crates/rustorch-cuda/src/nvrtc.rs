//! Run-time compilation of the kernels with NVRTC, called through our own `dlopen` handle
//! (see [`crate::probe`]), and the on-disk cache of compiled modules.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

use crate::error::CudaError;

type Prog = *mut c_void;
type Res = c_int;

/// The NVRTC entry points we use, resolved once.
pub struct Nvrtc {
    _lib: libloading::Library,
    /// Where the library was found.
    pub origin: String,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Res,
    destroy: unsafe extern "C" fn(*mut Prog) -> Res,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Res,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    num_archs: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
    archs: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
}

// SAFETY: the function pointers are plain C entry points; NVRTC is thread-safe for
// distinct programs.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

/// A compiled module: a cubin for the device's architecture, or PTX for the driver to
/// finish when NVRTC does not know the architecture.
#[derive(Debug, Clone)]
pub enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

impl Nvrtc {
    /// Loads libnvrtc (see [`crate::probe::load_nvrtc`]) and resolves its functions.
    pub fn load() -> Result<Self, CudaError> {
        let (lib, origin) = crate::probe::load_nvrtc()?;
        let missing = |name: &str| CudaError::NvrtcMissing {
            tried: format!("{origin} (found, but it has no symbol {name})"),
        };
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's C signature is NVRTC's documented one, matched by the
                // field's type.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| missing($name))?
            };
        }
        macro_rules! opt_sym {
            ($name:literal) => {
                // SAFETY: as above.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            };
        }
        Ok(Nvrtc {
            version: sym!("nvrtcVersion"),
            error_string: sym!("nvrtcGetErrorString"),
            create: sym!("nvrtcCreateProgram"),
            destroy: sym!("nvrtcDestroyProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            num_archs: opt_sym!("nvrtcGetNumSupportedArchs"),
            archs: opt_sym!("nvrtcGetSupportedArchs"),
            _lib: lib,
            origin,
        })
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { (self.version)(&mut a, &mut b) };
        (a, b)
    }

    /// The SM architectures NVRTC can build machine code for (e.g. 90 for sm_90).
    pub fn supported_archs(&self) -> Vec<i32> {
        let (Some(n_f), Some(a_f)) = (self.num_archs, self.archs) else {
            return Vec::new();
        };
        let mut n = 0;
        // SAFETY: valid out-pointer, then a buffer of the size NVRTC reported.
        unsafe {
            if n_f(&mut n) != 0 || n <= 0 {
                return Vec::new();
            }
            let mut v = vec![0; n as usize];
            if a_f(v.as_mut_ptr()) != 0 {
                return Vec::new();
            }
            v
        }
    }

    fn err(&self, r: Res) -> String {
        // SAFETY: NVRTC returns a static string for any result code.
        let p = unsafe { (self.error_string)(r) };
        if p.is_null() {
            return format!("NVRTC error {r}");
        }
        // SAFETY: non-null static C string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Compiles `src` for `arch` ("sm_90" gives a cubin, "compute_90" PTX).
    pub fn compile(&self, src: &str, arch: &str, opts: &[&str]) -> Result<Image, CudaError> {
        let fail = |log: String| CudaError::Compile {
            arch: arch.to_string(),
            log,
        };
        let csrc = CString::new(src).map_err(|_| fail("source contains a NUL byte".into()))?;
        let name = c"rustorch_kernels.cu";
        let mut all: Vec<CString> = vec![];
        for o in opts {
            all.push(CString::new(*o).map_err(|_| fail("option contains a NUL byte".into()))?);
        }
        all.push(CString::new(format!("--gpu-architecture={arch}")).unwrap_or_default());
        let ptrs: Vec<*const c_char> = all.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no headers.
        let r = unsafe {
            (self.create)(
                &mut prog,
                csrc.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(fail(self.err(r)));
        }
        struct Guard<'a>(&'a Nvrtc, Prog);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                // SAFETY: the program was created and is destroyed once.
                unsafe { (self.0.destroy)(&mut self.1) };
            }
        }
        let g = Guard(self, prog);
        // SAFETY: `ptrs` holds `ptrs.len()` valid C strings that outlive the call.
        let r = unsafe { (self.compile)(g.1, ptrs.len() as c_int, ptrs.as_ptr()) };
        if r != 0 {
            let log = self.program_log(g.1);
            return Err(fail(format!("{}\n{log}", self.err(r))));
        }
        let cubin = arch.starts_with("sm_");
        let (size_f, get_f) = if cubin {
            (self.cubin_size, self.cubin)
        } else {
            (self.ptx_size, self.ptx)
        };
        let mut n = 0usize;
        // SAFETY: valid out-pointer, then a buffer of the reported size.
        let r = unsafe { size_f(g.1, &mut n) };
        if r != 0 {
            return Err(fail(self.err(r)));
        }
        let mut buf = vec![0u8; n];
        let r = unsafe { get_f(g.1, buf.as_mut_ptr().cast()) };
        if r != 0 {
            return Err(fail(self.err(r)));
        }
        if cubin {
            Ok(Image::Cubin(buf))
        } else {
            while buf.last() == Some(&0) {
                buf.pop();
            }
            Ok(Image::Ptx(String::from_utf8_lossy(&buf).into_owned()))
        }
    }

    fn program_log(&self, prog: Prog) -> String {
        let mut n = 0usize;
        // SAFETY: as in `compile`.
        unsafe {
            if (self.log_size)(prog, &mut n) != 0 || n == 0 {
                return String::new();
            }
            let mut buf = vec![0u8; n];
            if (self.log)(prog, buf.as_mut_ptr().cast()) != 0 {
                return String::new();
            }
            while buf.last() == Some(&0) {
                buf.pop();
            }
            String::from_utf8_lossy(&buf).into_owned()
        }
    }
}

/// The folder of compiled modules: `$RUSTORCH_CACHE_DIR/cuda`, else
/// `$XDG_CACHE_HOME/rustorch/cuda`, else `~/.cache/rustorch/cuda`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("RUSTORCH_CACHE_DIR") {
        return Some(PathBuf::from(d).join("cuda"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("rustorch/cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rustorch/cuda"))
}

/// FNV-1a, 64 bits: a stable key for the cache file name (not a security boundary: a
/// corrupt or foreign file only fails to load, and is then rebuilt).
pub fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // separator so that ("ab","c") and ("a","bc") differ
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_separates_parts() {
        assert_ne!(fnv64(&[b"ab", b"c"]), fnv64(&[b"a", b"bc"]));
        assert_eq!(fnv64(&[b"x"]), fnv64(&[b"x"]));
    }
}

#[cfg(test)]
mod compile_tests {
    use super::*;

    /// Compiles the kernels for Hopper where NVRTC is installed (no GPU needed) and checks
    /// that every kernel the host looks up is in the module.
    #[test]
    fn kernels_compile() {
        let nv = match Nvrtc::load() {
            Ok(nv) => nv,
            Err(e) => {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIPPED: kernels_compile: {e}");
                return;
            }
        };
        let src = crate::device::kernel_source();
        let ptx = match nv.compile(&src, "compute_90", &crate::device::NVRTC_OPTS) {
            Ok(Image::Ptx(p)) => p,
            Ok(Image::Cubin(_)) => panic!("asked for PTX"),
            Err(e) => panic!("{e}"),
        };
        for name in crate::kernels::kernel_names() {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing"
            );
        }
        match nv.compile(&src, "sm_90", &crate::device::NVRTC_OPTS) {
            Ok(Image::Cubin(c)) => assert!(c.len() > 1000),
            Ok(Image::Ptx(_)) => panic!("asked for a cubin"),
            Err(e) => panic!("{e}"),
        }
    }

    /// The persistent decode kernel's module (crate::mega) compiles, with its two entries
    /// its only kernels.
    #[test]
    fn mega_compiles() {
        let nv = match Nvrtc::load() {
            Ok(nv) => nv,
            Err(e) => {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIPPED: mega_compiles: {e}");
                return;
            }
        };
        let src = crate::mega::mega_source();
        let ptx = match nv.compile(&src, "compute_90", &crate::device::NVRTC_OPTS) {
            Ok(Image::Ptx(p)) => p,
            Ok(Image::Cubin(_)) => panic!("asked for PTX"),
            Err(e) => panic!("{e}"),
        };
        assert_eq!(ptx.matches(".entry ").count(), 2);
        assert!(ptx.contains(".entry mega_step(") && ptx.contains(".entry mega_step8("));
    }
}
