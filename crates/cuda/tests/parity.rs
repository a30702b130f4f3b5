//! The CUDA backend against the CPU reference (see `parity.rs`): every op,
//! then small models of each supported shape with E1–E4 on the device.
//!
//! Runs where a GPU and its driver are present; elsewhere (CI has no GPU) it
//! says so and passes, unless `INFERSCALE_REQUIRE_CUDA=1` demands a device.
//! On GPU nodes `inferscale check` runs the same comparisons.

use inferscale_cuda::{CudaBackend, kernels::library_present, parity};

#[test]
fn cuda_matches_cpu_and_keeps_e1_to_e4() {
    let required = std::env::var("INFERSCALE_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    if !library_present("cuda") {
        assert!(!required, "INFERSCALE_REQUIRE_CUDA=1 but libcuda cannot be loaded");
        eprintln!("skipped: no CUDA driver on this machine");
        return;
    }
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => panic!("opening device 0: {e}"),
    };
    let report = match parity::run(&be).and_then(|mut r| {
        r.extend(parity::gemv(&be)?);
        r.extend(parity::fp8_encode(&be)?);
        Ok(r)
    }) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    let failed: Vec<_> = report.iter().filter(|c| !c.passed()).collect();
    assert!(failed.is_empty(), "{failed:#?}");
}
