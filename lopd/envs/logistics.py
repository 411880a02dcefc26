"""The logistics world: shipments, warehouses, drivers (see :mod:`lopd.envs.worlds`)."""

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
    CITIES,
    NUMBER_RANGE,
    STR,
    Step,
    draft,
    eq,
    find_id,
    get_record,
    random_names,
)


@register_world
class LogisticsWorld(World):
    """Logistics: shipments (tracking number, destination, hub, priority), hubs, drivers.

    Conventions: ``route_rule`` (destination and hub changes: notify the recipient after / scan
    the shipment first), ``dispatch_rule`` (driver assignment and priority changes: scan the
    shipment first / log the dispatch after).
    """

    name = "logistics"
    tools_spec = (
        ToolSpec(
            "find_shipment",
            "Look up a shipment by tracking number.",
            {"tracking": Param(STR, "Tracking number, e.g. 'TRK-482'.")},
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
        ToolSpec(
            "scan_shipment",
            "Record a handling scan of a shipment.",
            {"shipment_id": Param(STR, "Shipment id.")},
            kind="modify",
        ),
        ToolSpec(
            "notify_recipient",
            "Send the recipient of a shipment a notice.",
            {"shipment_id": Param(STR, "Shipment id.")},
            kind="modify",
        ),
        ToolSpec(
            "log_dispatch",
            "Write a shipment's dispatch log entry.",
            {"shipment_id": Param(STR, "Shipment id.")},
            kind="modify",
        ),
    )
    templates = ("change_destination", "expedite", "reroute", "assign_driver")
    conventions: ClassVar[dict[str, tuple[str, ...]]] = {
        "route_rule": ("notify", "scan"),
        "dispatch_rule": ("scan", "log"),
    }

    @classmethod
    def build_db(cls, seed: int) -> Db:
        rng = random.Random(f"logistics-db/{seed}")
        cities = rng.sample(CITIES, 6)
        warehouses = {f"W-{i + 1}": {"city": c} for i, c in enumerate(cities[:4])}
        drivers = {
            f"D-{i + 1}": {"name": n, "shipment_id": None}
            for i, n in enumerate(random_names(rng, 5))
        }
        shipments: dict[str, dict[str, Any]] = {}
        for i, num in enumerate(rng.sample(NUMBER_RANGE, 8)):
            shipments[f"S-{i + 1}"] = {
                "tracking": f"TRK-{num}",
                "destination": rng.choice(CITIES),
                "status": rng.choice(["pending", "in_transit", "in_transit", "delivered"]),
                "priority": rng.choice(["standard", "standard", "express"]),
                "warehouse_id": rng.choice(sorted(warehouses)),
                "driver_id": None,
                "scanned": False,
                "notices": 0,
                "logged": False,
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
        sid = find_id(self.db["shipments"], "tracking", tracking)
        if sid is None:
            raise ToolError(f"no shipment with tracking number '{tracking}'")
        return {"shipment_id": sid, "status": self.db["shipments"][sid]["status"]}

    def tool_find_warehouse(self, city: str) -> dict[str, Any]:
        wid = find_id(self.db["warehouses"], "city", city)
        if wid is None:
            raise ToolError(f"no warehouse in '{city}'")
        return {"warehouse_id": wid}

    def tool_find_driver(self, name: str) -> dict[str, Any]:
        did = find_id(self.db["drivers"], "name", name)
        if did is None:
            raise ToolError(f"no driver named '{name}'")
        return {"driver_id": did}

    def _open(self, shipment_id: str, slot: str) -> dict[str, Any]:
        s = get_record(self.db, "shipments", shipment_id, "shipment")
        if s["status"] == "delivered":
            raise ToolError(f"shipment {shipment_id} is already delivered")
        if self.convention(slot) == "scan" and not s["scanned"]:
            raise ToolError(f"shipment {shipment_id} has not been scanned")
        return s

    def tool_update_destination(self, shipment_id: str, city: str) -> dict[str, Any]:
        if city not in CITIES:
            raise ToolError(f"we do not deliver to '{city}'")
        self._open(shipment_id, "route_rule")["destination"] = city
        return {"shipment_id": shipment_id, "destination": city}

    def tool_set_priority(self, shipment_id: str, priority: str) -> dict[str, Any]:
        self._open(shipment_id, "dispatch_rule")["priority"] = priority
        return {"shipment_id": shipment_id, "priority": priority}

    def tool_reroute(self, shipment_id: str, warehouse_id: str) -> dict[str, Any]:
        get_record(self.db, "warehouses", warehouse_id, "warehouse")
        self._open(shipment_id, "route_rule")["warehouse_id"] = warehouse_id
        return {"shipment_id": shipment_id, "warehouse_id": warehouse_id}

    def tool_assign_driver(self, shipment_id: str, driver_id: str) -> dict[str, Any]:
        d = get_record(self.db, "drivers", driver_id, "driver")
        if d["shipment_id"] is not None:
            raise ToolError(f"driver {driver_id} is busy with {d['shipment_id']}")
        s = self._open(shipment_id, "dispatch_rule")
        if s["driver_id"] is not None:
            # Reassignment frees the previous driver so the two tables stay consistent.
            self.db["drivers"][s["driver_id"]]["shipment_id"] = None
        s["driver_id"] = driver_id
        d["shipment_id"] = shipment_id
        return {"shipment_id": shipment_id, "driver_id": driver_id}

    def tool_scan_shipment(self, shipment_id: str) -> dict[str, Any]:
        get_record(self.db, "shipments", shipment_id, "shipment")["scanned"] = True
        return {"shipment_id": shipment_id, "scanned": True}

    def tool_notify_recipient(self, shipment_id: str) -> dict[str, Any]:
        s = get_record(self.db, "shipments", shipment_id, "shipment")
        s["notices"] += 1
        return {"shipment_id": shipment_id, "notices": s["notices"]}

    def tool_log_dispatch(self, shipment_id: str) -> dict[str, Any]:
        get_record(self.db, "shipments", shipment_id, "shipment")["logged"] = True
        return {"shipment_id": shipment_id, "logged": True}

    # -- convention steps
    def _rule(self, slot: str, sid: str) -> tuple[str, Step]:
        alt = self.convention(slot)
        if alt == "scan":
            return "pre", Step(
                ToolCall("scan_shipment", {"shipment_id": sid}),
                [eq("shipments", sid, "scanned", True)],
                {"shipments": {sid: ["scanned"]}},
            )
        if alt == "notify":
            n = self.db["shipments"][sid]["notices"]
            return "post", Step(
                ToolCall("notify_recipient", {"shipment_id": sid}),
                [eq("shipments", sid, "notices", n + 1)],
                {"shipments": {sid: ["notices"]}},
            )
        return "post", Step(
            ToolCall("log_dispatch", {"shipment_id": sid}),
            [eq("shipments", sid, "logged", True)],
            {"shipments": {sid: ["logged"]}},
        )

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
        main = Step(
            ToolCall("update_destination", {"shipment_id": sid, "city": city}),
            [eq("shipments", sid, "destination", city)],
            {"shipments": {sid: ["destination"]}},
        )
        return draft(
            f"Change the destination of shipment {s['tracking']} to {city}.",
            {"tracking": s["tracking"], "city": city},
            [ToolCall("find_shipment", {"tracking": s["tracking"]})],
            [main],
            [self._rule("route_rule", sid)],
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
        main = Step(
            ToolCall("set_priority", {"shipment_id": sid, "priority": "express"}),
            [eq("shipments", sid, "priority", "express")],
            {"shipments": {sid: ["priority"]}},
        )
        return draft(
            f"Upgrade shipment {s['tracking']} to express.",
            {"tracking": s["tracking"]},
            [ToolCall("find_shipment", {"tracking": s["tracking"]})],
            [main],
            [self._rule("dispatch_rule", sid)],
        )

    def gen_reroute(self, rng: random.Random) -> Draft:
        sid, s = self._pick_open(rng)
        wid = rng.choice([w for w in sorted(self.db["warehouses"]) if w != s["warehouse_id"]])
        city = self.db["warehouses"][wid]["city"]
        main = Step(
            ToolCall("reroute", {"shipment_id": sid, "warehouse_id": wid}),
            [eq("shipments", sid, "warehouse_id", wid)],
            {"shipments": {sid: ["warehouse_id"]}},
        )
        return draft(
            f"Route shipment {s['tracking']} through the {city} warehouse.",
            {"tracking": s["tracking"], "city": city},
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("find_warehouse", {"city": city}),
            ],
            [main],
            [self._rule("route_rule", sid)],
        )

    def gen_assign_driver(self, rng: random.Random) -> Draft:
        sid, s = self._pick_open(rng, unassigned=True)
        free = [d for d, r in sorted(self.db["drivers"].items()) if r["shipment_id"] is None]
        did = rng.choice(free)
        name = self.db["drivers"][did]["name"]
        main = Step(
            ToolCall("assign_driver", {"shipment_id": sid, "driver_id": did}),
            [eq("shipments", sid, "driver_id", did), eq("drivers", did, "shipment_id", sid)],
            {"shipments": {sid: ["driver_id"]}, "drivers": {did: ["shipment_id"]}},
        )
        return draft(
            f"Assign driver {name} to shipment {s['tracking']}.",
            {"tracking": s["tracking"], "name": name},
            [
                ToolCall("find_shipment", {"tracking": s["tracking"]}),
                ToolCall("find_driver", {"name": name}),
            ],
            [main],
            [self._rule("dispatch_rule", sid)],
        )
