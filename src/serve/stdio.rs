//! The line protocol of `picchio serve --stdio` (specified in `docs/protocol.md`): raw token
//! IDs in, raw token IDs out, one persistent session, every request validated before the
//! cache changes.
//!
//! Lines are read as bytes with a bounded reader ([`max_line_bytes`]): an over-long line is
//! skipped up to its newline without being buffered, and a line that is not UTF-8 is refused,
//! both with a non-fatal `ERROR` that leaves the session as it was.
//!
//! A `CANCEL` line stops the turn it follows between prefill blocks or after a token
//! (`DONE CANCELLED`); it can only be seen during a turn when the input is read ahead
//! ([`serve_cancellable`], what `picchio serve --stdio` runs).

use std::io::{BufRead, Write};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};

use crate::chat::tokenizer::special;
use crate::chat::turn_stop_tokens;
use crate::error::{Error, Result};
use crate::model::LogitRows;
use crate::sample::{Sampled, Sampler, SamplingParams};
use crate::session::{Generation, Session, StopReason};

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
    /// The line is longer than [`max_line_bytes`]; it was skipped.
    LineTooLong,
    /// The line is not valid UTF-8.
    BadUtf8,
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
            ErrorCode::LineTooLong => "LINE_TOO_LONG",
            ErrorCode::BadUtf8 => "BAD_UTF8",
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
    let Some((id_words, options)) = rest.split_at_checked(n) else {
        return Err(refuse(ErrorCode::BadArgument, format!("n_ids is {n} but {} IDs follow", rest.len())));
    };
    let ids = id_words
        .iter()
        .map(|w| w.parse::<u32>().map_err(|_| refuse(ErrorCode::BadId, format!("`{w}` is not a token ID"))))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut params = SamplingParams { temperature, top_p, top_k, ..Default::default() };
    for opt in options {
        let (k, v) = opt.split_once('=').ok_or_else(|| {
            refuse(ErrorCode::BadArgument, format!("`{opt}` after the IDs is not key=value"))
        })?;
        match k {
            "seed" => params.seed = parse_num("seed", Some(v))?,
            "min_p" => params.min_p = parse_num("min_p", Some(v))?,
            "rep" => params.repetition_penalty = parse_num("rep", Some(v))?,
            "rep_window" => params.repetition_window = parse_num("rep_window", Some(v))?,
            "presence" => params.presence_penalty = parse_num("presence", Some(v))?,
            "frequency" => params.frequency_penalty = parse_num("frequency", Some(v))?,
            "bias" => params.logit_bias = parse_bias(v)?,
            "logprobs" => params.logprobs = Some(parse_num("logprobs", Some(v))?),
            other => return Err(refuse(ErrorCode::BadArgument, format!("unknown option `{other}`"))),
        }
    }
    params.validate().map_err(|e| refuse(ErrorCode::BadArgument, e.to_string()))?;
    Ok(Turn { max_new, keep, params, ids })
}

/// Parses `ID:BIAS[,ID:BIAS...]` (the `bias=` option).
fn parse_bias(value: &str) -> std::result::Result<Vec<(u32, f32)>, Refusal> {
    value
        .split(',')
        .map(|pair| {
            let (id, bias) = pair
                .split_once(':')
                .ok_or_else(|| refuse(ErrorCode::BadArgument, format!("bias `{pair}` is not ID:BIAS")))?;
            let id = id
                .parse::<u32>()
                .map_err(|_| refuse(ErrorCode::BadId, format!("bias: `{id}` is not a token ID")))?;
            Ok((id, parse_num("bias", Some(bias))?))
        })
        .collect()
}

/// Bytes allowed per ID on a request line: up to 6 digits and a separator make 7; 16 leaves
/// room for leading zeros, runs of blanks and a `\r`.
const LINE_BYTES_PER_ID: usize = 16;

/// Bytes allowed on a request line besides its IDs: the command, the numeric fields and the
/// `key=value` options.
const LINE_HEADER_BYTES: usize = 64 << 10;

/// The longest request line accepted for a context of `capacity` positions, in bytes (without
/// the newline): room for a `TURN` with `capacity` IDs ([`LINE_BYTES_PER_ID`] bytes each)
/// plus 64 KiB for the other fields. A longer line cannot be a valid request (it would not fit
/// the context), so it is skipped unread and answered with `ERROR LINE_TOO_LONG`; the cap is
/// what bounds the memory one line can take.
pub fn max_line_bytes(capacity: usize) -> usize {
    capacity.saturating_mul(LINE_BYTES_PER_ID).saturating_add(LINE_HEADER_BYTES)
}

/// One line read by [`read_line`].
#[derive(Debug, PartialEq, Eq)]
enum LineRead {
    /// A whole line, now in the buffer (without its `\n` or `\r\n`).
    Line,
    /// A line of this many bytes, over the cap: dropped as it was read.
    TooLong(u64),
}

/// Reads one line of at most `cap` bytes into `buf`, a chunk at a time. The bytes of a longer
/// line are dropped as they arrive, up to its newline, so that memory stays within `cap` plus
/// the reader's buffer. `None` at end of input; a last line without a newline counts.
fn read_line(input: &mut impl BufRead, cap: usize, buf: &mut Vec<u8>) -> std::io::Result<Option<LineRead>> {
    buf.clear();
    let mut total: u64 = 0;
    let mut started = false;
    loop {
        let chunk = match input.fill_buf() {
            Ok(chunk) => chunk,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            if !started {
                return Ok(None);
            }
            break;
        }
        started = true;
        let newline = chunk.iter().position(|&b| b == b'\n');
        let part = &chunk[..newline.unwrap_or(chunk.len())];
        total = total.saturating_add(part.len() as u64);
        if total <= cap as u64 {
            buf.extend_from_slice(part);
        } else {
            buf.clear();
        }
        let used = part.len() + usize::from(newline.is_some());
        input.consume(used);
        if newline.is_some() {
            break;
        }
    }
    if total > cap as u64 {
        return Ok(Some(LineRead::TooLong(total)));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(LineRead::Line))
}

/// The text of line `number` of `bytes`, or the refusal of a line that is not UTF-8.
fn line_text(bytes: &[u8], number: u64) -> std::result::Result<&str, Refusal> {
    std::str::from_utf8(bytes).map_err(|e| {
        refuse(
            ErrorCode::BadUtf8,
            format!("line {number} is not valid UTF-8 (bad byte at offset {})", e.valid_up_to()),
        )
    })
}

/// What the line reader hands the protocol loop.
enum Incoming {
    /// A line (its bytes, or the length of one over the cap).
    Line(LineRead, Vec<u8>),
    /// End of input.
    End,
    /// Reading failed.
    Failed(std::io::Error),
}

/// Where request lines come from.
enum Lines<'a> {
    /// Read from the input when the loop asks for the next request: nothing is read while a
    /// turn runs, so `CANCEL` cannot stop one.
    Direct(Box<dyn BufRead + 'a>),
    /// Read ahead by a thread (one line at a time), so that a `CANCEL` or the end of input
    /// is seen while a turn runs.
    ReadAhead {
        /// Lines from the reader thread.
        rx: Receiver<Incoming>,
        /// The next line, taken from `rx` to look at it during a turn.
        next: Option<Incoming>,
    },
}

/// Whether `bytes` is a line the protocol ignores (empty, or only whitespace), as the
/// protocol loop judges it.
fn is_blank(bytes: &[u8]) -> bool {
    std::str::from_utf8(bytes).is_ok_and(|l| l.split_whitespace().next().is_none())
}

/// Whether `bytes` is the line `CANCEL`.
fn is_cancel(bytes: &[u8]) -> bool {
    std::str::from_utf8(bytes).is_ok_and(|l| l.split_whitespace().eq(["CANCEL"]))
}

impl Lines<'_> {
    /// The next line, waiting for it; `Incoming::End` at end of input.
    fn next(&mut self, cap: usize) -> Incoming {
        match self {
            Lines::Direct(input) => {
                let mut buf = Vec::new();
                match read_line(input, cap, &mut buf) {
                    Ok(Some(read)) => Incoming::Line(read, buf),
                    Ok(None) => Incoming::End,
                    Err(e) => Incoming::Failed(e),
                }
            }
            Lines::ReadAhead { rx, next } => next.take().or_else(|| rx.recv().ok()).unwrap_or(Incoming::End),
        }
    }

    /// Whether the turn that runs now should stop: the next line is `CANCEL` (taken, so it
    /// gets no reply) or input has ended (or failed). Blank lines in between are taken
    /// (counted in `number`); any other line waits for its turn. Never waits; always false
    /// for [`Lines::Direct`].
    fn cancel_waiting(&mut self, number: &mut u64) -> bool {
        let Lines::ReadAhead { rx, next } = self else { return false };
        loop {
            if next.is_none() {
                match rx.try_recv() {
                    Ok(incoming) => *next = Some(incoming),
                    Err(TryRecvError::Empty) => return false,
                    Err(TryRecvError::Disconnected) => {
                        *next = Some(Incoming::End);
                        return true;
                    }
                }
            }
            match next {
                Some(Incoming::Line(LineRead::Line, bytes)) if is_blank(bytes) => {
                    *number = number.saturating_add(1);
                    *next = None;
                }
                Some(Incoming::Line(LineRead::Line, bytes)) if is_cancel(bytes) => {
                    *number = number.saturating_add(1);
                    *next = None;
                    return true;
                }
                Some(Incoming::End | Incoming::Failed(_)) => return true,
                Some(Incoming::Line(..)) | None => return false,
            }
        }
    }
}

/// Reads lines of at most `cap` bytes from `input` into `tx` until end of input, a read
/// error, or the receiver is gone.
fn read_ahead(mut input: impl BufRead, cap: usize, tx: SyncSender<Incoming>) {
    loop {
        let mut buf = Vec::new();
        let (incoming, last) = match read_line(&mut input, cap, &mut buf) {
            Ok(Some(read)) => (Incoming::Line(read, buf), false),
            Ok(None) => (Incoming::End, true),
            Err(e) => (Incoming::Failed(e), true),
        };
        if tx.send(incoming).is_err() || last {
            return;
        }
    }
}

/// Serves the protocol on `input`/`output` until `SHUTDOWN` or end of input. Lines longer
/// than [`max_line_bytes`] of the session's capacity, lines that are not UTF-8 and malformed
/// requests get a non-fatal `ERROR` line and leave the session as it was; blank lines are
/// ignored. Lines are read only between requests, so a `CANCEL` cannot stop a turn here
/// (it is read after the turn, as a no-op); [`serve_cancellable`] reads ahead.
pub fn serve(session: &mut Session, input: impl BufRead, output: impl Write) -> Result<()> {
    let stops = turn_stop_tokens(session.runner().config().vocab_size);
    serve_lines(session, &stops, Lines::Direct(Box::new(input)), output)
}

/// [`serve`] with the input read ahead by a thread, so that a `CANCEL` line (or the end of
/// input) stops the turn in progress between prefill blocks or after the token being
/// generated (`DONE CANCELLED`). The thread ends at end of input; when the protocol ends
/// first (`SHUTDOWN`), it is left waiting on `input` and ends with it (for stdin: when the
/// process exits).
pub fn serve_cancellable(
    session: &mut Session,
    input: impl BufRead + Send + 'static,
    output: impl Write,
) -> Result<()> {
    let stops = turn_stop_tokens(session.runner().config().vocab_size);
    serve_cancellable_with_stops(session, &stops, input, output)
}

/// [`serve_cancellable`] with the stop tokens of the model's chat format
/// ([`ChatFormat::stop_tokens`](crate::chat::ChatFormat::stop_tokens): Harmony's, or a
/// ChatML model's `eos_token_id`) instead of Harmony's.
pub fn serve_cancellable_with_stops(
    session: &mut Session,
    stops: &[u32],
    input: impl BufRead + Send + 'static,
    output: impl Write,
) -> Result<()> {
    let cap = max_line_bytes(session.capacity());
    let (tx, rx) = sync_channel(1);
    std::thread::Builder::new()
        .name("picchio-stdin".into())
        .spawn(move || read_ahead(input, cap, tx))
        .map_err(|e| Error::io("<stdin reader thread>", e))?;
    serve_lines(session, stops, Lines::ReadAhead { rx, next: None }, output)
}

/// The protocol loop over `lines`, ending turns at `stops`.
fn serve_lines(
    session: &mut Session,
    stops: &[u32],
    mut lines: Lines<'_>,
    mut output: impl Write,
) -> Result<()> {
    let vocab = session.runner().config().vocab_size;
    let cap = max_line_bytes(session.capacity());
    let io = |e: std::io::Error| Error::io("<stdout>", e);
    let ready = |session: &Session| {
        let stop_list: Vec<String> = stops.iter().map(u32::to_string).collect();
        format!("READY {} {vocab} {}", session.capacity(), stop_list.join(" ")).trim_end().to_string()
    };
    writeln!(output, "{}", ready(session)).map_err(io)?;
    output.flush().map_err(io)?;
    let mut number: u64 = 0;
    loop {
        let (read, buf) = match lines.next(cap) {
            Incoming::Line(read, buf) => (read, buf),
            Incoming::End => break,
            Incoming::Failed(e) => return Err(Error::io("<stdin>", e)),
        };
        number = number.saturating_add(1);
        let outcome = match read {
            LineRead::TooLong(len) => Err(refuse(
                ErrorCode::LineTooLong,
                format!("line {number} has {len} bytes, over the limit of {cap} bytes; it was skipped"),
            )),
            LineRead::Line => match line_text(&buf, number) {
                Err(r) => Err(r),
                Ok(line) => {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    // Blank lines are ignored (documented in docs/protocol.md).
                    let Some((&cmd, args)) = fields.split_first() else { continue };
                    match cmd {
                        "TURN" => match parse_turn(args) {
                            Ok(turn) => {
                                let mut cancel = || lines.cancel_waiting(&mut number);
                                run_turn(session, &turn, stops, &mut output, &mut cancel)
                            }
                            Err(r) => Err(r),
                        },
                        // A CANCEL read between turns came too late for its turn: nothing to
                        // stop, no reply (see docs/protocol.md).
                        "CANCEL" if args.is_empty() => continue,
                        // Keeps the model and its caches, drops the positions.
                        "RESET" => match session.rewind(0) {
                            Ok(()) => {
                                writeln!(output, "{}", ready(session)).map_err(io)?;
                                Ok(())
                            }
                            Err(e) => Err(refuse(ErrorCode::Internal, e.to_string())),
                        },
                        "SHUTDOWN" => {
                            writeln!(output, "BYE").map_err(io)?;
                            output.flush().map_err(io)?;
                            return Ok(());
                        }
                        other => Err(refuse(ErrorCode::BadCommand, format!("unknown command `{other}`"))),
                    }
                }
            },
        };
        if let Err(r) = outcome {
            writeln!(output, "{}", error_line(&r)).map_err(io)?;
        }
        output.flush().map_err(io)?;
    }
    Ok(())
}

/// The most characters of a message an `ERROR` line shows (a message can quote a field).
const MAX_MESSAGE_CHARS: usize = 1024;

/// `ERROR <code> <fatal> <message>`, on one line whatever the message holds, and at most
/// [`MAX_MESSAGE_CHARS`] characters of it.
fn error_line(r: &Refusal) -> String {
    let message: String =
        r.message.chars().take(MAX_MESSAGE_CHARS).map(|c| if c.is_control() { ' ' } else { c }).collect();
    format!("ERROR {} {} {}", r.code.as_str(), u8::from(r.fatal), message)
}

/// `TOKEN <id>`, and with log probabilities ` <logprob> <id>:<logprob>...` (the
/// alternatives, most likely first).
fn token_line(s: &Sampled) -> String {
    let mut line = format!("TOKEN {}", s.token);
    if let Some(lp) = &s.logprobs {
        line.push_str(&format!(" {}", lp.logprob));
        for (id, logprob) in &lp.top {
            line.push_str(&format!(" {id}:{logprob}"));
        }
    }
    line
}

/// Validates and runs one turn, streaming `TOKEN` lines and a final `DONE`. `cancel` is
/// asked between prefill blocks and after each token whether to stop (`DONE CANCELLED`).
fn run_turn(
    session: &mut Session,
    turn: &Turn,
    stops: &[u32],
    output: &mut impl Write,
    cancel: &mut dyn FnMut() -> bool,
) -> std::result::Result<(), Refusal> {
    // Everything is checked before the cache changes.
    if turn.keep > session.pos() {
        return Err(refuse(
            ErrorCode::KeepRange,
            format!("keep {} exceeds pos {}", turn.keep, session.pos()),
        ));
    }
    session.check_ids(&turn.ids).map_err(|e| refuse(ErrorCode::BadId, e.to_string()))?;
    let vocab = session.runner().config().vocab_size;
    turn.params.validate_for_vocab(vocab).map_err(|e| refuse(ErrorCode::BadId, e.to_string()))?;
    if turn.keep.saturating_add(turn.ids.len()) > session.capacity() {
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
    // The IDs go in block by block, so a CANCEL can stop a long prompt between blocks.
    let rows = if turn.max_new > 0 { LogitRows::Last } else { LogitRows::None };
    let prefilled =
        if turn.ids.is_empty() { Ok(true) } else { session.prefill(&turn.ids, rows, &mut |_| !cancel()) };
    let result = prefilled.and_then(|finished| {
        if !finished {
            return Ok(Generation { tokens: Vec::new(), stop: StopReason::Cancelled });
        }
        session.generate(&[], turn.max_new, &mut sampler, stops, &mut |s| {
            write_failed |= writeln!(output, "{}", token_line(s)).and_then(|_| output.flush()).is_err();
            !write_failed && !cancel()
        })
    });
    match result {
        Ok(g) => {
            let reason = match g.stop {
                StopReason::Stop(special::CALL) => "CALL",
                // Sessions never report a stop string (only chat turns do, and this
                // protocol has none); an end of the answer either way.
                StopReason::Stop(_) | StopReason::StopString => "RETURN",
                StopReason::MaxTokens => "MAX_TOKENS",
                StopReason::Cancelled => "CANCELLED",
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
        let t = parse_turn(&[
            "5",
            "0",
            "0",
            "1",
            "0",
            "1",
            "1",
            "presence=0.5",
            "frequency=-1",
            "bias=7:100,9:-2.5",
            "logprobs=3",
        ])
        .unwrap();
        assert_eq!((t.params.presence_penalty, t.params.frequency_penalty), (0.5, -1.0));
        assert_eq!((t.params.logit_bias.clone(), t.params.logprobs), (vec![(7, 100.0), (9, -2.5)], Some(3)));
        let code = |opt: &str| parse_turn(&["5", "0", "0", "1", "0", "0", opt]).unwrap_err().code;
        assert_eq!(code("bias=7"), ErrorCode::BadArgument);
        assert_eq!(code("bias=x:1"), ErrorCode::BadId);
        assert_eq!(code("bias=7:101"), ErrorCode::BadArgument);
        assert_eq!(code("presence=3"), ErrorCode::BadArgument);
        assert_eq!(code("logprobs=21"), ErrorCode::BadArgument);
    }

    #[test]
    fn token_lines_carry_log_probabilities_when_asked() {
        assert_eq!(token_line(&Sampled::token(5)), "TOKEN 5");
        let s = Sampled {
            token: 5,
            logprobs: Some(crate::sample::TokenLogprobs { logprob: -0.25, top: vec![(5, -0.25), (2, -1.5)] }),
        };
        assert_eq!(token_line(&s), "TOKEN 5 -0.25 5:-0.25 2:-1.5");
    }

    #[test]
    fn lines_are_read_within_the_cap() {
        // A reader with a 4-byte buffer, so that lines span many chunks.
        let text: &[u8] = b"TURN 1\r\n0123456789abcdef\nok\n\xff\n\nlast";
        let mut input = std::io::BufReader::with_capacity(4, text);
        let mut buf = Vec::new();
        let mut next = || {
            let r = read_line(&mut input, 8, &mut buf).unwrap();
            (r, buf.clone())
        };
        assert_eq!(next(), (Some(LineRead::Line), b"TURN 1".to_vec()));
        assert_eq!(next().0, Some(LineRead::TooLong(16)));
        assert_eq!(next(), (Some(LineRead::Line), b"ok".to_vec()));
        assert_eq!(next(), (Some(LineRead::Line), vec![0xff]));
        assert_eq!(next(), (Some(LineRead::Line), Vec::new()));
        assert_eq!(next(), (Some(LineRead::Line), b"last".to_vec()));
        assert_eq!(next().0, None);
        assert!(line_text(&[b'a', 0xff], 3).unwrap_err().message.contains("line 3"));
    }

    #[test]
    fn error_lines_stay_on_one_line() {
        let r = refuse(ErrorCode::BadCommand, format!("a\nb\r{}", "x".repeat(5000)));
        let line = error_line(&r);
        assert!(line.starts_with("ERROR BAD_COMMAND 0 a b "), "{line}");
        assert!(!line.contains('\n') && line.len() < 1100);
    }

    #[test]
    fn the_line_cap_fits_a_full_context_of_ids() {
        let cap = max_line_bytes(131_072);
        let header = "TURN 4294967295 131072 0.7 0.95 40 131072 ";
        assert!(cap >= header.len() + 131_072 * "201087 ".len() + "seed=18446744073709551615".len());
        assert_eq!(max_line_bytes(usize::MAX), usize::MAX);
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
