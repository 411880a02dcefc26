"""The three built-in tool-use worlds: shop orders, insurance policies, logistics.

Each world is small on purpose (6-8 people, a dozen records): instructions and tool results stay a
few dozen tokens, so the embedded ~1.1M-parameter default model can learn the tasks by SFT on the
oracle demonstrations. Every task needs *dependent* calls: human-visible keys from the instruction
(a name, an order number, a policy or tracking number) are looked up to internal ids, which the
modification tools take. Templates span 2 to 5 calls.
"""

from __future__ import annotations

import random
from typing import Any

from lopd.envs.base import ToolCall
from lopd.envs.tool_use import (
    Db,
    Draft,
    Param,
    TemplateNotApplicable,
    ToolError,
    ToolSpec,
    World,
    register_world,
)

FIRST_NAMES = (
    "Lena", "Omar", "Alice", "Ravi", "Mia", "Jonas", "Sara", "Kenji", "Nora", "Diego",
    "Hana", "Felix", "Zoe", "Ivan", "Leila", "Marco", "Chloe", "Tariq", "Emma", "Yusuf",
    "Ana", "Bruno", "Ines", "Liam", "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sven",
)  # fmt: skip
LAST_NAMES = (
    "Park", "Diaz", "Chan", "Patel", "Novak", "Berg", "Costa", "Ito", "Haddad", "Kim",
    "Lopez", "Moreau", "Okafor", "Rossi", "Silva", "Tanaka", "Weber", "Young", "Fischer", "Gray",
)  # fmt: skip
STREETS = ("Oak St", "Pine Ave", "Elm Rd", "Lake Dr", "Hill St", "Main St", "River Rd", "Bay Ave")
CITIES = (
    "Denver", "Boston", "Austin", "Chicago", "Seattle", "Miami", "Dallas", "Phoenix",
    "Atlanta", "Portland",
)  # fmt: skip
PRODUCTS = (
    "Desk Lamp", "Coffee Mug", "Yoga Mat", "Backpack", "Headphones", "Notebook",
    "Water Bottle", "Phone Case", "Wall Clock", "Sunglasses",
)  # fmt: skip
COVERAGES = {
    "health": ("ER", "Dental", "Vision", "Psychiatric", "Maternity"),
    "auto": ("Collision", "Liability", "Theft", "Glass", "Towing"),
    "home": ("Fire", "Flood", "Theft", "Water", "Storm"),
}


def _names(rng: random.Random, k: int) -> list[str]:
    pairs = rng.sample([(f, la) for f in FIRST_NAMES for la in LAST_NAMES], k)
    return [f"{f} {la}" for f, la in pairs]


def _numbers(rng: random.Random, k: int, lo: int, hi: int) -> list[int]:
    return rng.sample(range(lo, hi), k)


def _address(rng: random.Random) -> str:
    return f"{rng.randint(2, 98)} {rng.choice(STREETS)}"


def _find(table: dict[str, dict[str, Any]], field: str, value: Any) -> str | None:
    for rid, rec in table.items():
        if rec.get(field) == value:
            return rid
    return None


def _get(db: Db, table: str, rid: str, what: str) -> dict[str, Any]:
    rec = db[table].get(rid)
    if rec is None:
        raise ToolError(f"no {what} with id '{rid}'")
    return rec


def _unchanged(allow: dict[str, dict[str, list[str]]], new: dict[str, int] | None = None) -> dict:
    return {"op": "unchanged", "allow": allow, "new": new or {}}


def _eq(table: str, rid: str, path: str, value: Any) -> dict[str, Any]:
    return {"op": "equals", "table": table, "id": rid, "path": path, "value": value}


STR = "string"
INT = "integer"


# =========================================================================== shop


@register_world
class ShopWorld(World):
    """An online shop: customers, their orders (pending ones can change), products with stock."""

    name = "shop"
    tools_spec = (
        ToolSpec(
            "find_customer",
            "Look up a customer by full name.",
            {"name": Param(STR, "Full name, e.g. 'Lena Park'.")},
        ),
        ToolSpec(
            "get_orders",
            "List a customer's orders.",
            {"customer_id": Param(STR, "Customer id, e.g. 'C-3'.")},
        ),
        ToolSpec("get_order", "Show one order.", {"order_id": Param(STR, "Order id, e.g. 'O-7'.")}),
        ToolSpec(
            "find_product",
            "Look up a product by name.",
            {"name": Param(STR, "Product name, e.g. 'Desk Lamp'.")},
        ),
        ToolSpec(
            "update_email",
            "Change a customer's email.",
            {"customer_id": Param(STR, "Customer id."), "email": Param(STR, "New email.")},
            kind="modify",
        ),
        ToolSpec(
            "update_order_address",
            "Change the shipping address of a pending order.",
            {"order_id": Param(STR, "Order id."), "address": Param(STR, "New address.")},
            kind="modify",
        ),
        ToolSpec(
            "cancel_order",
            "Cancel a pending order.",
            {"order_id": Param(STR, "Order id.")},
            kind="modify",
        ),
        ToolSpec(
            "add_item",
            "Add one unit of a product to a pending order.",
            {"order_id": Param(STR, "Order id."), "product_id": Param(STR, "Product id.")},
            kind="modify",
        ),
    )
    templates = ("change_email", "change_address", "cancel_order", "add_item")

    @classmethod
    def build_db(cls, seed: int) -> Db:
        rng = random.Random(f"shop-db/{seed}")
        names = _names(rng, 7)
        customers = {
            f"C-{i + 1}": {"name": n, "email": n.lower().replace(" ", ".") + "@mail.com"}
            for i, n in enumerate(names)
        }
        products = {
            f"P-{i + 1}": {"name": p, "price": rng.randint(5, 90), "stock": rng.randint(1, 9)}
            for i, p in enumerate(rng.sample(PRODUCTS, 6))
        }
        orders: dict[str, dict[str, Any]] = {}
        numbers = iter(_numbers(rng, 7 * 3, 1000, 10000))
        for cid in customers:
            k = rng.randint(1, 3)
            statuses = ["pending"] + [rng.choice(["pending", "shipped", "delivered"])] * (k - 1)
            rng.shuffle(statuses)
            for st in statuses:
                oid = f"O-{len(orders) + 1}"
                orders[oid] = {
                    "customer_id": cid,
                    "number": str(next(numbers)),
                    "status": st,
                    "address": _address(rng),
                    "items": rng.sample(sorted(products), rng.randint(1, 2)),
                }
        return {"customers": customers, "orders": orders, "products": products}

    # -- tools
    def tool_find_customer(self, name: str) -> dict[str, Any]:
        cid = _find(self.db["customers"], "name", name)
        if cid is None:
            raise ToolError(f"no customer named '{name}'")
        return {"customer_id": cid}

    def tool_get_orders(self, customer_id: str) -> dict[str, Any]:
        _get(self.db, "customers", customer_id, "customer")
        orders = [
            {"order_id": oid, "number": o["number"], "status": o["status"]}
            for oid, o in self.db["orders"].items()
            if o["customer_id"] == customer_id
        ]
        return {"orders": orders}

    def tool_get_order(self, order_id: str) -> dict[str, Any]:
        return {"order_id": order_id, **_get(self.db, "orders", order_id, "order")}

    def tool_find_product(self, name: str) -> dict[str, Any]:
        pid = _find(self.db["products"], "name", name)
        if pid is None:
            raise ToolError(f"no product named '{name}'")
        p = self.db["products"][pid]
        return {"product_id": pid, "price": p["price"], "stock": p["stock"]}

    def _pending(self, order_id: str) -> dict[str, Any]:
        o = _get(self.db, "orders", order_id, "order")
        if o["status"] != "pending":
            raise ToolError(f"order {order_id} is {o['status']}; only pending orders can change")
        return o

    def tool_update_email(self, customer_id: str, email: str) -> dict[str, Any]:
        if "@" not in email:
            raise ToolError(f"invalid email '{email}'")
        _get(self.db, "customers", customer_id, "customer")["email"] = email
        return {"customer_id": customer_id, "email": email}

    def tool_update_order_address(self, order_id: str, address: str) -> dict[str, Any]:
        if not address.strip():
            raise ToolError("address must not be empty")
        self._pending(order_id)["address"] = address
        return {"order_id": order_id, "address": address}

    def tool_cancel_order(self, order_id: str) -> dict[str, Any]:
        self._pending(order_id)["status"] = "cancelled"
        return {"order_id": order_id, "status": "cancelled"}

    def tool_add_item(self, order_id: str, product_id: str) -> dict[str, Any]:
        o = self._pending(order_id)
        p = _get(self.db, "products", product_id, "product")
        if p["stock"] < 1:
            raise ToolError(f"product {product_id} is out of stock")
        p["stock"] -= 1
        o["items"].append(product_id)
        return {"order_id": order_id, "items": o["items"]}

    # -- templates
    def _pick_pending(self, rng: random.Random) -> tuple[str, str, str, dict[str, Any]]:
        oid = rng.choice([k for k, o in self.db["orders"].items() if o["status"] == "pending"])
        o = self.db["orders"][oid]
        cid = o["customer_id"]
        return cid, self.db["customers"][cid]["name"], oid, o

    def gen_change_email(self, rng: random.Random) -> Draft:
        cid = rng.choice(sorted(self.db["customers"]))
        name = self.db["customers"][cid]["name"]
        email = f"{name.split()[0].lower()}{rng.randint(10, 99)}@mail.com"
        return Draft(
            f"Change the email of customer {name} to {email}.",
            {"name": name, "email": email},
            [_eq("customers", cid, "email", email), _unchanged({"customers": {cid: ["email"]}})],
            [
                ToolCall("find_customer", {"name": name}),
                ToolCall("update_email", {"customer_id": cid, "email": email}),
            ],
        )

    def gen_change_address(self, rng: random.Random) -> Draft:
        cid, name, oid, o = self._pick_pending(rng)
        address = _address(rng)
        while address == o["address"]:
            address = _address(rng)
        return Draft(
            f"Ship order #{o['number']} of {name} to {address}.",
            {"name": name, "number": o["number"], "address": address},
            [_eq("orders", oid, "address", address), _unchanged({"orders": {oid: ["address"]}})],
            [
                ToolCall("find_customer", {"name": name}),
                ToolCall("get_orders", {"customer_id": cid}),
                ToolCall("update_order_address", {"order_id": oid, "address": address}),
            ],
        )

    def gen_cancel_order(self, rng: random.Random) -> Draft:
        cid, name, oid, o = self._pick_pending(rng)
        return Draft(
            f"Cancel order #{o['number']} of {name}.",
            {"name": name, "number": o["number"]},
            [_eq("orders", oid, "status", "cancelled"), _unchanged({"orders": {oid: ["status"]}})],
            [
                ToolCall("find_customer", {"name": name}),
                ToolCall("get_orders", {"customer_id": cid}),
                ToolCall("cancel_order", {"order_id": oid}),
            ],
        )

    def gen_add_item(self, rng: random.Random) -> Draft:
        cid, name, oid, o = self._pick_pending(rng)
        pid = rng.choice(sorted(self.db["products"]))
        p = self.db["products"][pid]
        return Draft(
            f"Add a {p['name']} to order #{o['number']} of {name}.",
            {"name": name, "number": o["number"], "product": p["name"]},
            [
                _eq("orders", oid, "items", [*o["items"], pid]),
                _eq("products", pid, "stock", p["stock"] - 1),
                _unchanged({"orders": {oid: ["items"]}, "products": {pid: ["stock"]}}),
            ],
            [
                ToolCall("find_customer", {"name": name}),
                ToolCall("get_orders", {"customer_id": cid}),
                ToolCall("find_product", {"name": p["name"]}),
                ToolCall("add_item", {"order_id": oid, "product_id": pid}),
            ],
        )


# =========================================================================== insurance


@register_world
class InsuranceWorld(World):
    """Insurance: holders, their policies (coverage name -> limit in $), claims on policies."""

    name = "insurance"
    tools_spec = (
        ToolSpec(
            "find_holder",
            "Look up a policy holder by full name.",
            {"name": Param(STR, "Full name, e.g. 'Alice Chan'.")},
        ),
        ToolSpec(
            "get_policies",
            "List a holder's policies.",
            {"holder_id": Param(STR, "Holder id, e.g. 'H-2'.")},
        ),
        ToolSpec(
            "find_policy",
            "Look up a policy by its policy number.",
            {"number": Param(STR, "Policy number, e.g. 'PN-4821'.")},
        ),
        ToolSpec(
            "get_claims",
            "List the claims on a policy.",
            {"policy_id": Param(STR, "Policy id, e.g. 'PL-5'.")},
        ),
        ToolSpec(
            "set_coverage",
            "Add a coverage to a policy or change its limit.",
            {
                "policy_id": Param(STR, "Policy id."),
                "coverage": Param(STR, "Coverage name, e.g. 'Dental'."),
                "limit": Param(INT, "Limit in dollars."),
            },
            kind="modify",
        ),
        ToolSpec(
            "remove_coverage",
            "Remove a coverage from a policy.",
            {"policy_id": Param(STR, "Policy id."), "coverage": Param(STR, "Coverage name.")},
            kind="modify",
        ),
        ToolSpec(
            "file_claim",
            "File a new claim on a policy.",
            {"policy_id": Param(STR, "Policy id."), "amount": Param(INT, "Amount in dollars.")},
            kind="modify",
        ),
        ToolSpec(
            "approve_claim",
            "Approve an open claim.",
            {"claim_id": Param(STR, "Claim id, e.g. 'CL-3'.")},
            kind="modify",
        ),
    )
    templates = ("set_limit", "add_coverage", "file_claim", "approve_claim", "swap_coverage")

    @classmethod
    def build_db(cls, seed: int) -> Db:
        rng = random.Random(f"insurance-db/{seed}")
        holders = {f"H-{i + 1}": {"name": n} for i, n in enumerate(_names(rng, 6))}
        policies: dict[str, dict[str, Any]] = {}
        claims: dict[str, dict[str, Any]] = {}
        numbers = iter(_numbers(rng, 6 * 3, 1000, 10000))
        for hid in holders:
            for ptype in rng.sample(sorted(COVERAGES), rng.randint(1, 3)):
                pid = f"PL-{len(policies) + 1}"
                covs = rng.sample(COVERAGES[ptype], 3)
                policies[pid] = {
                    "holder_id": hid,
                    "number": f"PN-{next(numbers)}",
                    "type": ptype,
                    "coverages": {c: rng.randint(1, 20) * 500 for c in covs},
                }
                for _ in range(rng.randint(0, 2)):
                    claims[f"CL-{len(claims) + 1}"] = {
                        "policy_id": pid,
                        "amount": rng.randint(1, 40) * 100,
                        "status": rng.choice(["open", "approved"]),
                    }
        return {"holders": holders, "policies": policies, "claims": claims}

    # -- tools
    def tool_find_holder(self, name: str) -> dict[str, Any]:
        hid = _find(self.db["holders"], "name", name)
        if hid is None:
            raise ToolError(f"no holder named '{name}'")
        return {"holder_id": hid}

    def tool_get_policies(self, holder_id: str) -> dict[str, Any]:
        _get(self.db, "holders", holder_id, "holder")
        pols = [
            {"policy_id": pid, "number": p["number"], "type": p["type"]}
            for pid, p in self.db["policies"].items()
            if p["holder_id"] == holder_id
        ]
        return {"policies": pols}

    def tool_find_policy(self, number: str) -> dict[str, Any]:
        pid = _find(self.db["policies"], "number", number)
        if pid is None:
            raise ToolError(f"no policy with number '{number}'")
        p = self.db["policies"][pid]
        return {"policy_id": pid, "type": p["type"], "coverages": p["coverages"]}

    def tool_get_claims(self, policy_id: str) -> dict[str, Any]:
        _get(self.db, "policies", policy_id, "policy")
        cl = [
            {"claim_id": k, "amount": c["amount"], "status": c["status"]}
            for k, c in self.db["claims"].items()
            if c["policy_id"] == policy_id
        ]
        return {"claims": cl}

    def tool_set_coverage(self, policy_id: str, coverage: str, limit: int) -> dict[str, Any]:
        p = _get(self.db, "policies", policy_id, "policy")
        if coverage not in COVERAGES[p["type"]]:
            raise ToolError(f"coverage '{coverage}' is not offered for {p['type']} policies")
        if not 0 < limit <= 100_000:
            raise ToolError("limit must be between 1 and 100000")
        p["coverages"][coverage] = limit
        return {"policy_id": policy_id, "coverages": p["coverages"]}

    def tool_remove_coverage(self, policy_id: str, coverage: str) -> dict[str, Any]:
        p = _get(self.db, "policies", policy_id, "policy")
        if coverage not in p["coverages"]:
            raise ToolError(f"policy {policy_id} has no {coverage} coverage")
        del p["coverages"][coverage]
        return {"policy_id": policy_id, "coverages": p["coverages"]}

    def tool_file_claim(self, policy_id: str, amount: int) -> dict[str, Any]:
        _get(self.db, "policies", policy_id, "policy")
        if not 0 < amount <= 100_000:
            raise ToolError("amount must be between 1 and 100000")
        cid = self.new_id("claims", "CL")
        self.db["claims"][cid] = {"policy_id": policy_id, "amount": amount, "status": "open"}
        return {"claim_id": cid}

    def tool_approve_claim(self, claim_id: str) -> dict[str, Any]:
        c = _get(self.db, "claims", claim_id, "claim")
        if c["status"] != "open":
            raise ToolError(f"claim {claim_id} is {c['status']}, not open")
        c["status"] = "approved"
        return {"claim_id": claim_id, "status": "approved"}

    # -- templates
    def _pick_policy(self, rng: random.Random, ids: list[str] | None = None):
        pid = rng.choice(ids if ids is not None else sorted(self.db["policies"]))
        p = self.db["policies"][pid]
        hid = p["holder_id"]
        return pid, p, hid, self.db["holders"][hid]["name"]

    @staticmethod
    def _new_limit(rng: random.Random, old: int | None) -> int:
        limit = rng.randint(1, 20) * 500
        while limit == old:
            limit = rng.randint(1, 20) * 500
        return limit

    def gen_set_limit(self, rng: random.Random) -> Draft:
        pid, p, _, _ = self._pick_policy(rng)
        cov = rng.choice(sorted(p["coverages"]))
        limit = self._new_limit(rng, p["coverages"][cov])
        return Draft(
            f"Set the {cov} limit of policy {p['number']} to ${limit}.",
            {"number": p["number"], "coverage": cov, "limit": limit},
            [
                # The whole coverage map: the policy's other coverages must survive untouched.
                _eq("policies", pid, "coverages", {**p["coverages"], cov: limit}),
                _unchanged({"policies": {pid: ["coverages"]}}),
            ],
            [
                ToolCall("find_policy", {"number": p["number"]}),
                ToolCall("set_coverage", {"policy_id": pid, "coverage": cov, "limit": limit}),
            ],
        )

    def gen_add_coverage(self, rng: random.Random) -> Draft:
        pid, p, hid, name = self._pick_policy(rng)
        cov = rng.choice([c for c in COVERAGES[p["type"]] if c not in p["coverages"]])
        limit = self._new_limit(rng, None)
        return Draft(
            f"Add {cov} coverage with a ${limit} limit to the {p['type']} policy of {name}.",
            {"name": name, "type": p["type"], "coverage": cov, "limit": limit},
            [
                _eq("policies", pid, "coverages", {**p["coverages"], cov: limit}),
                _unchanged({"policies": {pid: ["coverages"]}}),
            ],
            [
                ToolCall("find_holder", {"name": name}),
                ToolCall("get_policies", {"holder_id": hid}),
                ToolCall("set_coverage", {"policy_id": pid, "coverage": cov, "limit": limit}),
            ],
        )

    def gen_file_claim(self, rng: random.Random) -> Draft:
        pid, p, hid, name = self._pick_policy(rng)
        amount = rng.randint(1, 40) * 100
        return Draft(
            f"File a ${amount} claim on the {p['type']} policy of {name}.",
            {"name": name, "type": p["type"], "amount": amount},
            [
                {
                    "op": "count_new",
                    "table": "claims",
                    "where": {"policy_id": pid, "amount": amount, "status": "open"},
                    "count": 1,
                },
                _unchanged({}, new={"claims": 1}),
            ],
            [
                ToolCall("find_holder", {"name": name}),
                ToolCall("get_policies", {"holder_id": hid}),
                ToolCall("file_claim", {"policy_id": pid, "amount": amount}),
            ],
        )

    def gen_approve_claim(self, rng: random.Random) -> Draft:
        # A policy with exactly one open claim, so "the open claim" is unambiguous.
        open_by_policy: dict[str, list[str]] = {}
        for k, c in self.db["claims"].items():
            if c["status"] == "open":
                open_by_policy.setdefault(c["policy_id"], []).append(k)
        candidates = sorted(pid for pid, ks in open_by_policy.items() if len(ks) == 1)
        if not candidates:
            raise TemplateNotApplicable("no policy with exactly one open claim")
        pid, p, _, _ = self._pick_policy(rng, candidates)
        claim_id = open_by_policy[pid][0]
        return Draft(
            f"Approve the open claim on policy {p['number']}.",
            {"number": p["number"]},
            [
                _eq("claims", claim_id, "status", "approved"),
                _unchanged({"claims": {claim_id: ["status"]}}),
            ],
            [
                ToolCall("find_policy", {"number": p["number"]}),
                ToolCall("get_claims", {"policy_id": pid}),
                ToolCall("approve_claim", {"claim_id": claim_id}),
            ],
        )

    def gen_swap_coverage(self, rng: random.Random) -> Draft:
        pid, p, hid, name = self._pick_policy(rng)
        old = rng.choice(sorted(p["coverages"]))
        new = rng.choice([c for c in COVERAGES[p["type"]] if c not in p["coverages"]])
        limit = self._new_limit(rng, None)
        final = {c: v for c, v in p["coverages"].items() if c != old}
        final[new] = limit
        return Draft(
            f"On the {p['type']} policy of {name}, replace {old} with {new} at a ${limit} limit.",
            {"name": name, "type": p["type"], "old": old, "new": new, "limit": limit},
            [
                _eq("policies", pid, "coverages", final),
                {"op": "absent", "table": "policies", "id": pid, "path": f"coverages.{old}"},
                _unchanged({"policies": {pid: ["coverages"]}}),
            ],
            [
                ToolCall("find_holder", {"name": name}),
                ToolCall("get_policies", {"holder_id": hid}),
                ToolCall("remove_coverage", {"policy_id": pid, "coverage": old}),
                ToolCall("set_coverage", {"policy_id": pid, "coverage": new, "limit": limit}),
            ],
        )


# =========================================================================== logistics


@register_world
class LogisticsWorld(World):
    """Logistics: shipments (tracking number, destination, hub, priority), hubs, drivers."""

    name = "logistics"
    tools_spec = (
        ToolSpec(
            "find_shipment",
            "Look up a shipment by tracking number.",
            {"tracking": Param(STR, "Tracking number, e.g. 'TRK-4821'.")},
        ),
        ToolSpec(
            "get_shipment",
            "Show one shipment.",
            {"shipment_id": Param(STR, "Shipment id, e.g. 'S-4'.")},
        ),
        ToolSpec(
            "find_warehouse",
            "Look up the warehouse of a city.",
            {"city": Param(STR, "City, e.g. 'Denver'.")},
        ),
        ToolSpec(
            "find_driver",
            "Look up a driver by full name.",
            {"name": Param(STR, "Full name, e.g. 'Omar Diaz'.")},
        ),
        ToolSpec(
            "update_destination",
            "Change the destination city of a shipment not yet delivered.",
            {
                "shipment_id": Param(STR, "Shipment id."),
                "city": Param(STR, "New destination city."),
            },
            kind="modify",
        ),
        ToolSpec(
            "set_priority",
            "Set the priority of a shipment.",
            {
                "shipment_id": Param(STR, "Shipment id."),
                "priority": Param(STR, "Priority.", enum=("standard", "express")),
            },
            kind="modify",
        ),
        ToolSpec(
            "reroute",
            "Route a shipment through a warehouse.",
            {
                "shipment_id": Param(STR, "Shipment id."),
                "warehouse_id": Param(STR, "Warehouse id."),
            },
            kind="modify",
        ),
        ToolSpec(
            "assign_driver",
            "Assign a free driver to a shipment.",
            {"shipment_id": Param(STR, "Shipment id."), "driver_id": Param(STR, "Driver id.")},
            kind="modify",
        ),
    )
    templates = ("change_destination", "expedite", "reroute", "assign_driver", "reroute_assign")

    @classmethod
    def build_db(cls, seed: int) -> Db:
        rng = random.Random(f"logistics-db/{seed}")
        cities = rng.sample(CITIES, 6)
        warehouses = {f"W-{i + 1}": {"city": c} for i, c in enumerate(cities[:4])}
        drivers = {
            f"D-{i + 1}": {"name": n, "shipment_id": None} for i, n in enumerate(_names(rng, 5))
        }
        shipments: dict[str, dict[str, Any]] = {}
        for i, num in enumerate(_numbers(rng, 8, 1000, 10000)):
            shipments[f"S-{i + 1}"] = {
                "tracking": f"TRK-{num}",
                "destination": rng.choice(CITIES),
                "status": rng.choice(["pending", "in_transit", "in_transit", "delivered"]),
                "priority": rng.choice(["standard", "standard", "express"]),
                "warehouse_id": rng.choice(sorted(warehouses)),
                "driver_id": None,
            }
        # Some drivers are busy with an undelivered shipment.
        busy = [s for s, r in shipments.items() if r["status"] != "delivered"]
        for did in rng.sample(sorted(drivers), 2):
            free = [s for s in busy if shipments[s]["driver_id"] is None]
            if free:
                sid = rng.choice(free)
                shipments[sid]["driver_id"] = did
                drivers[did]["shipment_id"] = sid
        return {"shipments": shipments, "warehouses": warehouses, "drivers": drivers}

    # -- tools
    def tool_find_shipment(self, tracking: str) -> dict[str, Any]:
        sid = _find(self.db["shipments"], "tracking", tracking)
        if sid is None:
            raise ToolError(f"no shipment with tracking number '{tracking}'")
        s = self.db["shipments"][sid]
        return {"shipment_id": sid, "status": s["status"]}

    def tool_get_shipment(self, shipment_id: str) -> dict[str, Any]:
        return {"shipment_id": shipment_id, **_get(self.db, "shipments", shipment_id, "shipment")}

    def tool_find_warehouse(self, city: str) -> dict[str, Any]:
        wid = _find(self.db["warehouses"], "city", city)
        if wid is None:
            raise ToolError(f"no warehouse in '{city}'")
        return {"warehouse_id": wid}

    def tool_find_driver(self, name: str) -> dict[str, Any]:
        did = _find(self.db["drivers"], "name", name)
        if did is None:
            raise ToolError(f"no driver named '{name}'")
        return {"driver_id": did, "shipment_id": self.db["drivers"][did]["shipment_id"]}

    def _open(self, shipment_id: str) -> dict[str, Any]:
        s = _get(self.db, "shipments", shipment_id, "shipment")
        if s["status"] == "delivered":
            raise ToolError(f"shipment {shipment_id} is already delivered")
        return s

    def tool_update_destination(self, shipment_id: str, city: str) -> dict[str, Any]:
        if city not in CITIES:
            raise ToolError(f"we do not deliver to '{city}'")
        self._open(shipment_id)["destination"] = city
        return {"shipment_id": shipment_id, "destination": city}

    def tool_set_priority(self, shipment_id: str, priority: str) -> dict[str, Any]:
        self._open(shipment_id)["priority"] = priority
        return {"shipment_id": shipment_id, "priority": priority}

    def tool_reroute(self, shipment_id: str, warehouse_id: str) -> dict[str, Any]:
        s = self._open(shipment_id)
        _get(self.db, "warehouses", warehouse_id, "warehouse")
        s["warehouse_id"] = warehouse_id
        return {"shipment_id": shipment_id, "warehouse_id": warehouse_id}

    def tool_assign_driver(self, shipment_id: str, driver_id: str) -> dict[str, Any]:
        s = self._open(shipment_id)
        d = _get(self.db, "drivers", driver_id, "driver")
        if d["shipment_id"] is not None:
            raise ToolError(f"driver {driver_id} is busy with {d['shipment_id']}")
        if s["driver_id"] is not None:
            # Reassignment frees the previous driver so the two tables stay consistent.
            self.db["drivers"][s["driver_id"]]["shipment_id"] = None
        s["driver_id"] = driver_id
        d["shipment_id"] = shipment_id
        return {"shipment_id": shipment_id, "driver_id": driver_id}

    # -- templates
    def _pick_open(self, rng: random.Random, unassigned: bool = False) -> tuple[str, dict]:
        ids = [
            k
            for k, s in self.db["shipments"].items()
            if s["status"] != "delivered" and not (unassigned and s["driver_id"] is not None)
        ]
        if not ids:
            raise TemplateNotApplicable("no open shipment")
        sid = rng.choice(ids)
        return sid, self.db["shipments"][sid]

    def gen_change_destination(self, rng: random.Random) -> Draft:
        sid, s = self._pick_open(rng)
        city = rng.choice([c for c in CITIES if c != s["destination"]])
        return Draft(
            f"Change the destination of shipment {s['tracking']} to {city}.",
            {"tracking": s["tracking"], "city": city},
            [
                _eq("shipments", sid, "destination", city),
                _unchanged({"shipments": {sid: ["destination"]}}),
            ],
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("update_destination", {"shipment_id": sid, "city": city}),
            ],
        )

    def gen_expedite(self, rng: random.Random) -> Draft:
        ids = [
            k
            for k, s in self.db["shipments"].items()
            if s["status"] != "delivered" and s["priority"] == "standard"
        ]
        if not ids:
            raise TemplateNotApplicable("no open standard shipment")
        sid = rng.choice(ids)
        s = self.db["shipments"][sid]
        return Draft(
            f"Upgrade shipment {s['tracking']} to express.",
            {"tracking": s["tracking"]},
            [
                _eq("shipments", sid, "priority", "express"),
                _unchanged({"shipments": {sid: ["priority"]}}),
            ],
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("set_priority", {"shipment_id": sid, "priority": "express"}),
            ],
        )

    def _pick_warehouse(self, rng: random.Random, s: dict[str, Any]) -> tuple[str, str]:
        wid = rng.choice([w for w in sorted(self.db["warehouses"]) if w != s["warehouse_id"]])
        return wid, self.db["warehouses"][wid]["city"]

    def _pick_free_driver(self, rng: random.Random) -> tuple[str, str]:
        free = [d for d, r in self.db["drivers"].items() if r["shipment_id"] is None]
        did = rng.choice(free)
        return did, self.db["drivers"][did]["name"]

    def gen_reroute(self, rng: random.Random) -> Draft:
        sid, s = self._pick_open(rng)
        wid, city = self._pick_warehouse(rng, s)
        return Draft(
            f"Route shipment {s['tracking']} through the {city} warehouse.",
            {"tracking": s["tracking"], "city": city},
            [
                _eq("shipments", sid, "warehouse_id", wid),
                _unchanged({"shipments": {sid: ["warehouse_id"]}}),
            ],
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("find_warehouse", {"city": city}),
                ToolCall("reroute", {"shipment_id": sid, "warehouse_id": wid}),
            ],
        )

    def gen_assign_driver(self, rng: random.Random) -> Draft:
        sid, s = self._pick_open(rng, unassigned=True)
        did, name = self._pick_free_driver(rng)
        return Draft(
            f"Assign driver {name} to shipment {s['tracking']}.",
            {"tracking": s["tracking"], "name": name},
            [
                _eq("shipments", sid, "driver_id", did),
                _eq("drivers", did, "shipment_id", sid),
                _unchanged({"shipments": {sid: ["driver_id"]}, "drivers": {did: ["shipment_id"]}}),
            ],
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("find_driver", {"name": name}),
                ToolCall("assign_driver", {"shipment_id": sid, "driver_id": did}),
            ],
        )

    def gen_reroute_assign(self, rng: random.Random) -> Draft:
        sid, s = self._pick_open(rng, unassigned=True)
        wid, city = self._pick_warehouse(rng, s)
        did, name = self._pick_free_driver(rng)
        return Draft(
            f"Route shipment {s['tracking']} through the {city} warehouse and assign driver "
            f"{name}.",
            {"tracking": s["tracking"], "city": city, "name": name},
            [
                _eq("shipments", sid, "warehouse_id", wid),
                _eq("shipments", sid, "driver_id", did),
                _eq("drivers", did, "shipment_id", sid),
                _unchanged(
                    {
                        "shipments": {sid: ["warehouse_id", "driver_id"]},
                        "drivers": {did: ["shipment_id"]},
                    }
                ),
            ],
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("find_warehouse", {"city": city}),
                ToolCall("reroute", {"shipment_id": sid, "warehouse_id": wid}),
                ToolCall("find_driver", {"name": name}),
                ToolCall("assign_driver", {"shipment_id": sid, "driver_id": did}),
            ],
        )
