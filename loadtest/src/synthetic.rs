//! Synthetic memory facts (deterministic), for benchmarks and load tests
//! that need users with memory but no dataset.
//!
//! Each fact is about 25 tokens and combines a person, an activity, a place
//! and a time, so that facts are distinct and a question about one of them
//! ("What did Caroline do in Lisbon?") has something to retrieve.

const NAMES: &[&str] =
    &["Caroline", "Melanie", "John", "Maria", "Deborah", "Andrew", "Jolene", "Evan", "Nate", "Audrey", "Gina", "Tim"];
const DID: &[&str] = &[
    "adopted a grey puppy",
    "ran a charity race",
    "started pottery classes",
    "painted a sunset over the harbour",
    "went camping for three nights",
    "joined a neighbourhood book club",
    "repaired an old racing bicycle",
    "baked sourdough bread for friends",
    "began learning the violin",
    "volunteered at the animal shelter",
    "planted tomatoes and basil",
];
const WHERE: &[&str] = &[
    "in Lisbon",
    "near the lake",
    "at the community centre",
    "in the mountains",
    "downtown",
    "at the beach",
    "in Chicago",
];
const WHEN: &[&str] =
    &["on 8 May 2023", "last Saturday", "in early June", "during the winter holidays", "two weeks ago"];

/// Synthetic fact number `i`: who it is about, its text, and a question it answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticFact {
    pub speaker: String,
    pub text: String,
    pub question: String,
}

/// Fact `i` of the endless deterministic sequence.
pub fn synthetic_fact(i: usize) -> SyntheticFact {
    let name = NAMES[i % NAMES.len()];
    let friend = NAMES[(i / NAMES.len() + i + 3) % NAMES.len()];
    let place = WHERE[(i * 3 + i / 7) % WHERE.len()];
    let text = format!(
        "{name} {} {place} {} with {friend}, and said it felt wonderful.",
        DID[(i * 7 + i / 11) % DID.len()],
        WHEN[(i + i / 5) % WHEN.len()]
    );
    SyntheticFact { speaker: name.to_string(), text, question: format!("What did {name} do {place} with {friend}?") }
}

/// The texts of the first `n` synthetic facts.
pub fn synthetic_facts(n: usize) -> Vec<String> {
    (0..n).map(|i| synthetic_fact(i).text).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_are_deterministic_and_mostly_distinct() {
        let a = synthetic_facts(200);
        assert_eq!(a, synthetic_facts(200));
        assert_eq!(
            a[0],
            "Caroline adopted a grey puppy in Lisbon on 8 May 2023 with Maria, and said it felt wonderful."
        );
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), a.len());
        assert!(synthetic_fact(0).question.contains("Caroline"));
    }
}
