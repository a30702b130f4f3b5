//! Erasing records of a log in place: how a KV segment forgets.
//!
//! A user's KV segment runs to gigabytes (an 8B model's fact of 126 tokens
//! is 8 MB in fp8), and forgetting one fact used to copy every other
//! record into a new file on the engine thread — seconds of stalled decode
//! for a large user, and a forget refused on a full disk, where the copy
//! has nowhere to go. Instead the forgotten records are erased where they
//! lie: the frame stays (same length, so every other record keeps its
//! offset), its payload becomes zeros and its checksum that of the zeros.
//! Where the filesystem can (ext4, XFS, btrfs, tmpfs), the payload's whole
//! pages are punched out of the file (`fallocate(PUNCH_HOLE)`), which frees
//! them and reads back as zeros; elsewhere zeros are written over them.
//! Neither takes new space, so a full disk does not stop the KV part of a
//! forget (the fact log, kilobytes, is still rewritten).
//!
//! An erased record reads as a valid record of zeros; a record whose first
//! [`ERASED_HEAD`] bytes are zeros is erased (no record a log's user writes
//! starts so: see [`is_erased`]). The erasure goes in two synced steps —
//! the head first, then the rest and the checksum — so that a crash leaves
//! either the record whole, or a record that reads as erased (its head
//! zeros) whose checksum may fail: nothing reads an erased record, and a
//! torn erasure that ends the log is cut as any torn tail is, before the
//! next append (`RecordLog::settle_tail`).
//!
//! The dead frames still count in the file's length: the caller compacts
//! the log (copies its live records into a new one) once the dead bytes
//! outgrow the live, so that a log's size stays within twice its live
//! records and each erased byte costs at most one copied byte, on average.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{self, Result};
use crate::frame::{FRAME_BYTES, HEADER};
use crate::log::Frame;

/// Bytes at the start of a payload that an erasure zeroes first.
pub(crate) const ERASED_HEAD: usize = 8;

/// Pages punched out of a file are whole filesystem blocks; 4 KiB is the
/// block of every filesystem above (a larger one punches fewer bytes and
/// writes zeros over the rest).
const PAGE: u64 = 4096;

/// Zeros written a chunk at a time where punching is not possible.
const ZEROS: usize = 1 << 20;

/// Whether `head` (a payload's first bytes, at least [`ERASED_HEAD`] of
/// them unless the payload is shorter) is that of an erased record. The
/// logs that erase hold KV records, which start with their fact id's
/// length and token count, never both zero.
pub(crate) fn is_erased(head: &[u8]) -> bool {
    !head.is_empty() && head.iter().take(ERASED_HEAD).all(|&b| b == 0)
}

/// What [`erase`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Erased {
    /// Payload bytes erased.
    pub bytes: u64,
    /// Of those, bytes punched out of the file (freed); the rest were
    /// overwritten with zeros.
    pub punched: u64,
}

/// Erases the records at `frames` of the log at `path`, whose intact
/// frames end at `len`, durably (see the module doc). A frame that does
/// not lie within the log is refused before anything is written.
pub(crate) fn erase(path: &Path, len: u64, frames: &[Frame]) -> Result<Erased> {
    let min = (HEADER.len() + FRAME_BYTES) as u64;
    if let Some(f) = frames.iter().find(|f| f.offset < min || f.offset + u64::from(f.len) > len) {
        let why = format!("no record at byte {} ({} bytes) in a log of {len} bytes", f.offset, f.len);
        return Err(error::io(path)(std::io::Error::other(why)));
    }
    if frames.is_empty() {
        return Ok(Erased::default());
    }
    // Not O_APPEND: Linux writes every write of an O_APPEND file at its end,
    // whatever offset `pwrite` names.
    let file = OpenOptions::new().write(true).open(path).map_err(error::io(path))?;
    for f in frames {
        let head = (f.len as usize).min(ERASED_HEAD);
        file.write_all_at(&[0u8; ERASED_HEAD][..head], f.offset).map_err(error::io(path))?;
    }
    file.sync_data().map_err(error::io(path))?;
    let mut out = Erased::default();
    for f in frames {
        let (start, end) = (f.offset + ERASED_HEAD.min(f.len as usize) as u64, f.offset + u64::from(f.len));
        out.punched += zero_range(&file, start, end).map_err(error::io(path))?;
        out.bytes += u64::from(f.len);
        let len_bytes = f.len.to_le_bytes();
        let crc = zeros_checksum(len_bytes, f.len as usize);
        file.write_all_at(&crc.to_le_bytes(), f.offset - 4).map_err(error::io(path))?;
    }
    file.sync_data().map_err(error::io(path))?;
    Ok(out)
}

/// Makes bytes `start..end` of `file` read as zeros: whole pages punched
/// out where the filesystem can, zeros written over the rest. Returns the
/// bytes punched.
fn zero_range(file: &File, start: u64, end: u64) -> std::io::Result<u64> {
    let (lo, hi) = (start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
    let punched = hi > lo && punch(file, lo, hi - lo);
    let zeros = vec![0u8; ZEROS.min((end - start) as usize)];
    let write = |mut at: u64, to: u64| -> std::io::Result<()> {
        while at < to {
            let n = ((to - at) as usize).min(zeros.len());
            file.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        Ok(())
    };
    match punched {
        true => write(start, lo).and_then(|()| write(hi, end)).map(|()| hi - lo),
        false => write(start, end).map(|()| 0),
    }
}

/// Punches `len` bytes at `at` out of `file`, keeping its size; false
/// where the filesystem cannot (the caller writes zeros instead).
fn punch(file: &File, at: u64, len: u64) -> bool {
    let (Ok(at), Ok(len)) = (libc::off_t::try_from(at), libc::off_t::try_from(len)) else { return false };
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate reads no memory of ours; the descriptor is open for
    // writing for the duration of the call.
    unsafe { libc::fallocate(file.as_raw_fd(), mode, at, len) == 0 }
}

/// The checksum of a frame of `len` zero bytes (`frame::checksum` of
/// them, without allocating them whole).
fn zeros_checksum(len_bytes: [u8; 4], len: usize) -> u32 {
    let zeros = [0u8; 64 << 10];
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len_bytes);
    let mut left = len;
    while left > 0 {
        let n = left.min(zeros.len());
        hasher.update(&zeros[..n]);
        left -= n;
    }
    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::checksum;
    use crate::log::RecordLog;

    fn record(tag: u8, len: usize) -> Vec<u8> {
        // A KV record's head: a fact id's length, never zero.
        let mut r = vec![tag; len];
        r[..4].copy_from_slice(&3u32.to_le_bytes());
        r
    }

    #[test]
    fn zeros_checksum_is_the_checksum_of_zeros() {
        for len in [0, 1, 8, 65_535, 65_536, 200_001] {
            let bytes = (len as u32).to_le_bytes();
            assert_eq!(zeros_checksum(bytes, len), checksum(bytes, &vec![0; len]), "{len} bytes");
        }
    }

    #[test]
    fn an_erased_record_reads_as_zeros_and_the_others_stay_where_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.log");
        let (mut log, _) = RecordLog::open(&path).unwrap();
        // Records across page boundaries (some punched, some only written),
        // one shorter than the erased head.
        let records = [record(1, 100), record(2, 3 * 4096 + 17), record(3, 5), record(4, 20_000), record(5, 9_000)];
        let frames = log.append_frames(&records.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        let blocks = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&path).unwrap().blocks()
        };
        let gone = [frames[1], frames[2], frames[4]];
        let erased = log.erase(&gone).unwrap();
        assert_eq!(erased.bytes, (3 * 4096 + 17 + 5 + 9_000) as u64);
        assert!(erased.punched <= erased.bytes);
        if erased.punched > 0 {
            use std::os::unix::fs::MetadataExt;
            assert!(std::fs::metadata(&path).unwrap().blocks() < blocks, "punched pages are freed");
        }
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size, "the file keeps its length");
        for (i, f) in frames.iter().enumerate() {
            let got = log.read(*f).unwrap();
            match gone.contains(f) {
                true => {
                    assert!(got.iter().all(|&b| b == 0), "record {i} is zeros");
                    assert!(is_erased(&got[..got.len().min(ERASED_HEAD)]), "record {i} reads as erased");
                }
                false => {
                    assert_eq!(got, records[i], "record {i} untouched");
                    assert!(!is_erased(&got), "record {i} does not read as erased");
                }
            }
        }
        // Not a byte of the erased records' contents is left in the file.
        let bytes = std::fs::read(&path).unwrap();
        for tag in [2u8, 5] {
            assert!(!bytes.windows(64).any(|w| w.iter().all(|&b| b == tag)), "record {tag}'s bytes remain");
        }
        // The log reopens whole, and appends land after the erased records.
        drop(log);
        let (mut log, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.truncated_bytes, 0);
        assert_eq!(rec.records.len(), 5);
        let more = log.append_frames(&[&record(6, 50)]).unwrap();
        assert_eq!(more[0].offset, size + FRAME_BYTES as u64);
    }

    /// A crash between the erasure's two steps leaves a frame whose head is
    /// zeros and whose checksum is the old record's: it is indexed (a large
    /// record's checksum is not read at open) and reads as erased; at the
    /// log's end it is cut before anything is appended behind it.
    #[test]
    fn a_torn_erasure_reads_as_erased_and_is_cut_at_the_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.log");
        let (mut log, _) = RecordLog::open(&path).unwrap();
        let records = [record(1, 5_000), record(2, 5_000), record(3, 5_000)];
        let frames = log.append_frames(&records.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
        drop(log);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        for f in [frames[1], frames[2]] {
            file.write_all_at(&[0u8; ERASED_HEAD], f.offset).unwrap();
        }
        let (mut log, index) = RecordLog::open_frames(&path, 1024).unwrap();
        assert!(index.reason.is_none() && index.truncated_bytes == 0, "{:?}", index.reason);
        let heads: Vec<bool> = index.frames.iter().map(|(_, head)| is_erased(head)).collect();
        assert_eq!(heads, [false, true, true]);
        assert!(log.read(frames[1]).is_err(), "its checksum is the old record's");
        assert_eq!(log.settle_tail().unwrap(), Some(frames[2]), "the torn tail is cut");
        assert_eq!(log.settle_tail().unwrap(), None, "once");
        let more = log.append_frames(&[&record(4, 50)]).unwrap();
        assert_eq!(more[0].offset, frames[2].offset);
        assert_eq!(log.read(frames[0]).unwrap(), records[0]);
    }

    #[test]
    fn a_frame_outside_the_log_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.log");
        let (mut log, _) = RecordLog::open(&path).unwrap();
        let frames = log.append_frames(&[&record(1, 100)]).unwrap();
        let before = std::fs::read(&path).unwrap();
        let past = Frame { offset: frames[0].offset + 50, len: 100 };
        let err = log.erase(&[frames[0], past]).unwrap_err();
        assert!(err.to_string().contains("no record at byte"), "{err}");
        let header = Frame { offset: 4, len: 4 };
        assert!(log.erase(&[header]).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }
}
