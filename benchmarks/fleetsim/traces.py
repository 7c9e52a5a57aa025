"""Request traces: multi-turn chat with shared prefixes, and independent random requests.

Both are deterministic for a seed: every length and think time is drawn when a conversation (or
request) is created, so routing and timing cannot change what is asked. Chat is closed-loop per
conversation: turn k+1 arrives a think time after turn k finished, and its prompt is the system
prompt, every earlier user message and answer, then the new message. Block keys name a block's
whole prefix: the system prompt's blocks are shared by every conversation that uses it, later
blocks belong to one conversation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Request:
    """One request and what happened to it (times in seconds of simulated time)."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[Hashable, ...]  # one per full prompt block of the simulated block size
    conversation: int = -1  # -1: not part of a conversation
    turn: int = 0
    # filled in by the simulation
    hit_tokens: int = 0
    prefill_remaining: int = 0
    kv_reserved: int = 0
    first_token_s: float = math.inf
    finish_s: float = math.inf
    start_clock: float = 0.0  # the instance's decode clock when the row began decoding
    prefill_instance: int = -1
    decode_instance: int = -1


@dataclass(frozen=True)
class ChatShape:
    """The chat workload's assumptions (not measured: see docs/scale.md)."""

    system_prompts: int = 32
    system_tokens: tuple[int, int] = (256, 1024)
    zipf_s: float = 1.0  # popularity of the system prompts
    turns: tuple[int, int] = (2, 6)
    user_tokens: tuple[int, int] = (32, 256)
    answer_tokens: tuple[int, int] = (32, 256)
    think_s_mean: float = 3.0
    max_context: int = 8192


@dataclass(frozen=True)
class RandomShape:
    prompt_tokens: tuple[int, int] = (128, 1024)
    output_tokens: tuple[int, int] = (32, 256)


@dataclass
class _Conversation:
    system: int
    system_tokens: int
    users: list[int]
    answers: list[int]
    thinks: list[float]
    history_tokens: int = 0  # system + earlier turns


class Trace:
    """Initial arrivals plus follow-up turns; requests arriving after `horizon_s` are dropped."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._next_id = 0

    def initial(self) -> list[Request]:
        raise NotImplementedError

    def follow_up(self, finished: Request) -> Request | None:
        return None

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1


def _poisson_times(
    rng: random.Random, rate: float, horizon_s: float, limit: int | None = None
) -> list[float]:
    times, now = [], 0.0
    while limit is None or len(times) < limit:
        now += rng.expovariate(rate)
        if now > horizon_s:
            break
        times.append(now)
    return times


class ChatTrace(Trace):
    def __init__(
        self,
        rate: float,
        horizon_s: float,
        *,
        block_tokens: int,
        seed: int = 0,
        shape: ChatShape = ChatShape(),
    ) -> None:
        super().__init__(horizon_s)
        self.shape, self.block_tokens = shape, block_tokens
        rng = random.Random(seed)
        self._system_tokens = [
            rng.randint(*shape.system_tokens) for _ in range(shape.system_prompts)
        ]
        weights = [1.0 / (rank + 1) ** shape.zipf_s for rank in range(shape.system_prompts)]
        mean_turns = (shape.turns[0] + shape.turns[1]) / 2
        self._conversations: list[_Conversation] = []
        self._starts = _poisson_times(rng, rate / mean_turns, horizon_s)  # rate: requests/s
        for _ in self._starts:
            system = rng.choices(range(shape.system_prompts), weights)[0]
            turns = rng.randint(*shape.turns)
            self._conversations.append(
                _Conversation(
                    system=system,
                    system_tokens=self._system_tokens[system],
                    users=[rng.randint(*shape.user_tokens) for _ in range(turns)],
                    answers=[rng.randint(*shape.answer_tokens) for _ in range(turns)],
                    thinks=[rng.expovariate(1.0 / shape.think_s_mean) for _ in range(turns)],
                )
            )

    def initial(self) -> list[Request]:
        return [self._turn(index, 0, start) for index, start in enumerate(self._starts)]

    def follow_up(self, finished: Request) -> Request | None:
        conversation = self._conversations[finished.conversation]
        turn = finished.turn + 1
        if turn >= len(conversation.users) or finished.finish_s == math.inf:
            return None
        arrival = finished.finish_s + conversation.thinks[turn]
        if arrival > self.horizon_s:
            return None
        request = self._turn(finished.conversation, turn, arrival)
        if request.prompt_tokens + request.output_tokens > self.shape.max_context:
            return None
        return request

    def _turn(self, index: int, turn: int, arrival: float) -> Request:
        conversation = self._conversations[index]
        if turn == 0:
            conversation.history_tokens = conversation.system_tokens
        else:
            conversation.history_tokens += (
                conversation.users[turn - 1] + conversation.answers[turn - 1]
            )
        prompt = conversation.history_tokens + conversation.users[turn]
        system_blocks = conversation.system_tokens // self.block_tokens
        keys = tuple(
            ("s", conversation.system, b) if b < system_blocks else ("c", index, b)
            for b in range(prompt // self.block_tokens)
        )
        return Request(
            request_id=self._new_id(),
            arrival_s=arrival,
            prompt_tokens=prompt,
            output_tokens=conversation.answers[turn],
            block_keys=keys,
            conversation=index,
            turn=turn,
        )


class RandomTrace(Trace):
    """Independent requests, Poisson arrivals, uniform lengths; no prefix is shared."""

    def __init__(
        self,
        rate: float,
        horizon_s: float,
        *,
        block_tokens: int,
        seed: int = 0,
        shape: RandomShape = RandomShape(),
        fixed: tuple[int, int] | None = None,
        count: int | None = None,
    ) -> None:
        """`count`: stop after that many requests (the horizon becomes the last arrival)."""
        super().__init__(horizon_s)
        rng = random.Random(seed)
        self._requests = []
        arrivals = _poisson_times(rng, rate, horizon_s, count)
        if count is not None:
            self.horizon_s = arrivals[-1]
        for arrival in arrivals:
            if fixed is None:
                prompt, output = (
                    rng.randint(*shape.prompt_tokens),
                    rng.randint(*shape.output_tokens),
                )
            else:
                prompt, output = fixed
            request_id = self._new_id()
            keys = tuple(("r", request_id, b) for b in range(prompt // block_tokens))
            self._requests.append(Request(request_id, arrival, prompt, output, keys))

    def initial(self) -> list[Request]:
        return list(self._requests)
