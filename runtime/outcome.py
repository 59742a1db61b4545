"""What a turn reports: its reply as it streams (``Delta``), and once it
finished its reply, its tokens and its timings (``TurnResult``).

One type each for every layer that reports a turn: the engine makes the
deltas and the actor runtime posts them on as they are; it builds the
result, ``turns.run_turn`` returns it, the web APIs, dashboard and metrics
read both, the scenario backends yield both and their report prints the
result.  Plain data: nothing here imports MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine.sequence import Finished
    from .engine.sampling import TokenLogprob

__all__ = ["Delta", "FinishReason", "TurnResult", "decode_rate"]


def decode_rate(output_tokens: int, decode_s: float | None) -> float | None:
    """Tokens per second after the first, which is timed as the prefill's (None
    when fewer than two were generated or no decode time was measured)."""
    return (output_tokens - 1) / decode_s if decode_s and output_tokens > 1 else None


class FinishReason(StrEnum):
    """Why a sequence ended (a string: protocols compare and send it as one)."""

    STOP = "stop"  # end of turn or a stop string
    LENGTH = "length"  # its max_tokens, or its owner could not let it grow
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # taken out to free its cache: ``Engine.resume`` goes on


@dataclass(frozen=True)
class Delta:
    """A reply's news as it streams, the one type from the engine to the
    protocols: new text (whole characters, no partial stop string), its token
    ids (none on a bare finish), their log-probabilities when asked, which of
    the turn's replies it extends (``choice``: 0 unless it asked for several)
    and, on a choice's first delta, the prompt's log-probabilities when asked
    (a turn that ends with no delta has them in its result only).

    ``seq_id`` and ``finished`` are the engine's: the sequence it came from
    and, on its last delta, its end record, which holds its cache -- the GPU
    actor drops it before a delta leaves its thread."""

    text: str
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    choice: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    seq_id: int = 0
    finished: Finished | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended: ``reason`` is ``STOP``, ``LENGTH`` or ``CANCELLED``.

    ``prompt_tokens == reused_tokens + prefilled_tokens``.  Times are seconds,
    None when not measured (nothing generated, or a peer that did not say).
    """

    reason: FinishReason
    text: str  # the whole reply (a cancelled turn: what was generated)
    prompt_tokens: int
    reused_tokens: int  # prompt tokens served from the agent's cache
    prefilled_tokens: int  # prompt tokens computed by this turn
    output_tokens: int
    # From the turn's arrival (at the GPU actor; ``run_turn``: the call) to its admission
    # (waiting for memory or a model swap, loading its cache), and to its first token.
    queued_s: float | None
    ttft_s: float | None
    # Cancelled turns: engine steps completed between the cancel request and the cancel; 0 or 1
    # (the step in progress when it was asked), as no step starts before the inbox is drained.
    cancel_lag_steps: int | None = None
    prefill_s: float | None = None  # admitted -> first token (its prefill, interleaved with others' decoding)
    decode_s: float | None = None  # first token -> end
    stop_sequence: str | None = None  # the stop string that ended it (reason "stop")
    logprobs: tuple[TokenLogprob, ...] = ()  # of each output token, when the turn asked for them
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of each prompt token (the first's None), when asked
    drafted_tokens: int = 0  # drafts its decode steps verified (``runtime.engine.speculation``)
    accepted_tokens: int = 0  # of them, taken as output
    # The turn's other replies when it asked for several (choices 1, 2, ...): the same
    # prompt, prefilled once; this one (choice 0) is the reply the agent keeps.
    choices: tuple[TurnResult, ...] = ()

    @classmethod
    def measured(cls, finished: Finished | None, reason: FinishReason, *, arrived: float, admitted: float,
                 first_token: float | None, ended: float, cancel_lag_steps: int | None = None) -> TurnResult:
        """A turn from the engine's record of it (None: it never ran) and the
        ``perf_counter`` times it arrived, was admitted, got its first token
        (None: none came) and ended."""
        f, first = finished, first_token
        return cls(
            reason=reason,
            text=f.text if f else "",
            prompt_tokens=f.prompt_tokens if f else 0,
            reused_tokens=f.reused_tokens if f else 0,
            prefilled_tokens=f.prefilled_tokens if f else 0,
            output_tokens=len(f.output_tokens) if f else 0,
            queued_s=admitted - arrived,
            ttft_s=None if first is None else first - arrived,
            cancel_lag_steps=cancel_lag_steps,
            prefill_s=None if first is None else first - admitted,
            decode_s=None if first is None else ended - first,
            stop_sequence=f.stop_sequence if f else None,
            logprobs=f.logprobs if f else (),
            prompt_logprobs=f.prompt_logprobs if f else (),
            drafted_tokens=f.drafted_tokens if f else 0,
            accepted_tokens=f.accepted_tokens if f else 0,
        )

    @property
    def decode_tps(self) -> float | None:
        return decode_rate(self.output_tokens, self.decode_s)

    @property
    def reuse(self) -> float:
        """Share of the prompt's tokens that came from the cache."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
