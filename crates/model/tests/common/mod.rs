//! What the model crate's golden tests share.

use std::path::PathBuf;

/// `tests/golden/NAME` of the checkout under test. The runner's
/// `CARGO_MANIFEST_DIR` comes first: a test binary reused from a shared
/// target directory may have been compiled in another checkout, whose path
/// `env!` would have baked in.
pub fn golden_path(name: &str) -> PathBuf {
    let manifest =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest.join("../../tests/golden").join(name)
}
