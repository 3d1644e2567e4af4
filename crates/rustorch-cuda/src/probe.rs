//! Finding the CUDA libraries before anything calls into them.
//!
//! cudarc's dynamic loading panics when a library is missing, so every entry point of this
//! crate first checks here, with its own `dlopen`, that the library is present, and returns
//! a [`CudaError`] naming what is missing instead.

use std::path::{Path, PathBuf};

use crate::error::CudaError;

/// The names the driver library goes by (the first is what the driver package installs).
const DRIVER_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Whether the NVIDIA driver library can be loaded; `Err` names what was tried.
pub fn driver_library() -> Result<(), CudaError> {
    for name in DRIVER_NAMES {
        // SAFETY: loading the driver library runs its initializers, which have no
        // preconditions; the handle is dropped again (cudarc keeps its own).
        if unsafe { libloading::Library::new(name) }.is_ok() {
            return Ok(());
        }
    }
    Err(CudaError::DriverMissing {
        tried: DRIVER_NAMES.join(", "),
    })
}

/// NVRTC sonames, newest first (the major versions whose NVRTC can target Hopper).
const NVRTC_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Folders where CUDA toolkits and the `nvidia-cuda-nvrtc` Python wheels put libnvrtc.
fn nvrtc_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(v) = std::env::var_os(var) {
            let p = PathBuf::from(v);
            dirs.push(p.join("lib64"));
            dirs.push(p.join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.push(PathBuf::from("/usr/local/cuda/targets/x86_64-linux/lib"));
    dirs.push(PathBuf::from("/usr/lib/x86_64-linux-gnu"));
    // pip wheels: site-packages/nvidia/cuda_nvrtc/lib (CUDA 12) and nvidia/cu13/lib (CUDA 13)
    let mut roots = vec![
        PathBuf::from("/usr/local/lib"),
        PathBuf::from("/usr/lib"),
        PathBuf::from("/opt"),
    ];
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    for root in roots {
        for site in site_packages(&root) {
            dirs.push(site.join("nvidia/cu13/lib"));
            dirs.push(site.join("nvidia/cuda_nvrtc/lib"));
        }
    }
    dirs
}

/// `root/python3.*/{site,dist}-packages` and `root/*/.venv/lib/python3.*/...` (one level).
fn site_packages(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut scan = |dir: &Path| {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with("python3") {
                    out.push(e.path().join("site-packages"));
                    out.push(e.path().join("dist-packages"));
                }
            }
        }
    };
    scan(root);
    if let Ok(rd) = std::fs::read_dir(root) {
        for e in rd.flatten() {
            scan(&e.path().join(".venv/lib"));
        }
    }
    out
}

/// The newest `libnvrtc.so.N[.M...]` file in `dir` (not the builtins library).
fn nvrtc_in(dir: &Path) -> Option<PathBuf> {
    let rd = std::fs::read_dir(dir).ok()?;
    let mut best: Option<(Vec<u32>, PathBuf)> = None;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(ver) = name.strip_prefix("libnvrtc.so") else {
            continue;
        };
        let ver: Vec<u32> = ver
            .split('.')
            .filter(|s| !s.is_empty())
            .filter_map(|s| s.parse().ok())
            .collect();
        if best.as_ref().is_none_or(|(b, _)| ver > *b) {
            best = Some((ver, e.path()));
        }
    }
    best.map(|(_, p)| p)
}

/// Loads libnvrtc: `RUSTORCH_NVRTC` if set, else the library search path, else the usual
/// toolkit and wheel folders. The builtins library next to a file found in a folder is
/// loaded first, so NVRTC finds it without `LD_LIBRARY_PATH`.
pub fn load_nvrtc() -> Result<(libloading::Library, String), CudaError> {
    let mut tried: Vec<String> = Vec::new();
    if let Some(p) = std::env::var_os("RUSTORCH_NVRTC") {
        let p = PathBuf::from(p);
        if let Some(lib) = open_in_folder(&p) {
            return Ok((lib, p.display().to_string()));
        }
        tried.push(format!("RUSTORCH_NVRTC={}", p.display()));
    }
    for name in NVRTC_NAMES {
        // SAFETY: NVRTC's initializers have no preconditions.
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            return Ok((lib, name.to_string()));
        }
        tried.push(name.to_string());
    }
    for dir in nvrtc_dirs() {
        if let Some(p) = nvrtc_in(&dir) {
            if let Some(lib) = open_in_folder(&p) {
                return Ok((lib, p.display().to_string()));
            }
        }
        if dir.is_dir() {
            tried.push(dir.display().to_string());
        }
    }
    Err(CudaError::NvrtcMissing {
        tried: tried.join(", "),
    })
}

/// Opens the NVRTC file `p` after the `libnvrtc-builtins` beside it (globally, so NVRTC's
/// own lookup of it by soname succeeds).
fn open_in_folder(p: &Path) -> Option<libloading::Library> {
    if let Some(dir) = p.parent() {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with("libnvrtc-builtins.so")
                {
                    // SAFETY: as above; the handle is leaked on purpose so the library stays
                    // loaded for NVRTC.
                    if let Ok(lib) = unsafe {
                        libloading::os::unix::Library::open(
                            Some(e.path()),
                            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                        )
                    } {
                        std::mem::forget(lib);
                        break;
                    }
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe { libloading::Library::new(p) }.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_file_pick_prefers_newest() {
        let dir = std::env::temp_dir().join(format!("rustorch-nvrtc-pick-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "libnvrtc.so.12",
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.0",
            "other.so",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let got = nvrtc_in(&dir).unwrap();
        assert_eq!(got.file_name().unwrap(), "libnvrtc.so.13");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
