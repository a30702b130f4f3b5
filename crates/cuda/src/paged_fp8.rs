//! The fp8 paged cache on the device (`--kv-cache-dtype fp8`, docs/design.md
//! §2.2; kernels in kernels/kv_fp8.cu): e4m3 codes in the bf16 cache's
//! layout, a scale per (slot, KV head), each slot's RoPE position, and per
//! layer the key offsets keys are stored relative to. Its arithmetic is the
//! CPU store's (`inferscale_engine::fp8_cache`), so that `inferscale check`
//! can hold the two to the same codes.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};
use inferscale_engine::Result;
use inferscale_engine::backend::{AttentionShape, KvSpec, NewRows};
use inferscale_engine::rope::{Rope, TABLE_POSITIONS};

use crate::backend::{Cu, CudaBackend, CudaKvStore, CudaTensor, DeviceRope, KvBuffers, shape_err};
use crate::fused::check_qkv;

/// The buffers of an fp8 store (see kernels/kv_fp8.cu for the layout).
pub(crate) struct Fp8Cache {
    pub(crate) k: CudaSlice<u8>,
    pub(crate) v: CudaSlice<u8>,
    pub(crate) k_scale: CudaSlice<f32>,
    pub(crate) v_scale: CudaSlice<f32>,
    /// Each slot's RoPE position (written by every layer's write, alike).
    pub(crate) positions: CudaSlice<u32>,
    /// Set by calibration: keys are stored relative to these.
    pub(crate) offsets: Option<Offsets>,
    /// Whether any key has been written (calibration must come first).
    pub(crate) written: bool,
}

/// Per-layer key offsets `[layers, kv_dim]` and the rotation they turn with.
pub(crate) struct Offsets {
    values: CudaSlice<f32>,
    rope: Arc<DeviceRope>,
    rot: usize,
}

/// Device addresses of one layer of an fp8 store, as its kernels take them.
pub(crate) struct Fp8Layer {
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) k_scale: u64,
    pub(crate) v_scale: u64,
    pub(crate) positions: u64,
    /// 0: no offsets (keys rounded as they are).
    pub(crate) offsets: u64,
}

/// The RoPE tables kernels turn keys or offsets with, as kernel arguments.
pub(crate) struct Tables {
    pub(crate) cos: u64,
    pub(crate) sin: u64,
    pub(crate) inv_freq: u64,
    pub(crate) positions: u32,
    pub(crate) rot: i32,
}

impl Fp8Cache {
    /// Where the key offsets of every layer begin (0: none).
    pub(crate) fn offsets_ptr(&self, be: &CudaBackend) -> u64 {
        self.offsets.as_ref().map_or(0, |o| be.ptr(&o.values))
    }
}

impl CudaBackend {
    pub(crate) fn new_fp8_cache(&self, spec: KvSpec) -> Result<Fp8Cache> {
        let codes = spec.num_layers * spec.capacity() * spec.kv_dim();
        let scales = spec.num_layers * spec.capacity() * spec.num_kv_heads;
        let ones = vec![1f32; scales.max(1)];
        Ok(Fp8Cache {
            k: self.stream.alloc_zeros::<u8>(codes.max(16)).cu()?,
            v: self.stream.alloc_zeros::<u8>(codes.max(16)).cu()?,
            k_scale: self.stream.clone_htod(&ones).cu()?,
            v_scale: self.stream.clone_htod(&ones).cu()?,
            positions: self.stream.alloc_zeros::<u32>(spec.capacity().max(1)).cu()?,
            offsets: None,
            written: false,
        })
    }

    /// [`inferscale_engine::backend::PagedKv::calibrate_kv`] for an fp8 store.
    pub(crate) fn calibrate_fp8(&self, store: &mut CudaKvStore, offsets: &[Vec<f32>], rope: &Rope) -> Result<()> {
        let spec = store.spec;
        let KvBuffers::Fp8(cache) = &mut store.cache else {
            return Ok(());
        };
        if cache.written {
            return Err(shape_err(
                "fp8 KV cache: calibrated after keys were written (they were stored against other offsets)".into(),
            ));
        }
        if offsets.len() != spec.num_layers || offsets.iter().any(|o| o.len() != spec.kv_dim()) {
            return Err(shape_err(format!(
                "fp8 KV cache: {} offset rows for {} layers of width {}",
                offsets.len(),
                spec.num_layers,
                spec.kv_dim()
            )));
        }
        if let Some(bad) = offsets.iter().position(|o| o.iter().any(|x| !x.is_finite())) {
            return Err(shape_err(format!("fp8 KV cache: layer {bad}'s key offsets are not finite")));
        }
        check_rotation(rope, spec.head_dim)?;
        let flat: Vec<f32> = offsets.concat();
        cache.offsets = if flat.iter().all(|&x| x == 0.0) {
            None
        } else {
            Some(Offsets {
                values: self.stream.clone_htod(&flat).cu()?,
                rope: self.rope_tables(rope)?,
                rot: rope.dim(),
            })
        };
        Ok(())
    }

    /// Layer `layer` of an fp8 store, once any injection into it is done.
    pub(crate) fn fp8_layer(&self, store: &CudaKvStore, layer: usize) -> Result<Fp8Layer> {
        self.await_layer(store, layer)?;
        let KvBuffers::Fp8(c) = &store.cache else {
            return Err(shape_err("fp8 layer of a bf16 KV store".into()));
        };
        let spec = store.spec;
        let (codes, scales) = (store.layer_elems, spec.capacity() * spec.num_kv_heads);
        Ok(Fp8Layer {
            k: self.ptr(&c.k) + (layer * codes) as u64,
            v: self.ptr(&c.v) + (layer * codes) as u64,
            k_scale: self.ptr(&c.k_scale) + (4 * layer * scales) as u64,
            v_scale: self.ptr(&c.v_scale) + (4 * layer * scales) as u64,
            positions: self.ptr(&c.positions),
            offsets: c.offsets.as_ref().map_or(0, |o| self.ptr(&o.values) + (4 * layer * spec.kv_dim()) as u64),
        })
    }

    fn tables(&self, rope: &DeviceRope, rot: usize) -> Tables {
        Tables {
            cos: self.ptr(&rope.cos),
            sin: self.ptr(&rope.sin),
            inv_freq: self.ptr(&rope.inv_freq),
            positions: TABLE_POSITIONS as u32,
            rot: rot as i32,
        }
    }

    /// The tables a store's offsets turn with (zeros when it has none: the
    /// kernels then read no table).
    pub(crate) fn offset_tables(&self, store: &CudaKvStore) -> Tables {
        match &store.cache {
            KvBuffers::Fp8(c) if let Some(o) = &c.offsets => self.tables(&o.rope, o.rot),
            _ => Tables { cos: 0, sin: 0, inv_freq: 0, positions: 0, rot: store.spec.head_dim as i32 },
        }
    }

    /// Records that keys were written (calibration must come first).
    pub(crate) fn mark_written(store: &mut CudaKvStore) {
        if let KvBuffers::Fp8(c) = &mut store.cache {
            c.written = true;
        }
    }

    /// Shared memory of the kernels that encode one token a block.
    fn token_smem(spec: KvSpec) -> u32 {
        (4 * (2 * spec.kv_dim() + 2 * spec.num_kv_heads)) as u32
    }

    /// `qkv_rope_write` into an fp8 store: Q rotated out, K and V encoded.
    pub(crate) fn fp8_qkv_rope_write(
        &self,
        qkv: &CudaTensor,
        shape: AttentionShape,
        rope: &Rope,
        rows: NewRows<'_>,
        store: &mut CudaKvStore,
        layer: usize,
    ) -> Result<CudaTensor> {
        let _span = self.span("qkv_rope_write");
        let spec = store.spec;
        let (q_cols, kv_cols) = check_qkv(qkv, shape, rope, &rows, spec, layer)?;
        let d = shape.head_dim;
        check_rotation(rope, d)?;
        Self::mark_written(store);
        let q = self.tensor(qkv.rows, q_cols)?;
        let l = self.fp8_layer(store, layer)?;
        let r = self.rope_tables(rope)?;
        let t = self.tables(&r, rope.dim());
        let (pos, slots) = (self.meta(rows.positions)?, self.meta(rows.slots)?);
        let (qp, src, pp, sp) = (self.tp(&q), self.tp(qkv), self.ptr(&pos), self.ptr(&slots));
        let (qc, kvc, hd) = (q_cols as i32, kv_cols as i32, d as i32);
        let cfg = LaunchConfig { shared_mem_bytes: Self::token_smem(spec), ..Self::rows_cfg(qkv.rows, 128) };
        self.launch_pdl(
            &self.k.qkv_rope_write_fp8,
            cfg,
            &[
                &qp,
                &l.k,
                &l.v,
                &l.k_scale,
                &l.v_scale,
                &l.positions,
                &src,
                &pp,
                &sp,
                &qc,
                &kvc,
                &hd,
                &t.rot,
                &t.cos,
                &t.sin,
                &t.inv_freq,
                &t.positions,
                &l.offsets,
            ],
        )?;
        Ok(q)
    }

    /// `write_kv` into an fp8 store (keys already rotated by `rope`).
    pub(crate) fn fp8_write_kv(
        &self,
        store: &mut CudaKvStore,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        rows: NewRows<'_>,
        rope: &Rope,
    ) -> Result<()> {
        let _span = self.span("write_kv");
        let spec = store.spec;
        let (slots, kv_dim) = (rows.slots, spec.kv_dim());
        spec.check(layer, slots)?;
        if k.rows != slots.len()
            || v.rows != slots.len()
            || rows.positions.len() != slots.len()
            || k.cols != kv_dim
            || v.cols != kv_dim
        {
            return Err(shape_err(format!("write_kv: {} slots for K [{}, {}]", slots.len(), k.rows, k.cols)));
        }
        check_rotation(rope, spec.head_dim)?;
        Self::mark_written(store);
        let l = self.fp8_layer(store, layer)?;
        let r = self.rope_tables(rope)?;
        let t = self.tables(&r, rope.dim());
        let (pos, s) = (self.meta(rows.positions)?, self.meta(slots)?);
        let (kp, vp, pp, sp) = (self.tp(k), self.tp(v), self.ptr(&pos), self.ptr(&s));
        let (d, hd) = (kv_dim as i32, spec.head_dim as i32);
        let cfg = LaunchConfig { shared_mem_bytes: Self::token_smem(spec), ..Self::rows_cfg(slots.len(), 128) };
        self.launch(
            &self.k.write_kv_fp8,
            cfg,
            &[
                &l.k,
                &l.v,
                &l.k_scale,
                &l.v_scale,
                &l.positions,
                &kp,
                &vp,
                &pp,
                &sp,
                &d,
                &hd,
                &t.rot,
                &t.cos,
                &t.sin,
                &t.inv_freq,
                &t.positions,
                &l.offsets,
            ],
        )
    }

    /// `gather_kv` of an fp8 store: keys (offsets added back) and values as bf16.
    pub(crate) fn fp8_gather_kv(
        &self,
        store: &CudaKvStore,
        layer: usize,
        slots: &[u32],
    ) -> Result<(CudaTensor, CudaTensor)> {
        let _span = self.span("gather_kv");
        let spec = store.spec;
        spec.check(layer, slots)?;
        let kv_dim = spec.kv_dim();
        let (k, v) = (self.tensor(slots.len(), kv_dim)?, self.tensor(slots.len(), kv_dim)?);
        let l = self.fp8_layer(store, layer)?;
        let t = self.offset_tables(store);
        let s = self.meta(slots)?;
        let (kp, vp, sp, d, hd) = (self.tp(&k), self.tp(&v), self.ptr(&s), kv_dim as i32, spec.head_dim as i32);
        self.launch(
            &self.k.gather_kv_fp8,
            Self::rows_cfg(slots.len(), 256),
            &[
                &kp,
                &vp,
                &l.k,
                &l.v,
                &l.k_scale,
                &l.v_scale,
                &l.positions,
                &sp,
                &d,
                &hd,
                &t.rot,
                &t.cos,
                &t.sin,
                &t.inv_freq,
                &t.positions,
                &l.offsets,
            ],
        )?;
        Ok((k, v))
    }

    /// `copy_blocks` of an fp8 store: codes, scales and positions.
    pub(crate) fn fp8_copy_blocks(&self, store: &CudaKvStore, pairs: &[(u32, u32)]) -> Result<()> {
        let _span = self.span("copy_blocks");
        let spec = store.spec;
        let KvBuffers::Fp8(c) = &store.cache else {
            return Err(shape_err("fp8 copy of a bf16 KV store".into()));
        };
        self.await_all_layers(store)?;
        let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
        let dev = self.stream.clone_htod(if flat.is_empty() { &[0u32][..] } else { &flat }).cu()?;
        let ptrs = [&c.k, &c.v].map(|b| self.ptr(b));
        let (ks, vs, kpos, pp) = (self.ptr(&c.k_scale), self.ptr(&c.v_scale), self.ptr(&c.positions), self.ptr(&dev));
        let (layer_codes, layer_scales) = (store.layer_elems, spec.capacity() * spec.num_kv_heads);
        let block_codes = (spec.block_size * spec.kv_dim()) as i32;
        let (block_scales, bs) = ((spec.block_size * spec.num_kv_heads) as i32, spec.block_size as i32);
        let cfg = LaunchConfig {
            grid_dim: (pairs.len() as u32, spec.num_layers as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            &self.k.copy_blocks_fp8,
            cfg,
            &[&ptrs[0], &ptrs[1], &ks, &vs, &kpos, &pp, &layer_codes, &layer_scales, &block_codes, &block_scales, &bs],
        )
    }
}

/// The fp8 kernels turn pairs 8 dimensions at a time (attention's decode of
/// a key) and read 16-byte words of codes: rot/2 and head_dim multiples of 8.
fn check_rotation(rope: &Rope, head_dim: usize) -> Result<()> {
    let rot = rope.dim();
    if rot > head_dim || !(rot / 2).is_multiple_of(8) || !head_dim.is_multiple_of(16) {
        return Err(shape_err(format!(
            "fp8 KV cache: a rotary dimension of {rot} in heads of {head_dim} (the kernels need rot/2 a multiple of 8)"
        )));
    }
    Ok(())
}

impl CudaBackend {
    /// How many f32 bit patterns the fp8 cache's encoder (`e4m3x2` in
    /// kernels/kv_fp8.cu: the hardware's conversion from sm_89 on) codes
    /// otherwise than the CPU's rule (`f32_to_e4m3` there, `fp8::f32_to_e4m3`
    /// here): `[non-NaN inputs, NaN inputs, control]`, the control counting
    /// against the rule with each pair's codes swapped. All 2³² patterns,
    /// a few milliseconds.
    pub fn e4m3_encode_mismatches(&self) -> Result<[u64; 3]> {
        self.count_over_f32(&self.k.e4m3_encode_mismatches)
    }

    /// How the injection's divisions by a row's scale (`Fp8Divisor` in
    /// kernels/kv_fp8.cu: a reciprocal a row and two fused corrections a
    /// value) differ from `__fdiv_rn` over every f32 bit pattern, each with a
    /// row maximum drawn from its hash: `[codes, quotients that can code
    /// non-zero, control]`, the control counting the codes of the
    /// uncorrected product. A few milliseconds.
    pub fn fp8_divisor_mismatches(&self) -> Result<[u64; 3]> {
        self.count_over_f32(&self.k.fp8_divisor_mismatches)
    }

    /// Runs one of the checks that sweep every f32 bit pattern (a kernel
    /// taking three u64 counters) over the whole device; its counters.
    fn count_over_f32(&self, kernel: &cudarc::driver::CudaFunction) -> Result<[u64; 3]> {
        let counts = self.stream.alloc_zeros::<u64>(3).cu()?;
        let cfg =
            LaunchConfig { grid_dim: (self.sm_count as u32 * 8, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(kernel, cfg, &[&self.ptr(&counts)])?;
        let got = self.stream.clone_dtoh(&counts).cu()?;
        Ok([got[0], got[1], got[2]])
    }
}
