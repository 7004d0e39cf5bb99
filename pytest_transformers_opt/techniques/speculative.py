"""Speculative decoding: a draft model (``assisted_decoding``) or n-grams of the prompt (``prompt_lookup``)
propose tokens that the model verifies in one forward pass.

Lossless under greedy decoding: the model keeps a proposed token only where its own argmax is that token,
so the default similarity is exact token parity plus the lossless KL limit. The proof is transformers'
candidate-verification path itself: its candidate generator's ``get_candidates`` is wrapped for the
duration of each generate call (it proposed tokens; the draft model's forward ran), and its
``update_candidate_strategy`` reports how many proposals the model accepted, the figures of the report.
"""

from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from typing import Any, Callable, ClassVar, Iterator

from ..compat import layer_kinds_outside
from ..errors import OptConfigError
from .base import DOCS, GenerationSettings, ProbeContext, RunEvidence, Technique

# True while a candidate generator proposes tokens: a logits processor called then works for the draft (or
# for prompt lookup's check of its candidates), not for the model's own next token (engine.generation's
# time-to-first-token clock ignores those calls)
_DRAFTING: ContextVar[bool] = ContextVar("pytest_transformers_opt_drafting", default=False)

# the draft model loaded with each model (engine.loading attaches it): weak keys, so an evicted model frees it
_DRAFTS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

# the layer kinds whose dynamic cache layers transformers can crop back after rejected draft tokens (a linear
# attention's recurrent state cannot roll back: "Assisted decoding requires a cache that can be cropped")
CROPPABLE_KINDS = {"full_attention", "sliding_attention"}

# the counters of the observed (verified) runs in progress: the wrapped candidate generator adds to each
_COUNTERS: list[dict[str, int]] = []


def drafting() -> bool:
    """True while a speculative technique's candidate generator is proposing tokens."""
    return _DRAFTING.get()


def new_counter() -> dict[str, int]:
    return {"steps": 0, "proposed": 0, "accepted": 0, "max_proposed": 0, "draft_forward_calls": 0}


def _candidate_generator_class(kind: str) -> type:
    from transformers.generation.candidate_generator import AssistedCandidateGenerator, PromptLookupCandidateGenerator

    chosen: type = AssistedCandidateGenerator if kind == "assisted" else PromptLookupCandidateGenerator
    return chosen


@contextlib.contextmanager
def _patched(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """``cls.name`` replaced by ``make(original)`` for the duration, then restored as it was (own or inherited)."""
    own = name in cls.__dict__
    saved = cls.__dict__.get(name)
    setattr(cls, name, make(getattr(cls, name)))
    try:
        yield
    finally:
        if own:
            setattr(cls, name, saved)
        else:
            delattr(cls, name)


@contextlib.contextmanager
def counting_candidates(kind: str) -> Iterator[None]:
    """Around one generate call: the candidate generator of ``kind`` ('assisted' or 'prompt_lookup') proposes
    with the drafting flag set, and reports each step's proposals and accepted count to the observed runs."""
    cls = _candidate_generator_class(kind)

    def wrap_get(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_candidates(self: Any, input_ids: Any, **kwargs: Any) -> Any:
            token = _DRAFTING.set(True)
            try:
                candidates = original(self, input_ids, **kwargs)
            finally:
                _DRAFTING.reset(token)
            proposed = int(candidates[0].shape[-1] - input_ids.shape[-1])
            for counter in _COUNTERS:
                counter["steps"] += 1
                counter["proposed"] += proposed
                counter["max_proposed"] = max(counter["max_proposed"], proposed)
            return candidates
        return get_candidates

    def wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
        def update_candidate_strategy(self: Any, input_ids: Any, scores: Any, num_matches: Any) -> Any:
            for counter in _COUNTERS:
                counter["accepted"] += int(num_matches)
            return original(self, input_ids, scores, num_matches)
        return update_candidate_strategy

    with _patched(cls, "get_candidates", wrap_get), _patched(cls, "update_candidate_strategy", wrap_update):
        yield


class SpeculativeDecoding(Technique):
    """What both speculative techniques share: batch size 1, greedy verification, the proof and the figures."""

    family = "speculative_decoding"
    exclusive_group = "source of draft tokens"
    max_batch_size = 1  # transformers: "assisted generate is only supported for batch_size = 1"
    docs = f"{DOCS}/generation_strategies#speculative-decoding"
    docs_title = "Generation strategies > Speculative decoding"
    kind: ClassVar[str] = ""

    def probe(self, ctx: ProbeContext) -> str | None:
        others = layer_kinds_outside(ctx.model_config, CROPPABLE_KINDS)
        if others:
            return (f"{self.label()} needs a model whose cache can be cropped back after rejected draft tokens "
                    f"({' or '.join(sorted(CROPPABLE_KINDS))} layers); found: {others}")
        return None

    def around_generate(self, model: Any) -> Any:
        return counting_candidates(self.kind)

    @contextlib.contextmanager
    def observe(self, model: Any, evidence: RunEvidence) -> Iterator[None]:
        counter = evidence.draft if evidence.draft is not None else new_counter()
        evidence.draft = counter
        _COUNTERS.append(counter)
        try:
            yield
        finally:
            _COUNTERS.remove(counter)

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        counts = evidence.draft or new_counter()
        if counts["steps"] == 0:
            return (f"{self.label()} was requested but transformers' candidate-verification path never ran "
                    f"(no {self.kind.replace('_', ' ')} candidate generator was asked for candidates)")
        if counts["proposed"] == 0:
            return (f"{self.label()} was requested but no draft token was proposed in {counts['steps']} "
                    f"verification steps (plain decoding)")
        return None

    def conflicts_with(self, other: Technique) -> str | None:
        if other.family == "continuous_batching":
            return "generate_batch() takes no assistant_model or prompt lookup (speculative decoding is generate()-only)"
        if other.runs_in_subprocesses:
            return "the torchrun workers run plain greedy generate(), without a draft"
        if other.name == "sliding_window_cache":  # measured on tiny-random-mistral, transformers 5.24
            return ("speculative decoding crops the cache back after rejected draft tokens, and a static "
                    "sliding-window cache cannot be cropped (ValueError: Assisted decoding requires a cache that can "
                    "be cropped)")
        if getattr(other, "cache_implementation", None) == "quantized":
            return ("speculative decoding crops the cache back after rejected draft tokens, and transformers' "
                    "QuantizedCache cannot be cropped (ValueError: Assisted decoding requires a cache that can be cropped)")
        return None


def _positive_int(technique: str, name: str, value: Any, optional: bool) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        accepted = "an int > 0" + (" or None" if optional else "")
        raise OptConfigError(f"{technique}: {name}={value!r}; accepted: {accepted}")


class AssistedDecoding(SpeculativeDecoding):
    """A draft model proposes ``num_assistant_tokens`` tokens a step (transformers' default: up to 20, cut short
    where the draft's confidence falls under 0.4); the model verifies them in one forward pass.

    The draft is loaded with the model (``engine.loading``), so its load time and memory are the optimized
    side's: the loaded configuration's identity includes it."""

    name = "assisted_decoding"
    kind = "assisted"
    load_time = True
    summary = "a draft model proposes tokens that the model verifies in one forward pass (assistant_model)"
    requirement = "a draft model with the model's tokenizer (a built-in name or a folder); batch size 1"
    accepted_params = {"assistant": "the draft model: a built-in name ('tiny-random-llama') or a folder; it must "
                                    "share the model's tokenizer",
                       "num_assistant_tokens": "draft tokens per step, int > 0 (default: the draft's generation "
                                               "config, transformers' 20)"}
    example_params = {"assistant": "tiny-random-llama"}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        assistant = self.params.get("assistant")
        if assistant is None:
            raise OptConfigError("assisted_decoding: assistant is required; accepted: a built-in model name "
                                 "('tiny-random-llama') or a model folder that shares the model's tokenizer")
        if not isinstance(assistant, str) or not assistant.strip():
            raise OptConfigError(f"assisted_decoding: assistant={assistant!r}; accepted: a built-in model name "
                                 f"('tiny-random-llama') or a model folder (a non-empty str)")
        _positive_int(self.name, "num_assistant_tokens", self.params.get("num_assistant_tokens"), optional=True)

    @property
    def assistant(self) -> str:
        return str(self.params["assistant"])

    def attach(self, model: Any, draft: Any, draft_tokenizer: Any, tokenizer: Any) -> None:
        """Hold ``draft`` as ``model``'s draft, after checking that transformers can verify its tokens as they are
        (one tokenizer); called by the loader, inside the load's time and memory."""
        where = f"{self.name}: assistant={self.assistant!r}"
        main_vocab = model.config.get_text_config().vocab_size
        draft_vocab = draft.config.get_text_config().vocab_size
        if main_vocab != draft_vocab or draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise OptConfigError(
                f"{where} does not share the model's tokenizer (vocab_size {draft_vocab} and {len(draft_tokenizer)} "
                f"tokens vs the model's {main_vocab} and {len(tokenizer)}); accepted: a draft with the same tokenizer "
                f"and vocabulary (e.g. a smaller model of the same family)")
        if self.params.get("num_assistant_tokens") is not None:
            # transformers reads the draft length from the draft's own generation config, not from generate()
            draft.generation_config.num_assistant_tokens = self.params["num_assistant_tokens"]
            draft.generation_config.num_assistant_tokens_schedule = "constant"
        _DRAFTS[model] = draft

    def verify_loaded(self, model: Any) -> str | None:
        if model not in _DRAFTS:
            return f"{self.label()}: no draft model was loaded with the model"
        return None

    def prepare_generation(self, model: Any, gen: GenerationSettings) -> str | None:
        draft = _DRAFTS.get(model)
        if draft is None:
            raise OptConfigError(f"{self.label()}: no draft model was loaded with this model (load it through the "
                                 f"plugin's opt_model / opt_bench fixtures)")
        gen.kwargs["assistant_model"] = draft
        return None

    @contextlib.contextmanager
    def observe(self, model: Any, evidence: RunEvidence) -> Iterator[None]:
        draft = _DRAFTS.get(model)
        with super().observe(model, evidence):
            counter = evidence.draft
            assert counter is not None  # set by the parent's observe
            if draft is not None and not any(self.assistant in note for note in evidence.notes):
                size = sum(p.numel() for p in draft.parameters())
                evidence.notes.append(f"{self.label()}: the draft {self.assistant} ({size:,} parameters) is loaded with "
                                      f"the model: its load time and memory are in the optimized side's figures")

            def count(*_: Any) -> None:
                counter["draft_forward_calls"] += 1

            handle = draft.register_forward_pre_hook(count) if draft is not None else None
            try:
                yield
            finally:
                if handle is not None:
                    handle.remove()

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        counts = evidence.draft or new_counter()
        if counts["draft_forward_calls"] == 0:
            return (f"{self.label()} was requested but the draft model's forward was never called "
                    f"({counts['steps']} verification steps, {counts['proposed']} tokens proposed)")
        problem = super().verify_run(model, evidence)
        if problem:
            return problem
        limit = self.params.get("num_assistant_tokens")
        if limit is not None and counts["max_proposed"] > limit:
            return (f"{self.label()}: the draft proposed {counts['max_proposed']} tokens in one step, more than "
                    f"num_assistant_tokens={limit}")
        return None


class PromptLookup(SpeculativeDecoding):
    """Candidates are the tokens that followed the last n-gram's earlier occurrence in the prompt or output
    (prompt lookup decoding): no draft model, gains where the output repeats the input (summaries, code edits)."""

    name = "prompt_lookup"
    kind = "prompt_lookup"
    summary = "n-grams of the prompt propose tokens that the model verifies in one forward pass (prompt_lookup_num_tokens)"
    requirement = "batch size 1; a dynamic KV cache"
    docs = f"{DOCS}/generation_strategies#prompt-lookup-decoding"
    docs_title = "Generation strategies > Prompt lookup decoding"
    accepted_params = {"num_tokens": "candidate tokens per step, int > 0 (default 10)",
                       "max_matching_ngram_size": "the longest n-gram matched, int > 0 (default: transformers' 2)"}

    def __init__(self, **params: Any) -> None:
        params.setdefault("num_tokens", 10)
        super().__init__(**params)
        _positive_int(self.name, "num_tokens", self.params["num_tokens"], optional=False)
        _positive_int(self.name, "max_matching_ngram_size", self.params.get("max_matching_ngram_size"), optional=True)

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.kwargs["prompt_lookup_num_tokens"] = self.params["num_tokens"]
        if self.params.get("max_matching_ngram_size") is not None:
            gen.kwargs["max_matching_ngram_size"] = self.params["max_matching_ngram_size"]

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        problem = super().verify_run(model, evidence)
        counts = evidence.draft or new_counter()
        if problem and counts["steps"] and not counts["proposed"]:
            return (f"{problem}: no n-gram at the end of the sequence occurred earlier in the prompt or output, so "
                    f"prompt lookup had nothing to propose; measure it on a workload whose output repeats its input "
                    f"(summaries, code edits, extraction)")
        limit = self.params["num_tokens"]
        if problem is None and counts["max_proposed"] > limit:
            return f"{self.label()}: {counts['max_proposed']} tokens proposed in one step, more than num_tokens={limit}"
        return problem

    def conflicts_with(self, other: Technique) -> str | None:
        reason = super().conflicts_with(other)
        if reason:
            return reason
        if other.compiled or getattr(other, "cache_implementation", None) in ("static", "offloaded_static"):
            # measured on transformers 5.24: IndexError "index_copy_(): index 46 is out of bounds for dimension 2
            # with size 46" in the last steps of a 12-token run
            return ("transformers' prompt lookup proposes candidates past the end of a static cache sized for "
                    "max_new_tokens (IndexError in index_copy_ near the end); use the dynamic cache")
        return None
