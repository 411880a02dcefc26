"""The shop world: customers, orders, products (see :mod:`lopd.envs.worlds`)."""

from __future__ import annotations

import random
from typing import Any, ClassVar

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
from lopd.envs.world_kit import (
    NUMBER_RANGE,
    PRODUCTS,
    STR,
    Step,
    draft,
    eq,
    find_id,
    get_record,
    random_address,
    random_names,
)


@register_world
class ShopWorld(World):
    """An online shop: customers, their orders (pending ones can change), products with stock.

    Conventions: ``account_rule`` (email changes: notify the customer after / verify first),
    ``order_rule`` (order changes: verify the customer first / notify after), ``cancel_rule``
    (a cancelled order is then refunded / restocked).
    """

    name = "shop"
    tools_spec = (
        ToolSpec(
            "find_customer",
            "Look up a customer by full name.",
            {"name": Param(STR, "Full name, e.g. 'Lena Park'.")},
        ),
        ToolSpec(
            "find_order",
            "Look up an order by its order number.",
            {"number": Param(STR, "Order number, e.g. '#482'.")},
        ),
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
            "update_address",
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
        ToolSpec(
            "verify_customer",
            "Mark a customer's identity as verified.",
            {"customer_id": Param(STR, "Customer id.")},
            kind="modify",
        ),
        ToolSpec(
            "notify_customer",
            "Send a customer a notice about a change.",
            {"customer_id": Param(STR, "Customer id.")},
            kind="modify",
        ),
        ToolSpec(
            "refund_order",
            "Refund a cancelled order.",
            {"order_id": Param(STR, "Order id.")},
            kind="modify",
        ),
        ToolSpec(
            "restock_order",
            "Return the items of a cancelled order to stock.",
            {"order_id": Param(STR, "Order id.")},
            kind="modify",
        ),
    )
    templates = ("change_email", "change_address", "cancel_order", "add_item")
    conventions: ClassVar[dict[str, tuple[str, ...]]] = {
        "account_rule": ("notify", "verify"),
        "order_rule": ("verify", "notify"),
        "cancel_rule": ("refund", "restock"),
    }

    @classmethod
    def build_db(cls, seed: int) -> Db:
        rng = random.Random(f"shop-db/{seed}")
        names = random_names(rng, 7)
        customers = {
            f"C-{i + 1}": {
                "name": n,
                "email": n.lower().replace(" ", ".") + "@mail.com",
                "verified": False,
                "notices": 0,
            }
            for i, n in enumerate(names)
        }
        products = {
            f"P-{i + 1}": {"name": p, "stock": rng.randint(0, 6)}
            for i, p in enumerate(rng.sample(PRODUCTS, 6))
        }
        orders: dict[str, dict[str, Any]] = {}
        numbers = iter(rng.sample(NUMBER_RANGE, 7 * 3))
        for cid in customers:
            k = rng.randint(1, 3)
            statuses = ["pending"] + [rng.choice(["pending", "shipped", "delivered"])] * (k - 1)
            rng.shuffle(statuses)
            for st in statuses:
                oid = f"O-{len(orders) + 1}"
                orders[oid] = {
                    "customer_id": cid,
                    "number": f"#{next(numbers)}",
                    "status": st,
                    "address": random_address(rng),
                    "items": rng.sample(sorted(products), rng.randint(1, 2)),
                    "refunded": False,
                    "restocked": False,
                }
        return {"customers": customers, "orders": orders, "products": products}

    # -- tools
    def tool_find_customer(self, name: str) -> dict[str, Any]:
        cid = find_id(self.db["customers"], "name", name)
        if cid is None:
            raise ToolError(f"no customer named '{name}'")
        return {"customer_id": cid}

    def tool_find_order(self, number: str) -> dict[str, Any]:
        oid = find_id(self.db["orders"], "number", number)
        if oid is None:
            raise ToolError(f"no order with number '{number}'")
        o = self.db["orders"][oid]
        return {"order_id": oid, "customer_id": o["customer_id"], "status": o["status"]}

    def tool_find_product(self, name: str) -> dict[str, Any]:
        pid = find_id(self.db["products"], "name", name)
        if pid is None:
            raise ToolError(f"no product named '{name}'")
        return {"product_id": pid, "stock": self.db["products"][pid]["stock"]}

    def _customer(self, customer_id: str) -> dict[str, Any]:
        return get_record(self.db, "customers", customer_id, "customer")

    def _verified_if_required(self, slot: str, customer_id: str) -> None:
        if self.convention(slot) == "verify" and not self._customer(customer_id)["verified"]:
            raise ToolError(f"customer {customer_id} is not verified")

    def _pending(self, order_id: str) -> dict[str, Any]:
        o = get_record(self.db, "orders", order_id, "order")
        if o["status"] != "pending":
            raise ToolError(f"order {order_id} is {o['status']}; only pending orders can change")
        self._verified_if_required("order_rule", o["customer_id"])
        return o

    def _cancelled(self, order_id: str, flag: str) -> dict[str, Any]:
        o = get_record(self.db, "orders", order_id, "order")
        if o["status"] != "cancelled":
            raise ToolError(f"order {order_id} is {o['status']}, not cancelled")
        if o[flag]:
            raise ToolError(f"order {order_id} is already {flag}")
        return o

    def tool_update_email(self, customer_id: str, email: str) -> dict[str, Any]:
        if "@" not in email:
            raise ToolError(f"invalid email '{email}'")
        c = self._customer(customer_id)
        self._verified_if_required("account_rule", customer_id)
        c["email"] = email
        return {"customer_id": customer_id, "email": email}

    def tool_update_address(self, order_id: str, address: str) -> dict[str, Any]:
        if not address.strip():
            raise ToolError("address must not be empty")
        self._pending(order_id)["address"] = address
        return {"order_id": order_id, "address": address}

    def tool_cancel_order(self, order_id: str) -> dict[str, Any]:
        self._pending(order_id)["status"] = "cancelled"
        return {"order_id": order_id, "status": "cancelled"}

    def tool_add_item(self, order_id: str, product_id: str) -> dict[str, Any]:
        o = get_record(self.db, "orders", order_id, "order")
        p = get_record(self.db, "products", product_id, "product")
        if p["stock"] < 1:
            raise ToolError(f"product {product_id} is out of stock")
        self._pending(order_id)
        p["stock"] -= 1
        o["items"].append(product_id)
        return {"order_id": order_id, "items": o["items"]}

    def tool_verify_customer(self, customer_id: str) -> dict[str, Any]:
        self._customer(customer_id)["verified"] = True
        return {"customer_id": customer_id, "verified": True}

    def tool_notify_customer(self, customer_id: str) -> dict[str, Any]:
        c = self._customer(customer_id)
        c["notices"] += 1
        return {"customer_id": customer_id, "notices": c["notices"]}

    def tool_refund_order(self, order_id: str) -> dict[str, Any]:
        self._cancelled(order_id, "refunded")["refunded"] = True
        return {"order_id": order_id, "refunded": True}

    def tool_restock_order(self, order_id: str) -> dict[str, Any]:
        o = self._cancelled(order_id, "restocked")
        for pid in o["items"]:
            get_record(self.db, "products", pid, "product")["stock"] += 1
        o["restocked"] = True
        return {"order_id": order_id, "restocked": o["items"]}

    # -- convention steps
    def _verify(self, cid: str) -> Step:
        return Step(
            ToolCall("verify_customer", {"customer_id": cid}),
            [eq("customers", cid, "verified", True)],
            {"customers": {cid: ["verified"]}},
        )

    def _notify(self, cid: str) -> Step:
        n = self.db["customers"][cid]["notices"]
        return Step(
            ToolCall("notify_customer", {"customer_id": cid}),
            [eq("customers", cid, "notices", n + 1)],
            {"customers": {cid: ["notices"]}},
        )

    def _rule(self, slot: str, cid: str) -> tuple[str, Step]:
        if self.convention(slot) == "verify":
            return "pre", self._verify(cid)
        return "post", self._notify(cid)

    # -- templates
    def _pick_pending(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        oid = rng.choice([k for k, o in self.db["orders"].items() if o["status"] == "pending"])
        o = self.db["orders"][oid]
        return oid, o["customer_id"], o

    def gen_change_email(self, rng: random.Random) -> Draft:
        cid = rng.choice(sorted(self.db["customers"]))
        name = self.db["customers"][cid]["name"]
        email = f"{name.split()[0].lower()}{rng.randint(10, 99)}@mail.com"
        main = Step(
            ToolCall("update_email", {"customer_id": cid, "email": email}),
            [eq("customers", cid, "email", email)],
            {"customers": {cid: ["email"]}},
        )
        return draft(
            f"Change the email of customer {name} to {email}.",
            {"name": name, "email": email},
            [ToolCall("find_customer", {"name": name})],
            [main],
            [self._rule("account_rule", cid)],
        )

    def gen_change_address(self, rng: random.Random) -> Draft:
        oid, cid, o = self._pick_pending(rng)
        address = random_address(rng)
        while address == o["address"]:
            address = random_address(rng)
        main = Step(
            ToolCall("update_address", {"order_id": oid, "address": address}),
            [eq("orders", oid, "address", address)],
            {"orders": {oid: ["address"]}},
        )
        return draft(
            f"Ship order {o['number']} to {address}.",
            {"number": o["number"], "address": address},
            [ToolCall("find_order", {"number": o["number"]})],
            [main],
            [self._rule("order_rule", cid)],
        )

    def gen_cancel_order(self, rng: random.Random) -> Draft:
        oid, cid, o = self._pick_pending(rng)
        main = Step(
            ToolCall("cancel_order", {"order_id": oid}),
            [eq("orders", oid, "status", "cancelled")],
            {"orders": {oid: ["status"]}},
        )
        if self.convention("cancel_rule") == "refund":
            follow = Step(
                ToolCall("refund_order", {"order_id": oid}),
                [eq("orders", oid, "refunded", True)],
                {"orders": {oid: ["refunded"]}},
            )
        else:
            stock = {pid: self.db["products"][pid]["stock"] for pid in o["items"]}
            for pid in o["items"]:
                stock[pid] += 1
            follow = Step(
                ToolCall("restock_order", {"order_id": oid}),
                [eq("orders", oid, "restocked", True)]
                + [eq("products", pid, "stock", s) for pid, s in sorted(stock.items())],
                {"orders": {oid: ["restocked"]}, "products": {pid: ["stock"] for pid in stock}},
            )
        return draft(
            f"Cancel order {o['number']}.",
            {"number": o["number"]},
            [ToolCall("find_order", {"number": o["number"]})],
            [main, follow],
            [self._rule("order_rule", cid)],
        )

    def gen_add_item(self, rng: random.Random) -> Draft:
        oid, cid, o = self._pick_pending(rng)
        in_stock = [k for k, p in sorted(self.db["products"].items()) if p["stock"] > 0]
        if not in_stock:
            raise TemplateNotApplicable("no product in stock")
        pid = rng.choice(in_stock)
        p = self.db["products"][pid]
        main = Step(
            ToolCall("add_item", {"order_id": oid, "product_id": pid}),
            [
                eq("orders", oid, "items", [*o["items"], pid]),
                eq("products", pid, "stock", p["stock"] - 1),
            ],
            {"orders": {oid: ["items"]}, "products": {pid: ["stock"]}},
        )
        return draft(
            f"Add a {p['name']} to order {o['number']}.",
            {"number": o["number"], "product": p["name"]},
            [
                ToolCall("find_order", {"number": o["number"]}),
                ToolCall("find_product", {"name": p["name"]}),
            ],
            [main],
            [self._rule("order_rule", cid)],
        )
