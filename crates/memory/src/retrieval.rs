//! Which of a user's facts answer a question.
//!
//! Three rankers, chosen per memory ([`Retriever`]):
//! - **dense**: cosine similarity of sentence embeddings (MiniLM, run by our
//!   engine; the search itself on the host for a user's few facts, else
//!   [`inferscale_engine::Backend::top_k`], a GEMV and a sort on a GPU);
//! - **lexical**: BM25 over each fact's line (speaker, session date, text)
//!   and the texts of the facts stored just before and after it, with the
//!   `bm25` crate's English tokenizer (Unicode normalisation, stop words,
//!   Snowball stemming). The neighbours matter in conversations: the turn
//!   that holds an answer often names the topic only in the question it
//!   answers ("What did you paint?" — "A sunrise over the lake.");
//! - **hybrid** (the default): both rankings fused by weighted reciprocal rank.
//!
//! Dense similarity finds paraphrases but misses the rare words a question
//! shares with its evidence (names of places, pets, books, events); BM25 finds
//! those but not paraphrases. Reciprocal-rank fusion needs no score
//! calibration between the two. The document layout, the weights and the
//! rank constant were chosen on the LoCoMo dev split by recall@20
//! (docs/locomo.md, "Retrieval").

use std::collections::HashMap;

use bm25::{Embedder, EmbedderBuilder, Language, Scorer};

use crate::compose::Composer;
use crate::error::{MemoryError, Result};
use crate::fact::Fact;

/// How facts are ranked for a question.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retriever {
    Dense,
    Lexical,
    #[default]
    Hybrid,
}

impl Retriever {
    pub const ALL: [Retriever; 3] = [Retriever::Dense, Retriever::Lexical, Retriever::Hybrid];

    pub fn as_str(self) -> &'static str {
        match self {
            Retriever::Dense => "dense",
            Retriever::Lexical => "lexical",
            Retriever::Hybrid => "hybrid",
        }
    }
}

impl std::fmt::Display for Retriever {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Retriever {
    type Err = MemoryError;

    fn from_str(s: &str) -> Result<Self> {
        Retriever::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| MemoryError::Invalid {
            what: "retriever",
            reason: format!("`{s}` is not one of dense, lexical, hybrid"),
        })
    }
}

/// A question as the rankers see it: its text (lexical) and its sentence
/// embedding (dense).
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    pub text: &'a str,
    pub embedding: &'a [f32],
}

/// Weights of the dense and the lexical ranking in the fusion: equal, as
/// measured best on the dev split (a heavier lexical side gained < 0.005).
pub const DENSE_WEIGHT: f64 = 1.0;
pub const LEXICAL_WEIGHT: f64 = 1.0;
/// The rank constant of reciprocal-rank fusion: a fact at rank r (0-based)
/// of a ranking adds weight / (RRF_RANK_CONSTANT + r). Lower than the usual
/// 60: the first few places of each ranking are the ones worth trusting.
pub const RRF_RANK_CONSTANT: f64 = 10.0;

/// What BM25 indexes for fact `i`: its line, then the texts of the facts
/// before and after it.
pub(crate) fn lexical_document(facts: &[Fact], i: usize) -> String {
    let f = &facts[i];
    let mut doc = Composer::turn_text(&f.unit.speaker, &f.unit.time, &f.unit.text);
    for j in [i.checked_sub(1), Some(i + 1)].into_iter().flatten() {
        if let Some(n) = facts.get(j) {
            doc.push(' ');
            doc.push_str(&n.unit.text);
        }
    }
    doc
}

/// BM25 over one user's fact lines, built once after the facts change.
pub(crate) struct LexicalIndex {
    embedder: Embedder,
    scorer: Scorer<usize>,
}

impl LexicalIndex {
    pub(crate) fn new(lines: &[&str]) -> Self {
        let embedder = EmbedderBuilder::with_fit_to_corpus(Language::English, lines).build();
        let mut scorer = Scorer::new();
        for (i, line) in lines.iter().enumerate() {
            scorer.upsert(&i, embedder.embed(line));
        }
        LexicalIndex { embedder, scorer }
    }

    /// Facts sharing a term with `query`, best first; equal scores go to the
    /// earlier fact, so the order does not depend on hashing.
    pub(crate) fn rank(&self, query: &str) -> Vec<usize> {
        let mut hits: Vec<(usize, f32)> =
            self.scorer.matches(&self.embedder.embed(query)).into_iter().map(|d| (d.id, d.score)).collect();
        hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        hits.into_iter().map(|(i, _)| i).collect()
    }
}

/// Weighted reciprocal-rank fusion: each fact scores Σ wᵢ / (C + rankᵢ)
/// over the rankings it appears in; the `k` best, ties to the earlier fact.
pub fn fuse(rankings: &[(&[usize], f64)], k: usize) -> Vec<usize> {
    let mut score: HashMap<usize, f64> = HashMap::new();
    for (ranking, weight) in rankings {
        for (r, &i) in ranking.iter().enumerate() {
            *score.entry(i).or_default() += weight / (RRF_RANK_CONSTANT + r as f64);
        }
    }
    let mut all: Vec<(usize, f64)> = score.into_iter().collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.into_iter().take(k).map(|(i, _)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_names_are_refused() {
        for r in Retriever::ALL {
            assert_eq!(r.as_str().parse::<Retriever>().ok(), Some(r));
        }
        let e = "bm25".parse::<Retriever>().expect_err("unknown");
        assert!(e.to_string().contains("`bm25` is not one of dense, lexical, hybrid"), "{e}");
        assert_eq!(Retriever::default(), Retriever::Hybrid);
    }

    #[test]
    fn lexical_ranks_by_shared_rare_words_with_stemming() {
        let lines = [
            "Caroline (8 May 2023): I went to a support group yesterday.",
            "Melanie (8 May 2023): I painted a sunrise over the lake.",
            "Caroline (9 June 2023): My cat Miso loves the garden.",
            "Melanie (9 June 2023): We went camping with the kids.",
        ];
        let idx = LexicalIndex::new(&lines);
        assert_eq!(idx.rank("What did Melanie paint?").first(), Some(&1), "paint ~ painted");
        assert_eq!(idx.rank("What is the name of Caroline's cat?").first(), Some(&2));
        assert_eq!(idx.rank("When did they go camping?").first(), Some(&3));
        assert!(idx.rank("quantum chromodynamics").is_empty(), "no shared term, no hit");
    }

    #[test]
    fn a_lexical_document_holds_the_neighbours_texts() {
        let fact = |id: &str, text: &str| Fact {
            unit: inferscale_types::MemoryUnit {
                id: id.into(),
                speaker: "Mel".into(),
                text: text.into(),
                time: "8 May 2023".into(),
                source_turn: String::new(),
                ..Default::default()
            },
            tokens: Vec::new(),
            embedding: Vec::new(),
            history: Vec::new(),
        };
        let facts = [fact("a", "What did you paint?"), fact("b", "A sunrise."), fact("c", "Lovely!")];
        assert_eq!(lexical_document(&facts, 0), "Mel (8 May 2023): What did you paint? A sunrise.");
        assert_eq!(lexical_document(&facts, 1), "Mel (8 May 2023): A sunrise. What did you paint? Lovely!");
        assert_eq!(lexical_document(&facts, 2), "Mel (8 May 2023): Lovely! A sunrise.");
    }

    #[test]
    fn fusion_favours_facts_both_rankings_rank_high() {
        // Scores with C = 10: 1 → 1/11 + 1/10, 3 → 1/10, 4 → 1/11, 2 → 1/12.
        let dense = [3, 1, 2, 0];
        let lexical = [1, 4];
        assert_eq!(fuse(&[(&dense, 1.0), (&lexical, 1.0)], 3), vec![1, 3, 4]);
        // A heavier lexical ranking lifts its second hit above the dense first.
        assert_eq!(fuse(&[(&dense, 1.0), (&lexical, 3.0)], 2), vec![1, 4]);
        assert_eq!(fuse(&[(&dense, 1.0)], 10), dense.to_vec(), "one ranking passes through");
        assert!(fuse(&[], 5).is_empty());
    }
}
