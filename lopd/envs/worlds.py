"""The three built-in tool-use worlds: shop orders, insurance policies, logistics.

Each world is small on purpose (5-8 people, a dozen records, 11-12 tools): instructions and tool
results stay a few dozen tokens, so the embedded ~1M-parameter default model can play them on a
CPU. Every task needs *dependent* calls: the human-visible keys of the instruction (a name, an
order number, a policy or tracking number) are looked up to internal ids, which the modification
tools take. Each lookup returns one record, so filling an argument is a copy from the last
observations, never a search through a list.

What makes experience matter is each world's **conventions** (:attr:`World.conventions`): house
rules the task text never states, enforced by the tools and by the final-state checks. A
modification either needs a *precondition* step first (the tool refuses with an error otherwise)
or a *follow-up* step after it (a check on the final database), and which one depends on the
kind of task. The default alternatives (the first listed per slot) give these procedures:

=====================  ========================================================="""

from __future__ import annotations

from lopd.envs.insurance import InsuranceWorld
from lopd.envs.logistics import LogisticsWorld
from lopd.envs.shop import ShopWorld
from lopd.envs.world_kit import lexicon

__all__ = ["InsuranceWorld", "LogisticsWorld", "ShopWorld", "lexicon"]
