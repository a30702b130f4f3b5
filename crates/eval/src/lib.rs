//! Evaluation, shared by `inferscale eval` (answer quality through the
//! engine) and the load test (latency through the router's HTTP API):
//! reading LoCoMo-format data ([`locomo`]), scoring answers and retrieval
//! ([`score`]) and drawing results as PNG line charts ([`plot`]).
//!
//! It knows nothing of the engine: a load generator that only speaks HTTP
//! depends on this crate, not on the model stack.

mod error;
pub mod locomo;
pub mod plot;
pub mod score;

pub use error::{EvalError, Result};
