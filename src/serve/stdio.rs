//! The line protocol of `picchio serve --stdio` (specified in `docs/protocol.md`): raw token
//! IDs in, raw token IDs out, one persistent session, every request validated before the
//! cache changes.

use std::io::{BufRead, Write};

use crate::chat::tokenizer::special;
use crate::chat::turn_stop_tokens;
use crate::error::{Error, Result};
use crate::sample::{Sampler, SamplingParams};
use crate::session::{Session, StopReason};

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// Unknown command or a line that is not a command.
    BadCommand,
    /// A field is missing, not a number, or out of range.
    BadArgument,
    /// A token ID outside the vocabulary.
    BadId,
    /// `keep` exceeds the cached positions.
    KeepRange,
    /// The request does not fit in the context.
    ContextFull,
    /// The engine failed (I/O or device); the session was reset.
    Internal,
}

impl ErrorCode {
    fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadCommand => "BAD_COMMAND",
            ErrorCode::BadArgument => "BAD_ARGUMENT",
            ErrorCode::BadId => "BAD_ID",
            ErrorCode::KeepRange => "KEEP_RANGE",
            ErrorCode::ContextFull => "CONTEXT_FULL",
            ErrorCode::Internal => "INTERNAL",
        }
    }
}

/// A refused request.
#[derive(Debug)]
struct Refusal {
    code: ErrorCode,
    fatal: bool,
    message: String,
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal { code, fatal: false, message: message.into() }
}

/// One parsed `TURN` request.
#[derive(Debug, PartialEq)]
struct Turn {
    max_new: usize,
    keep: usize,
    params: SamplingParams,
    ids: Vec<u32>,
}

fn parse_num<T: std::str::FromStr>(field: &str, value: Option<&str>) -> std::result::Result<T, Refusal> {
    let v = value.ok_or_else(|| refuse(ErrorCode::BadArgument, format!("missing {field}")))?;
    v.parse().map_err(|_| refuse(ErrorCode::BadArgument, format!("{field} `{v}` is not a valid number")))
}

/// Parses `TURN <max_new> <keep> <temp> <top_p> <top_k> <n_ids> <ids...> [key=value...]`.
fn parse_turn(fields: &[&str]) -> std::result::Result<Turn, Refusal> {
    let mut it = fields.iter().copied();
    let max_new = parse_num("max_new", it.next())?;
    let keep = parse_num("keep", it.next())?;
    let temperature: f32 = parse_num("temp", it.next())?;
    let top_p: f32 = parse_num("top_p", it.next())?;
    let top_k = parse_num("top_k", it.next())?;
    let n: usize = parse_num("n_ids", it.next())?;
    let rest: Vec<&str> = it.collect();
    if rest.len() < n {
        return Err(refuse(ErrorCode::BadArgument, format!("n_ids is {n} but {} IDs follow", rest.len())));
    }
    let ids = rest[..n]
        .iter()
        .map(|w| w.parse::<u32>().map_err(|_| refuse(ErrorCode::BadId, format!("`{w}` is not a token ID"))))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut params = SamplingParams { temperature, top_p, top_k, ..Default::default() };
    for opt in &rest[n..] {
        let (k, v) = opt.split_once('=').ok_or_else(|| {
            refuse(ErrorCode::BadArgument, format!("`{opt}` after the IDs is not key=value"))
        })?;
        match k {
            "seed" => params.seed = parse_num("seed", Some(v))?,
            "min_p" => params.min_p = parse_num("min_p", Some(v))?,
            "rep" => params.repetition_penalty = parse_num("rep", Some(v))?,
            "rep_window" => params.repetition_window = parse_num("rep_window", Some(v))?,
            other => return Err(refuse(ErrorCode::BadArgument, format!("unknown option `{other}`"))),
        }
    }
    params.validate().map_err(|e| refuse(ErrorCode::BadArgument, e.to_string()))?;
    Ok(Turn { max_new, keep, params, ids })
}

/// Serves the protocol on `input`/`output` until `SHUTDOWN` or end of input.
pub fn serve(session: &mut Session, input: impl BufRead, mut output: impl Write) -> Result<()> {
    let vocab = session.runner().config().vocab_size;
    let stops = turn_stop_tokens(vocab);
    let io = |e: std::io::Error| Error::io("<stdout>", e);
    let ready = |session: &Session| {
        let stop_list: Vec<String> = stops.iter().map(u32::to_string).collect();
        format!("READY {} {vocab} {}", session.capacity(), stop_list.join(" ")).trim_end().to_string()
    };
    writeln!(output, "{}", ready(session)).map_err(io)?;
    output.flush().map_err(io)?;
    for line in input.lines() {
        let line = line.map_err(|e| Error::io("<stdin>", e))?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some((&cmd, args)) = fields.split_first() else { continue };
        let outcome = match cmd {
            "TURN" => match parse_turn(args) {
                Ok(turn) => run_turn(session, &turn, &stops, &mut output),
                Err(r) => Err(r),
            },
            // Keeps the model and its caches, drops the positions.
            "RESET" => match session.rewind(0) {
                Ok(()) => writeln!(output, "{}", ready(session)).map_err(io).map(|_| Ok(()))?,
                Err(e) => Err(refuse(ErrorCode::Internal, e.to_string())),
            },
            "SHUTDOWN" => {
                writeln!(output, "BYE").map_err(io)?;
                output.flush().map_err(io)?;
                return Ok(());
            }
            other => Err(refuse(ErrorCode::BadCommand, format!("unknown command `{other}`"))),
        };
        if let Err(r) = outcome {
            writeln!(output, "ERROR {} {} {}", r.code.as_str(), u8::from(r.fatal), r.message).map_err(io)?;
        }
        output.flush().map_err(io)?;
    }
    Ok(())
}

/// Validates and runs one turn, streaming `TOKEN` lines and a final `DONE`.
fn run_turn(
    session: &mut Session,
    turn: &Turn,
    stops: &[u32],
    output: &mut impl Write,
) -> std::result::Result<(), Refusal> {
    // Everything is checked before the cache changes.
    if turn.keep > session.pos() {
        return Err(refuse(
            ErrorCode::KeepRange,
            format!("keep {} exceeds pos {}", turn.keep, session.pos()),
        ));
    }
    session.check_ids(&turn.ids).map_err(|e| refuse(ErrorCode::BadId, e.to_string()))?;
    if turn.keep + turn.ids.len() > session.capacity() {
        return Err(refuse(
            ErrorCode::ContextFull,
            format!(
                "keep {} + {} IDs exceed the context of {}",
                turn.keep,
                turn.ids.len(),
                session.capacity()
            ),
        ));
    }
    if turn.ids.is_empty() && (turn.keep != session.pos() || session.pos() == 0) && turn.max_new > 0 {
        return Err(refuse(ErrorCode::BadArgument, "no IDs to consume and nothing to continue from"));
    }
    let mut sampler =
        Sampler::new(turn.params.clone()).map_err(|e| refuse(ErrorCode::BadArgument, e.to_string()))?;
    session.rewind(turn.keep).map_err(|e| refuse(ErrorCode::KeepRange, e.to_string()))?;
    let mut write_failed = false;
    let result = session.generate(&turn.ids, turn.max_new, &mut sampler, stops, &mut |id| {
        write_failed |= writeln!(output, "TOKEN {id}").and_then(|_| output.flush()).is_err();
        !write_failed
    });
    match result {
        Ok(g) => {
            let reason = match g.stop {
                StopReason::Stop(special::CALL) => "CALL",
                StopReason::Stop(_) => "RETURN",
                StopReason::MaxTokens | StopReason::Cancelled => "MAX_TOKENS",
                StopReason::ContextFull => "CONTEXT_FULL",
            };
            let _ = writeln!(output, "DONE {reason} {} {}", g.tokens.len(), session.pos());
            Ok(())
        }
        Err(e) => {
            // The engine failed mid-turn: the cache may hold partial positions, so start over.
            let _ = session.rewind(0);
            Err(Refusal {
                code: ErrorCode::Internal,
                fatal: false,
                message: format!("{e}; the session was reset"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_parses_with_options() {
        let t =
            parse_turn(&["5", "0", "0.7", "0.9", "40", "3", "1", "2", "3", "seed=9", "min_p=0.05"]).unwrap();
        assert_eq!((t.max_new, t.keep, t.ids.clone()), (5, 0, vec![1, 2, 3]));
        assert_eq!((t.params.temperature, t.params.top_p, t.params.top_k), (0.7, 0.9, 40));
        assert_eq!((t.params.seed, t.params.min_p), (9, 0.05));
    }

    #[test]
    fn malformed_turns_are_refused_with_a_code() {
        let code = |f: &[&str]| parse_turn(f).unwrap_err().code;
        assert_eq!(code(&["5", "0", "0.7"]), ErrorCode::BadArgument);
        assert_eq!(code(&["5", "x", "0", "1", "0", "0"]), ErrorCode::BadArgument);
        assert_eq!(code(&["5", "0", "0", "1", "0", "3", "1", "2"]), ErrorCode::BadArgument);
        assert_eq!(code(&["5", "0", "0", "1", "0", "2", "1", "-4"]), ErrorCode::BadId);
        assert_eq!(code(&["5", "0", "0", "1.5", "0", "0"]), ErrorCode::BadArgument);
        assert_eq!(code(&["5", "0", "0", "1", "0", "0", "bogus=1"]), ErrorCode::BadArgument);
    }
}
