//! Stop strings: text that ends a turn when it appears in the answer, and that is never
//! shown (neither it nor anything after it).
//!
//! Text arrives in pieces (one per token or so), and a stop string can span pieces, so
//! [`StopMatcher`] holds back the end of the text that could still be the start of a stop
//! string, and releases it as soon as it cannot be one anymore (or when the text ends).
//! The turn ends at the first stop string to be *complete* (the one whose first occurrence
//! ends earliest; of two ending together, the longer), as it would when the text arrives one
//! character at a time: generation cannot wait for a longer stop string that started earlier
//! to maybe complete later. The released pieces always add up to the text before that stop
//! string, whatever the split: a stream and a one-shot answer say the same.

use crate::error::{Error, Result};

/// The most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// What one piece of text released.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Text that can be shown now (possibly empty).
    pub text: String,
    /// A stop string was found: `text` ends right before it, and the matcher releases
    /// nothing more.
    pub stopped: bool,
}

/// Finds stop strings in text that arrives in pieces; see the module documentation.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not released: the longest end of it that is the start of a stop
    /// string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; fails on an empty stop string (it would match everywhere).
    /// With no stop strings every piece is released whole at once.
    pub fn new(stops: &[String]) -> Result<Self> {
        if let Some(i) = stops.iter().position(String::is_empty) {
            return Err(Error::invalid(format!("stop string {i} is empty")));
        }
        Ok(StopMatcher { stops: stops.to_vec(), held: String::new(), stopped: false })
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The text held back now (the start of a possible stop string).
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Takes the next piece of text: releases what cannot be part of a stop string, or
    /// everything before the first stop string and stops. After a stop nothing more is
    /// released.
    pub fn push(&mut self, piece: &str) -> Released {
        if self.stopped {
            return Released { text: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            return Released { text: piece.to_string(), stopped: false };
        }
        let mut text = std::mem::take(&mut self.held);
        text.push_str(piece);
        // The stop string complete first: smallest end, then smallest start.
        let first =
            self.stops.iter().filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at))).min();
        if let Some((_, at)) = first {
            text.truncate(at);
            self.stopped = true;
            return Released { text, stopped: true };
        }
        let keep = self.start_of_possible_stop(&text);
        self.held = text.split_off(keep);
        Released { text, stopped: false }
    }

    /// Releases the held text: the text ended (or is interrupted by text a stop string
    /// does not apply to), so it cannot become a stop string. The matcher goes on with
    /// the next piece as if the text started afresh.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Where the longest end of `text` that is a proper start of a stop string begins
    /// (`text.len()` when none is). Only character boundaries are tried, so the held text
    /// is always whole characters.
    fn start_of_possible_stop(&self, text: &str) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = text.len().saturating_sub(longest.saturating_sub(1));
        (from..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .find(|&i| self.stops.iter().any(|s| s.as_bytes().starts_with(&text.as_bytes()[i..])))
            .unwrap_or(text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    /// Every release of `pieces`, then the flush if no stop was found.
    fn run(m: &mut StopMatcher, pieces: &[&str]) -> (Vec<String>, bool) {
        let mut out = Vec::new();
        for p in pieces {
            let r = m.push(p);
            out.push(r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push(m.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_held_then_cut() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("Hello S"), Released { text: "Hello ".into(), stopped: false });
        assert_eq!(m.held(), "S");
        assert_eq!(m.push("T"), Released { text: String::new(), stopped: false });
        assert_eq!(m.push("OP and more"), Released { text: String::new(), stopped: true });
        assert!(m.stopped());
        assert_eq!(m.push("x"), Released { text: String::new(), stopped: true });
    }

    #[test]
    fn held_text_is_released_when_it_cannot_be_a_stop() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("ST").text, "");
        assert_eq!(m.push("ORY").text, "STORY");
        assert_eq!(m.push(" S").text, " ");
        assert_eq!(m.flush(), "S");
    }

    #[test]
    fn the_stop_complete_first_wins() {
        // "abcd" starts before "bc" in "xabcd", but "bc" is complete first: one character at
        // a time the turn would end there, so it does whatever the pieces.
        for pieces in [&["xa", "b", "cd"][..], &["xabcd"], &["x", "a", "b", "c", "d"]] {
            let (out, stopped) = run(&mut matcher(&["abcd", "bc"]), pieces);
            assert!(stopped);
            assert_eq!(out.concat(), "xa", "{pieces:?}");
        }
        // Two complete at the same character: the longer (earlier) one wins.
        let (out, stopped) = run(&mut matcher(&["bc", "abc"]), &["xab", "c"]);
        assert!(stopped);
        assert_eq!(out.concat(), "x");
        // A stop whose end overlaps its own start: "aab" in "aaab".
        let (out, stopped) = run(&mut matcher(&["aab"]), &["a", "a", "a", "b"]);
        assert!(stopped);
        assert_eq!(out.concat(), "a");
        // A stop at the very start shows nothing.
        let (out, stopped) = run(&mut matcher(&["\n\n", "Hi"]), &["Hi there"]);
        assert_eq!((out.concat(), stopped), (String::new(), true));
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("café").text, "caf");
        assert_eq!(m.held(), "é");
        assert_eq!(m.push("s").text, "és");
        let (out, stopped) = run(&mut matcher(&["🙂"]), &["ok 🙂 no"]);
        assert_eq!((out.concat(), stopped), ("ok ".to_string(), true));
    }

    #[test]
    fn no_stops_releases_everything_and_an_empty_stop_is_refused() {
        let (out, stopped) = run(&mut matcher(&[]), &["a", "b"]);
        assert_eq!(out, ["a", "b", ""]);
        assert!(!stopped);
        let e = StopMatcher::new(&["x".into(), String::new()]).unwrap_err().to_string();
        assert!(e.contains("stop string 1 is empty"), "{e}");
    }

    /// Splits `text` at the character indices `cuts` (taken modulo its length).
    fn split(text: &str, cuts: &[usize]) -> Vec<String> {
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        let mut at: Vec<usize> = if bounds.is_empty() {
            Vec::new()
        } else {
            cuts.iter().map(|c| bounds[c % bounds.len()]).collect()
        };
        at.sort_unstable();
        at.dedup();
        let mut pieces = Vec::new();
        let mut start = 0;
        for i in at {
            pieces.push(text[start..i].to_string());
            start = i;
        }
        pieces.push(text[start..].to_string());
        pieces
    }

    proptest! {
        #[test]
        fn releases_add_up_to_the_text_before_the_first_stop_whatever_the_split(
            text in "[ab é🙂\n]{0,40}",
            stops in proptest::collection::vec("[ab é🙂\n]{1,4}", 1..=MAX_STOP_STRINGS),
            cuts in proptest::collection::vec(0usize..64, 0..12),
        ) {
            // The stop string complete first (see the module documentation).
            let first = stops.iter().filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at))).min();
            let expected = &text[..first.map_or(text.len(), |(_, at)| at)];
            let mut m = StopMatcher::new(&stops).unwrap();
            let pieces = split(&text, &cuts);
            let mut shown = String::new();
            let mut stopped = false;
            for p in &pieces {
                let r = m.push(p);
                shown.push_str(&r.text);
                // Nothing shown so far holds a stop string, and what is held could still
                // become one.
                prop_assert!(stops.iter().all(|s| !shown.contains(s.as_str())));
                if r.stopped {
                    stopped = true;
                    break;
                }
                let held = m.held();
                prop_assert!(held.is_empty() || stops.iter().any(|s| s.starts_with(held) && s.len() > held.len()));
            }
            if !stopped {
                shown.push_str(&m.flush());
            }
            prop_assert_eq!(stopped, first.is_some());
            prop_assert_eq!(shown.as_str(), expected);
        }
    }
}
