//! The library's error type: every failure names the file, tensor, key or value at fault,
//! so a user can act on the message without a debugger.

use std::path::{Path, PathBuf};

/// Result alias used throughout the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system I/O failure on a named file. The OS error is part of the
    /// message and not a separate `source()`, so a printed chain (`{:#}`) says it once.
    #[error("{path}: {cause}")]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// `config.json` is missing a key, has a value of the wrong type, or an impossible value.
    #[error("{path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong, naming the key and value.
        message: String,
    },
    /// A weight file is malformed (bad header, truncated, inconsistent index).
    #[error("{path}: {message}")]
    Format {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A mandatory tensor is absent from the checkpoint.
    #[error("missing tensor `{name}` in {dir}")]
    MissingTensor {
        /// The tensor's full name.
        name: String,
        /// The checkpoint directory searched.
        dir: PathBuf,
    },
    /// A tensor has a shape or dtype other than the config implies.
    #[error("tensor `{name}`: {message}")]
    Tensor {
        /// The tensor's full name.
        name: String,
        /// Expected versus found.
        message: String,
    },
    /// A request that cannot be served as given (bad token ID, prompt too long, ...).
    /// Nothing has changed when this is returned.
    #[error("{0}")]
    Invalid(String),
    /// The context window cannot hold the requested positions. Nothing has changed.
    #[error("context full: {needed} positions needed, capacity is {capacity}")]
    ContextFull {
        /// Positions the request would occupy.
        needed: usize,
        /// The KV cache capacity (`--ctx`).
        capacity: usize,
    },
    /// A backend (device) failure: lost device, allocation failure, shader error.
    #[error("backend: {0}")]
    Backend(String),
    /// The output grammar failed during generation (the grammar engine's fault, not the
    /// request's: a grammar is compiled and checked before the turn starts).
    #[error("output grammar: {0}")]
    Constraint(String),
}

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().to_path_buf(), cause: source }
    }

    /// A format error in `path`.
    pub fn format(path: impl AsRef<Path>, message: impl Into<String>) -> Self {
        Error::Format { path: path.as_ref().to_path_buf(), message: message.into() }
    }

    /// A config error in `path`.
    pub fn config(path: impl AsRef<Path>, message: impl Into<String>) -> Self {
        Error::Config { path: path.as_ref().to_path_buf(), message: message.into() }
    }

    /// A tensor shape/dtype error.
    pub fn tensor(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), message: message.into() }
    }

    /// An invalid request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::Invalid(message.into())
    }
}
