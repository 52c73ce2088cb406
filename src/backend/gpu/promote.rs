//! Background promotion of experts into VRAM: a thread that encodes an expert's record into
//! its slot layout and hands it to the queue as one write, so that no token waits on an
//! upload.
//!
//! The VRAM cache decides what to promote and where (it frees the slot and clears its table
//! entry first); the promoter only moves bytes. A write made through the queue lands before
//! the next submission and after every earlier one, so the kernels already submitted still
//! read the slot's previous expert, and the kernels submitted after the slot's table entry
//! is set read the new one. The cache sets that entry only after the promoter reports the
//! write made ([`Promoter::finished`]), so a kernel never sees a half-written slot.
//!
//! At most [`IN_FLIGHT`] promotions are queued or being encoded at once: each holds a slot's
//! bytes of host memory in the encoder and in wgpu's staging memory until the next
//! submission, so the staging memory is a ring of that many slots.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::model::weights::ExpertWeights;

use super::vram::SlotLayout;

/// Promotions queued or being encoded at once (the staging ring's depth): a slot's bytes
/// each (12.6 MiB for GPT-OSS) in the encoder's buffer or wgpu's staging memory.
pub const IN_FLIGHT: usize = 4;

/// One expert to write into a slot.
pub struct Promotion {
    /// The expert: `(layer, expert)`.
    pub key: (usize, usize),
    /// Its weights (shared with the RAM tier, which keeps them).
    pub weights: Arc<ExpertWeights>,
    /// The slot it goes to.
    pub slot: usize,
    /// The pool buffer holding the slot.
    pub pool: wgpu::Buffer,
    /// The slot's byte offset in that pool.
    pub offset: u64,
}

/// A promotion the thread has written (or failed to encode).
pub struct Promoted {
    /// The expert.
    pub key: (usize, usize),
    /// The slot.
    pub slot: usize,
    /// `Ok`: the bytes are queued and land before the next submission.
    pub result: Result<()>,
}

/// The promoter thread and its two channels.
pub struct Promoter {
    jobs: Option<Sender<Promotion>>,
    done: Receiver<Promoted>,
    thread: Option<JoinHandle<()>>,
    in_flight: usize,
}

impl Promoter {
    /// Starts the thread, writing through `queue` in `layout`.
    pub fn start(queue: wgpu::Queue, layout: SlotLayout) -> Result<Self> {
        let (jobs, job_rx) = channel::<Promotion>();
        let (done_tx, done) = channel::<Promoted>();
        let thread = std::thread::Builder::new()
            .name("picchio-vram-promoter".into())
            .spawn(move || {
                let mut record = vec![0u8; layout.bytes() as usize];
                for job in job_rx {
                    let (l, e) = job.key;
                    record.fill(0);
                    let result = layout.encode(&job.weights, &mut record, &format!("layer {l} expert {e}"));
                    if result.is_ok() {
                        queue.write_buffer(&job.pool, job.offset, &record);
                    }
                    if done_tx.send(Promoted { key: job.key, slot: job.slot, result }).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Backend(format!("starting the VRAM promoter thread: {e}")))?;
        Ok(Promoter { jobs: Some(jobs), done, thread: Some(thread), in_flight: 0 })
    }

    /// Whether another promotion may be queued now (fewer than [`IN_FLIGHT`] outstanding).
    pub fn has_room(&self) -> bool {
        self.in_flight < IN_FLIGHT
    }

    /// Queues `job`. Fails when the thread has stopped.
    pub fn send(&mut self, job: Promotion) -> Result<()> {
        let jobs =
            self.jobs.as_ref().ok_or_else(|| Error::Backend("the VRAM promoter has stopped".into()))?;
        jobs.send(job).map_err(|_| Error::Backend("the VRAM promoter thread has stopped".into()))?;
        self.in_flight += 1;
        Ok(())
    }

    /// The promotions written since the last call (never waits).
    pub fn finished(&mut self) -> Vec<Promoted> {
        let done: Vec<Promoted> = self.done.try_iter().collect();
        self.in_flight = self.in_flight.saturating_sub(done.len());
        done
    }

    /// Waits for every queued promotion and returns them (tests and shutdown).
    pub fn drain(&mut self) -> Vec<Promoted> {
        let mut all = Vec::new();
        while self.in_flight > 0 {
            match self.done.recv() {
                Ok(p) => {
                    self.in_flight -= 1;
                    all.push(p);
                }
                Err(_) => {
                    self.in_flight = 0;
                }
            }
        }
        all
    }
}

impl Drop for Promoter {
    fn drop(&mut self) {
        // Closing the job channel ends the thread's loop.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
