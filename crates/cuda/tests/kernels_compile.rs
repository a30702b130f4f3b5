//! The kernels compile under NVRTC for every architecture we support, and
//! where `INFERSCALE_PTXAS` names a ptxas, its PTX assembles for each — what
//! the driver does when it loads the module on a GPU, so inline assembly
//! the compiler passes through unchecked is checked here. Needs NVRTC, the
//! CUDA headers (and ptxas) but no GPU: CI installs them from PyPI
//! (scripts/test.sh) and sets `INFERSCALE_REQUIRE_NVRTC=1`, so there a
//! missing library fails the test instead of skipping it.

use std::process::Command;

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
    let ptxas = std::env::var_os("INFERSCALE_PTXAS");
    if ptxas.is_none() {
        eprintln!("ptxas not run: INFERSCALE_PTXAS is not set");
    }
    for arch in ["sm_80", "sm_90"] {
        let ptx = match compile(arch, &include) {
            Ok(p) => p,
            Err(e) => panic!("{arch}: {e}"),
        };
        let Some(ptxas) = &ptxas else { continue };
        let dir = std::env::temp_dir().join(format!("inferscale-ptx-{}-{arch}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let (src, out) = (dir.join("kernels.ptx"), dir.join("kernels.cubin"));
        std::fs::write(&src, ptx.to_src()).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
        let run = Command::new(ptxas)
            .arg(format!("-arch={arch}"))
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap_or_else(|e| panic!("running ptxas ({}): {e}", ptxas.to_string_lossy()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(run.status.success(), "ptxas -arch={arch}: {}", String::from_utf8_lossy(&run.stderr));
    }
}
