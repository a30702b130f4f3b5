//! LoCoMo scoring: token F1 with LoCoMo's normalisation and category rules,
//! retrieval recall, and the kv-vs-prompt divergence of first tokens.
//!
//! Normalisation follows LoCoMo's evaluation code: drop commas, lower-case,
//! strip punctuation, drop the words a/an/the/and, collapse whitespace.
//! (LoCoMo's script also Porter-stems tokens; we do not, so scores can be a
//! little lower than theirs on inflected words — the same for every mode.)
//! Category 1 (multi-hop) answers are comma-split and each gold part takes
//! the best-matching predicted part; category 3 keeps the gold text before
//! ';'.

use std::collections::HashMap;

fn normalize(s: &str) -> Vec<String> {
    let s: String = s.replace(',', "").to_lowercase().chars().filter(|c| !c.is_ascii_punctuation()).collect();
    s.split_whitespace().filter(|w| !matches!(*w, "a" | "an" | "the" | "and")).map(str::to_string).collect()
}

/// Token F1 between a prediction and one gold answer.
pub fn token_f1(prediction: &str, gold: &str) -> f64 {
    let (p, g) = (normalize(prediction), normalize(gold));
    if p.is_empty() || g.is_empty() {
        return 0.0;
    }
    let mut counts: HashMap<&str, i32> = HashMap::new();
    for w in &g {
        *counts.entry(w).or_default() += 1;
    }
    let mut same = 0;
    for w in &p {
        if let Some(c) = counts.get_mut(w.as_str())
            && *c > 0
        {
            *c -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return 0.0;
    }
    let (precision, recall) = (same as f64 / p.len() as f64, same as f64 / g.len() as f64);
    2.0 * precision * recall / (precision + recall)
}

/// F1 of `prediction` against `gold` under LoCoMo's rules for `category`.
pub fn locomo_f1(prediction: &str, gold: &str, category: u8) -> f64 {
    match category {
        1 => {
            let preds: Vec<&str> = prediction.split(',').map(str::trim).collect();
            let golds: Vec<&str> = gold.split(',').map(str::trim).collect();
            let best = |g: &str| preds.iter().map(|p| token_f1(p, g)).fold(0.0, f64::max);
            golds.iter().map(|g| best(g)).sum::<f64>() / golds.len() as f64
        }
        3 => token_f1(prediction, gold.split(';').next().unwrap_or(gold).trim()),
        _ => token_f1(prediction, gold),
    }
}

/// Whether an answer copies the label a stored turn carries in the memory
/// block, `Speaker (date):` — a name (one or two capitalised words), a
/// parenthesis holding a digit, a colon. It does not know the speakers, so
/// it also counts "Paris (1998): …"-shaped text, which LoCoMo answers do
/// not contain.
pub fn copies_label(answer: &str) -> bool {
    answer.match_indices(" (").any(|(at, _)| {
        let before = &answer[..at];
        let name = before.rsplit(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '-' || c == '.')).next();
        let Some(inner_end) = answer[at + 2..].find(')') else { return false };
        let inner = &answer[at + 2..at + 2 + inner_end];
        let after = &answer[at + 2 + inner_end + 1..];
        name.is_some_and(|n| n.chars().next().is_some_and(char::is_uppercase))
            && !inner.contains('(')
            && inner.chars().any(|c| c.is_ascii_digit())
            && after.starts_with(':')
    })
}

/// Share of `evidence` ids found among `retrieved`; `None` without evidence.
pub fn recall(retrieved: &[&str], evidence: &[String]) -> Option<f64> {
    if evidence.is_empty() {
        return None;
    }
    let hit = evidence.iter().filter(|e| retrieved.contains(&e.as_str())).count();
    Some(hit as f64 / evidence.len() as f64)
}

/// log-softmax in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// KL(p ‖ q) of two distributions given as log-probabilities.
pub fn kl(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p.iter().zip(log_q).map(|(&lp, &lq)| lp.exp() * (lp - lq)).sum::<f64>().max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_recognised() {
        assert!(copies_label("Caroline (1:56 pm on 8 May, 2023): I went to the group"));
        assert!(copies_label("She said Melanie (2023): hi"));
        assert!(copies_label("Jean-Luc (7 May 2023):"));
        assert!(!copies_label("Caroline went to the LGBTQ support group on 8 May, 2023."));
        assert!(!copies_label("a painting (2023) of a sunset: lovely"));
        assert!(!copies_label("the group (on 8 May): yes"));
        assert!(!copies_label("Melanie (her friend): a painter"));
        assert!(!copies_label("Caroline (8 May"));
    }

    #[test]
    fn f1_follows_locomo_normalisation() {
        assert_eq!(token_f1("The Lisbon, Portugal!", "lisbon portugal"), 1.0);
        assert_eq!(token_f1("a cat and a dog", "cat dog"), 1.0);
        assert_eq!(token_f1("", "x"), 0.0);
        let f = token_f1("she went to Lisbon", "Lisbon");
        assert!((f - 0.4).abs() < 1e-12, "{f}"); // p = 1/4, r = 1
    }

    #[test]
    fn category_rules() {
        // Multi-hop: each gold part takes its best prediction part.
        assert_eq!(locomo_f1("painting, running", "running, painting", 1), 1.0);
        assert_eq!(locomo_f1("painting", "running, painting", 1), 0.5);
        // Open-domain: gold before ';' only.
        assert_eq!(locomo_f1("likely yes", "likely yes; because she said so", 3), 1.0);
    }

    #[test]
    fn recall_and_kl() {
        assert_eq!(recall(&["D1:1", "D2:2"], &["D2:2".into(), "D3:3".into()]), Some(0.5));
        assert_eq!(recall(&["D1:1"], &[]), None);
        let p = log_softmax(&[1.0, 2.0, 3.0]);
        assert!(kl(&p, &p).abs() < 1e-12);
        assert!(kl(&p, &log_softmax(&[3.0, 2.0, 1.0])) > 0.1);
    }
}
