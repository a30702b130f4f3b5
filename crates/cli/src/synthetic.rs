//! Synthetic memory facts for benchmarks.

/// `n` distinct synthetic facts of about 25 tokens each (deterministic).
pub fn synthetic_facts(n: usize) -> Vec<String> {
    const NAMES: &[&str] = &[
        "Caroline", "Melanie", "John", "Maria", "Deborah", "Andrew", "Jolene", "Evan", "Nate", "Audrey", "Gina", "Tim",
    ];
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
    (0..n)
        .map(|i| {
            let name = NAMES[i % NAMES.len()];
            let friend = NAMES[(i / NAMES.len() + i + 3) % NAMES.len()];
            format!(
                "{name} {} {} {} with {friend}, and said it felt wonderful.",
                DID[(i * 7 + i / 11) % DID.len()],
                WHERE[(i * 3 + i / 7) % WHERE.len()],
                WHEN[(i + i / 5) % WHEN.len()]
            )
        })
        .collect()
}
