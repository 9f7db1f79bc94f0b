"""Prometheus metrics of the HTTP endpoint, in vLLM's spec-decode vocabulary."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specserve_requests", "Finished requests", ["finish_reason"], registry=r)
        self.failures = Counter("specserve_request_failures", "Completion requests that did not finish, by the HTTP "
                                "status they got (in the stream's error event, once streaming), or 'cancelled': "
                                "the client went away", ["status"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.num_drafts = Counter("specserve_spec_decode_num_drafts", "Draft rounds", registry=r)
        self.num_draft_tokens = Counter("specserve_spec_decode_num_draft_tokens", "Drafted tokens", registry=r)
        self.num_accepted_tokens = Counter("specserve_spec_decode_num_accepted_tokens", "Accepted drafted tokens",
                                           registry=r)
        self.accepted_per_pos = Counter("specserve_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafted tokens by draft position", ["position"], registry=r)
        self.chosen_k = Histogram("specserve_spec_decode_chosen_k", "Draft length the speculation policy chose, per "
                                  "round", registry=r, buckets=tuple(range(17)))
        self.drafts_by_method = Counter("specserve_spec_decode_num_drafts_by_method", "Drafted rounds by proposer",
                                        ["method"], registry=r)
        self.pipeline_hits = Counter("specserve_pipeline_hits", "Rounds whose draft was prepared by pipelining",
                                     registry=r)
        self.outcome_rounds = Counter("specserve_pipeline_rounds_by_outcome", "Drafted rounds by the drafts "
                                      "accepted in the round before", ["accepted"], registry=r)
        self.outcome_hits = Counter("specserve_pipeline_hits_by_outcome", "Pipeline hits by the drafts accepted in "
                                    "the round before", ["accepted"], registry=r)
        self.prepared_rounds = Counter("specserve_pipeline_prepared_rounds", "Drafted rounds for which the "
                                       "drafter had prepared outcomes", registry=r)
        self.prepared_outcomes = Counter("specserve_pipeline_prepared_outcomes", "Outcomes the drafter had prepared "
                                         "for those rounds (over prepared_rounds: the fan-out used)", registry=r)
        self.pairs = Gauge("specserve_pairs_reporting", "Pairs whose state is in the gauges below (a pair that "
                           "did not answer in time is left out of their sums)", registry=r)
        self.running = Gauge("specserve_num_requests_running", "Sequences in the engines' batches", registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Sequences queued for a slot", registry=r)
        self.speculating = Gauge("specserve_spec_decode_policy_speculating", "Pairs whose speculation policy "
                                 "drafts now (adaptive: its last round drafted; fixed: always)", registry=r)
        self.guard_vetoes = Gauge("specserve_spec_decode_guard_vetoes", "Vetoes of speculation by the adaptive "
                                  "policy's guard, summed over pairs since each started", registry=r)
        self.guard_holds = Gauge("specserve_spec_decode_guard_holds", "Pairs where a veto of the guard (or its trial "
                                 "of plain rounds) holds now", registry=r)
        self.guard_keepings = Gauge("specserve_spec_decode_guard_keepings", "Times the adaptive policy's guard kept "
                                    "speculation on where it measured it clearly ahead, summed over pairs since each "
                                    "started", registry=r)
        self.unprepared = Gauge("specserve_spec_decode_unprepared_rounds", "Drafting rounds whose call asked the "
                                "pipelining drafter to prepare nothing (the next call was unlikely to find every "
                                "draft ready), summed over pairs since each started", registry=r)
        self.degraded = Gauge("specserve_pairs_degraded", "Pairs serving without their drafter now (its sequences on "
                              "the n-gram proposer, or target-only), until it is back", registry=r)
        self.drafter_failures = Gauge("specserve_drafter_failures", "Times a pair's drafter failed (an RPC error, a "
                                      "missed deadline, its actor gone or silent) and its sequences went to the "
                                      "fallback, summed over pairs since each started", registry=r)
        self.drafter_recoveries = Gauge("specserve_drafter_recoveries", "Times a pair's drafter came back and "
                                        "speculation resumed, summed over pairs since each started", registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("specserve_inter_token_latency_seconds", "Time between output tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)

    def finished(self, finish_reason: str, seconds: float, usage: dict, stats: dict) -> None:
        self.requests.labels(finish_reason).inc()
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        self.num_drafts.inc(stats.get("num_drafts", 0))
        self.num_draft_tokens.inc(stats.get("num_draft_tokens", 0))
        self.num_accepted_tokens.inc(stats.get("num_accepted_tokens", 0))
        for pos, n in enumerate(stats.get("num_accepted_tokens_per_pos", [])):
            self.accepted_per_pos.labels(str(pos)).inc(n)
        self.pipeline_hits.inc(stats.get("num_pipeline_hits", 0))
        for k, n in enumerate(stats.get("rounds_by_k", [])):
            for _ in range(n):
                self.chosen_k.observe(k)
        for a, (n, hits) in enumerate(zip(stats.get("outcome_rounds", []), stats.get("outcome_hits", []))):
            self.outcome_rounds.labels(str(a)).inc(n)
            self.outcome_hits.labels(str(a)).inc(hits)
        self.prepared_rounds.inc(stats.get("num_prepared_rounds", 0))
        self.prepared_outcomes.inc(stats.get("num_prepared_outcomes", 0))
        for method, n in stats.get("drafts_by_method", {}).items():
            self.drafts_by_method.labels(method).inc(n)

    def render(self, loads: list[dict]) -> bytes:
        self.pairs.set(len(loads))
        self.running.set(sum(x["running"] for x in loads))
        self.waiting.set(sum(x["waiting"] for x in loads))
        self.speculating.set(sum(x.get("speculating", 0) for x in loads))
        self.guard_vetoes.set(sum(x.get("guard_vetoes", 0) for x in loads))
        self.guard_holds.set(sum(x.get("guard_holds", 0) for x in loads))
        self.guard_keepings.set(sum(x.get("guard_keepings", 0) for x in loads))
        self.unprepared.set(sum(x.get("unprepared_rounds", 0) for x in loads))
        self.degraded.set(sum(x.get("degraded", 0) for x in loads))
        self.drafter_failures.set(sum(x.get("drafter_failures", 0) for x in loads))
        self.drafter_recoveries.set(sum(x.get("drafter_recoveries", 0) for x in loads))
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies: time to first token, then the gap before each later chunk, shared
    evenly by the chunk's tokens (speculation writes several tokens at once)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        self._observe(time.monotonic(), n)

    def _observe(self, now: float, n: int) -> None:
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - self.last) / n)
        self.last = now

    def rounds(self, rounds: list) -> None:
        """A coalesced request's rounds, [seconds before its final message, tokens] each, as the
        pair timed them: observed as if each had arrived on its own (less the message's transit)."""
        now = time.monotonic()
        for age, n in rounds:
            self._observe(now - age, n)

    def elapsed(self) -> float:
        return time.monotonic() - self.start
