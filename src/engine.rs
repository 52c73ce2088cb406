//! Loading a model and putting it on a backend: the object-safe [`Runner`] that sessions
//! and front-ends drive without knowing which backend or weight source is underneath.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::experts::{ExpertSource, ResidentExperts};
use crate::format::{hf, safetensors::Checkpoint};
use crate::model::forward::PhaseTimes;
use crate::model::weights::DenseWeights;
use crate::model::{Forward, LogitRows, Observer};

/// A model on a backend, ready to run positions.
pub trait Runner: Send {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// Positions the key/value cache holds.
    fn capacity(&self) -> usize;
    /// One line describing backend and weights.
    fn describe(&self) -> String;
    /// Runs `ids` at positions `start_pos..`, returning logits for `rows`. The caller
    /// (a `Session`) has validated IDs and capacity.
    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>>;
    /// Time spent so far, by phase.
    fn times(&self) -> PhaseTimes;
}

impl<B: Backend + Send> Runner for Forward<B> {
    fn config(&self) -> &ModelConfig {
        self.backend().config()
    }

    fn capacity(&self) -> usize {
        self.backend().capacity()
    }

    fn describe(&self) -> String {
        self.backend().describe()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        self.run(ids, start_pos, rows, observer)
    }

    fn times(&self) -> PhaseTimes {
        Forward::times(self)
    }
}

/// A loaded model: configuration, dense weights and where experts come from.
pub struct LoadedModel {
    /// The configuration.
    pub config: Arc<ModelConfig>,
    /// Resident dense weights.
    pub dense: Arc<DenseWeights>,
    /// The expert source.
    pub experts: Arc<dyn ExpertSource>,
    /// The directory it was loaded from.
    pub dir: PathBuf,
}

/// Options for running a model.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Key/value cache capacity in positions (`--ctx`).
    pub ctx: usize,
    /// Most positions processed in one forward batch.
    pub max_batch: usize,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { ctx: 4096, max_batch: 256 }
    }
}

/// The context capacity used when none is asked for: 4096 positions, or the model's
/// maximum if smaller.
pub fn default_ctx(cfg: &ModelConfig) -> usize {
    4096.min(cfg.max_position_embeddings)
}

/// Loads a model directory (a Hugging Face checkpoint), checking every mandatory tensor.
pub fn load(dir: &Path) -> Result<LoadedModel> {
    if !dir.is_dir() {
        return Err(Error::format(dir, "model directory does not exist"));
    }
    let cfg = ModelConfig::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    let dense = hf::load_dense(&ck, &cfg)?;
    let experts = hf::load_all_experts(&ck, &cfg)?;
    Ok(LoadedModel {
        config: Arc::new(cfg),
        dense: Arc::new(dense),
        experts: Arc::new(ResidentExperts::new(experts)),
        dir: dir.to_path_buf(),
    })
}

/// Puts a loaded model on the CPU backend.
pub fn cpu_runner(model: &LoadedModel, opts: &RunOptions) -> Result<Box<dyn Runner>> {
    if opts.ctx == 0 {
        return Err(Error::invalid("--ctx must be at least 1"));
    }
    if opts.ctx > model.config.max_position_embeddings {
        return Err(Error::invalid(format!(
            "--ctx {} exceeds the model's max_position_embeddings {}",
            opts.ctx, model.config.max_position_embeddings
        )));
    }
    let backend = CpuBackend::new(
        Arc::clone(&model.config),
        Arc::clone(&model.dense),
        Arc::clone(&model.experts),
        opts.ctx,
    );
    Ok(Box::new(Forward::new(backend, opts.max_batch)))
}
