//! kv+blend: selective recompute of injected tokens (docs/design.md §1.2).
//!
//! Injected facts were encoded without each other: a token of fact 7 never
//! attended to facts 1–6. Blend recomputes, in the same forward pass as the
//! question, the injected tokens whose KV a full prefill would change most.
//! Every injected token runs through the layers before [`SELECT_LAYER`] and
//! into that layer's K and V (a little more than 1 of a real model's 24–32
//! layers), where the request's selection ([`BlendSelect`]) ranks it: by the
//! distance of its freshly computed values from the injected ones (the facts
//! alone), by the attention the question's queries pay its fresh key (the
//! question's layer-1 queries are exact, for layer 0 of an injected token
//! is), or by how near it is to the start of its fact. The top `ratio`
//! share go on through that layer's attention and MLP and the remaining
//! layers. A recomputed token writes its K and
//! V over the injected entries at its own cache index, layer by layer, and
//! attends causally by position (`SeqSpan::row_ends`) over the header, the
//! injected and the recomputed KV; the question's tokens come after it in
//! the same pass and see the blended cache.
//!
//! Layer 0 cannot rank anything: a pre-RoPE key or value there depends only
//! on its token, so the injected one is what a prefill computes. Layer 1 is
//! the first where context shows.
//!
//! Exactness anchors (tests/blend.rs): ratio 0 plans nothing, so the
//! sequence stays exactly as kv mode left it; ratio 1 recomputes every
//! injected token at every layer, which is prompt mode's prefill of the
//! facts. In between, the result equals a dense forward with the same rows
//! recomputed at each layer (`tests/common/dense.rs`).
//!
//! Selection is per forward chunk: when a prefill is split into chunks of
//! `max_batch_tokens`, each chunk of candidates keeps its own top share; a
//! chunk that does not hold the question ranks by deviation, for there are
//! no queries yet to rank by.
//! What a chunk computes is exactly what one pass with that selection
//! would: earlier chunks' entries are already final when later ones read
//! them, as in a single pass at each layer.

use std::ops::Range;

use inferscale_types::BlendSelect;

use crate::backend::{AttentionShape, Backend};
use crate::error::{EngineError, Result};

/// The layer whose value deviation ranks the candidates (0-based).
pub const SELECT_LAYER: usize = 1;

/// Injected tokens of one sequence that its next steps recompute:
/// `next..end` are still to go, each chunk keeping `ratio` of its share
/// ranked by `select`, and the last `tail` of them always.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlendPlan {
    pub next: usize,
    pub end: usize,
    pub ratio: f32,
    pub tail: usize,
    pub select: BlendSelect,
    /// Cache indices where the injected facts begin, ascending.
    pub fact_starts: Vec<usize>,
}

impl BlendPlan {
    pub fn remaining(&self) -> usize {
        self.end - self.next
    }

    /// How many of `n` candidates go past the selection layer: `ratio · n`
    /// rounded up (less a hair, so that 0.15 · 100 is 15 although 0.15 is
    /// not exact in f32), at least one of a non-empty chunk, at most all.
    pub fn keep(&self, n: usize) -> usize {
        keep_count(self.ratio, n)
    }

    /// The group of the next candidates, rows `rows` of a batch whose rows
    /// `question` are the sequence's next tokens: how many go on, how many
    /// of its last rows must, and what ranks the others.
    pub fn group(&self, rows: Range<usize>, question: Range<usize>) -> BlendGroup {
        let n = rows.len();
        let tail_from = self.end - self.tail.min(self.end);
        let forced = (self.next + n).saturating_sub(tail_from.max(self.next)).min(n);
        let rank = match self.select {
            BlendSelect::Deviation => Rank::Deviation,
            BlendSelect::Question if question.is_empty() => Rank::Deviation,
            BlendSelect::Question => Rank::Question(question),
            // A candidate's score: minus its distance from its fact's start
            // (`fact_starts` begins with the memory's first token).
            BlendSelect::FactStarts => Rank::Given(
                (self.next..self.next + n)
                    .map(|i| {
                        let at = self.fact_starts.partition_point(|&s| s <= i);
                        let start = at.checked_sub(1).map_or(i, |a| self.fact_starts[a]);
                        -((i - start) as f32)
                    })
                    .collect(),
            ),
        };
        BlendGroup { rows, keep: self.keep(n).max(forced), forced, rank }
    }
}

/// See [`BlendPlan::keep`].
pub fn keep_count(ratio: f32, n: usize) -> usize {
    ((ratio as f64 * n as f64 - 1e-6).ceil().max(0.0) as usize).clamp(n.min(1), n)
}

/// Rows a blend of `injected` tokens at `ratio` adds to the steps that
/// compute the sequence: all of them (each runs up to [`SELECT_LAYER`]),
/// or none at ratio 0. What a scheduler budgets, before the plan exists.
pub fn blend_rows(injected: usize, ratio: f32) -> usize {
    if ratio > 0.0 { injected } else { 0 }
}

/// One sequence's rows of a blend pass: consecutive rows of the batch that
/// recompute injected tokens, how many of them go past [`SELECT_LAYER`],
/// how many of the last ones go on whatever their rank, and what ranks them.
#[derive(Debug, Clone, PartialEq)]
pub struct BlendGroup {
    pub rows: Range<usize>,
    pub keep: usize,
    pub forced: usize,
    pub rank: Rank,
}

/// What ranks a group's candidates at [`SELECT_LAYER`]; the largest go on.
#[derive(Debug, Clone, PartialEq)]
pub enum Rank {
    /// Distance of the recomputed values from the injected ones.
    Deviation,
    /// Attention mass the queries of these rows of the batch (the
    /// sequence's question) pay each candidate's fresh key.
    Question(Range<usize>),
    /// Known before the pass, one per candidate.
    Given(Vec<f32>),
}

/// The blend part of one forward pass, a group per sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlendRows {
    pub groups: Vec<BlendGroup>,
}

impl BlendRows {
    /// Whether some rows stop at the selection layer (else the pass is a plain one).
    pub fn narrows(&self) -> bool {
        self.groups.iter().any(|g| g.keep < g.rows.len())
    }

    /// The candidate rows, group after group.
    pub fn rows(&self) -> Vec<usize> {
        self.groups.iter().flat_map(|g| g.rows.clone()).collect()
    }

    /// Whether some group ranks by deviation (which needs the injected
    /// values read before the selection layer overwrites them).
    pub fn ranks_by_deviation(&self) -> bool {
        self.groups.iter().any(|g| g.rank == Rank::Deviation)
    }

    /// One score per candidate ([`BlendRows::rows`] order): `deviation`
    /// (present when [`BlendRows::ranks_by_deviation`]) for groups ranked by
    /// it, the attention mass of the question's rows of `q` over the
    /// candidates' rows of `keys` (fresh, rotated: one row per candidate) for
    /// groups ranked by the question, the given scores for the rest.
    pub fn scores<B: Backend>(
        &self,
        be: &B,
        q: &B::Tensor,
        keys: &B::Tensor,
        deviation: Option<&[f32]>,
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.groups.iter().map(|g| g.rows.len()).sum());
        for g in &self.groups {
            let at = out.len();
            let n = g.rows.len();
            match &g.rank {
                Rank::Deviation => {
                    let d = deviation.ok_or_else(|| EngineError::Shape("blend deviation not computed".into()))?;
                    out.extend_from_slice(d.get(at..at + n).ok_or_else(|| {
                        EngineError::Shape(format!("{} deviations for candidates {at}..{}", d.len(), at + n))
                    })?);
                }
                Rank::Question(rows) => {
                    let q = be.select_rows(q, &rows.clone().collect::<Vec<_>>())?;
                    let k = be.select_rows(keys, &(at..at + n).collect::<Vec<_>>())?;
                    out.extend(be.attention_mass(&q, &k, shape)?);
                }
                Rank::Given(s) if s.len() == n => out.extend_from_slice(s),
                Rank::Given(s) => return Err(EngineError::Shape(format!("{} scores for {n} candidates", s.len()))),
            }
        }
        Ok(out)
    }

    /// The rows of a `total`-row batch that go on past the selection layer, ascending:
    /// every row outside the groups, and in each group its forced last rows
    /// and, up to `keep` in all, the rows whose `score` (one per
    /// candidate, in [`BlendRows::rows`] order) is largest, ties to the
    /// lower row.
    pub fn kept(&self, total: usize, score: &[f32]) -> Result<Vec<usize>> {
        let candidates: usize = self.groups.iter().map(|g| g.rows.len()).sum();
        if score.len() != candidates {
            return Err(EngineError::Shape(format!("{} scores for {candidates} candidates", score.len())));
        }
        let mut keep = vec![true; total];
        let mut at = 0;
        for g in &self.groups {
            let rows = &g.rows;
            if rows.end > total {
                return Err(EngineError::Shape(format!("blend rows {rows:?} of a {total}-row batch")));
            }
            let dev = &score[at..at + rows.len()];
            at += rows.len();
            let forced_from = rows.len() - g.forced.min(rows.len());
            // Forced rows first, then by score; NaN (a broken value)
            // ranks with the forced: recomputing it is the cure.
            let key = |i: usize| if i >= forced_from || dev[i].is_nan() { f32::INFINITY } else { dev[i] };
            let mut order: Vec<usize> = (0..rows.len()).collect();
            order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
            for &i in &order[g.keep.min(rows.len())..] {
                keep[rows.start + i] = false;
            }
        }
        Ok((0..total).filter(|&r| keep[r]).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_group_keeps_its_most_deviating_rows_in_row_order() {
        let g = |rows, keep, forced| BlendGroup { rows, keep, forced, rank: Rank::Deviation };
        let b = BlendRows { groups: vec![g(1..5, 2, 0), g(6..9, 1, 0)] };
        assert!(b.narrows());
        assert_eq!(b.rows(), vec![1, 2, 3, 4, 6, 7, 8]);
        // Group 1: rows 2 and 4 deviate most; group 2: a tie between 6 and 8 goes to 6.
        let dev = [0.1, 5.0, 0.2, 3.0, 7.0, 1.0, 7.0];
        assert_eq!(b.kept(10, &dev).unwrap(), vec![0, 2, 4, 5, 6, 9]);
        // A NaN deviation is recomputed before any number.
        let dev = [0.1, f32::NAN, 0.2, 3.0, 7.0, 1.0, 7.0];
        assert_eq!(b.kept(10, &dev).unwrap(), vec![0, 2, 4, 5, 6, 9]);
        assert!(b.kept(10, &dev[1..]).is_err());
        assert!(b.kept(8, &dev).is_err());
        let all = BlendRows { groups: vec![g(0..3, 3, 0)] };
        assert!(!all.narrows());
        // The last row of group 1 is forced: it goes on, with the most
        // deviating of the others (row 2), although row 4 deviates more.
        let forced = BlendRows { groups: vec![g(1..5, 2, 1), g(6..9, 1, 0)] };
        let dev = [0.1, 5.0, 7.0, 0.0, 7.0, 1.0, 7.0];
        assert_eq!(forced.kept(10, &dev).unwrap(), vec![0, 3, 4, 5, 6, 9]);
    }

    #[test]
    fn the_tail_is_forced_in_the_chunks_that_hold_it() {
        // 20 injected tokens (cache 10..30), 5 kept in all, the last 3 forced.
        let plan = |next| BlendPlan {
            next,
            end: 30,
            ratio: 0.25,
            tail: 3,
            select: BlendSelect::Deviation,
            fact_starts: vec![10],
        };
        // A chunk of the first 12 holds none of the tail.
        assert_eq!(plan(10).group(0..12, 0..0), BlendGroup { rows: 0..12, keep: 3, forced: 0, rank: Rank::Deviation });
        // The last 8 hold all three: they go on although 0.25 of 8 is 2.
        assert_eq!(
            plan(22).group(4..12, 12..14),
            BlendGroup { rows: 4..12, keep: 3, forced: 3, rank: Rank::Deviation }
        );
        // All 20 in one chunk: 5 kept, 3 of them the tail.
        assert_eq!(plan(10).group(0..20, 0..0), BlendGroup { rows: 0..20, keep: 5, forced: 3, rank: Rank::Deviation });
        // A chunk ending where the tail starts (cache index 27), and ones
        // reaching into it.
        assert_eq!(plan(10).group(0..17, 0..0).forced, 0);
        assert_eq!(plan(10).group(0..18, 0..0).forced, 1);
        assert_eq!(plan(10).group(0..19, 0..0).forced, 2);
    }

    #[test]
    fn a_chunk_keeps_at_least_one_and_at_most_all() {
        let p = |ratio| BlendPlan {
            next: 0,
            end: 10,
            ratio,
            tail: 0,
            select: BlendSelect::Deviation,
            fact_starts: vec![0],
        };
        assert_eq!((p(0.15).keep(100), p(0.15).keep(3), p(0.15).keep(0)), (15, 1, 0));
        assert_eq!((p(1.0).keep(7), p(0.001).keep(7), p(0.5).keep(7)), (7, 1, 4));
    }
}
