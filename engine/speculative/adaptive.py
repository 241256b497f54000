"""How many tokens to draft: the length that maximizes tokens per second, from each sequence's acceptance rate
and what a verification step of that many tokens costs on this machine.

With a per-token acceptance probability a, a draft of k tokens yields E(k) = 1 + a + ... + a^k tokens per step (the
accepted prefix plus the target's own token). A step over 1 + k tokens costs c(k) times a plain decode step, so
drafting k gains E(k) / c(k). The engine measures c(k) from its own single-sequence decode steps (on a GPU it stays
near 1; on a CPU, where a few extra rows can cost 30-80% more, it rises quickly), and a falls and rises with what
the sequence is writing. When no length gains, drafting pauses, and a one-token probe after the pause checks
whether drafting pays again; the pauses double for as long as it does not."""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past in the acceptance counts, per verification step
PRIOR = (1.0, 1.0)  # pseudo-counts (accepted, rejected) a sequence starts with: a = 0.5
PAUSE_STEPS = (4, 64)  # first and longest pause, in decode steps; doubles while nothing gains, halves on a kept probe
PRIOR_COST_PER_TOKEN = 0.3  # c(k) = 1 + 0.3 k until the engine has measured it
COST_SMOOTHING = 0.3  # weight of a new measurement in a step cost's moving average
MIN_GAIN = 1.02  # draft only when the best length is expected to beat plain decoding by this much
BASE_EVERY = 64  # speculative steps after which a plain step re-times the unit cost


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step over a k-token draft yields when each draft token is accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class StepCosts:
    """Seconds of single-sequence decode steps by the number of tokens they computed (moving averages). A plain
    one-token step is the unit: when none has been timed yet, or not for BASE_EVERY speculative steps, the next
    single-sequence step is left plain (`needs_base`), so a proposer as slow as the model (a draft as large as
    the target) is found out instead of being judged on the prior."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.since_base = 0

    @property
    def needs_base(self) -> bool:
        return 1 not in self.seconds or self.since_base >= BASE_EVERY

    def record(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * seconds
        self.since_base = 0 if tokens == 1 else self.since_base + 1

    def ratio(self, k: int) -> float:
        """c(k): a step over 1 + k tokens relative to a one-token step (at least 1)."""
        base, step = self.seconds.get(1), self.seconds.get(1 + k)
        if k == 0:
            return 1.0
        if base is None or step is None:
            return 1.0 + PRIOR_COST_PER_TOKEN * k
        return max(1.0, step / base)


def best_length(a: float, ceiling: int, costs: StepCosts) -> int:
    """The draft length (0..ceiling) with the most tokens per unit of time; 0 unless it gains MIN_GAIN."""
    gains = [(expected_tokens(a, k) / costs.ratio(k), k) for k in range(1, ceiling + 1)]
    gain, k = max(gains, default=(1.0, 0))
    return k if gain >= MIN_GAIN else 0


@dataclass
class SpecState:
    """One sequence's acceptance estimate, pause and counts."""
    accepted_w: float = PRIOR[0]  # decayed counts of accepted and rejected draft tokens
    rejected_w: float = PRIOR[1]
    pause: int = 0  # decode steps left without drafting
    next_pause: int = PAUSE_STEPS[0]
    probe: bool = False  # the next draft is a one-token probe after a pause
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps (steps that drafted at least one token)
    history: list = field(default_factory=list, repr=False)

    @property
    def acceptance(self) -> float:
        return self.accepted_w / (self.accepted_w + self.rejected_w)

    def length(self, ceiling: int, costs: StepCosts, adaptive: bool) -> int:
        """Tokens to draft at this decode step (0 = none; counts a paused step)."""
        if not adaptive:
            return ceiling
        if self.pause:
            self.pause -= 1
            self.probe = self.pause == 0
            return 0
        if self.probe:
            return 1
        k = best_length(self.acceptance, ceiling, costs)
        if k == 0:  # pauses double while no length gains (rejected drafts, or drafts that cost more than they save)
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, PAUSE_STEPS[1])
        else:
            self.next_pause = PAUSE_STEPS[0]
        return k

    def record(self, drafted: int, accepted: int, costs: StepCosts | None = None, ceiling: int = 0) -> None:
        """A verification step: the first `accepted` of `drafted` tokens were kept (a prefix: the rest unseen).
        `costs`/`ceiling` (adaptive lengths): a kept probe shortens the pauses only when drafting would now gain at
        these step costs (a proposer as slow as the model is accepted and still never pays)."""
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        rejected = 1 if accepted < drafted else 0
        self.accepted_w = DECAY * self.accepted_w + accepted
        self.rejected_w = DECAY * self.rejected_w + rejected
        pays = costs is None or best_length(self.acceptance, ceiling, costs) > 0
        if self.probe and accepted and pays:  # a kept probe: the content may have turned predictable; pause less
            self.next_pause = max(PAUSE_STEPS[0], self.next_pause // 2)
        self.probe = False
