//! `--config FILE`: settings for the serving commands from a file.
//!
//! The file is an environment file — one `INFERSCALE_NAME=value` per line,
//! `#` comments, blank lines ignored — naming the same variables the flags
//! read (docs/serving.md lists them), as a Kubernetes ConfigMap or a
//! systemd `EnvironmentFile` would hold them. Precedence: flags, then the
//! process environment, then the file, then the defaults.

use std::path::Path;

use anyhow::{Context, Result, bail};

/// `(name, value)` pairs of an environment file; errors name file and line.
pub fn parse(path: &Path, text: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let Some((name, value)) = line.split_once('=') else {
            bail!("{}: expected `INFERSCALE_NAME=value`, got {line:?}", at());
        };
        let name = name.trim();
        if !name.starts_with("INFERSCALE_")
            || !name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        {
            bail!("{}: {name:?} is not an INFERSCALE_* setting", at());
        }
        let value = value.trim();
        let value = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value);
        out.push((name.to_string(), value.to_string()));
    }
    Ok(out)
}

/// The `--config` value in `args`, if any (`--config FILE` or `--config=FILE`).
pub fn find(args: &[String]) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--config") {
        Some("") => args.get(i + 1).cloned(),
        Some(rest) => rest.strip_prefix('=').map(str::to_string),
        None => None,
    })
}

/// Variables this binary once read and reads no more, with what replaced
/// each: a deployment that still sets one would otherwise start on the
/// default address without a word.
const RETIRED: &[(&str, &str)] = &[
    ("INFERSCALE_LISTEN", "INFERSCALE_API_LISTEN (serve, router) or INFERSCALE_GRPC_LISTEN (worker)"),
    ("INFERSCALE_HTTP_LISTEN", "INFERSCALE_WORKER_HTTP_LISTEN"),
];

/// Fails when a retired variable is set (in the environment or the
/// `--config` file), naming its replacement.
pub fn refuse_retired_env() -> Result<()> {
    for (name, instead) in RETIRED {
        if std::env::var_os(name).is_some() {
            bail!("{name} is no longer read: the addresses have separate settings; set {instead}");
        }
    }
    Ok(())
}

/// Loads `path` into the environment, leaving variables that are already set.
///
/// Runs first thing in `main`, before any thread exists: setting the
/// environment is only sound while nothing else can read it.
pub fn apply(path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
    for (name, value) in parse(path, &text)? {
        if std::env::var_os(&name).is_none() {
            // SAFETY: called from `main` before any other thread is started.
            unsafe { std::env::set_var(&name, value) };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_files_parse_and_errors_name_the_line() {
        let p = Path::new("w.env");
        let got = parse(p, "# worker\nINFERSCALE_WINDOW=7\n\nINFERSCALE_GRPC_LISTEN = \"0.0.0.0:50051\"\n")
            .unwrap_or_default();
        assert_eq!(
            got,
            [
                ("INFERSCALE_WINDOW".to_string(), "7".to_string()),
                ("INFERSCALE_GRPC_LISTEN".into(), "0.0.0.0:50051".into())
            ]
        );
        let e = parse(p, "INFERSCALE_WINDOW=7\nwindow 7\n").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("w.env:2"), "{e}");
        let e = parse(p, "PATH=/bin\n").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("w.env:1") && e.contains("PATH"), "{e}");
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(find(&args(&["inferscale", "worker", "--config", "a.env"])).as_deref(), Some("a.env"));
        assert_eq!(find(&args(&["inferscale", "worker", "--config=b.env"])).as_deref(), Some("b.env"));
        assert_eq!(find(&args(&["inferscale", "worker"])), None);
    }
}
