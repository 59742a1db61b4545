"""A sequence the engine runs, and what it hands back: its state while it runs
(``Sequence``), each step's news (``Delta``, from ``runtime.outcome``) and its
end (``Finished``, with why: ``FinishReason``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .speculation import Drafter
from ..kv import SequenceCache
from ..outcome import Delta, FinishReason  # plain data (no MLX), for every layer up to the protocols
from ..text.reply_text import ReplyText
from .sampling import Sampler, SamplingParams, TokenLogprob

__all__ = ["CANCELLED", "Delta", "FinishReason", "Finished", "LENGTH", "PREEMPTED", "STOP", "Sequence"]


STOP, LENGTH, CANCELLED, PREEMPTED = FinishReason


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    cache: SequenceCache  # per-layer single-sequence caches, materialised
    cache_tokens: tuple[int, ...]  # exactly the token ids the cache covers
    output_tokens: tuple[int, ...]  # generated ids (end-of-turn token excluded)
    text: str  # generated text, cut before a stop string
    prompt_tokens: int
    reused_tokens: int  # prompt tokens served from the given cache
    prefilled_tokens: int  # prompt tokens computed by this request
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    logprobs: tuple[TokenLogprob, ...] = ()  # of each output token, when ``SamplingParams.logprobs`` asked
    drafted_tokens: int = 0  # drafts verified (``runtime.engine.speculation``)
    accepted_tokens: int = 0  # of them, taken as output
    # Of each prompt token (the first's logprob None), when ``SamplingParams.prompt_logprobs`` asked;
    # a sequence cancelled mid-prefill has those of the chunks it ran.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    sampling: SamplingParams
    sampler: Sampler
    reply: ReplyText  # its text, stop strings found, what has been shown
    cache: SequenceCache  # per-layer caches of record (what a finished sequence hands back)
    view: SequenceCache  # the same caches as attention sees them (``SequenceCache.view``)
    cached: list[int]  # token ids whose K/V are in the cache
    reused: int
    prompt_tokens: int  # the prompt as given (``resume`` may extend ``prompt`` with tokens to recompute)
    drafter: Drafter | None  # its history, for drafts (None: it does not speculate)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of ``output``, when asked
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts taken
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the prompt tokens fed so far, when asked
    delivered: bool = False  # a delta went out (the first carries ``prompt_logprobs``)
    choice: int = 0  # which of its prompt's replies it is (``Engine.add_choices``)
    continues: bool = False  # its text continues the prompt's (``Engine.add``)
    # Its cache came from the caller (``add``, ``resume``) and may be lazy on the caller's own
    # streams, which the evaluator's thread cannot evaluate: its next step starts on the caller's.
    callers_cache: bool = False

    @property
    def pending(self) -> list[int]:
        return self.prompt[len(self.cached):]

    @property
    def next_input(self) -> int:
        """What the next decode step feeds: the last prompt token (it joined the
        batch with it pending), else the last token sampled."""
        return self.prompt[len(self.cached)] if len(self.cached) < len(self.prompt) else self.output[-1]

    @property
    def scores_prompt(self) -> bool:
        """Whether its next prefill chunk is scored: it asked, and its prompt is
        not scored yet (a resumed sequence that recomputes it was)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_tokens
