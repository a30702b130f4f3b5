//! Retrieval on the device. A user's fact embeddings stay in device memory
//! (f32, as the host reference scores them); a query is scored by one GEMV
//! (`inner_products` in kernels/retrieval.cu) and ranked by one block
//! (`top_k_sorted`, up to [`TOP_K_SORT_ROWS`] rows; a user with more facts
//! has its scores ranked on the host). Only the query goes up and only the
//! k ids come back.

use cudarc::driver::{CudaSlice, LaunchConfig};
use inferscale_engine::Result;
use inferscale_engine::backend::Retrieval;
use inferscale_engine::retrieval::{check_query, check_rows, rank};

use crate::backend::{Cu, CudaBackend};
use crate::kernels::TOP_K_SORT_ROWS;

/// Embeddings in device memory, `[rows, dim]` f32.
pub struct CudaEmbeddings {
    data: CudaSlice<f32>,
    rows: usize,
    dim: usize,
}

impl CudaBackend {
    pub(crate) fn embeddings(&self, rows: &[f32], dim: usize) -> Result<CudaEmbeddings> {
        check_rows(rows.len(), dim)?;
        // An empty index still gets a (one-value) buffer to point at.
        let data = self.stream.clone_htod(if rows.is_empty() { &[0.0f32][..] } else { rows }).cu()?;
        Ok(CudaEmbeddings { data, rows: rows.len().checked_div(dim).unwrap_or(0), dim })
    }

    pub(crate) fn top_k_device(&self, e: &CudaEmbeddings, query: &[f32], k: usize) -> Result<Vec<u32>> {
        check_query(e.dim, e.rows, query, k)?;
        if e.rows == 0 {
            return Ok(Vec::new());
        }
        let _span = self.span("top_k");
        let k = k.min(e.rows);
        let q = self.stream.clone_htod(query).cu()?;
        // SAFETY: inner_products writes every row's score.
        let scores = unsafe { self.stream.alloc::<f32>(e.rows) }.cu()?;
        let (sp, ep, qp, r, d) = (self.ptr(&scores), self.ptr(&e.data), self.ptr(&q), e.rows as i32, e.dim as i32);
        // Eight warps per block, a warp per row.
        let cfg =
            LaunchConfig { grid_dim: (e.rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(&self.k.inner_products, cfg, &[&sp, &ep, &qp, &r, &d])?;
        if e.rows > TOP_K_SORT_ROWS {
            return Ok(rank(&self.stream.clone_dtoh(&scores).cu()?, k));
        }
        let n = e.rows.next_power_of_two().max(2);
        // SAFETY: top_k_sorted writes all k ids.
        let ids = unsafe { self.stream.alloc::<u32>(k) }.cu()?;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: (8 * n) as u32 };
        let (ip, np, kp) = (self.ptr(&ids), n as i32, k as i32);
        self.launch(&self.k.top_k_sorted, cfg, &[&ip, &sp, &r, &np, &kp])?;
        self.stream.clone_dtoh(&ids).cu()
    }
}

impl Retrieval for CudaBackend {
    type Embeddings = CudaEmbeddings;

    fn upload_embeddings(&self, rows: &[f32], dim: usize) -> Result<CudaEmbeddings> {
        self.embeddings(rows, dim)
    }

    fn top_k(&self, e: &CudaEmbeddings, query: &[f32], k: usize) -> Result<Vec<u32>> {
        self.top_k_device(e, query, k)
    }
}
