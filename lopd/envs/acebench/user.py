"""ACEBench's simulated user for multi-turn tasks: a local chat model playing the task's brief.

As ACEBench's user (``model_inference/multi_turn/APIModel_user.py``), the simulator is a chat model
whose system prompt holds the task's ``question`` and the rules of play (one line per turn,
reveal the brief step by step, invent nothing, say ``finish conversation`` when everything is
done); its conversation opens with the assistant asking whether it can help, and then every
assistant text turn is the simulator's next input. The two prompts (phone platform, travel) are
:data:`PHONE_USER_PROMPT` and :data:`TRAVEL_USER_PROMPT`, this project's wording of ACEBench's
rules (docs/evaluation.md shows them).

The model is any local Hugging Face chat checkpoint (nothing is downloaded). It runs in a worker
process (``_user_worker.py``: transformers is imported there, not in lopd's envs), one per
``(path, device)`` in this process, kept for later episodes; replies are greedy (ACEBench uses
temperature 0.001) and at most :data:`MAX_REPLY_TOKENS` tokens, ``<think>`` blocks removed.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lopd.envs.base import strip_thinking

__all__ = [
    "FINISH",
    "OPENING",
    "PHONE_USER_PROMPT",
    "TRAVEL_USER_PROMPT",
    "UserConversation",
    "local_chat",
]

FINISH = "finish conversation"
"""What the simulated user says to end the dialogue (ACEBench's own phrase)."""
OPENING = "Is there anything I can help you with today?"
"""The assistant's first line, which the simulated user answers with its first request."""
MAX_REPLY_TOKENS = 256
LOAD_TIME_LIMIT_S = 600.0
REPLY_TIME_LIMIT_S = 600.0

PHONE_USER_PROMPT = """You are playing a user who talks to an assistant on a phone.

Your brief: {question}

How to play:
- Write one line per turn, as this user would write it.
- Reveal the brief step by step: give what the current step needs, never everything at once.
- When a step needs details, give all of them (for a reminder: its title, description and time).
- Never invent what the brief does not say (for example, what to order when it names no dish).
- When the assistant asks whether you need anything else, check whether every task of the brief \
is done; if one is not, ask for it.
- Names in the brief are full names.
- When the assistant asks which message to delete, answer as the brief says.
- Do not offer the assistant help; answer its questions from the brief alone.
- When every task is done, write one line that says only: finish conversation"""

TRAVEL_USER_PROMPT = """You are playing a user who talks to an airline's booking assistant.

Your brief: {question}

How to play:
- Write one line per turn, as this user would write it.
- Reveal the brief step by step: give what the current step needs, never everything at once.
- Never invent what the brief does not say: if you are asked for something it does not give \
(an order number, say), say you do not have it.
- When the assistant asks you to confirm, confirm or not as the brief says.
- Say things in your own words rather than repeating the brief.
- Keep the dialogue natural and keep the personality the brief describes.
- If the brief asks for a round trip, say at the very start that you want to book a round trip.
- When the brief's goal is reached, write one line that says only: finish conversation"""


Chat = Callable[[list[dict[str, str]]], str]
"""A chat model: a conversation (``role``/``content`` messages) -> the next assistant text."""


class UserConversation:
    """One episode's simulated user.

    Args:
        chat: the chat model playing the user.
        question: the task's brief.
        involved_classes: the task's classes (``BaseApi`` picks the phone prompt, else travel).
    """

    def __init__(self, chat: Chat, question: str, involved_classes: list[str]) -> None:
        prompt = PHONE_USER_PROMPT if "BaseApi" in involved_classes else TRAVEL_USER_PROMPT
        self._chat = chat
        # The user's side of the dialogue: the assistant's turns are its "user" messages.
        self.messages = [
            {"role": "system", "content": prompt.format(question=question)},
            {"role": "user", "content": OPENING},
        ]

    def _next(self) -> str:
        text = strip_thinking(self._chat(self.messages)).strip()
        self.messages.append({"role": "assistant", "content": text})
        return text

    def opening(self) -> str:
        """The user's first message."""
        return self._next()

    def reply(self, assistant_text: str) -> str:
        """The user's answer to an assistant turn."""
        self.messages.append({"role": "user", "content": strip_thinking(assistant_text).strip()})
        return self._next()


_WORKER = Path(__file__).with_name("_user_worker.py")


class _Worker:
    """A chat model in its own process: one JSON request line in, one JSON answer line out."""

    def __init__(self, path: str, device: str) -> None:
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, str(_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        answer = self._request({"model": path, "device": device}, LOAD_TIME_LIMIT_S)
        if "error" in answer:
            self.close()
            raise ValueError(f"user model {path!r} could not be loaded: {answer['error']}")

    def _request(self, message: dict, timeout_s: float) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            raise RuntimeError("the user model's process is gone") from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        chunks = b""
        while not chunks.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                raise RuntimeError(f"the user model gave no answer within {timeout_s:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError("the user model's process died")
            chunks += chunk
        return json.loads(chunks)

    def chat(self, messages: list[dict[str, str]]) -> str:
        with self.lock:
            answer = self._request(
                {"messages": messages, "max_new_tokens": MAX_REPLY_TOKENS}, REPLY_TIME_LIMIT_S
            )
        if "error" in answer:
            raise RuntimeError(f"the user model failed: {answer['error']}")
        return str(answer["text"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_POOL: dict[tuple[str, str], _Worker] = {}
_POOL_LOCK = threading.Lock()


def local_chat(path: str, device: str = "cpu") -> Chat:
    """The chat function of a local checkpoint, loaded once per ``(path, device)``.

    Raises:
        ValueError: ``path`` is not a directory, or the model cannot be loaded (one line).
    """
    if not Path(path).is_dir():
        raise ValueError(f"user model {path!r} is not a local checkpoint directory")
    key = (str(Path(path).resolve()), device)
    with _POOL_LOCK:
        worker = _POOL.get(key)
        if worker is None or worker.proc.poll() is not None:
            worker = _POOL[key] = _Worker(key[0], device)
    return worker.chat


@atexit.register
def _close_pool() -> None:
    with _POOL_LOCK:
        for worker in _POOL.values():
            worker.close()
        _POOL.clear()
