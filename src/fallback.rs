//! `--device auto` after a device failure: a runner that continues on the CPU when the GPU
//! reports an error (lost device, allocation failure), with one log line. The CPU runner is
//! built on demand and replays the cached positions, so the session goes on unchanged.

use crate::ModelConfig;
use crate::engine::{LoadedModel, RunOptions, Runner, cpu_runner};
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
    /// Token at each cached position.
    history: Vec<u32>,
}

impl FallbackRunner {
    /// Wraps `gpu`; `model` and `opts` build the CPU runner if it is ever needed.
    pub fn new(gpu: Box<dyn Runner>, model: LoadedModel, opts: RunOptions) -> Self {
        FallbackRunner { current: gpu, on_gpu: true, model, opts, history: Vec::new() }
    }

    fn fall_back(&mut self, why: &str, start_pos: usize) -> Result<()> {
        tracing::warn!(
            "the GPU failed ({why}); continuing on the CPU (replaying {start_pos} cached positions)"
        );
        let mut cpu = cpu_runner(&self.model, &self.opts)?;
        if start_pos > 0 {
            cpu.forward(&self.history[..start_pos], 0, LogitRows::None, &mut NoObserver)?;
        }
        self.current = cpu;
        self.on_gpu = false;
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
        if start_pos > self.history.len() {
            return Err(Error::invalid(format!(
                "position {start_pos} follows only {} cached positions",
                self.history.len()
            )));
        }
        let out = match self.current.forward(ids, start_pos, rows, observer) {
            Err(Error::Backend(why)) if self.on_gpu => {
                self.fall_back(&why, start_pos)?;
                self.current.forward(ids, start_pos, rows, observer)?
            }
            r => r?,
        };
        self.history.truncate(start_pos);
        self.history.extend_from_slice(ids);
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

    fn report(&self) -> Vec<String> {
        let mut lines = self.current.report();
        if !self.on_gpu {
            lines.push("device: fell back to the CPU after a GPU failure".into());
        }
        lines
    }
}
