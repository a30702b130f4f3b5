//! The kernels compile under NVRTC for every architecture we support. Needs
//! NVRTC and the CUDA headers but no GPU: CI installs both from PyPI
//! (scripts/test.sh) and sets `INFERSCALE_REQUIRE_NVRTC=1`, so there a
//! missing library fails the test instead of skipping it.

use inferscale_cuda::kernels::{compile, find_include_dir, library_present};

#[test]
fn kernels_compile_for_ampere_and_hopper() {
    let required = std::env::var("INFERSCALE_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if !library_present("nvrtc") {
        assert!(!required, "INFERSCALE_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded");
        eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH)");
        return;
    }
    let include = match find_include_dir() {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    for arch in ["sm_80", "sm_90"] {
        if let Err(e) = compile(arch, &include) {
            panic!("{arch}: {e}");
        }
    }
}
