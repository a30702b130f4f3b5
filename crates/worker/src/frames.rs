//! A shard cut into fixed-size frames, for transports that move buffers of
//! sizes both ends know in advance — NCCL send/recv between two GPUs of one
//! host, where the KV (the bulk of a shard) goes device to device.
//!
//! The control channel (gRPC) carries a [`Manifest`]: every record's fact
//! bytes inline, and its KV's length and the record's checksum. The KV
//! payloads, concatenated in record order, travel as frames of
//! `frame_bytes` (the last one shorter), so the receiver posts each receive
//! with the right size from the manifest alone. A frame may end inside a
//! record; the [`Reassembler`] carries the partial record over and hands out
//! each record once its last byte has arrived and its checksum holds.
//!
//! Pure data layout, no transport (any link can carry it), and it
//! is tested on the CPU.

use inferscale_memory::ShardRecord;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestEntry {
    pub fact: Vec<u8>,
    pub kv_len: u64,
    /// [`ShardRecord::checksum`] of the whole record.
    pub crc32: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub entries: Vec<ManifestEntry>,
    pub frame_bytes: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame size must be at least 1 byte")]
    ZeroFrame,
    #[error("frame {index} has {got} bytes, the manifest says {want}")]
    Size { index: usize, got: usize, want: usize },
    #[error("frame {0} arrived after the last one the manifest names")]
    Extra(usize),
    #[error("record {index} (fact {fact_bytes} bytes, KV {kv_len} bytes) fails its checksum")]
    Checksum { index: usize, fact_bytes: usize, kv_len: u64 },
    #[error("the shard ended after {got} of {want} frames")]
    Missing { got: usize, want: usize },
}

impl Manifest {
    /// Bytes of KV the frames carry in all.
    pub fn kv_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.kv_len).sum()
    }

    /// The size of every frame, in order.
    pub fn frame_sizes(&self) -> Vec<usize> {
        let total = self.kv_bytes() as usize;
        let f = self.frame_bytes.max(1);
        (0..total.div_ceil(f)).map(|i| f.min(total - i * f)).collect()
    }
}

/// `payloads` concatenated and cut into frames of `frame_bytes` (the last
/// one shorter): what [`Manifest::frame_sizes`] describes for records with
/// these KV payloads.
pub fn pack<'a>(payloads: impl Iterator<Item = &'a [u8]>, frame_bytes: usize) -> Result<Vec<Vec<u8>>, FrameError> {
    if frame_bytes == 0 {
        return Err(FrameError::ZeroFrame);
    }
    let mut frames = Vec::new();
    let mut current = Vec::with_capacity(frame_bytes);
    for mut kv in payloads {
        while !kv.is_empty() {
            let n = kv.len().min(frame_bytes - current.len());
            current.extend_from_slice(&kv[..n]);
            kv = &kv[n..];
            if current.len() == frame_bytes {
                frames.push(std::mem::replace(&mut current, Vec::with_capacity(frame_bytes)));
            }
        }
    }
    if !current.is_empty() {
        frames.push(current);
    }
    Ok(frames)
}

/// Rebuilds records from a manifest and its frames, as they arrive.
pub struct Reassembler {
    manifest: Manifest,
    sizes: Vec<usize>,
    frame: usize,
    /// The next record to complete, and its KV bytes so far.
    record: usize,
    partial: Vec<u8>,
}

impl Reassembler {
    pub fn new(manifest: Manifest) -> Result<Reassembler, FrameError> {
        if manifest.frame_bytes == 0 {
            return Err(FrameError::ZeroFrame);
        }
        let sizes = manifest.frame_sizes();
        Ok(Reassembler { manifest, sizes, frame: 0, record: 0, partial: Vec::new() })
    }

    /// The size of the next frame to receive; `None` when all have arrived.
    pub fn next_frame(&self) -> Option<usize> {
        self.sizes.get(self.frame).copied()
    }

    /// Takes the records complete without any KV at the front of the queue.
    fn complete(&mut self, out: &mut Vec<ShardRecord>) -> Result<(), FrameError> {
        while let Some(e) = self.manifest.entries.get(self.record) {
            if (self.partial.len() as u64) < e.kv_len {
                break;
            }
            let r = ShardRecord { fact: e.fact.clone(), kv: std::mem::take(&mut self.partial) };
            if r.checksum() != e.crc32 {
                return Err(FrameError::Checksum { index: self.record, fact_bytes: e.fact.len(), kv_len: e.kv_len });
            }
            out.push(r);
            self.record += 1;
        }
        Ok(())
    }

    /// Adds the next frame; returns the records it completed (checksums
    /// verified), in order. Records without KV come out as soon as every
    /// record before them has.
    pub fn push(&mut self, frame: &[u8]) -> Result<Vec<ShardRecord>, FrameError> {
        let want = self.next_frame().ok_or(FrameError::Extra(self.frame))?;
        if frame.len() != want {
            return Err(FrameError::Size { index: self.frame, got: frame.len(), want });
        }
        self.frame += 1;
        let mut out = Vec::new();
        self.complete(&mut out)?;
        let mut rest = frame;
        while !rest.is_empty() {
            // Frame sizes add up to the KV of the records, so a byte left
            // over means a manifest that contradicts itself.
            let e = self.manifest.entries.get(self.record).ok_or(FrameError::Extra(self.frame - 1))?;
            let need = (e.kv_len as usize) - self.partial.len();
            let n = need.min(rest.len());
            self.partial.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            self.complete(&mut out)?;
        }
        Ok(out)
    }

    /// The records still due once every frame is in (trailing records
    /// without KV), or what is missing.
    pub fn finish(mut self) -> Result<Vec<ShardRecord>, FrameError> {
        if self.frame < self.sizes.len() {
            return Err(FrameError::Missing { got: self.frame, want: self.sizes.len() });
        }
        let mut out = Vec::new();
        self.complete(&mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a sender makes of `records`: their manifest and their KV cut
    /// into frames of `frame_bytes` (the transfer builds the same from its
    /// protobuf records).
    fn cut(records: &[ShardRecord], frame_bytes: usize) -> Result<(Manifest, Vec<Vec<u8>>), FrameError> {
        let entries = records
            .iter()
            .map(|r| ManifestEntry { fact: r.fact.clone(), kv_len: r.kv.len() as u64, crc32: r.checksum() })
            .collect();
        let frames = pack(records.iter().map(|r| r.kv.as_slice()), frame_bytes)?;
        Ok((Manifest { entries, frame_bytes }, frames))
    }

    fn record(i: usize, kv_len: usize) -> ShardRecord {
        ShardRecord {
            fact: format!("fact {i}").into_bytes(),
            kv: (0..kv_len).map(|j| (i * 31 + j * 7) as u8).collect(),
        }
    }

    fn shard() -> Vec<ShardRecord> {
        // Lengths that straddle frame edges, and records without KV at the
        // start, in the middle and at the end.
        [0, 10, 3, 0, 25, 1, 0, 16, 0].iter().enumerate().map(|(i, &n)| record(i, n)).collect()
    }

    fn through(records: &[ShardRecord], frame_bytes: usize) -> Result<Vec<ShardRecord>, FrameError> {
        let (manifest, frames) = cut(records, frame_bytes)?;
        assert_eq!(frames.iter().map(Vec::len).collect::<Vec<_>>(), manifest.frame_sizes());
        let mut r = Reassembler::new(manifest)?;
        let mut out = Vec::new();
        for f in &frames {
            assert_eq!(r.next_frame(), Some(f.len()));
            out.extend(r.push(f)?);
        }
        assert_eq!(r.next_frame(), None);
        out.extend(r.finish()?);
        Ok(out)
    }

    #[test]
    fn every_frame_size_round_trips() {
        let records = shard();
        for frame_bytes in [1, 2, 3, 7, 16, 25, 55, 56, 1000] {
            assert_eq!(through(&records, frame_bytes).unwrap(), records, "frame {frame_bytes}");
        }
        assert_eq!(through(&[], 8).unwrap(), vec![]);
        let no_kv: Vec<ShardRecord> = (0..3).map(|i| record(i, 0)).collect();
        assert_eq!(through(&no_kv, 8).unwrap(), no_kv);
    }

    #[test]
    fn records_come_out_as_soon_as_they_are_complete() {
        let records = shard();
        let (manifest, frames) = cut(&records, 10).unwrap();
        let mut r = Reassembler::new(manifest).unwrap();
        // Frame 0 holds record 1's 10 bytes: records 0 and 1 are out.
        assert_eq!(r.push(&frames[0]).unwrap(), records[..2].to_vec());
    }

    #[test]
    fn damage_and_disorder_are_errors() {
        let records = shard();
        let (manifest, frames) = cut(&records, 8).unwrap();
        let mut flipped = frames.clone();
        flipped[2][3] ^= 0x40;
        let mut r = Reassembler::new(manifest.clone()).unwrap();
        let err = flipped.iter().try_for_each(|f| r.push(f).map(|_| ())).unwrap_err();
        assert!(matches!(err, FrameError::Checksum { .. }), "{err}");

        let mut r = Reassembler::new(manifest.clone()).unwrap();
        assert!(matches!(r.push(&frames[0][..7]), Err(FrameError::Size { index: 0, got: 7, want: 8 })));

        let mut r = Reassembler::new(manifest.clone()).unwrap();
        frames[..frames.len() - 1].iter().for_each(|f| {
            r.push(f).unwrap();
        });
        let missing = frames.len() - 1;
        assert_eq!(r.finish().unwrap_err(), FrameError::Missing { got: missing, want: frames.len() });

        let mut r = Reassembler::new(manifest).unwrap();
        frames.iter().for_each(|f| {
            r.push(f).unwrap();
        });
        assert_eq!(r.push(&[0]).unwrap_err(), FrameError::Extra(frames.len()));
        assert_eq!(cut(&records, 0).unwrap_err(), FrameError::ZeroFrame);
    }
}
