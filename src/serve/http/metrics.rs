//! `GET /metrics`: the server's counters in the Prometheus text format (version 0.0.4).
//!
//! Rates are left to the scraper, as Prometheus wants: the prefill rate is
//! `rate(picchio_prefill_tokens_total) / rate(picchio_prefill_seconds_total)`, the decode
//! rate `rate(picchio_completion_tokens_total) / rate(picchio_decode_seconds_total)`.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use super::worker::Counters;
use crate::slots::SlotCounters;

/// The content type of the Prometheus text format.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The text of every metric, from `counters` and the number of stored responses.
pub(crate) fn render(counters: &Counters, stored_responses: usize) -> String {
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::SeqCst);
    let seconds = |a: &std::sync::atomic::AtomicU64| get(a) as f64 / 1e6;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, String)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    metric(
        "picchio_requests_total",
        "counter",
        "Turns the engine finished, by outcome (cancelled: the client went away).",
        &[
            ("{outcome=\"completed\"}", get(&counters.completed).to_string()),
            ("{outcome=\"cancelled\"}", get(&counters.cancelled).to_string()),
            ("{outcome=\"failed\"}", get(&counters.failed).to_string()),
        ],
    );
    let plain = |v: String| [("", v)];
    metric(
        "picchio_prompt_tokens_total",
        "counter",
        "Prompt tokens of every turn run (the whole prompt, also of a turn stopped during its prefill).",
        &plain(get(&counters.prompt_tokens).to_string()),
    );
    metric(
        "picchio_cached_tokens_total",
        "counter",
        "Prompt tokens reused from the cache (prefix cache hits).",
        &plain(get(&counters.cached_tokens).to_string()),
    );
    metric(
        "picchio_prefill_tokens_total",
        "counter",
        "Prompt tokens computed (not reused from the cache; of a turn stopped during its prefill, only those computed).",
        &plain(get(&counters.prefill_tokens).to_string()),
    );
    metric(
        "picchio_completion_tokens_total",
        "counter",
        "Tokens generated.",
        &plain(get(&counters.completion_tokens).to_string()),
    );
    metric(
        "picchio_prefill_seconds_total",
        "counter",
        "Time from the start of each turn to its first generated token.",
        &plain(format!("{:.6}", seconds(&counters.prefill_micros))),
    );
    metric(
        "picchio_decode_seconds_total",
        "counter",
        "Time from the first generated token of each turn to its end.",
        &plain(format!("{:.6}", seconds(&counters.decode_micros))),
    );
    metric(
        "picchio_queue_length",
        "gauge",
        "Requests waiting for the engine.",
        &plain(get(&counters.queued).to_string()),
    );
    metric(
        "picchio_busy",
        "gauge",
        "1 while the engine is generating (some slot runs a request).",
        &plain(u8::from(get(&counters.active) > 0).to_string()),
    );
    metric(
        "picchio_slots",
        "gauge",
        "Slots: requests served at once (--parallel).",
        &plain(get(&counters.slots).to_string()),
    );
    metric(
        "picchio_active_slots",
        "gauge",
        "Slots running a request now.",
        &plain(get(&counters.active).to_string()),
    );
    let scheduler = counters.scheduler.get();
    let sched = |f: fn(&SlotCounters) -> &std::sync::atomic::AtomicU64| scheduler.map_or(0, |c| get(f(c)));
    metric(
        "picchio_decode_steps_total",
        "counter",
        "Decode steps run, each advancing every slot that was decoding by one token.",
        &plain(sched(|c| &c.steps).to_string()),
    );
    metric(
        "picchio_decode_step_rows_total",
        "counter",
        "Rows of the decode steps, summed (over picchio_decode_steps_total: the mean batch size).",
        &plain(sched(|c| &c.step_rows).to_string()),
    );
    metric(
        "picchio_decode_batch_size",
        "gauge",
        "Rows (slots) in the last decode step.",
        &plain(sched(|c| &c.last_step_rows).to_string()),
    );
    let generated = get(&counters.completion_tokens);
    let per_token = |total: u64| if generated == 0 { 0.0 } else { total as f64 / generated as f64 };
    metric(
        "picchio_expert_read_bytes_per_generated_token",
        "gauge",
        "Bytes of expert weights read from disk per generated token (all turns so far).",
        &plain(format!("{:.1}", per_token(get(&counters.expert_bytes_read)))),
    );
    metric(
        "picchio_expert_requests_per_generated_token",
        "gauge",
        "Expert weight requests (from memory or disk) per generated token, prefill included: \
         batching slots reads each expert of a step once for all of them.",
        &plain(format!(
            "{:.2}",
            per_token(get(&counters.expert_hits).saturating_add(get(&counters.expert_misses)))
        )),
    );
    metric(
        "picchio_expert_requests_total",
        "counter",
        "Expert weight requests of the expert cache, by where they were served from (as of the last turn).",
        &[
            ("{result=\"hit\"}", get(&counters.expert_hits).to_string()),
            ("{result=\"miss\"}", get(&counters.expert_misses).to_string()),
        ],
    );
    metric(
        "picchio_expert_read_bytes_total",
        "counter",
        "Bytes of expert weights read from disk (as of the last turn).",
        &plain(get(&counters.expert_bytes_read).to_string()),
    );
    metric(
        "picchio_stored_responses",
        "gauge",
        "Responses kept for GET /v1/responses/{id} and previous_response_id.",
        &plain(stored_responses.to_string()),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_type_and_a_sample() {
        let counters = Counters::default();
        counters.completed.store(3, Ordering::SeqCst);
        counters.prefill_micros.store(1_500_000, Ordering::SeqCst);
        let text = render(&counters, 2);
        assert!(text.contains("picchio_requests_total{outcome=\"completed\"} 3\n"), "{text}");
        assert!(text.contains("picchio_prefill_seconds_total 1.500000\n"), "{text}");
        assert!(text.contains("picchio_stored_responses 2\n"), "{text}");
        let mut last_type = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                last_type = rest.split(' ').next();
            } else if !line.starts_with("# HELP ") {
                let name = line.split(['{', ' ']).next().unwrap();
                assert_eq!(Some(name), last_type, "a sample follows its TYPE line: {line}");
                let value = line.rsplit(' ').next().unwrap();
                assert!(value.parse::<f64>().is_ok(), "{line}");
            }
        }
    }
}
