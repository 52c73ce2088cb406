//! Timing recorded work for `picchio bench-gpu`: many calls of a [`Backend`] op in one
//! submission, timed by GPU timestamps where the device has TIMESTAMP_QUERY, else by the
//! wall clock around the submission; and a buffer-to-buffer copy of given bytes timed the
//! same way, the reference a weight-streaming kernel is compared with.
//!
//! [`Backend`]: crate::backend::Backend

use std::time::Instant;

use crate::error::{Error, Result};

use super::super::context::GBuf;
use super::GpuBackend;

/// How a [`Timed`] measurement was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Clock {
    /// GPU timestamps (TIMESTAMP_QUERY) written before the first and after the last call,
    /// each once all earlier work has completed.
    Timestamps,
    /// The host's clock from the submission to the end of the wait.
    WallClock,
}

impl Clock {
    /// One phrase for reports.
    pub fn describe(self) -> &'static str {
        match self {
            Clock::Timestamps => "GPU timestamps (TIMESTAMP_QUERY) around the calls of one submission",
            Clock::WallClock => "wall clock from submission to completion, many calls per submission",
        }
    }
}

/// A timed run of `calls` repetitions.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Timed {
    /// Seconds per call.
    pub seconds_per_call: f64,
    /// Calls timed.
    pub calls: usize,
    /// How.
    pub clock: Clock,
    /// Submissions the calls took (more than one when the parameter ring filled, or the
    /// op waits itself; the wall clock then includes the recording).
    pub submissions: u64,
    /// Wall-clock seconds per call over the same run (recording included when the calls
    /// took several submissions).
    pub wall_seconds_per_call: f64,
}

impl GpuBackend {
    /// The clock [`time_calls`](Self::time_calls) uses on this device.
    pub fn clock(&self) -> Clock {
        if self.gpu.open.timestamps { Clock::Timestamps } else { Clock::WallClock }
    }

    /// Runs `call(self, i)` for `i` in `0..calls`, recorded into one submission where the
    /// parameter ring allows, and times them (inputs should be uploaded before: anything
    /// `call` stages is timed too).
    pub fn time_calls(
        &mut self,
        calls: usize,
        mut call: impl FnMut(&mut Self, usize) -> Result<()>,
    ) -> Result<Timed> {
        let calls = calls.max(1);
        self.gpu.sync()?;
        let clock = self.clock();
        let set = self.marker_set(clock)?;
        let before = self.gpu.counters().submissions;
        let start = Instant::now();
        if let Some(set) = &set {
            self.gpu.write_marker(set, 0);
        }
        for i in 0..calls {
            call(self, i)?;
        }
        if let Some(set) = &set {
            self.gpu.write_marker(set, 1);
        }
        self.finish(clock, set, calls, before, start)
    }

    /// Times `calls` buffer-to-buffer copies of `bytes` bytes, call `i` reading the `i %
    /// regions`-th of `regions` distinct source regions (so the bytes read are not the same
    /// each time, as a kernel cycling through layers reads different weights), in chunks
    /// of at most the device's largest buffer.
    pub fn time_copy(&mut self, bytes: u64, regions: usize, calls: usize) -> Result<Timed> {
        let bytes = bytes.max(4).next_multiple_of(4);
        let usage = wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let chunk = self.gpu.max_buffer.min(1 << 30) & !3;
        let pieces = |gpu: &mut super::super::context::Gpu, label: &str| -> Result<Vec<GBuf>> {
            let mut out = Vec::new();
            let mut left = bytes;
            while left > 0 {
                let n = left.min(chunk);
                out.push(gpu.buffer(label, n, usage)?);
                left -= n;
            }
            Ok(out)
        };
        let sources =
            (0..regions.max(1)).map(|_| pieces(&mut self.gpu, "copy source")).collect::<Result<Vec<_>>>()?;
        let dst = pieces(&mut self.gpu, "copy destination")?;
        // Untimed: one copy from every region, so that no first touch of a page is timed.
        for src in &sources {
            for (s, d) in src.iter().zip(&dst) {
                self.gpu.copy(s, 0, d, 0, s.size.min(d.size));
            }
        }
        let result = self.time_calls(calls, |b, i| {
            for (s, d) in sources[i % sources.len()].iter().zip(&dst) {
                b.gpu.copy(s, 0, d, 0, s.size.min(d.size));
            }
            Ok(())
        });
        drop((sources, dst));
        self.gpu.sync()?;
        result
    }

    fn marker_set(&mut self, clock: Clock) -> Result<Option<wgpu::QuerySet>> {
        Ok(match clock {
            Clock::Timestamps => Some(self.gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("picchio bench"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            })),
            Clock::WallClock => None,
        })
    }

    fn finish(
        &mut self,
        clock: Clock,
        set: Option<wgpu::QuerySet>,
        calls: usize,
        before: u64,
        start: Instant,
    ) -> Result<Timed> {
        let recorded = self.gpu.counters().submissions;
        let t0 = Instant::now();
        self.gpu.sync()?;
        let end = Instant::now();
        let submissions = self.gpu.counters().submissions - before;
        // One submission: the device started with the flush, after the recording.
        let wall = if recorded == before { end - t0 } else { end - start };
        let wall_per_call = wall.as_secs_f64() / calls as f64;
        let seconds_per_call = match &set {
            Some(set) => {
                let resolve = self.gpu.buffer(
                    "timestamps",
                    16,
                    wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                )?;
                self.gpu.resolve_markers(set, 2, &resolve);
                let bytes = self.gpu.read_back(&[(&resolve, 0, 16)])?;
                let t: Vec<u64> = bytes
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect();
                let ticks = t[1].checked_sub(t[0]).ok_or_else(|| {
                    Error::Backend(format!("GPU timestamps went backwards ({} then {})", t[0], t[1]))
                })?;
                let period_ns = self.gpu.queue.get_timestamp_period() as f64;
                ticks as f64 * period_ns * 1e-9 / calls as f64
            }
            None => wall_per_call,
        };
        Ok(Timed { seconds_per_call, calls, clock, submissions, wall_seconds_per_call: wall_per_call })
    }
}
