//! `inferscale eval kv-error`: per layer, how far each stored KV format
//! rounds a memory's KV from its unquantized values, and which channels
//! carry the error — the table that shows what a format loses and where
//! (docs/design.md, "KV formats"). The memory must hold f32 KV (made on the
//! CPU with `--kv-format f32`): every format is measured against it,
//! through the segment codec itself, beside the first fp8 layout (one
//! scale per KV head, no key offsets) as the control.
//!
//! The key error that matters is relative to a channel's variation around
//! its mean, not to its magnitude: attention compares one token's key with
//! another's, and a channel that sits near −355 in every token adds the
//! same to every score — what its rounding does to the ±1 it varies by is
//! what changes the scores.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use inferscale_engine::fp8::first_layout_round_trip;
use inferscale_memory::{KvFormat, KvHeader, StoredKv, read_segment};
use inferscale_model::HostTensor;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A memory directory whose segments hold f32 KV (`eval locomo
    /// --kv-format f32` on the CPU makes one): the reference.
    #[arg(long)]
    memory: PathBuf,
    /// Write every layer's numbers as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// What is compared with the f32 reference.
const STORES: [&str; 3] = ["fp8 first layout", "fp8-e4m3", "bf16"];

/// Sums over every token of one tensor kind (a layer's K or V).
#[derive(Default, Clone)]
struct Acc {
    /// Σx², Σ(x − its channel's mean)².
    norm2: f64,
    dev2: f64,
    /// Per store: Σ error², largest |error|, Σ error² per channel.
    err2: [f64; 3],
    max: [f64; 3],
    chan_err2: [Vec<f64>; 3],
}

pub fn run(a: Args) -> Result<()> {
    let users = a.memory.join("users");
    let mut segments = Vec::new();
    for entry in std::fs::read_dir(&users).with_context(|| format!("reading {}", users.display()))? {
        let path = entry?.path().join("kv.log");
        if !path.exists() {
            continue;
        }
        let (header, records) = read_segment(&path).with_context(|| format!("reading {}", path.display()))?;
        if header.dtype != KvFormat::F32 {
            bail!(
                "{}: its KV is {}, and the reference must be f32 (make the memory with --kv-format f32)",
                path.display(),
                header.dtype
            );
        }
        segments.push((header, records));
    }
    let Some(header) = segments.first().map(|s| s.0.clone()) else {
        bail!("{}: no KV segment under users/", a.memory.display());
    };
    let (layers, cols, hd) = (header.layers, header.kv_dim, header.head_dim.max(1));
    let tensors = |s: &StoredKv| s.k.iter().chain(&s.v).cloned().collect::<Vec<HostTensor>>();

    // Each channel's mean over every token, per layer and K/V.
    let mut sum = vec![vec![0f64; cols]; 2 * layers];
    let mut rows = 0usize;
    for s in segments.iter().flat_map(|s| &s.1) {
        rows += s.tokens.len();
        for (t, x) in tensors(s).iter().enumerate() {
            for row in x.data.chunks_exact(cols) {
                sum[t].iter_mut().zip(row).for_each(|(a, &b)| *a += b as f64);
            }
        }
    }
    let mean: Vec<Vec<f64>> = sum.iter().map(|c| c.iter().map(|x| x / rows.max(1) as f64).collect()).collect();
    let mut var = vec![vec![0f64; cols]; 2 * layers];

    let empty = Acc { chan_err2: std::array::from_fn(|_| vec![0.0; cols]), ..Acc::default() };
    let mut acc = vec![empty; 2 * layers];
    for (seg, records) in &segments {
        for s in records {
            let original = tensors(s);
            let first = original.iter().map(|t| first_layout_round_trip(t, hd)).collect::<Result<Vec<_>, _>>()?;
            let through = |f: KvFormat| -> Result<Vec<HostTensor>> {
                let h: KvHeader = seg.with_format(f);
                let back = StoredKv::decode(&s.encode(&h)?, &h, std::path::Path::new("kv-error"))?;
                Ok(back.k.into_iter().chain(back.v).collect())
            };
            let stored = [first, through(KvFormat::Fp8)?, through(KvFormat::Bf16)?];
            for (t, x) in original.iter().enumerate() {
                let a = &mut acc[t];
                for (i, &v) in x.data.iter().enumerate() {
                    let c = i % cols;
                    let d = v as f64 - mean[t][c];
                    (a.norm2, a.dev2) = (a.norm2 + (v as f64).powi(2), a.dev2 + d * d);
                    var[t][c] += d * d;
                    for (k, st) in stored.iter().enumerate() {
                        let e = (st[t].data[i] - v) as f64;
                        a.err2[k] += e * e;
                        a.max[k] = a.max[k].max(e.abs());
                        a.chan_err2[k][c] += e * e;
                    }
                }
            }
        }
    }

    println!(
        "KV rounding by format, {} ({} tokens of {} facts); error relative to each channel's variation around \
         its mean (keys) or to the values' magnitude (values)\n",
        header.describe(),
        rows,
        segments.iter().map(|s| s.1.len()).sum::<usize>()
    );
    println!(
        "| layer | K error: {} / {} / {} | K max abs error: first / fp8 | channels of the first layout's K error (mean ± sd, share) | V error: first / fp8 / bf16 |",
        STORES[0], STORES[1], STORES[2]
    );
    println!("|---:|---|---|---|---|");
    let mut json = Vec::new();
    for l in 0..layers {
        let (k, v) = (&acc[l], &acc[layers + l]);
        let kdev: Vec<f64> = k.err2.iter().map(|e| (e / k.dev2.max(f64::MIN_POSITIVE)).sqrt()).collect();
        let vrel: Vec<f64> = v.err2.iter().map(|e| (e / v.norm2.max(f64::MIN_POSITIVE)).sqrt()).collect();
        let mut chans: Vec<usize> = (0..cols).collect();
        chans.sort_by(|&x, &y| k.chan_err2[0][y].total_cmp(&k.chan_err2[0][x]));
        let sd = |c: usize| (var[l][c] / rows.max(1) as f64).sqrt();
        let top: Vec<String> = chans
            .iter()
            .take(3)
            .map(|&c| {
                let share = k.chan_err2[0][c] / k.err2[0].max(f64::MIN_POSITIVE);
                format!("{c}: {:.1} ± {:.2}, {:.0}%", mean[l][c], sd(c), 100.0 * share)
            })
            .collect();
        println!(
            "| {l} | {:.3} / {:.4} / {:.4} | {:.2} / {:.3} | {} | {:.4} / {:.4} / {:.4} |",
            kdev[0],
            kdev[1],
            kdev[2],
            k.max[0],
            k.max[1],
            top.join("; "),
            vrel[0],
            vrel[1],
            vrel[2]
        );
        let by_store = |xs: &[f64]| -> serde_json::Value {
            STORES.iter().zip(xs).map(|(s, x)| (s.to_string(), serde_json::json!(x))).collect()
        };
        json.push(serde_json::json!({
            "layer": l,
            "k_error_vs_deviation": by_store(&kdev),
            "k_max_abs_error": by_store(&k.max),
            "v_relative_error": by_store(&vrel),
            "k_channels_of_first_layout_error": chans.iter().take(8).map(|&c| serde_json::json!({
                "channel": c, "mean": mean[l][c], "sd": sd(c),
                "share": k.chan_err2[0][c] / k.err2[0].max(f64::MIN_POSITIVE)})).collect::<Vec<_>>(),
        }));
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({"segment": header.describe(), "tokens": rows, "layers": json});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
