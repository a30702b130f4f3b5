//! Injection into a KV cache another engine owns — vLLM's, for the KV
//! connector (crates/vllm-connector) — on that engine's stream.
//!
//! The same fused kernel as our own injection (`inject_body` in
//! kernels/kv.cu), with the destination addressed by the foreign cache's
//! strides: one tensor per layer, a slot `block · block_size + n` at
//! `block·s_block + n·s_slot`, a head at `h·s_head`, V `s_kv` past K, the
//! head's dimensions contiguous. That covers vLLM's three layouts and their
//! NHD/HND storage orders.
//!
//! Ordering. Stored KV is written and freed on our main stream; the foreign
//! cache is written and read on the caller's stream. The kernel runs on the
//! caller's stream after it has waited for our main stream (the stored KV
//! and the uploaded tables are ready), and our main stream then waits for
//! the caller's (the tables are freed and stored KV released only after the
//! kernel). The caller's later work (vLLM's forward) follows in its own
//! stream order.

use cudarc::driver::LaunchConfig;
use cudarc::driver::sys::CUstream;
use inferscale_engine::Result;
use inferscale_engine::rope::{Rope, TABLE_POSITIONS};

use crate::backend::{Cu, CudaBackend, CudaTensor, shape_err};
use crate::error::CudaError;
use crate::tier::{INJECT_TOKENS, check_inject_dims};

/// A foreign bf16 KV cache, per layer one tensor, addressed in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalCache {
    /// Per layer, the device address of element 0 (K of slot 0, head 0).
    pub bases: Vec<u64>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub s_block: usize,
    pub s_slot: usize,
    pub s_head: usize,
    /// V's distance from K.
    pub s_kv: usize,
}

impl ExternalCache {
    /// Checks what the kernel's 16-byte accesses need beyond
    /// [`check_inject_dims`]: head dimensions contiguous (the caller's view
    /// guarantees that), every stride and base a multiple of 8 elements.
    fn check(&self) -> Result<()> {
        let strides = [self.s_block, self.s_slot, self.s_head, self.s_kv];
        if strides.iter().any(|s| !s.is_multiple_of(8)) {
            return Err(CudaError::Unsupported(format!(
                "external cache: strides {strides:?} must be multiples of 8 elements"
            ))
            .into());
        }
        if let Some(b) = self.bases.iter().find(|b| *b % 16 != 0 || **b == 0) {
            return Err(CudaError::Unsupported(format!("external cache: base {b:#x} not 16-byte aligned")).into());
        }
        Ok(())
    }
}

/// Rows `first_row..first_row + slots.len()` of one stored chunk (pre-RoPE
/// K and V of every layer, `[rows, kv_dim]` bf16), to `slots` at `positions`.
/// Rows before `first_row` are what the other engine already has.
pub struct ExternalChunk<'a> {
    pub k: &'a [CudaTensor],
    pub v: &'a [CudaTensor],
    pub first_row: usize,
    pub positions: &'a [u32],
    pub slots: &'a [u32],
}

impl CudaBackend {
    /// Writes `chunks` into `cache` at their slots, keys rotated to their
    /// positions, on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context, and
    /// every layer of `cache` a live bf16 allocation covering `num_blocks`
    /// blocks at its strides, not written by anyone else while the kernel
    /// runs on `stream` (the caller orders its own work on `stream`).
    pub unsafe fn inject_external(
        &self,
        cache: &ExternalCache,
        chunks: &[ExternalChunk<'_>],
        rope: &Rope,
        stream: u64,
    ) -> Result<()> {
        check_inject_dims(rope, cache.head_dim)?;
        cache.check()?;
        let layers = cache.bases.len();
        let kv_dim = cache.kv_heads * cache.head_dim;
        let slots_total = (cache.num_blocks * cache.block_size) as u64;
        let total: usize = chunks.iter().map(|c| c.slots.len()).sum();
        if total == 0 {
            return Ok(());
        }
        // bf16 chunks and fp8 chunks (host-tier KV kept as stored): one launch each.
        let mut kinds: [Vec<_>; 2] = [Vec::new(), Vec::new()];
        for (ci, c) in chunks.iter().enumerate() {
            let n = c.slots.len();
            if c.k.len() != layers || c.v.len() != layers || c.positions.len() != n {
                return Err(shape_err(format!("inject_external: chunk {ci} has {} layers, {n} slots", c.k.len())));
            }
            let rows = c.first_row + n;
            if let Some(s) = c.slots.iter().find(|&&s| u64::from(s) >= slots_total) {
                return Err(shape_err(format!("inject_external: slot {s} of a cache of {slots_total} slots")));
            }
            let fp8 = c.k.first().is_some_and(CudaTensor::is_fp8);
            for (l, (k, v)) in c.k.iter().zip(c.v).enumerate() {
                if [k, v].iter().any(|x| x.rows < rows || x.cols != kv_dim || x.is_fp8() != fp8) {
                    return Err(shape_err(format!(
                        "inject_external: chunk {ci} layer {l} is [{}, {}]{}",
                        k.rows,
                        k.cols,
                        if fp8 { ", not all fp8" } else { "" }
                    )));
                }
            }
            kinds[usize::from(fp8)].push((c.first_row, c.k, c.v, c.positions, c.slots));
        }
        let bases_dev = self.stream.clone_htod(&cache.bases).cu()?;
        let r = self.rope_tables(rope)?;
        // SAFETY: the caller guarantees `stream` is a live stream of this
        // context; the wrapper does not destroy it.
        let theirs = unsafe { self.ctx.wrap_borrowed_stream(stream as CUstream) };
        theirs.join(&self.stream).cu()?;
        let bp = self.ptr(&bases_dev);
        let (nl, bs) = (layers as u32, cache.block_size as u32);
        let (sb, ss, sh, skv) = (cache.s_block, cache.s_slot, cache.s_head, cache.s_kv);
        let (d, hd, rot) = (kv_dim as i32, cache.head_dim as i32, rope.dim() as i32);
        let (cs, sn, inv, tp) = (self.ptr(&r.cos), self.ptr(&r.sin), self.ptr(&r.inv_freq), TABLE_POSITIONS as u32);
        let _span = self.span("inject_kv_strided");
        // The tables live until the fence below: freed on our stream, which
        // waits for their kernels.
        let mut tables = Vec::new();
        for (fp8, cs_) in kinds.iter().enumerate().filter(|(_, c)| !c.is_empty()) {
            let (table, n) = self.kind_table(cs_, fp8 == 1);
            let table_dev = self.stream.clone_htod(&table).cu()?;
            theirs.join(&self.stream).cu()?;
            let (tb, tt, nc) = (self.ptr(&table_dev), n as u32, cs_.len() as u32);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(INJECT_TOKENS) as u32, layers as u32, 1),
                block_dim: ((kv_dim / 8).clamp(32, 256) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let args: [&dyn crate::launch::Arg; 17] =
                [&bp, &tb, &tt, &nc, &nl, &bs, &sb, &ss, &sh, &skv, &d, &hd, &rot, &cs, &sn, &inv, &tp];
            let kernel = if fp8 == 1 { &self.k.inject_kv_strided_fp8 } else { &self.k.inject_kv_strided };
            self.launch_on(&theirs, kernel, cfg, &args)?;
            tables.push(table_dev);
        }
        // Host-tier KV is released after this fence; device KV and the tables
        // are freed on our stream, which waits for the kernel.
        self.inject_fence.record(&theirs).cu()?;
        self.stream.join(&theirs).cu()
    }
}

/// The logical layouts of vLLM's caches the check covers, with their
/// element strides `(s_block, s_slot, s_head, s_kv)` for `b` blocks of
/// `n` slots, `h` heads of `d` dimensions, and the elements a layer holds.
fn layouts(b: usize, n: usize, h: usize, d: usize) -> [(&'static str, [usize; 4]); 4] {
    [
        ("(2, blocks, block_size, heads, dim)", [n * h * d, h * d, d, b * n * h * d]),
        ("(blocks, 2, block_size, heads, dim)", [2 * n * h * d, h * d, d, n * h * d]),
        ("(blocks, heads, block_size, 2·dim) HND", [h * n * 2 * d, 2 * d, n * 2 * d, d]),
        ("(blocks, heads, block_size, 2·dim) NHD", [n * h * 2 * d, h * 2 * d, 2 * d, d]),
    ]
}

/// `inject_external` into each layout on a stream of its own, against the
/// CPU backend's injection into our paged cache (read back slot by slot):
/// the same rotated keys and values wherever the strides put them (one
/// chunk from a row past its first), nothing written anywhere else, and a
/// control with positions off by one that must miss.
pub fn check(be: &CudaBackend) -> Result<crate::parity::Report> {
    use inferscale_engine::CpuBackend;
    use inferscale_engine::backend::{InjectChunk, KvCacheDtype, KvSpec, PagedKv, Tensors};
    use inferscale_model::{HostTensor, RopeScaling};

    use crate::parity::{Check, OP_TOL, host, rel, rope_for, upload_kv};

    let cpu = CpuBackend;
    let mut out = Vec::new();
    for (hd, heads) in [(64usize, 4usize), (128, 2)] {
        let (layers, blocks, bs) = (3usize, 12usize, 16usize);
        let spec = KvSpec {
            num_layers: layers,
            num_blocks: blocks,
            block_size: bs,
            num_kv_heads: heads,
            head_dim: hd,
            dtype: KvCacheDtype::Native,
        };
        let kv_dim = heads * hd;
        let rope = rope_for(hd, RopeScaling::None);
        // Two chunks; the second's positions pass the RoPE table.
        let table = [5u32, 0, 9, 3, 11];
        let lens = [37usize, 9];
        let starts = [0u32, TABLE_POSITIONS as u32 - 4];
        let mut at = 0u32;
        let mut slots = Vec::new();
        let mut positions = Vec::new();
        for (&len, &start) in lens.iter().zip(&starts) {
            slots.push(
                (0..len as u32)
                    .map(|t| table[((at + t) as usize) / bs] * bs as u32 + (at + t) % bs as u32)
                    .collect::<Vec<_>>(),
            );
            positions.push((0..len as u32).map(|t| start + t).collect::<Vec<_>>());
            at += len as u32;
        }
        // Chunk 1 on the device: SKIP junk rows, then its rows.
        const SKIP: usize = 3;
        let dev_rows = |t: &[HostTensor], i: usize| -> Vec<HostTensor> {
            if i != 1 {
                return t.to_vec();
            }
            t.iter()
                .map(|x| {
                    let mut data = host(999, &[SKIP, kv_dim], 1.0).data;
                    data.extend_from_slice(&x.data);
                    HostTensor { shape: vec![x.shape[0] + SKIP, kv_dim], data }
                })
                .collect()
        };
        let rows =
            |seed: u64, len: usize| (0..layers).map(|l| host(seed + l as u64, &[len, kv_dim], 1.0)).collect::<Vec<_>>();
        let hk: Vec<_> = lens.iter().enumerate().map(|(i, &n)| rows(100 + 10 * i as u64, n)).collect();
        let hv: Vec<_> = lens.iter().enumerate().map(|(i, &n)| rows(200 + 10 * i as u64, n)).collect();
        // The reference: the CPU backend's injection, read back per slot.
        let reference = |pos_shift: u32| -> Result<Vec<f32>> {
            let (ck, cv): (Vec<_>, Vec<_>) = (0..lens.len())
                .map(|i| Ok((upload_kv(&cpu, &hk[i], false)?, upload_kv(&cpu, &hv[i], false)?)))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
            let shifted: Vec<Vec<u32>> = positions.iter().map(|p| p.iter().map(|x| x + pos_shift).collect()).collect();
            let chunks: Vec<InjectChunk<'_, _>> = (0..lens.len())
                .map(|i| InjectChunk { k: &ck[i], v: &cv[i], positions: &shifted[i], slots: &slots[i] })
                .collect();
            let mut store = cpu.new_kv_store(spec)?;
            cpu.inject_kv(&mut store, &chunks, &rope)?;
            let all: Vec<u32> = slots.concat();
            let mut v = Vec::new();
            for l in 0..layers {
                let (k, vv) = cpu.gather_kv(&store, l, &all)?;
                v.extend(cpu.to_host(&k)?.data);
                v.extend(cpu.to_host(&vv)?.data);
            }
            Ok(v)
        };
        let want = reference(0)?;
        let control = reference(1)?;
        // On the device, the second chunk carries `SKIP` more leading rows,
        // which the other engine is taken to have already.
        let dk: Vec<_> = (0..lens.len()).map(|i| upload_kv(be, &dev_rows(&hk[i], i), true)).collect::<Result<_>>()?;
        let dv: Vec<_> = (0..lens.len()).map(|i| upload_kv(be, &dev_rows(&hv[i], i), true)).collect::<Result<_>>()?;
        let chunks: Vec<ExternalChunk<'_>> = (0..lens.len())
            .map(|i| ExternalChunk {
                k: &dk[i],
                v: &dv[i],
                first_row: if i == 1 { SKIP } else { 0 },
                positions: &positions[i],
                slots: &slots[i],
            })
            .collect();
        for (name, [s_block, s_slot, s_head, s_kv]) in layouts(blocks, bs, heads, hd) {
            let elems = blocks * 2 * bs * heads * hd;
            let theirs = be.ctx.new_stream().cu()?;
            let bufs = (0..layers).map(|_| theirs.alloc_zeros::<half::bf16>(elems).cu()).collect::<Result<Vec<_>>>()?;
            let cache = ExternalCache {
                bases: bufs.iter().map(|b| be.ptr(b)).collect(),
                num_blocks: blocks,
                block_size: bs,
                kv_heads: heads,
                head_dim: hd,
                s_block,
                s_slot,
                s_head,
                s_kv,
            };
            // SAFETY: `theirs` is a live stream of this context; every buffer
            // holds the layout's elements and nothing else writes them.
            unsafe { be.inject_external(&cache, &chunks, &rope, theirs.cu_stream() as u64)? };
            theirs.synchronize().cu()?;
            let mut got = Vec::new();
            let mut stray = 0usize;
            for b in &bufs {
                let data: Vec<f32> = theirs.clone_dtoh(b).cu()?.iter().map(|x| x.to_f32()).collect();
                let mut touched = vec![false; elems];
                for kv in [0, 1] {
                    for &s in slots.iter().flatten() {
                        let (blk, n) = (s as usize / bs, s as usize % bs);
                        for h in 0..heads {
                            let o = blk * s_block + n * s_slot + h * s_head + kv * s_kv;
                            got.extend_from_slice(&data[o..o + hd]);
                            touched[o..o + hd].iter_mut().for_each(|t| *t = true);
                        }
                    }
                }
                stray += data.iter().zip(&touched).filter(|(x, t)| !**t && **x != 0.0).count();
            }
            // `got` is per layer all K rows then all V rows, as `want`.
            let label = format!("inject into a vLLM cache d{hd} {name}");
            out.push(Check { name: label.clone(), error: rel(&got, &want), tolerance: OP_TOL, control: false });
            out.push(Check {
                name: format!("{label}: elements written outside the slots"),
                error: stray as f64,
                tolerance: 0.0,
                control: false,
            });
            out.push(Check {
                name: format!("{label}: control, positions off by one"),
                error: rel(&got, &control),
                tolerance: OP_TOL,
                control: true,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::tier::table_words;

    #[test]
    fn rows_start_at_each_chunks_first_row() {
        let (k, v) = ([1, 3], [2, 4]);
        let (p0, s0, p1, s1) = ([10, 11], [100, 101], [20], [200]);
        let t = table_words(&[&k, &v], [(0, &p0[..], &s0[..]), (5, &p1[..], &s1[..])].into_iter(), 3);
        // After the 4 pointer words of each of the 2 (chunk, layer) entries:
        // chunk, row, position and slot of each of the 3 tokens.
        assert_eq!(&t[8..], &[0, 0, 1, 0, 1, 5, 10, 11, 20, 100, 101, 200]);
    }
}
