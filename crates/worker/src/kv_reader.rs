//! Reads of facts' KV from disk off the engine thread: a request whose
//! facts' KV is on disk only is served with those facts prefilled, while
//! a few reader threads read their KV for the next request (issue 24,
//! docs/serving.md "Where stored KV lives"). The engine thread sends
//! [`ReadJob`]s and caches what comes back between its steps.

use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};

use inferscale_engine::Backend;
use inferscale_memory::{ReadDone, ReadJob};

pub(crate) struct KvReader<B: Backend> {
    jobs: Sender<ReadJob<B>>,
    done: Receiver<ReadDone<B>>,
    /// Jobs run here because the reader threads were gone (never expected:
    /// they end only with this value), so that every job is answered.
    inline: Vec<ReadDone<B>>,
    /// Jobs queued or running (sent, not yet finished).
    pending: usize,
    /// Reader threads: reads in flight at once (an NVMe queue wants several).
    threads: usize,
}

impl<B: Backend> KvReader<B> {
    /// Starts `threads` reader threads (at least one); they end when this
    /// value is dropped.
    pub(crate) fn start(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let (jobs, queue) = channel::<ReadJob<B>>();
        let (finished, done) = channel();
        let queue = Arc::new(Mutex::new(queue));
        for n in 0..threads {
            let (queue, finished) = (queue.clone(), finished.clone());
            std::thread::Builder::new().name(format!("inferscale-kv-read-{n}")).spawn(move || {
                loop {
                    // One job at a time: the lock is held only to take it.
                    let job = match queue.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    if finished.send(job.run()).is_err() {
                        return;
                    }
                }
            })?;
        }
        Ok(KvReader { jobs, done, inline: Vec::new(), pending: 0, threads })
    }

    /// Queues `jobs` for the reader threads.
    pub(crate) fn read(&mut self, jobs: Vec<ReadJob<B>>) {
        self.pending += jobs.len();
        for job in jobs {
            if let Err(gone) = self.jobs.send(job) {
                self.inline.push(gone.0.run());
            }
        }
    }

    /// Reads queued or running.
    pub(crate) fn pending(&self) -> usize {
        self.pending
    }

    /// Reader threads.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Reads finished since the last call.
    pub(crate) fn finished(&mut self) -> Vec<ReadDone<B>> {
        let mut out = std::mem::take(&mut self.inline);
        loop {
            match self.done.try_recv() {
                Ok(d) => out.push(d),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                    self.pending = self.pending.saturating_sub(out.len());
                    return out;
                }
            }
        }
    }
}
