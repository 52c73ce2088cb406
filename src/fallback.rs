//! `--device auto` after a device failure: a runner that continues on the CPU when the GPU
//! reports an error (lost device, allocation failure), with one log line. The CPU runner is
//! built on demand with as many sequences (slots) and replays each one's cached positions,
//! so every session goes on unchanged.

use crate::ModelConfig;
use crate::backend::SeqPos;
use crate::engine::{LoadedModel, Pick, Picked, RunOptions, Runner, cpu_runner};
use crate::error::{Error, Result};
use crate::experts::ExpertStats;
use crate::model::forward::PhaseTimes;
use crate::model::{LogitRows, NoObserver, Observer};

/// A GPU runner with a CPU fallback.
pub struct FallbackRunner {
    current: Box<dyn Runner>,
    on_gpu: bool,
    model: LoadedModel,
    opts: RunOptions,
    /// Token at each cached position, per sequence.
    history: Vec<Vec<u32>>,
}

impl FallbackRunner {
    /// Wraps `gpu`; `model` and `opts` build the CPU runner if it is ever needed.
    pub fn new(gpu: Box<dyn Runner>, model: LoadedModel, opts: RunOptions) -> Self {
        FallbackRunner { current: gpu, on_gpu: true, model, opts, history: vec![Vec::new()] }
    }

    /// Replaces the GPU runner with a CPU one holding the same sequences and cached
    /// positions (the histories, which the caller has cut to what stays valid).
    fn fall_back(&mut self, why: &str) -> Result<()> {
        let cached: usize = self.history.iter().map(Vec::len).sum();
        tracing::warn!(
            "the GPU failed ({why}); continuing on the CPU (replaying {cached} cached positions of {} sequence(s))",
            self.history.len()
        );
        let mut cpu = cpu_runner(&self.model, &self.opts)?;
        for (seq, tokens) in self.history.iter().enumerate() {
            if seq > 0 {
                cpu.add_sequence()?;
            }
            if !tokens.is_empty() {
                cpu.forward_on(seq, tokens, 0, LogitRows::None, &mut NoObserver)?;
            }
        }
        self.current = cpu;
        self.on_gpu = false;
        Ok(())
    }

    /// An error unless `seq` exists and `pos` does not pass its cached positions.
    fn check_position(&self, seq: usize, pos: usize) -> Result<()> {
        let Some(h) = self.history.get(seq) else {
            return Err(Error::Backend(format!("sequence {seq} does not exist")));
        };
        if pos > h.len() {
            return Err(Error::invalid(format!(
                "position {pos} follows only {} cached positions of sequence {seq}",
                h.len()
            )));
        }
        Ok(())
    }
}

impl Runner for FallbackRunner {
    fn config(&self) -> &ModelConfig {
        self.current.config()
    }

    fn capacity(&self) -> usize {
        self.current.capacity()
    }

    fn describe(&self) -> String {
        self.current.describe()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        self.forward_on(0, ids, start_pos, rows, observer)
    }

    fn forward_pick(&mut self, seq: usize, ids: &[u32], start_pos: usize, pick: &Pick) -> Result<Picked> {
        self.check_position(seq, start_pos)?;
        let out = match self.current.forward_pick(seq, ids, start_pos, pick) {
            Err(Error::Backend(why)) if self.on_gpu => {
                self.history[seq].truncate(start_pos);
                self.fall_back(&why)?;
                self.current.forward_pick(seq, ids, start_pos, pick)?
            }
            r => r?,
        };
        self.history[seq].truncate(start_pos);
        self.history[seq].extend_from_slice(ids);
        Ok(out)
    }

    fn add_sequence(&mut self) -> Result<usize> {
        let seq = self.current.add_sequence()?;
        self.history.push(Vec::new());
        Ok(seq)
    }

    fn forward_on(
        &mut self,
        seq: usize,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        self.check_position(seq, start_pos)?;
        let out = match self.current.forward_on(seq, ids, start_pos, rows, observer) {
            Err(Error::Backend(why)) if self.on_gpu => {
                self.history[seq].truncate(start_pos);
                self.fall_back(&why)?;
                self.current.forward_on(seq, ids, start_pos, rows, observer)?
            }
            r => r?,
        };
        self.history[seq].truncate(start_pos);
        self.history[seq].extend_from_slice(ids);
        Ok(out)
    }

    fn step(&mut self, rows: &[SeqPos], ids: &[u32]) -> Result<Vec<f32>> {
        for at in rows {
            self.check_position(at.seq, at.pos)?;
        }
        let out = match self.current.step(rows, ids) {
            Err(Error::Backend(why)) if self.on_gpu => {
                for at in rows {
                    self.history[at.seq].truncate(at.pos);
                }
                self.fall_back(&why)?;
                self.current.step(rows, ids)?
            }
            r => r?,
        };
        for (at, &id) in rows.iter().zip(ids) {
            self.history[at.seq].truncate(at.pos);
            self.history[at.seq].push(id);
        }
        Ok(out)
    }

    fn step_picks(&mut self, rows: &[SeqPos], ids: &[u32], picks: &[Pick]) -> Result<Vec<Picked>> {
        for at in rows {
            self.check_position(at.seq, at.pos)?;
        }
        let out = match self.current.step_picks(rows, ids, picks) {
            Err(Error::Backend(why)) if self.on_gpu => {
                for at in rows {
                    self.history[at.seq].truncate(at.pos);
                }
                self.fall_back(&why)?;
                self.current.step_picks(rows, ids, picks)?
            }
            r => r?,
        };
        for (at, &id) in rows.iter().zip(ids) {
            self.history[at.seq].truncate(at.pos);
            self.history[at.seq].push(id);
        }
        Ok(out)
    }

    fn prefill_block(&self) -> usize {
        self.current.prefill_block()
    }

    fn times(&self) -> PhaseTimes {
        self.current.times()
    }

    fn expert_stats(&self) -> ExpertStats {
        self.current.expert_stats()
    }

    fn decode_counters(&self) -> Option<crate::backend::DecodeCounters> {
        self.current.decode_counters()
    }

    fn report(&self) -> Vec<String> {
        let mut lines = self.current.report();
        if !self.on_gpu {
            lines.push("device: fell back to the CPU after a GPU failure".into());
        }
        lines
    }
}
