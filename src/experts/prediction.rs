//! Whether predicting the next layer's experts pays, judged at run time.
//!
//! A prediction's reads help only by the time they run before the computation asks for
//! them (its overlap window), and they hurt by the disk time of every wrong guess that was
//! read. Both are measured as the session runs: a right guess *hides* the time its read had
//! been under way when it was asked for (at most one record's read time); a wrong guess whose
//! read had started *wastes* one record's read time (one that had not started is cancelled
//! and costs nothing). While the hidden time is below the wasted time, predictions are not
//! acted on, except one in [`PROBE_EVERY`], which keeps both figures current so that the
//! gate opens again when the workload changes. Old evidence fades: both sums are halved
//! every [`HALF_LIFE`] scored guesses.

/// Scored guesses before the gate may close.
pub const WARMUP: u64 = 32;
/// While closed, one prediction in this many is still acted on.
pub const PROBE_EVERY: u64 = 8;
/// Scored guesses between two halvings of the sums.
pub const HALF_LIFE: u64 = 256;

/// The running account of what predictions hid and wasted.
#[derive(Clone, Debug, Default)]
pub struct PredictionGate {
    hidden_s: f64,
    wasted_s: f64,
    scored: u64,
    since_halving: u64,
    refused: u64,
}

impl PredictionGate {
    /// Whether the next prediction should be acted on (counts probes while closed).
    pub fn admit(&mut self) -> bool {
        if self.is_open() {
            return true;
        }
        self.refused += 1;
        self.refused.is_multiple_of(PROBE_EVERY)
    }

    /// Whether predictions pay (or there is not yet enough evidence to say they do not).
    pub fn is_open(&self) -> bool {
        self.scored < WARMUP || self.hidden_s >= self.wasted_s
    }

    /// A right guess whose read had been under way for `secs` (capped by the caller at one
    /// record's read time) when it was asked for.
    pub fn hid(&mut self, secs: f64) {
        self.hidden_s += secs.max(0.0);
        self.scored();
    }

    /// A wrong guess whose read could not be cancelled: `secs` of disk time for nothing.
    pub fn wasted(&mut self, secs: f64) {
        self.wasted_s += secs.max(0.0);
        self.scored();
    }

    fn scored(&mut self) {
        self.scored += 1;
        self.since_halving += 1;
        if self.since_halving >= HALF_LIFE {
            self.since_halving = 0;
            self.hidden_s /= 2.0;
            self.wasted_s /= 2.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_open_while_guesses_hide_more_than_they_waste() {
        let mut g = PredictionGate::default();
        for _ in 0..100 {
            g.hid(0.004);
            g.wasted(0.001);
        }
        assert!(g.is_open());
        assert!((0..20).all(|_| g.admit()));
    }

    #[test]
    fn closes_when_guesses_waste_more_than_they_hide_but_keeps_probing() {
        let mut g = PredictionGate::default();
        for _ in 0..100 {
            g.hid(0.0005);
            g.wasted(0.008);
        }
        assert!(!g.is_open());
        let admitted = (0..80).filter(|_| g.admit()).count();
        assert_eq!(admitted, 80 / PROBE_EVERY as usize);
    }

    #[test]
    fn opens_again_when_the_workload_changes() {
        let mut g = PredictionGate::default();
        for _ in 0..100 {
            g.wasted(0.008);
        }
        assert!(!g.is_open());
        for _ in 0..(4 * HALF_LIFE) {
            g.hid(0.008);
        }
        assert!(g.is_open());
    }

    #[test]
    fn needs_evidence_before_closing() {
        let mut g = PredictionGate::default();
        for _ in 0..WARMUP - 1 {
            g.wasted(1.0);
        }
        assert!(g.is_open());
        g.wasted(1.0);
        assert!(!g.is_open());
    }
}
