//! Decode steps replayed from captured graphs against the same steps run op
//! by op, on the same device (`graphs.rs`): the logits of every step,
//! teacher-forced on the op-by-op run's tokens, over a batch that shrinks
//! as its sequences finish (so several graph sizes are captured, and the
//! smaller batches are padded) with contexts from a few tokens to more
//! than a thousand (several key splits).

use inferscale_engine::backend::Backend;
use inferscale_engine::sampling::argmax;
use inferscale_engine::{Engine, EngineConfig, EngineError, Sequence};
use inferscale_model::ModelFiles;

use super::{Check, OP_TOL, R, Report, rel};

/// Prompt lengths of the sequences, and how many tokens each decodes.
const PROMPTS: [(usize, usize); 5] = [(3, 24), (17, 6), (40, 14), (300, 24), (1100, 10)];

/// The checks on `files` (none where `gpu` has no decode graphs).
pub fn decode_graphs<G: Backend + Clone>(gpu: &G, name: &str, files: &ModelFiles) -> R<Report> {
    if gpu.decode_graph_rows(1).is_none() {
        return Ok(Report::new());
    }
    let cfg = EngineConfig { kv_blocks: 256, max_batch_tokens: 2048 };
    let mut eager = Engine::new(gpu.clone(), files, cfg)?;
    let mut graphed = Engine::new(gpu.clone(), files, cfg)?;
    graphed.enable_decode_graphs()?;
    let vocab = files.config.vocab_size as u32;
    let prompt = |i: usize, n: usize| (0..n as u32).map(|j| 3 + (i as u32 * 7919 + j * 131) % (vocab - 3)).collect();
    let mut seqs: Vec<(Sequence, Sequence)> = Vec::new();
    for (i, &(n, _)) in PROMPTS.iter().enumerate() {
        let (mut a, mut b) = (eager.new_sequence(prompt(i, n))?, graphed.new_sequence(prompt(i, n))?);
        let first = argmax(&eager.prefill(&mut a)?);
        graphed.prefill(&mut b)?;
        a.push(first);
        b.push(first);
        seqs.push((a, b));
    }
    let (mut worst, mut control, mut steps) = (0f64, f64::INFINITY, 0u64);
    for t in 0..PROMPTS.iter().map(|p| p.1).max().unwrap_or(0) {
        let active: Vec<usize> = (0..PROMPTS.len()).filter(|&i| PROMPTS[i].1 > t).collect();
        let (mut ea, mut ga): (Vec<&mut Sequence>, Vec<&mut Sequence>) = (Vec::new(), Vec::new());
        for (i, (a, b)) in seqs.iter_mut().enumerate() {
            if active.contains(&i) {
                ea.push(a);
                ga.push(b);
            }
        }
        let (e, g) = (eager.step(&mut ea)?, graphed.step(&mut ga)?);
        steps += 1;
        let rows: Vec<(Vec<f32>, Vec<f32>)> = e
            .into_iter()
            .zip(g)
            .map(|pair| match pair {
                (Some(e), Some(g)) => Ok((e, g)),
                _ => Err(EngineError::Shape("a decode step without logits".into())),
            })
            .collect::<R<_>>()?;
        for (j, (e, g)) in rows.iter().enumerate() {
            worst = worst.max(rel(g, e));
            // Control: the graphed row against another sequence's logits.
            if rows.len() > 1 {
                control = control.min(rel(g, &rows[(j + 1) % rows.len()].0));
            }
        }
        let next: Vec<u32> = rows.iter().map(|(e, _)| argmax(e)).collect();
        for (s, &tok) in ea.iter_mut().zip(&next) {
            s.push(tok);
        }
        for (s, &tok) in ga.iter_mut().zip(&next) {
            s.push(tok);
        }
    }
    let (captured, replayed) = graphed.decode_graph_counts().unwrap_or((0, 0));
    let name = |what: &str| format!("{name}: decode graphs, {what}");
    Ok(vec![
        Check { name: name("logits vs op by op (same device)"), error: worst, tolerance: OP_TOL, control: false },
        Check { name: name("control: another sequence's logits"), error: control, tolerance: OP_TOL, control: true },
        // Every step but each size's first (its capture) is replayed.
        Check {
            name: name(&format!("steps not replayed ({captured} captures, {replayed} of {steps} replayed)")),
            error: (steps - replayed.min(steps)) as f64 / steps.max(1) as f64,
            tolerance: 0.5,
            control: false,
        },
    ])
}
