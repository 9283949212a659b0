"""Toy tasks with a verifiable reward that a byte-level tiny model learns on a CPU in minutes.

A task makes prompts (`sample(rng)` -> (prompt text, the right answer)) and scores a completion
(`reward(prompt, completion)`, completion text without its end-of-answer newline):

    reverse   "cabd=" -> "dbac"      the letters backwards (letters from "abcd")
    sort      "cabd=" -> "abcd"      the letters in order
    add       "12+47=" -> "59"       the sum of two numbers of `length` digits

The reward is the fraction of answer positions the completion gets right, over the longer of the
two (so missing and extra characters cost alike): 1 for the answer, about 1/4 for uniformly random
letters of the right length (reverse, sort). `format_example` gives a prompt with a random answer
of the right length and alphabet: the warm-up's supervised data, which teaches the format (and the
chance reward) but not the task.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

LETTERS = "abcd"
EOS = "\n"  # a completion ends with it (the engine's stop id)


def char_reward(answer: str, completion: str) -> float:
    """Matching positions over the longer length (1 when equal, 0 for an empty completion)."""
    if not completion:
        return 0.0
    hits = sum(a == b for a, b in zip(answer, completion))
    return hits / max(len(answer), len(completion))


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    length: int
    make: Callable  # (rng, length) -> (prompt, answer)
    alphabet: str

    def sample(self, rng) -> tuple[str, str]:
        return self.make(rng, self.length)

    def answer(self, prompt: str) -> str:
        return _ANSWERS[self.name](prompt)

    def reward(self, prompt: str, completion: str) -> float:
        return char_reward(self.answer(prompt), completion)

    def format_example(self, rng, right: float = 0.0) -> tuple[str, str]:
        """A prompt and, with probability `right`, its answer, else random characters of the answer's
        length and alphabet (the warm-up's supervised data)."""
        prompt, answer = self.sample(rng)
        if rng.uniform() < right:
            return prompt, answer
        return prompt, "".join(rng.choice(list(self.alphabet), size=len(answer)))

    def prompts(self, seed: int, index: int, n: int) -> list[str]:
        """The n prompts of update `index` (a function of (seed, index), as data batches are)."""
        rng = np.random.default_rng([seed, index])
        return [self.sample(rng)[0] for _ in range(n)]


def _letters(rng, n: int) -> str:
    return "".join(rng.choice(list(LETTERS), size=n))


def _reverse(rng, n):
    s = _letters(rng, n)
    return s + "=", s[::-1]


def _sort(rng, n):
    s = _letters(rng, n)
    return s + "=", "".join(sorted(s))


def _add(rng, n):
    a, b = (int(rng.integers(0, 10**n)) for _ in range(2))
    return f"{a}+{b}=", str(a + b)


def _add_answer(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


_ANSWERS = {
    "reverse": lambda p: p.rstrip("=")[::-1],
    "sort": lambda p: "".join(sorted(p.rstrip("="))),
    "add": _add_answer,
}
_MAKERS = {"reverse": (_reverse, LETTERS), "sort": (_sort, LETTERS), "add": (_add, "0123456789")}
TASKS = tuple(_MAKERS)


def get(name: str, length: int) -> Task:
    make, alphabet = _MAKERS[name]
    return Task(name, length, make, alphabet)


def longest_prompt(task: Task) -> int:
    return {"reverse": task.length + 1, "sort": task.length + 1, "add": 2 * task.length + 2}[task.name]


def longest_answer(task: Task) -> int:
    return task.length + 1 if task.name == "add" else task.length
