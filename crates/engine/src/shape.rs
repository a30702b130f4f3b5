//! Shapes of host tensors, as every backend and the stored formats read them.

use inferscale_model::HostTensor;

use crate::error::{EngineError, Result};

/// `(rows, cols)` of a 1-D (one row) or 2-D host tensor whose data fits its
/// shape: what every backend's `upload` accepts.
pub fn matrix_dims(t: &HostTensor) -> Result<(usize, usize)> {
    let (rows, cols) = match t.shape.as_slice() {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        s => return Err(EngineError::Shape(format!("a {}-D tensor where a matrix is needed", s.len()))),
    };
    if rows * cols != t.data.len() {
        return Err(EngineError::Shape(format!("shape {:?} for {} values", t.shape, t.data.len())));
    }
    Ok((rows, cols))
}
