//! Exact top-k retrieval by inner product: the reference every backend's
//! [`Backend::top_k`](crate::backend::Backend::top_k) must agree with.
//!
//! A user's facts are few (hundreds to thousands of 384-d embeddings), so an
//! exhaustive search is both exact and cheap; what a device backend adds is
//! keeping a large user's embeddings beside the model and doing the scoring
//! as one GEMV. The memory searches small users on the host with [`rank`]
//! and this arithmetic: a device search waits on the engine's stream.

use crate::error::{EngineError, Result};

/// Embeddings on the host, `[n, dim]` row-major (the CPU backend's index,
/// and what device backends upload from).
#[derive(Debug, Clone, Default)]
pub struct HostEmbeddings {
    pub data: Vec<f32>,
    pub dim: usize,
}

impl HostEmbeddings {
    /// `data` as rows of `dim` values; an error when it is not whole rows.
    pub fn new(data: Vec<f32>, dim: usize) -> Result<Self> {
        check_rows(data.len(), dim)?;
        Ok(HostEmbeddings { data, dim })
    }

    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.dim).unwrap_or(0)
    }
}

/// `len` values are whole rows of `dim` (an empty index may have any `dim`).
pub fn check_rows(len: usize, dim: usize) -> Result<()> {
    if len > 0 && (dim == 0 || !len.is_multiple_of(dim)) {
        return Err(EngineError::Shape(format!("{len} embedding values are not rows of {dim}")));
    }
    Ok(())
}

/// The query fits the index, and `k` asks for something.
pub fn check_query(dim: usize, rows: usize, query: &[f32], k: usize) -> Result<()> {
    if k == 0 {
        return Err(EngineError::Shape("top-k with k = 0".into()));
    }
    if rows > 0 && query.len() != dim {
        return Err(EngineError::Shape(format!("query of {} values for embeddings of {dim}", query.len())));
    }
    Ok(())
}

/// Rows of `scores` in retrieval order: highest score first, ties to the
/// lower index (an older fact) — the order every backend returns.
pub fn rank(scores: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<(f32, u32)> = scores.iter().copied().zip(0u32..).collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    order.into_iter().take(k).map(|(_, i)| i).collect()
}

/// The `k` rows of `e` with the largest inner product with `query`, best first.
pub fn top_k_host(e: &HostEmbeddings, query: &[f32], k: usize) -> Result<Vec<u32>> {
    check_query(e.dim, e.rows(), query, k)?;
    if e.rows() == 0 {
        return Ok(Vec::new());
    }
    let scores: Vec<f32> = e.data.chunks_exact(e.dim).map(|r| r.iter().zip(query).map(|(a, b)| a * b).sum()).collect();
    Ok(rank(&scores, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_ties_to_the_older_row() {
        // Rows 1 and 3 are equal and best; row 0 next; row 2 last.
        let e = HostEmbeddings::new(vec![0.5, 0.0, 1.0, 0.0, -1.0, 0.0, 1.0, 0.0], 2).unwrap();
        assert_eq!(top_k_host(&e, &[1.0, 0.0], 3).unwrap(), [1, 3, 0]);
        assert_eq!(top_k_host(&e, &[1.0, 0.0], 10).unwrap(), [1, 3, 0, 2]);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(HostEmbeddings::new(vec![0.0; 5], 2).is_err());
        let e = HostEmbeddings::new(vec![0.0; 4], 2).unwrap();
        assert!(top_k_host(&e, &[1.0, 0.0, 0.0], 1).is_err());
        assert!(top_k_host(&e, &[1.0, 0.0], 0).is_err());
        assert!(top_k_host(&HostEmbeddings::default(), &[1.0], 3).unwrap().is_empty());
    }
}
