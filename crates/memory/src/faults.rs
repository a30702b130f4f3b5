//! Injected write failures, for the fault suite (`tests/faults.rs`; the
//! feature `fault-injection`, which nothing but tests enables): a
//! process-wide budget of bytes that writes to the memory's files may
//! still take. A write that would pass it writes what is left of the
//! budget, then fails as a full disk does (`ENOSPC`), so that the code
//! meets the torn writes and refusals a real full disk gives. Without the
//! feature, [`charge`] allows everything and compiles to nothing.

/// How many bytes of a write of `len` bytes may go: `Ok` for all of them,
/// `Err(n)` for the first `n` (then the write must fail with
/// [`full`]).
#[inline]
pub(crate) fn charge(len: usize) -> Result<(), usize> {
    #[cfg(feature = "fault-injection")]
    {
        use std::sync::atomic::Ordering;
        let mut left = BUDGET.load(Ordering::SeqCst);
        loop {
            let take = (len as u64).min(left);
            match BUDGET.compare_exchange(left, left - take, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) if take == len as u64 => return Ok(()),
                Ok(_) => return Err(take as usize),
                Err(now) => left = now,
            }
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = len;
        Ok(())
    }
}

/// The error a write past the budget fails with.
pub(crate) fn full() -> std::io::Error {
    std::io::Error::from(std::io::ErrorKind::StorageFull)
}

#[cfg(feature = "fault-injection")]
static BUDGET: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Lets writes take `bytes` more bytes from now on (`None`: no limit).
#[cfg(feature = "fault-injection")]
pub fn set_write_budget(bytes: Option<u64>) {
    BUDGET.store(bytes.unwrap_or(u64::MAX), std::sync::atomic::Ordering::SeqCst);
}

/// The bytes writes may still take (`u64::MAX` without a limit).
#[cfg(feature = "fault-injection")]
pub fn write_budget_left() -> u64 {
    BUDGET.load(std::sync::atomic::Ordering::SeqCst)
}
