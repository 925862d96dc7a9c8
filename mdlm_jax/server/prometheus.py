"""Server metrics in the Prometheus text format (no client library needed)."""

from __future__ import annotations

import bisect
import collections
import threading

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
  def __init__(self):
    self._lock = threading.Lock()
    self.requests = collections.Counter()  # (endpoint, status) -> count
    self.prompt_tokens = 0
    self.completion_tokens = 0
    self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
    self.latency_sum = 0.0

  def request(self, endpoint: str, status: int) -> None:
    with self._lock:
      self.requests[(endpoint, status)] += 1

  def tokens(self, prompt: int, completion: int) -> None:
    with self._lock:
      self.prompt_tokens += prompt
      self.completion_tokens += completion

  def latency(self, seconds: float) -> None:
    with self._lock:
      self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
      self.latency_sum += seconds

  def render(self, queue_depth: int, active: int, slots: int, finish_reasons: dict[str, int] | None = None,
             kv_cache: tuple[int, int, int] = (0, 0, 0), compiled: dict[str, int] | None = None) -> str:
    """`kv_cache`: (bytes every slot reserves, tokens in use, token capacity);
    `compiled`: programs compiled so far by kind (pass, prefill)."""
    with self._lock:
      lines = ["# HELP mdlm_requests_total HTTP requests by endpoint and status.",
               "# TYPE mdlm_requests_total counter"]
      for (endpoint, status), n in sorted(self.requests.items()):
        lines.append(f'mdlm_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
      lines += ["# HELP mdlm_prompt_tokens_total Prompt tokens of completed requests.",
                "# TYPE mdlm_prompt_tokens_total counter", f"mdlm_prompt_tokens_total {self.prompt_tokens}",
                "# HELP mdlm_completion_tokens_total Tokens generated.",
                "# TYPE mdlm_completion_tokens_total counter",
                f"mdlm_completion_tokens_total {self.completion_tokens}",
                "# HELP mdlm_queue_depth Requests waiting for a slot.", "# TYPE mdlm_queue_depth gauge",
                f"mdlm_queue_depth {queue_depth}",
                "# HELP mdlm_active_requests Requests holding a slot.", "# TYPE mdlm_active_requests gauge",
                f"mdlm_active_requests {active}",
                "# HELP mdlm_slots Slots of the engine.", "# TYPE mdlm_slots gauge", f"mdlm_slots {slots}",
                "# HELP mdlm_kv_cache_bytes KV cache the slots reserve.", "# TYPE mdlm_kv_cache_bytes gauge",
                f"mdlm_kv_cache_bytes {kv_cache[0]}",
                "# HELP mdlm_kv_cache_tokens_in_use KV-cache tokens the running requests occupy.",
                "# TYPE mdlm_kv_cache_tokens_in_use gauge", f"mdlm_kv_cache_tokens_in_use {kv_cache[1]}",
                "# HELP mdlm_kv_cache_tokens KV-cache tokens of all slots.", "# TYPE mdlm_kv_cache_tokens gauge",
                f"mdlm_kv_cache_tokens {kv_cache[2]}",
                "# HELP mdlm_finished_total Engine requests (one per choice) by how they ended.",
                "# TYPE mdlm_finished_total counter"]
      lines += [f'mdlm_finished_total{{reason="{r}"}} {n}' for r, n in sorted((finish_reasons or {}).items())]
      lines += ["# HELP mdlm_compiled_programs Pass and prefill programs compiled so far (warmup compiles all"
                " of them before serving; without it each compiles on first use).",
                "# TYPE mdlm_compiled_programs gauge"]
      lines += [f'mdlm_compiled_programs{{kind="{k}"}} {n}' for k, n in sorted((compiled or {}).items())]
      lines += [
                "# HELP mdlm_request_latency_seconds Time from request to its last token.",
                "# TYPE mdlm_request_latency_seconds histogram"]
      total = 0
      for bound, n in zip(LATENCY_BUCKETS, self.latency_counts):
        total += n
        lines.append(f'mdlm_request_latency_seconds_bucket{{le="{bound}"}} {total}')
      total += self.latency_counts[-1]
      lines += [f'mdlm_request_latency_seconds_bucket{{le="+Inf"}} {total}',
                f"mdlm_request_latency_seconds_sum {self.latency_sum:.6f}",
                f"mdlm_request_latency_seconds_count {total}"]
    return "\n".join(lines) + "\n"
