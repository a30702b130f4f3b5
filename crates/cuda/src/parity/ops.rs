//! Every backend op on random data, the device against the CPU: each
//! op's cases (attention, paged writes, injection from every tier and
//! format, retrieval, sampling reductions) with their controls.

use super::*;
use crate::gemm::GemvOut;

/// Runs `f` on both backends and compares the host results.
fn both<G: Backend, F>(cpu: &CpuBackend, gpu: &G, name: &str, f: F, out: &mut Report) -> R<()>
where
    F: Fn(&dyn Ops) -> R<Vec<f32>>,
{
    let (a, b) = (f(&Dyn(cpu))?, f(&Dyn(gpu))?);
    out.push(Check { name: name.into(), error: rel(&b, &a), tolerance: OP_TOL, control: false });
    Ok(())
}

/// A check that ids chosen on the device equal the host reference's:
/// error = positions that differ (and any difference in count).
pub(super) fn same_ids(name: String, got: &[u32], want: &[u32]) -> Check {
    let wrong = got.iter().zip(want).filter(|(a, b)| a != b).count() + want.len().abs_diff(got.len());
    Check { name, error: wrong as f64, tolerance: 0.0, control: false }
}

/// A fused op against the ops it replaces, on one backend: the same bits.
fn exact<G: Backend, F>(gpu: &G, name: &str, f: F, out: &mut Report) -> R<()>
where
    F: Fn(&dyn Ops, bool) -> R<Vec<f32>>,
{
    let (fused, plain) = (f(&Dyn(gpu), true)?, f(&Dyn(gpu), false)?);
    let error = bit_error(&fused, &plain);
    out.push(Check { name: format!("{name}: fused = unfused, bit for bit"), error, tolerance: 0.0, control: false });
    Ok(())
}

/// Object-safe view of the ops we compare, over either backend.
trait Ops {
    fn linear(&self, x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>) -> R<Vec<f32>>;
    fn norms(&self, x: &HostTensor, w: &HostTensor, b: &HostTensor) -> R<Vec<f32>>;
    fn acts(&self, x: &HostTensor, y: &HostTensor) -> R<Vec<f32>>;
    fn rope(&self, x: &HostTensor, head_dim: usize, pos: &[u32], rope: &Rope) -> R<Vec<f32>>;
    fn bidir(
        &self,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        s: AttentionShape,
        spans: &[(usize, usize)],
    ) -> R<Vec<f32>>;
    fn paged(&self, case: &PagedCase) -> R<Vec<f32>>;
    /// `x += y` then RMSNorm: x and the norm, through `add_rms_norm` when
    /// `fused`, else `add_assign` and `rms_norm`.
    fn add_norm(&self, x: &HostTensor, y: &HostTensor, w: &HostTensor, fused: bool) -> R<Vec<f32>>;
    /// Q, then the K and V written to the cache, through `qkv_rope_write`
    /// when `fused`, else `split_cols`, `rope`, `rope` and `write_kv`.
    fn qkv(&self, c: &QkvCase, fused: bool) -> R<Vec<f32>>;
    fn inject(&self, case: &PagedCase, rope: &Rope, src: KvSource) -> R<Vec<f32>>;
}

/// An fp8 record body of one fact's K and V (per layer), made as fp8
/// segments make it, and the tensors it decodes to on the host (K then V).
pub(super) fn fp8_record(k: &[HostTensor], v: &[HostTensor], head_dim: usize) -> R<(Vec<u8>, Vec<HostTensor>)> {
    let body = fp8::encode(k, v, head_dim)?;
    let (rows, cols) = (k[0].shape[0], k[0].shape[1]);
    let decoded = fp8::Fp8Kv::from_body(&body, k.len(), rows, cols, cols / head_dim)?.decode()?;
    Ok((body, decoded))
}

/// Keys with an offset channel in every head (a few hundred, varying by
/// ±1 as Qwen2.5's layer-0 keys do), so that fp8 checks cover the offsets.
pub(super) fn with_offset_channels(mut t: HostTensor, head_dim: usize) -> HostTensor {
    let cols = t.shape[1];
    for (i, x) in t.data.iter_mut().enumerate() {
        if (i % cols) % head_dim == 3 {
            *x -= 300.0 + 40.0 * ((i % cols) / head_dim) as f32;
        }
    }
    t
}

struct Dyn<'a, B>(&'a B);

/// Key offsets for an fp8 store of `spec` in the checks: one channel a
/// head far from zero (as Qwen2.5's keys hold), small values elsewhere.
fn fp8_offsets(spec: KvSpec) -> Vec<Vec<f32>> {
    (0..spec.num_layers)
        .map(|l| {
            let mut o = values(300 + l as u64, spec.kv_dim(), 0.05);
            for h in 0..spec.num_kv_heads {
                o[h * spec.head_dim + 3] = 150.0 + 20.0 * h as f32 - 30.0 * l as f32;
            }
            o
        })
        .collect()
}

/// A store of `spec` on `be`; an fp8 one calibrated with [`fp8_offsets`].
fn new_store<B: Backend>(be: &B, spec: KvSpec, rope: &Rope) -> R<B::KvStore> {
    let mut store = be.new_kv_store(spec)?;
    if spec.dtype == KvCacheDtype::Fp8 {
        be.calibrate_kv(&mut store, &fp8_offsets(spec), rope)?;
    }
    Ok(store)
}

/// A fused-QKV case: `rows` new tokens at `positions` into `slots` of layer 1.
struct QkvCase {
    spec: KvSpec,
    shape: AttentionShape,
    rope: Rope,
    positions: Vec<u32>,
    slots: Vec<u32>,
}

/// A paged-attention case: KV for every context token written through
/// `write_kv` into scattered blocks, then one attention call.
struct PagedCase {
    spec: KvSpec,
    shape: AttentionShape,
    /// Per sequence: (context_len, q_len, block table).
    seqs: Vec<(usize, usize, Vec<u32>)>,
    /// Per sequence, its rows' ends when they are scattered (see
    /// `SeqSpan::row_ends`); sequences past the end have none.
    row_ends: Vec<Option<Vec<u32>>>,
    /// Keys written at positions that skip three every 29 keys rather than
    /// at 0, 1, 2, …: the fp8 cache's attention turns each key's offset by
    /// its recorded position, taking the positions to run on from a tile's
    /// first key where they do, and must notice where they do not.
    position_gaps: bool,
    /// Dimensions of a head that RoPE turns (the rest keep their offsets
    /// unturned: an fp8 cache's attention adds q·o over them as a constant).
    rot: usize,
    seed: u64,
}

impl<B: Backend> Ops for Dyn<'_, B> {
    fn linear(&self, x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>) -> R<Vec<f32>> {
        let be = self.0;
        let b = b.map(|b| be.upload(b)).transpose()?;
        Ok(be.to_host(&be.linear(&be.upload_rows(x)?, &be.upload(w)?, b.as_ref())?)?.data)
    }

    fn norms(&self, x: &HostTensor, w: &HostTensor, b: &HostTensor) -> R<Vec<f32>> {
        let be = self.0;
        let (xd, wd, bd) = (be.upload_rows(x)?, be.upload(w)?, be.upload(b)?);
        let mut out = be.to_host(&be.rms_norm(&xd, &wd, 1e-5)?)?.data;
        out.extend(be.to_host(&be.layer_norm(&xd, &wd, &bd, 1e-12)?)?.data);
        Ok(out)
    }

    fn acts(&self, x: &HostTensor, y: &HostTensor) -> R<Vec<f32>> {
        let be = self.0;
        let (xd, yd) = (be.upload_rows(x)?, be.upload_rows(y)?);
        let mut out = be.to_host(&be.gelu(&xd)?)?.data;
        out.extend(be.to_host(&be.silu_mul(&yd)?)?.data);
        for part in be.split_cols(&xd, &[40, 8, 48])? {
            out.extend(be.to_host(&part)?.data);
        }
        let mut s = be.upload_rows(x)?;
        be.add_assign(&mut s, &yd)?;
        out.extend(be.to_host(&s)?.data);
        let picked = be.select_rows(&xd, &[3, 0, 3])?;
        out.extend(be.to_host(&be.concat_rows(&[&picked, &yd])?)?.data);
        out.extend(be.to_host(&be.embedding(&be.upload(x)?, &[2, 2, 1])?)?.data);
        Ok(out)
    }

    fn rope(&self, x: &HostTensor, head_dim: usize, pos: &[u32], rope: &Rope) -> R<Vec<f32>> {
        let mut t = self.0.upload_rows(x)?;
        self.0.rope(&mut t, head_dim, pos, rope)?;
        Ok(self.0.to_host(&t)?.data)
    }

    fn bidir(
        &self,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        s: AttentionShape,
        spans: &[(usize, usize)],
    ) -> R<Vec<f32>> {
        let be = self.0;
        let out =
            be.attention_bidirectional(&be.upload_rows(q)?, &be.upload_rows(k)?, &be.upload_rows(v)?, s, spans)?;
        Ok(be.to_host(&out)?.data)
    }

    fn paged(&self, c: &PagedCase) -> R<Vec<f32>> {
        let be = self.0;
        let kv_dim = c.spec.kv_dim();
        let bs = c.spec.block_size;
        let rope = Rope::new(&RopeConfig { theta: 10_000.0, dim: c.rot, scaling: RopeScaling::None });
        let mut store = new_store(be, c.spec, &rope)?;
        let mut spans = Vec::new();
        let mut q_rows = 0;
        for (i, (ctx, q_len, table)) in c.seqs.iter().enumerate() {
            let slots: Vec<u32> = (0..*ctx).map(|t| table[t / bs] * bs as u32 + (t % bs) as u32).collect();
            let k = be.upload_rows(&host(c.seed + 10 * i as u64, &[*ctx, kv_dim], 1.0))?;
            let v = be.upload_rows(&host(c.seed + 10 * i as u64 + 1, &[*ctx, kv_dim], 1.0))?;
            // Keys written as they are: the rotation is not what is checked.
            let gap = |t: u32| if c.position_gaps { t + 3 * (t / 29) } else { t };
            let positions: Vec<u32> = (0..*ctx as u32).map(gap).collect();
            be.write_kv(&mut store, 0, &k, &v, NewRows { positions: &positions, slots: &slots }, &rope)?;
            spans.push((q_rows, *q_len, *ctx, table.as_slice()));
            q_rows += q_len;
        }
        let q = be.upload_rows(&host(c.seed + 99, &[q_rows, c.shape.num_heads * c.spec.head_dim], 1.0))?;
        let spans: Vec<SeqSpan<'_>> = spans
            .iter()
            .enumerate()
            .map(|(i, &(q_start, q_len, context_len, block_table))| SeqSpan {
                q_start,
                q_len,
                context_len,
                block_table,
                row_ends: c.row_ends.get(i).and_then(|e| e.as_deref()),
            })
            .collect();
        Ok(be.to_host(&be.attention(&q, &store, 0, c.shape, &spans)?)?.data)
    }

    fn add_norm(&self, x: &HostTensor, y: &HostTensor, w: &HostTensor, fused: bool) -> R<Vec<f32>> {
        let be = self.0;
        let (mut xd, yd, wd) = (be.upload_rows(x)?, be.upload_rows(y)?, be.upload(w)?);
        let n = if fused {
            be.add_rms_norm(&mut xd, &yd, &wd, 1e-5)?
        } else {
            be.add_assign(&mut xd, &yd)?;
            be.rms_norm(&xd, &wd, 1e-5)?
        };
        let mut out = be.to_host(&xd)?.data;
        out.extend(be.to_host(&n)?.data);
        Ok(out)
    }

    fn qkv(&self, c: &QkvCase, fused: bool) -> R<Vec<f32>> {
        let be = self.0;
        let d = c.shape.head_dim;
        let (qc, kvc) = (c.shape.num_heads * d, c.shape.num_kv_heads * d);
        let qkv = be.upload_rows(&host(31, &[c.positions.len(), qc + 2 * kvc], 1.0))?;
        let mut store = new_store(be, c.spec, &c.rope)?;
        let rows = NewRows { positions: &c.positions, slots: &c.slots };
        let q = if fused {
            be.qkv_rope_write(&qkv, c.shape, &c.rope, rows, &mut store, 1)?
        } else {
            let mut parts = be.split_cols(&qkv, &[qc, kvc, kvc])?;
            let v = parts.pop().ok_or_else(|| inferscale_engine::EngineError::Shape("split".into()))?;
            let mut k = parts.pop().ok_or_else(|| inferscale_engine::EngineError::Shape("split".into()))?;
            let mut q = parts.pop().ok_or_else(|| inferscale_engine::EngineError::Shape("split".into()))?;
            be.rope(&mut q, d, &c.positions, &c.rope)?;
            be.rope(&mut k, d, &c.positions, &c.rope)?;
            be.write_kv(&mut store, 1, &k, &v, rows, &c.rope)?;
            q
        };
        let (k, v) = be.gather_kv(&store, 1, &c.slots)?;
        let mut out = be.to_host(&q)?.data;
        out.extend(be.to_host(&k)?.data);
        out.extend(be.to_host(&v)?.data);
        Ok(out)
    }

    fn inject(&self, c: &PagedCase, rope: &Rope, src: KvSource) -> R<Vec<f32>> {
        let be = self.0;
        let mut store = new_store(be, c.spec, rope)?;
        let kv_dim = c.spec.kv_dim();
        let bs = c.spec.block_size as u32;
        let layers = c.spec.num_layers;
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut meta = Vec::new();
        for (i, (ctx, _, table)) in c.seqs.iter().enumerate() {
            let kh: Vec<_> = (0..layers).map(|l| host(c.seed + (100 * i + l) as u64, &[*ctx, kv_dim], 1.0)).collect();
            let vh: Vec<_> =
                (0..layers).map(|l| host(c.seed + (100 * i + l) as u64 + 50, &[*ctx, kv_dim], 1.0)).collect();
            let (k, v) =
                if matches!(src, KvSource::HostTierFp8 | KvSource::HostTierFp8Decoded | KvSource::DeviceTierFp8) {
                    let hd = c.spec.head_dim;
                    let kh: Vec<_> = kh.into_iter().map(|t| with_offset_channels(t, hd)).collect();
                    let (body, decoded) = fp8_record(&kh, &vh, hd)?;
                    let mut k = if src != KvSource::HostTierFp8Decoded {
                        let kv = fp8::Fp8Kv::from_body(&body, layers, *ctx, kv_dim, kv_dim / hd)?;
                        let none = || EngineError::Shape("this backend keeps no fp8 in that tier".into());
                        // A backend with one memory (the CPU) places both alike.
                        let up = match src {
                            KvSource::DeviceTierFp8 => {
                                be.device_tier_upload_fp8().or_else(|| be.host_tier_upload_fp8())
                            }
                            _ => be.host_tier_upload_fp8(),
                        };
                        let up = up.ok_or_else(none)?;
                        // Uploaded by another thread, as a disk reader does.
                        std::thread::scope(|s| s.spawn(|| up(&kv)).join())
                            .map_err(|_| EngineError::Shape("the upload thread panicked".into()))??
                    } else {
                        be.upload_rows_host_tier(&decoded.iter().collect::<Vec<_>>())?
                    };
                    let v = k.split_off(layers);
                    (k, v)
                } else if src == KvSource::HostTier {
                    let mut k = be.upload_rows_host_tier(&kh.iter().chain(&vh).collect::<Vec<_>>())?;
                    let v = k.split_off(layers);
                    (k, v)
                } else if src == KvSource::DeviceTier {
                    let none = || EngineError::Shape("this backend has no device-tier upload".into());
                    // The CPU has one memory: its "host tier" upload places there.
                    let up = be.device_tier_upload().or_else(|| be.host_tier_upload()).ok_or_else(none)?;
                    let ts: Vec<&HostTensor> = kh.iter().chain(&vh).collect();
                    let mut k = std::thread::scope(|s| s.spawn(|| up(&ts)).join())
                        .map_err(|_| EngineError::Shape("the upload thread panicked".into()))??;
                    let v = k.split_off(layers);
                    (k, v)
                } else {
                    let keep = src == KvSource::Kept;
                    (upload_kv(be, &kh, keep)?, upload_kv(be, &vh, keep)?)
                };
            // Positions past the RoPE table exercise the on-the-fly path.
            let positions: Vec<u32> = (0..*ctx as u32).map(|t| t * 37 + 8000 * i as u32).collect();
            let slots: Vec<u32> = (0..*ctx as u32).map(|t| table[(t / bs) as usize] * bs + t % bs).collect();
            ks.push(k);
            vs.push(v);
            meta.push((positions, slots));
        }
        let chunks: Vec<InjectChunk<'_, B::Tensor>> = ks
            .iter()
            .zip(&vs)
            .zip(&meta)
            .map(|((k, v), (p, s))| InjectChunk { k, v, positions: p, slots: s })
            .collect();
        be.inject_kv(&mut store, &chunks, rope)?;
        // Copy-on-write of shared blocks: each sequence's first block to a free one.
        let free = (c.spec.num_blocks - c.seqs.len()) as u32;
        let pairs: Vec<(u32, u32)> = c.seqs.iter().enumerate().map(|(i, s)| (s.2[0], free + i as u32)).collect();
        be.copy_blocks(&mut store, &pairs)?;
        let copied: Vec<u32> = (free * bs..(free + c.seqs.len() as u32) * bs).collect();
        let mut out = Vec::new();
        for l in 0..layers {
            for slots in meta.iter().map(|m| &m.1).chain([&copied]) {
                let (k, v) = be.gather_kv(&store, l, slots)?;
                out.extend(be.to_host(&k)?.data);
                out.extend(be.to_host(&v)?.data);
            }
        }
        Ok(out)
    }
}

pub(crate) fn rope_for(head_dim: usize, scaling: RopeScaling) -> Rope {
    Rope::new(&RopeConfig { theta: 500_000.0, dim: head_dim, scaling })
}

/// Every backend op on random data, CUDA against CPU.
pub fn ops<G: Backend>(gpu: &G) -> R<Report> {
    let cpu = CpuBackend;
    let mut out = Report::new();
    // Few rows (decode, a question) and many (prefill): cuBLAS picks different kernels.
    for (rows, inp, outs) in [(37, 320, 200), (1, 4096, 200), (20, 4096, 1000), (32, 512, 72), (13, 14336, 100)] {
        let x = host(rows as u64, &[rows, inp], 1.0);
        let (w, b) = (host(2, &[outs, inp], 0.05), host(3, &[outs], 0.5));
        let name = format!("linear {rows}×{inp} · ({outs}×{inp})ᵀ + bias");
        both(&cpu, gpu, &name, |be| be.linear(&x, &w, Some(&b)), &mut out)?;
    }
    let x = host(1, &[37, 320], 1.0);
    let (nw, nb) = (host(4, &[320], 1.0), host(5, &[320], 1.0));
    both(&cpu, gpu, "rms_norm, layer_norm", |be| be.norms(&x, &nw, &nb), &mut out)?;
    let (a, y) = (host(6, &[5, 96], 2.0), host(7, &[5, 96], 2.0));
    both(&cpu, gpu, "gelu, silu_mul, split, add, select, concat, embedding", |be| be.acts(&a, &y), &mut out)?;
    // Greedy sampling on the device must pick exactly the host's argmax of
    // the same (bf16) values, ties to the lowest id; error = rows that differ.
    // Widths of whole 16-byte words take the kernel's vector path, others not.
    for vocab in [50_000, 50_001] {
        let rows = 7;
        let xd = gpu.upload_rows(&host(12, &[rows, vocab], 1.0))?;
        let got = gpu.argmax_rows(&xd)?;
        let h = gpu.to_host(&xd)?;
        let want: Vec<u32> = (0..rows).map(|r| argmax(&h.data[r * vocab..(r + 1) * vocab])).collect();
        out.push(same_ids(format!("argmax_rows 7×{vocab} (rows differing)"), &got, &want));
    }
    // kv+blend's ranking: per-row squared distances of the same (bf16)
    // values summed on the device and on the host; relative error.
    {
        let (a, b) = (gpu.upload_rows(&host(13, &[300, 256], 1.0))?, gpu.upload_rows(&host(14, &[300, 256], 1.0))?);
        let got = gpu.row_sq_distance(&a, &b)?;
        let want = CpuBackend.row_sq_distance(
            &CpuBackend.upload_rows(&gpu.to_host(&a)?)?,
            &CpuBackend.upload_rows(&gpu.to_host(&b)?)?,
        )?;
        let error =
            got.iter().zip(&want).map(|(g, w)| f64::from((g - w).abs() / w.abs().max(1e-6))).fold(0.0, f64::max);
        let error = if got.len() == want.len() { error } else { f64::INFINITY };
        out.push(Check { name: "row_sq_distance 300×256 (relative)".into(), error, tolerance: 1e-5, control: false });
    }
    // kv+blend's question rank: the attention mass the question's rows pay
    // each candidate key, on the device and on the host from the same
    // (bf16) values; error relative to the mean mass. A Qwen2.5-1.5B head
    // layout (12 heads over 2 KV heads) and a Llama-3.1-8B one (32 over 8).
    for (m, n, heads, kv_heads) in [(30, 1300, 12, 2), (17, 3000, 32, 8)] {
        let d = 128;
        let shape =
            AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: d, scale: 1.0 / (d as f32).sqrt() };
        let q = gpu.upload_rows(&host(15, &[m, heads * d], 1.0))?;
        let k = gpu.upload_rows(&host(16, &[n, kv_heads * d], 1.0))?;
        let got = gpu.attention_mass(&q, &k, shape)?;
        let want = inferscale_engine::attention_mass(&gpu.to_host(&q)?.data, &gpu.to_host(&k)?.data, shape);
        let mean = want.iter().sum::<f32>() / want.len().max(1) as f32;
        let error = got.iter().zip(&want).map(|(g, w)| f64::from((g - w).abs() / mean)).fold(0.0, f64::max);
        let error = if got.len() == want.len() { error } else { f64::INFINITY };
        let name = format!("attention_mass {m} rows × {n} keys, {heads}/{kv_heads} heads (relative to the mean)");
        out.push(Check { name, error, tolerance: 1e-3, control: false });
    }
    // Retrieval: the device's GEMV and sort return exactly the host
    // reference's ids — ties (duplicated rows) to the lower row — through
    // the shared-memory sort and, past TOP_K_SORT_ROWS, the host ranking.
    for (rows, k) in [(1, 5), (777, 50), (8192, 200), (9000, 64)] {
        let dim = 384;
        let mut e = values(40 + rows as u64, rows * dim, 1.0);
        for r in (0..rows / 2).step_by(7) {
            let row = e[r * dim..(r + 1) * dim].to_vec();
            e[(rows / 2 + r) * dim..(rows / 2 + r + 1) * dim].copy_from_slice(&row);
        }
        let q = values(41, dim, 1.0);
        let want = top_k_host(&HostEmbeddings::new(e.clone(), dim)?, &q, k)?;
        let got = gpu.top_k(&gpu.upload_embeddings(&e, dim)?, &q, k)?;
        out.push(same_ids(format!("top_k over {rows} × {dim}, k = {k} (ids differing from the host's)"), &got, &want));
    }
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    for (hd, scaling) in [(64, RopeScaling::None), (128, llama3)] {
        let rope = rope_for(hd, scaling);
        let xr = host(8, &[6, 3 * hd], 1.0);
        let pos = [0, 1, 17, 4095, 8191, 20_000];
        both(
            &cpu,
            gpu,
            &format!("rope d{hd} (table and on-the-fly positions)"),
            |be| be.rope(&xr, hd, &pos, &rope),
            &mut out,
        )?;
    }
    // Fused ops: against the CPU, and against the unfused ops on the same device bit for bit.
    for (rows, width) in [(20, 4096), (3, 576), (7, 200)] {
        let (x, y, w) = (host(21, &[rows, width], 1.0), host(22, &[rows, width], 1.0), host(23, &[width], 1.0));
        let name = format!("add_rms_norm {rows}×{width}");
        both(&cpu, gpu, &name, |be| be.add_norm(&x, &y, &w, true), &mut out)?;
        exact(gpu, &name, |be, fused| be.add_norm(&x, &y, &w, fused), &mut out)?;
    }
    for (hd, heads, kv_heads, rot) in [(128, 32, 8, 128), (64, 9, 3, 64), (64, 4, 2, 32)] {
        let c = qkv_case(hd, heads, kv_heads, rot, KvCacheDtype::Native);
        let name = format!("qkv_rope_write d{hd} {heads}/{kv_heads} heads, {rot} rotated");
        both(&cpu, gpu, &name, |be| be.qkv(&c, true), &mut out)?;
        exact(gpu, &name, |be, fused| be.qkv(&c, fused), &mut out)?;
    }

    let s = AttentionShape { num_heads: 4, num_kv_heads: 4, head_dim: 32, scale: 32f32.powf(-0.5) };
    let (q, k, v) = (host(9, &[40, 128], 1.0), host(10, &[40, 128], 1.0), host(11, &[40, 128], 1.0));
    both(&cpu, gpu, "attention_bidirectional", |be| be.bidir(&q, &k, &v, s, &[(0, 15), (15, 25)]), &mut out)?;

    for (hd, heads, kv_heads) in [(64, 9, 3), (128, 32, 8), (128, 4, 4)] {
        let spec = KvSpec {
            num_layers: 2,
            num_blocks: 160,
            block_size: 16,
            num_kv_heads: kv_heads,
            head_dim: hd,
            dtype: KvCacheDtype::Native,
        };
        let shape =
            AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: (hd as f32).powf(-0.5) };
        for (name, c) in paged_cases(spec, shape) {
            both(
                &cpu,
                gpu,
                &format!("paged attention d{hd} {heads}/{kv_heads} heads: {name}"),
                |be| be.paged(&c),
                &mut out,
            )?;
        }
        let rope = rope_for(hd, RopeScaling::None);
        let c = PagedCase {
            spec,
            shape,
            seqs: vec![(25, 0, block_table(9, 2)), (40, 0, block_table(11, 3))],
            row_ends: Vec::new(),
            position_gaps: false,
            rot: hd,
            seed: 77,
        };
        both(
            &cpu,
            gpu,
            &format!("inject_kv d{hd} (2 chunks × 2 layers), copy_blocks, gather_kv"),
            |be| be.inject(&c, &rope, KvSource::Device),
            &mut out,
        )?;
        // Stored KV (kept on the device, or in the host tier): the side
        // stream, in groups of layers, read by gather_kv and copy_blocks on
        // the main stream after their waits.
        let c = PagedCase { spec: KvSpec { num_layers: 7, ..spec }, ..c };
        for (src, what) in [
            (KvSource::Kept, "kept on the device"),
            (KvSource::HostTier, "from the host tier"),
            (KvSource::DeviceTier, "uploaded to the device tier by another thread"),
        ] {
            both(
                &cpu,
                gpu,
                &format!("inject_kv d{hd} {what} (2 chunks × 7 layers), copy_blocks, gather_kv"),
                |be| be.inject(&c, &rope, src),
                &mut out,
            )?;
            // Same kernel, same math: where the KV lives must not change a single bit.
            let (dev, other) = (Dyn(gpu).inject(&c, &rope, KvSource::Device)?, Dyn(gpu).inject(&c, &rope, src)?);
            let name = format!("inject_kv d{hd} {heads}/{kv_heads} heads: {what} = main-stream launch, bit for bit");
            out.push(Check { name, error: bit_error(&other, &dev), tolerance: 0.0, control: false });
        }
        // fp8 kept as fp8 in the host tier, dequantized by the kernel, must
        // inject exactly what decoding the same codes on the host did.
        let (fp8, decoded) = (
            Dyn(gpu).inject(&c, &rope, KvSource::HostTierFp8)?,
            Dyn(gpu).inject(&c, &rope, KvSource::HostTierFp8Decoded)?,
        );
        let name = format!(
            "inject_kv d{hd} {heads}/{kv_heads} heads: fp8 in the host tier = decoded on the host, bit for bit"
        );
        out.push(Check { name, error: bit_error(&fp8, &decoded), tolerance: 0.0, control: false });
        // The same codes in device memory (a read the device tier had room for).
        let device = Dyn(gpu).inject(&c, &rope, KvSource::DeviceTierFp8)?;
        let name = format!(
            "inject_kv d{hd} {heads}/{kv_heads} heads: fp8 in the device tier = decoded on the host, bit for bit"
        );
        out.push(Check { name, error: bit_error(&device, &decoded), tolerance: 0.0, control: false });
        let name =
            format!("to_host d{hd}: fp8 in the host tier and in the device tier = the decoded codes, bit for bit");
        out.push(Check { name, error: fp8_read_back(gpu, hd)?, tolerance: 0.0, control: false });
    }
    fp8_cache(&cpu, gpu, &mut out)?;
    Ok(out)
}

/// A fused-QKV case of 21 rows into a two-layer cache of `dtype`: positions
/// in the RoPE table and past it, slots scattered.
fn qkv_case(hd: usize, heads: usize, kv_heads: usize, rot: usize, dtype: KvCacheDtype) -> QkvCase {
    let spec = KvSpec { num_layers: 2, num_blocks: 8, block_size: 16, num_kv_heads: kv_heads, head_dim: hd, dtype };
    let shape =
        AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: (hd as f32).powf(-0.5) };
    let rope = Rope::new(&RopeConfig { theta: 10_000.0, dim: rot, scaling: RopeScaling::None });
    let positions: Vec<u32> = (0..21).map(|i| i * 1000).collect();
    let slots: Vec<u32> = (0..21).map(|i| (i * 37) % 128).collect();
    QkvCase { spec, shape, rope, positions, slots }
}

/// Scattered, non-monotonic block tables of a 160-block cache.
fn block_table(start: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (start + i * 7) % 160).collect()
}

/// The paged-attention cases, by name: prefill, chunked prefill beside
/// decodes, a question after cached tokens (at consecutive positions, and
/// with gaps), kv+blend's scattered rows, and a serving step of many
/// decodes.
fn paged_cases(spec: KvSpec, shape: AttentionShape) -> Vec<(&'static str, PagedCase)> {
    let table = block_table;
    let cases = [
        ("prefill", vec![(300, 300, table(0, 19))]),
        (
            "chunked prefill + decode, 3 sequences",
            vec![(700, 37, table(1, 44)), (90, 1, table(3, 6)), (1500 / 16 * 16, 1, table(5, 94))],
        ),
        ("question after 1,320 cached tokens", vec![(1340, 20, table(2, 84))]),
        ("question after 1,320 keys at positions with gaps", vec![(1340, 20, table(2, 84))]),
        // kv+blend: 100 injected tokens recomputed in place among 1,320,
        // then a 20-token question; and a decode beside it.
        ("blend: 100 scattered rows + a question", vec![(1340, 120, table(4, 84)), (90, 1, table(3, 6))]),
        (
            // A serving step: many sequences decoding, one prompt chunk.
            "100 decodes + a prefill chunk",
            (0..100u32)
                .map(|i| {
                    let ctx = 1 + (i as usize * 53) % 700;
                    (ctx, 1, table(i, ctx.div_ceil(16)))
                })
                .chain([(300, 37, table(7, 19))])
                .collect(),
        ),
    ];
    // The blend case's rows: every 13th injected token, then the question.
    let blend_ends: Vec<u32> = (0..100u32).map(|i| 1 + 13 * i + i % 3).chain(1321..=1340).collect();
    cases
        .into_iter()
        .map(|(name, seqs)| {
            let row_ends = if name.starts_with("blend") { vec![Some(blend_ends.clone())] } else { Vec::new() };
            let position_gaps = name.contains("positions with gaps");
            (name, PagedCase { spec, shape, seqs, row_ends, position_gaps, rot: spec.head_dim, seed: 1000 })
        })
        .collect()
}

/// The fp8 paged cache (`--kv-cache-dtype fp8`, kernels/kv_fp8.cu) against
/// the CPU's: writes, injection from every source, gathers, block copies
/// and attention, on stores calibrated with [`fp8_offsets`]. The two
/// backends round the same floats to codes with the same operations, so
/// what differs is the device's bf16 where it computes (decoded keys enter
/// attention as bf16).
fn fp8_cache<G: Backend>(cpu: &CpuBackend, gpu: &G, out: &mut Report) -> R<()> {
    for (hd, heads, kv_heads, rot) in [(128, 32, 8, 128), (64, 9, 3, 64), (64, 4, 2, 32)] {
        let c = qkv_case(hd, heads, kv_heads, rot, KvCacheDtype::Fp8);
        let name = format!("fp8 cache: qkv_rope_write d{hd} {heads}/{kv_heads} heads, {rot} rotated");
        both(cpu, gpu, &name, |be| be.qkv(&c, true), out)?;
        // E2 on the device: a key the forward pass writes and the same
        // pre-RoPE key injected at the same position are the same codes.
        let name = format!(
            "fp8 cache d{hd} {heads}/{kv_heads} heads, {rot} rotated: injected = forward-pass codes, bit for bit"
        );
        out.push(Check { name, error: fp8_inject_vs_forward(gpu, &c, 0)?, tolerance: 0.0, control: false });
        let name =
            format!("fp8 cache d{hd} {heads}/{kv_heads} heads, {rot} rotated: control, injected one position off");
        out.push(Check { name, error: fp8_inject_vs_forward(gpu, &c, 1)?, tolerance: 0.0, control: true });
    }
    for (hd, heads, kv_heads) in [(64, 9, 3), (128, 32, 8)] {
        let spec = KvSpec {
            num_layers: 2,
            num_blocks: 160,
            block_size: 16,
            num_kv_heads: kv_heads,
            head_dim: hd,
            dtype: KvCacheDtype::Fp8,
        };
        let shape =
            AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: (hd as f32).powf(-0.5) };
        for (name, c) in paged_cases(spec, shape) {
            let what = format!("fp8 cache: paged attention d{hd} {heads}/{kv_heads} heads: {name}");
            both(cpu, gpu, &what, |be| be.paged(&c), out)?;
            if name.starts_with("chunked") {
                // The control: the same case over the bf16 cache, which the
                // fp8 cache's rounding must move by more than the tolerance.
                let (fp8, bf16) = (Dyn(gpu).paged(&c)?, Dyn(gpu).paged(&c_with(&c, KvCacheDtype::Native))?);
                out.push(Check {
                    name: format!("{what}, control: against the bf16 cache"),
                    error: rel(&fp8, &bf16),
                    tolerance: OP_TOL,
                    control: true,
                });
            }
        }
        if hd == 64 {
            // Heads that RoPE turns only in part: the dimensions past `rot`
            // keep their offsets as they are.
            let spec = KvSpec { num_kv_heads: 2, ..spec };
            let shape = AttentionShape { num_heads: 4, num_kv_heads: 2, ..shape };
            for (name, c) in paged_cases(spec, shape) {
                if !(name.starts_with("chunked") || name.contains("gaps")) {
                    continue;
                }
                let c = PagedCase { rot: 32, ..c };
                let what = format!("fp8 cache: paged attention d64 4/2 heads, 32 rotated: {name}");
                both(cpu, gpu, &what, |be| be.paged(&c), out)?;
            }
        }
        let rope = rope_for(hd, RopeScaling::None);
        let c = PagedCase {
            spec: KvSpec { num_layers: 7, ..spec },
            shape,
            seqs: vec![(25, 0, block_table(9, 2)), (40, 0, block_table(11, 3))],
            row_ends: Vec::new(),
            position_gaps: false,
            rot: hd,
            seed: 77,
        };
        for (src, what) in [
            (KvSource::Device, "plain device tensors"),
            (KvSource::Kept, "kept on the device"),
            (KvSource::HostTier, "from the host tier"),
            (KvSource::HostTierFp8, "fp8 records in the host tier"),
            (KvSource::DeviceTierFp8, "fp8 records in the device tier"),
        ] {
            let name = format!("fp8 cache: inject_kv d{hd} {what} (2 chunks × 7 layers), copy_blocks, gather_kv");
            both(cpu, gpu, &name, |be| be.inject(&c, &rope, src), out)?;
        }
        // Same kernel, same math: where the KV lives must not change a bit.
        let (dev, kept) = (Dyn(gpu).inject(&c, &rope, KvSource::Device)?, Dyn(gpu).inject(&c, &rope, KvSource::Kept)?);
        let name = format!("fp8 cache: inject_kv d{hd} kept (side stream) = main-stream launch, bit for bit");
        out.push(Check { name, error: bit_error(&kept, &dev), tolerance: 0.0, control: false });
    }
    Ok(())
}

/// `c` with its cache of `dtype`.
fn c_with(c: &PagedCase, dtype: KvCacheDtype) -> PagedCase {
    PagedCase {
        spec: KvSpec { dtype, ..c.spec },
        shape: c.shape,
        seqs: c.seqs.clone(),
        row_ends: c.row_ends.clone(),
        position_gaps: c.position_gaps,
        rot: c.rot,
        seed: c.seed,
    }
}

/// The bit error between layer 1 of an fp8 store written by the fused
/// forward write (`qkv_rope_write`) of `c`'s rows and one whose same K and
/// V, before RoPE, were injected at the positions `shift` further on.
fn fp8_inject_vs_forward<G: Backend>(gpu: &G, c: &QkvCase, shift: u32) -> R<f64> {
    let d = c.shape.head_dim;
    let (qc, kvc) = (c.shape.num_heads * d, c.shape.num_kv_heads * d);
    let n = c.positions.len();
    let qkv = host(31, &[n, qc + 2 * kvc], 1.0);
    let cols = |from: usize| HostTensor {
        shape: vec![n, kvc],
        data: qkv.data.chunks_exact(qc + 2 * kvc).flat_map(|r| r[from..from + kvc].iter().copied()).collect(),
    };
    let (kh, vh) = (cols(qc), cols(qc + kvc));
    let mut forward = new_store(gpu, c.spec, &c.rope)?;
    let rows = NewRows { positions: &c.positions, slots: &c.slots };
    gpu.qkv_rope_write(&gpu.upload_rows(&qkv)?, c.shape, &c.rope, rows, &mut forward, 1)?;
    let mut injected = new_store(gpu, c.spec, &c.rope)?;
    let layers = c.spec.num_layers;
    let ks = (0..layers).map(|_| gpu.upload_rows(&kh)).collect::<R<Vec<_>>>()?;
    let vs = (0..layers).map(|_| gpu.upload_rows(&vh)).collect::<R<Vec<_>>>()?;
    let positions: Vec<u32> = c.positions.iter().map(|p| p + shift).collect();
    let chunk = InjectChunk { k: &ks, v: &vs, positions: &positions, slots: &c.slots };
    gpu.inject_kv(&mut injected, &[chunk], &c.rope)?;
    let read = |store: &G::KvStore| -> R<Vec<f32>> {
        let (k, v) = gpu.gather_kv(store, 1, &c.slots)?;
        let mut out = gpu.to_host(&k)?.data;
        out.extend(gpu.to_host(&v)?.data);
        Ok(out)
    };
    Ok(bit_error(&read(&injected)?, &read(&forward)?))
}

/// How far `to_host` of fp8 tensors in either tier (what a shard's export
/// reads of a cached fact) is from decoding their codes on the host: the
/// largest bit error over both tiers (0 when exact).
pub(super) fn fp8_read_back<G: Backend>(gpu: &G, hd: usize) -> R<f64> {
    let (k, v) = (with_offset_channels(host(71, &[5, 2 * hd], 1.0), hd), host(72, &[5, 2 * hd], 2.0));
    let (body, decoded) = fp8_record(std::slice::from_ref(&k), std::slice::from_ref(&v), hd)?;
    let kv = fp8::Fp8Kv::from_body(&body, 1, 5, 2 * hd, 2)?;
    let want: Vec<f32> = decoded.iter().flat_map(|t| t.data.iter().copied()).collect();
    let mut worst = 0.0f64;
    // A backend with one memory (the CPU) has no device-tier upload of its own.
    let device = gpu.device_tier_upload_fp8().or_else(|| gpu.host_tier_upload_fp8());
    for up in [gpu.host_tier_upload_fp8(), device] {
        let up = up.ok_or_else(|| EngineError::Shape("this backend keeps no fp8 in a tier".into()))?;
        let mut got = Vec::new();
        for t in up(&kv)? {
            got.extend(gpu.to_host(&t)?.data);
        }
        worst = worst.max(bit_error(&got, &want));
    }
    Ok(worst)
}

/// Our few-row GEMM kernel (gemv.cu) against the CPU's `linear`, whatever
/// the tuner would pick for the shape: every row bucket (and row counts
/// between them), weights of few and many columns, with and without a bias,
/// each case's error the largest over the kernel's splits (warps a column).
/// The control adds another bias, which must miss.
pub fn gemv(gpu: &crate::CudaBackend) -> R<Report> {
    let cpu = CpuBackend;
    let mut out = Report::new();
    let worst = |x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>, want: &[f32]| -> R<f64> {
        let (xt, wt) = (gpu.upload_rows(x)?, gpu.upload(w)?);
        let bt = b.map(|b| gpu.upload(b)).transpose()?;
        let mut worst = 0.0f64;
        for split in crate::gemm::GEMV_SPLITS {
            let o = gpu.tensor(x.shape[0], w.shape[0])?;
            gpu.gemv(&o, &xt, &wt, bt.as_ref(), split, GemvOut::Product)?;
            worst = worst.max(rel(&gpu.to_host(&o)?.data, want));
        }
        Ok(worst)
    };
    for (rows, inp, outs) in [(1, 1536, 2048), (2, 8960, 200), (3, 320, 37), (5, 4096, 1000), (8, 8, 75)] {
        let x = host(rows as u64 + 20, &[rows, inp], 1.0);
        let (w, b) = (host(21, &[outs, inp], 0.05), host(22, &[outs], 0.5));
        let cpu_linear = |b: Option<&HostTensor>| -> R<Vec<f32>> {
            let b = b.map(|b| cpu.upload(b)).transpose()?;
            Ok(cpu.to_host(&cpu.linear(&cpu.upload_rows(&x)?, &cpu.upload(&w)?, b.as_ref())?)?.data)
        };
        let (want, plain) = (cpu_linear(Some(&b))?, cpu_linear(None)?);
        let name = format!("gemv {rows}×{inp} · ({outs}×{inp})ᵀ + bias, every split");
        out.push(Check { name, error: worst(&x, &w, Some(&b), &want)?, tolerance: OP_TOL, control: false });
        let name = format!("gemv {rows}×{inp} · ({outs}×{inp})ᵀ, every split");
        out.push(Check { name, error: worst(&x, &w, None, &plain)?, tolerance: OP_TOL, control: false });
        if outs % 4 == 0 {
            // Gated (the MLP's gate and up, then silu_mul): the same bits as
            // the plain kernel and silu_mul, and near the CPU's.
            let (xt, wt, bt) = (gpu.upload_rows(&x)?, gpu.upload(&w)?, gpu.upload(&b)?);
            let cpu_act = cpu.to_host(
                &cpu.silu_mul(&cpu.upload_rows(&HostTensor { shape: vec![rows, outs], data: want.clone() })?)?,
            )?;
            let (mut differ, mut worst) = (0.0f64, 0.0f64);
            for split in crate::gemm::GEMV_SPLITS {
                let (plain, fused) = (gpu.tensor(rows, outs)?, gpu.tensor(rows, outs / 2)?);
                gpu.gemv(&plain, &xt, &wt, Some(&bt), split, GemvOut::Product)?;
                gpu.gemv(&fused, &xt, &wt, Some(&bt), split, GemvOut::SiluMul)?;
                let (two, one) = (gpu.to_host(&gpu.silu_mul(&plain)?)?.data, gpu.to_host(&fused)?.data);
                differ = differ.max(bit_error(&one, &two));
                worst = worst.max(rel(&one, &cpu_act.data));
            }
            let name = format!("gemv silu {rows}×{inp} · ({outs}×{inp})ᵀ + bias = gemv, silu_mul, bit for bit");
            out.push(Check { name, error: differ, tolerance: 0.0, control: false });
            let name = format!("gemv silu {rows}×{inp} · ({outs}×{inp})ᵀ + bias, every split");
            out.push(Check { name, error: worst, tolerance: OP_TOL, control: false });
        }
        if rows == 1 {
            // The smallest error over the splits must still miss.
            let other = host(23, &[outs], 0.5);
            let (xt, wt, ot) = (gpu.upload_rows(&x)?, gpu.upload(&w)?, gpu.upload(&other)?);
            let mut least = f64::INFINITY;
            for split in crate::gemm::GEMV_SPLITS {
                let o = gpu.tensor(rows, outs)?;
                gpu.gemv(&o, &xt, &wt, Some(&ot), split, GemvOut::Product)?;
                least = least.min(rel(&gpu.to_host(&o)?.data, &want));
            }
            let name = format!("gemv {rows}×{inp} · ({outs}×{inp})ᵀ, control: another bias");
            out.push(Check { name, error: least, tolerance: OP_TOL, control: true });
        }
    }
    Ok(out)
}

/// The fp8 cache's encoder on the device against the CPU's rule over every
/// f32 bit pattern ([`crate::CudaBackend::e4m3_encode_mismatches`]): the
/// count of patterns coded otherwise, which must be 0 — NaNs counted in a
/// row of their own, since a NaN reaches the encoder only from a NaN in the
/// model's K or V. The control swaps each pair's codes, which must miss.
/// Then the injection's division by a row's scale against `__fdiv_rn`
/// ([`crate::CudaBackend::fp8_divisor_mismatches`]): the same codes, and
/// the same quotients wherever one can code non-zero; its control, the
/// uncorrected product, must miss.
pub fn fp8_encode(gpu: &crate::CudaBackend) -> R<Report> {
    let [ours, nans, swapped] = gpu.e4m3_encode_mismatches()?;
    let [codes, quotients, uncorrected] = gpu.fp8_divisor_mismatches()?;
    let check =
        |name: &str, count: u64, control| Check { name: name.into(), error: count as f64, tolerance: 0.0, control };
    Ok(vec![
        check("fp8 encode: device codes = the CPU's rule, every non-NaN f32 (mismatches)", ours, false),
        check("fp8 encode: device codes = the CPU's rule, every NaN f32 (mismatches)", nans, false),
        check("fp8 encode: control, each pair's codes swapped (mismatches)", swapped, true),
        check("fp8 divide: injection's codes = __fdiv_rn's, every f32 (mismatches)", codes, false),
        check("fp8 divide: quotients ≥ 2⁻¹⁰ = __fdiv_rn's, bit for bit (mismatches)", quotients, false),
        check("fp8 divide: control, codes of the uncorrected product (mismatches)", uncorrected, true),
    ])
}
