//! Telling damage from a torn tail, and getting records back from a
//! damaged log ([`crate::log`]'s frames: `[u32 len][u32 crc][payload]`).
//!
//! A crash can only tear the end of a log: the last append's write is cut
//! short (a partial frame header, or a payload that stops before its
//! length says) or, after a power loss, left as zeros. Anything else — a
//! frame that fails its checksum with intact frames after it, a length no
//! append writes, a whole final frame whose checksum fails — is damage to
//! bytes that were written and synced: a flipped bit, a bad sector.
//! Damage is never cut away (that would drop every acknowledged record
//! after it); it is reported, and [`salvage`] recovers what it can.
//!
//! What salvage recovers: every intact frame (found again after a damaged
//! one by [`resync`]); a frame whose only damage is its length field (the
//! checksum, which covers the length, confirms the length found by
//! resync); and a frame with one damaged byte anywhere — in its length,
//! its payload or its stored checksum — corrected when exactly one
//! single-byte change makes its checksum match (CRC-32 is linear, so the
//! error's position and value follow from the mismatch in one pass over
//! the frame; see [`correct_one_byte`]). The caller checks that a
//! corrected record still decodes.

use crate::frame::{FRAME_BYTES, HEADER, MAX_RECORD_BYTES, checksum};

/// What is past the last intact frame of a log's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tail {
    /// Nothing: the log ends on a frame boundary.
    Clean,
    /// An append cut short by a crash: safe to drop.
    Torn(String),
    /// Written bytes that fail their checks: not to be dropped.
    Damaged(String),
}

/// What `bytes[at..]` is, `at` being where replay found no intact frame
/// (`why` says what was wrong there).
pub fn classify(bytes: &[u8], at: usize, why: &str) -> Tail {
    let rest = &bytes[at.min(bytes.len())..];
    if rest.is_empty() {
        return Tail::Clean;
    }
    let after = |reason: &str| match resync(bytes, at + 1) {
        Some(q) => format!("{reason}; intact records follow at byte {q}"),
        None => reason.to_string(),
    };
    if rest.len() < FRAME_BYTES {
        return Tail::Torn(format!("torn frame header ({} of {FRAME_BYTES} bytes)", rest.len()));
    }
    if rest.iter().all(|&b| b == 0) {
        return Tail::Torn(format!("a zero-filled tail of {} bytes", rest.len()));
    }
    let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
    let short = len <= MAX_RECORD_BYTES && FRAME_BYTES + len > rest.len();
    // A payload cut short is what a crash leaves — unless intact frames
    // follow, or the damage is a length field (the checksum then fits the
    // bytes that are there).
    if short && resync(bytes, at + 1).is_none() && repair_length(bytes, at).is_none() {
        return Tail::Torn(format!("torn payload ({} of {len} bytes)", rest.len() - FRAME_BYTES));
    }
    Tail::Damaged(after(why))
}

/// The first offset from `from` where an intact frame starts that is
/// followed by the end of the log or by a plausible frame header (a length
/// that fits in what is left): the next record after damage. The header
/// test rules out almost every offset before a checksum is computed.
pub fn resync(bytes: &[u8], from: usize) -> Option<usize> {
    let n = bytes.len();
    let word = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
    let mut q = from.max(HEADER.len());
    while q + FRAME_BYTES <= n {
        let len = word(q);
        let end = q + FRAME_BYTES + len;
        if len <= MAX_RECORD_BYTES && end <= n {
            let next_fits = end == n || n - end < FRAME_BYTES || word(end) <= n - end - FRAME_BYTES;
            if next_fits && frame_ok(bytes, q) {
                return Some(q);
            }
        }
        q += 1;
    }
    None
}

/// Whether an intact frame starts at `at`.
fn frame_ok(bytes: &[u8], at: usize) -> bool {
    let Some(head) = bytes.get(at..at + FRAME_BYTES) else { return false };
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    bytes
        .get(at + FRAME_BYTES..at + FRAME_BYTES + len)
        .is_some_and(|p| checksum([head[0], head[1], head[2], head[3]], p) == crc)
}

/// The payload of a frame at `at` whose length field is damaged but whose
/// payload and checksum are intact: the payload runs to the next intact
/// frame (or the end), and the checksum of that length confirms it.
fn repair_length(bytes: &[u8], at: usize) -> Option<(Vec<u8>, usize)> {
    let end = resync(bytes, at + 1).unwrap_or(bytes.len());
    let payload = bytes.get(at + FRAME_BYTES..end)?;
    let len = u32::try_from(payload.len()).ok()?.to_le_bytes();
    let crc = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
    (checksum(len, payload) == crc).then(|| (payload.to_vec(), end))
}

/// What [`salvage`] got back from a log's bytes.
#[derive(Debug, Default)]
pub struct Salvaged {
    /// Every record recovered, in log order.
    pub records: Vec<Vec<u8>>,
    /// Byte offsets of the frames recovered by correcting them.
    pub corrected: Vec<u64>,
    /// Byte ranges `(start, end)` dropped as unrecoverable.
    pub lost: Vec<(u64, u64)>,
    /// Bytes of a torn tail dropped (an append a crash cut short).
    pub torn: u64,
}

/// Every record of a log's `bytes` that can be recovered (see the module
/// doc). `plausible` checks a corrected record (e.g. that it decodes):
/// a correction it refuses is not made.
pub fn salvage(bytes: &[u8], plausible: impl Fn(&[u8]) -> bool) -> Salvaged {
    let mut out = Salvaged::default();
    let n = bytes.len();
    let mut at = HEADER.len().min(n);
    while at < n {
        if frame_ok(bytes, at) {
            let len = u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
            out.records.push(bytes[at + FRAME_BYTES..at + FRAME_BYTES + len].to_vec());
            at += FRAME_BYTES + len;
            continue;
        }
        if let Tail::Torn(_) = classify(bytes, at, "") {
            out.torn = (n - at) as u64;
            break;
        }
        if let Some((record, end)) = correct(bytes, at).filter(|(r, _)| plausible(r)) {
            out.corrected.push(at as u64);
            out.records.push(record);
            at = end;
            continue;
        }
        let next = resync(bytes, at + 1).unwrap_or(n);
        out.lost.push((at as u64, next as u64));
        at = next;
    }
    out
}

/// The record of a damaged frame at `at`, corrected, and where the next
/// frame starts: its length field repaired, or one byte of it corrected.
fn correct(bytes: &[u8], at: usize) -> Option<(Vec<u8>, usize)> {
    if let Some(found) = repair_length(bytes, at) {
        return Some(found);
    }
    // One damaged byte, with the frame's extent as its length says or as
    // far as the next intact frame.
    let len = u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
    let ends = [at + FRAME_BYTES + len, resync(bytes, at + 1).unwrap_or(bytes.len())];
    ends.into_iter().filter(|&e| e <= bytes.len() && e >= at + FRAME_BYTES).find_map(|end| {
        let frame = correct_one_byte(&bytes[at..end])?;
        let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
        (FRAME_BYTES + len == frame.len()).then(|| (frame[FRAME_BYTES..].to_vec(), end))
    })
}

/// The reflected CRC-32 table (polynomial 0xEDB88320), the one `crc32fast`
/// computes with.
fn table() -> &'static [u32; 256] {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        std::array::from_fn(|i| (0..8).fold(i as u32, |c, _| if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 }))
    })
}

/// `frame` (a whole frame: length, checksum, payload) with the one byte
/// changed that makes its checksum match, if exactly one such change
/// exists; `None` otherwise (intact frames included).
///
/// The checksum covers `m` = length bytes ‖ payload. CRC-32 is affine:
/// crc(m ⊕ e) = crc(m) ⊕ lin(e), where lin is the CRC with a zero start
/// and no final inversion. So the syndrome s = crc(m) ⊕ stored is lin(e)
/// of the error. An error byte p at k bytes from the end has lin(e) =
/// Z^k(T[p]) (T the table, Z one step over a zero byte); Z is invertible,
/// so walking s back one zero byte at a time and looking each value up
/// among the 256 T[p] finds every single-byte error that fits, in one
/// pass. A damaged byte of the stored checksum shows as a syndrome with
/// one non-zero byte.
pub fn correct_one_byte(frame: &[u8]) -> Option<Vec<u8>> {
    if frame.len() < FRAME_BYTES {
        return None;
    }
    let stored = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
    let len_bytes = [frame[0], frame[1], frame[2], frame[3]];
    let payload = &frame[FRAME_BYTES..];
    let s = checksum(len_bytes, payload) ^ stored;
    if s == 0 {
        return None;
    }
    let t = table();
    // T[p]'s top byte is distinct for every p: it names p when undoing Z.
    let mut by_top = [0u8; 256];
    (0..256).for_each(|p| by_top[(t[p] >> 24) as usize] = p as u8);
    let unstep = |x: u32| {
        let i = by_top[(x >> 24) as usize];
        ((x ^ t[i as usize]) << 8) | i as u32
    };
    let lookup: std::collections::HashMap<u32, u8> = (0..256).map(|p| (t[p], p as u8)).collect();
    // Covered bytes: the 4 length bytes, then the payload.
    let covered = 4 + payload.len();
    let mut fixes = Vec::new();
    let mut u = s;
    for k in 0..covered {
        if let Some(&p) = lookup.get(&u) {
            fixes.push((covered - 1 - k, p));
        }
        u = unstep(u);
    }
    // The stored checksum itself: one byte of it differs from crc(m).
    let checksum_byte = (s.to_le_bytes().iter().filter(|&&b| b != 0).count() == 1)
        .then(|| s.to_le_bytes().iter().position(|&b| b != 0).unwrap_or(0));
    let mut out = frame.to_vec();
    match (fixes.as_slice(), checksum_byte) {
        ([(pos, p)], None) => {
            let i = if *pos < 4 { *pos } else { FRAME_BYTES + pos - 4 };
            out[i] ^= p;
        }
        ([], Some(b)) => out[4 + b] ^= s.to_le_bytes()[b],
        _ => return None,
    }
    let fixed_len = [out[0], out[1], out[2], out[3]];
    let fixed_crc = u32::from_le_bytes([out[4], out[5], out[6], out[7]]);
    (checksum(fixed_len, &out[FRAME_BYTES..]) == fixed_crc).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_le_bytes();
        [&len[..], &checksum(len, payload).to_le_bytes(), payload].concat()
    }

    fn log(records: &[&[u8]]) -> Vec<u8> {
        let mut out = HEADER.to_vec();
        records.iter().for_each(|r| out.extend(frame(r)));
        out
    }

    fn records() -> Vec<Vec<u8>> {
        (0..6).map(|i| (0..40 + 17 * i).map(|j| (j * 31 + i * 7) as u8).collect()).collect()
    }

    #[test]
    fn the_table_is_crc32fasts() {
        let data = b"123456789";
        let mut crc = !0u32;
        for &b in data {
            crc = table()[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
        }
        assert_eq!(!crc, crc32fast::hash(data));
        assert_eq!(!crc, 0xCBF4_3926, "the standard check value");
    }

    #[test]
    fn every_single_byte_error_in_a_frame_is_corrected_exactly() {
        let f = frame(&records()[3]);
        for i in 0..f.len() {
            for p in [0x01u8, 0x80, 0x5a, 0xff] {
                let mut bad = f.clone();
                bad[i] ^= p;
                assert_eq!(correct_one_byte(&bad).as_deref(), Some(&f[..]), "byte {i} ^ {p:#x}");
            }
        }
        assert_eq!(correct_one_byte(&f), None, "an intact frame needs nothing");
        let mut two = f.clone();
        two[10] ^= 0x11;
        two[30] ^= 0x22;
        assert!(
            correct_one_byte(&two).is_none_or(|c| c != f),
            "two damaged bytes are never 'corrected' to the original"
        );
    }

    #[test]
    fn damage_is_told_from_a_torn_tail() {
        let recs = records();
        let refs: Vec<&[u8]> = recs.iter().map(Vec::as_slice).collect();
        let full = log(&refs);
        let second = HEADER.len() + FRAME_BYTES + recs[0].len();
        let last = full.len() - FRAME_BYTES - recs[5].len();
        // Torn: a cut header, a cut payload, zeros after the last frame.
        assert!(matches!(classify(&full[..last + 5], last, "x"), Tail::Torn(_)));
        assert!(matches!(classify(&full[..full.len() - 3], last, "x"), Tail::Torn(_)));
        let mut zeros = full.clone();
        zeros.extend([0u8; 40]);
        assert!(matches!(classify(&zeros, full.len(), "x"), Tail::Torn(_)));
        assert_eq!(classify(&full, full.len(), "x"), Tail::Clean);
        // Damaged: a flipped payload byte in the middle or in the last
        // frame, a flipped length byte (the frame seems to run past the
        // end), garbage after the last frame.
        for (at, i) in [(second, second + 20), (last, full.len() - 1), (second, second + 2), (last, last + 3)] {
            let mut bad = full.clone();
            bad[i] ^= 0x40;
            match classify(&bad, at, "x") {
                Tail::Damaged(_) => {}
                other => panic!("byte {i}: {other:?}"),
            }
        }
        let mut garbage = full.clone();
        garbage.extend([0xffu8; 12]);
        assert!(matches!(classify(&garbage, full.len(), "x"), Tail::Damaged(_)));
    }

    #[test]
    fn salvage_recovers_every_record_around_damage() {
        let recs = records();
        let refs: Vec<&[u8]> = recs.iter().map(Vec::as_slice).collect();
        let full = log(&refs);
        let starts: Vec<usize> = recs
            .iter()
            .scan(HEADER.len(), |at, r| {
                let s = *at;
                *at += FRAME_BYTES + r.len();
                Some(s)
            })
            .collect();
        let any = |_: &[u8]| true;
        // One byte anywhere: every record back, one of them corrected.
        for i in HEADER.len()..full.len() {
            let mut bad = full.clone();
            bad[i] ^= 0x24;
            let s = salvage(&bad, any);
            assert_eq!(s.records, recs, "byte {i}");
            assert_eq!(s.corrected.len(), 1, "byte {i}");
            assert!(s.lost.is_empty() && s.torn == 0, "byte {i}: {s:?}");
        }
        // A record wrecked beyond correction: it alone is lost, the rest back.
        let mut bad = full.clone();
        (starts[2] + 10..starts[2] + 30).for_each(|i| bad[i] ^= 0x5a);
        let s = salvage(&bad, any);
        let mut want = recs.clone();
        want.remove(2);
        assert_eq!(s.records, want);
        assert_eq!(s.lost, [(starts[2] as u64, starts[3] as u64)]);
        // A correction the caller finds implausible is not made.
        let mut one = full.clone();
        one[starts[1] + 12] ^= 0x01;
        let s = salvage(&one, |r| r != recs[1].as_slice());
        assert_eq!(s.records.len(), recs.len() - 1);
        // A torn tail is dropped, not counted as lost.
        let s = salvage(&full[..full.len() - 7], any);
        assert_eq!((s.records.len(), s.torn), (recs.len() - 1, (FRAME_BYTES + recs[5].len() - 7) as u64));
    }
}
