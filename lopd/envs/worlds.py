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

=====================  ================================================================
template               oracle tool sequence (default conventions)
=====================  ================================================================
shop/change_email      find_customer, update_email, **notify_customer**
shop/change_address    find_order, **verify_customer**, update_address
shop/add_item          find_order, find_product, **verify_customer**, add_item
shop/cancel_order      find_order, **verify_customer**, cancel_order, **refund_order**
insurance/set_limit    find_policy, **request_review**, set_limit
insurance/remove_cov.  find_policy, **request_review**, remove_coverage
insurance/add_coverage find_holder, get_policy, **request_review**, add_coverage
insurance/file_claim   find_holder, get_policy, file_claim, **notify_holder**
insurance/approve      find_policy, get_open_claim, approve_claim, **notify_holder**
logistics/change_dest. find_shipment, update_destination, **notify_recipient**
logistics/reroute      find_shipment, find_warehouse, reroute, **notify_recipient**
logistics/assign       find_shipment, find_driver, **scan_shipment**, assign_driver
logistics/expedite     find_shipment, **scan_shipment**, set_priority
=====================  ================================================================

A successful trajectory of a task of the same kind shows the convention; the instruction alone
does not. A wrong procedure scores 0: a missing precondition makes the modification fail, and a
step the convention does not ask for changes a field the ``unchanged`` gate protects.
"""

from __future__ import annotations

from lopd.envs.insurance import InsuranceWorld
from lopd.envs.logistics import LogisticsWorld
from lopd.envs.shop import ShopWorld
from lopd.envs.world_kit import lexicon

__all__ = ["InsuranceWorld", "LogisticsWorld", "ShopWorld", "lexicon"]
