"""The insurance world: holders, policies, claims (see :mod:`lopd.envs.worlds`)."""

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
    COVERAGES,
    NUMBER_RANGE,
    STR,
    Step,
    dollars,
    draft,
    eq,
    find_id,
    get_record,
    random_names,
)


@register_world
class InsuranceWorld(World):
    """Insurance: holders, their policies (coverage name -> limit in $), claims on policies.

    Conventions: ``coverage_rule`` (coverage changes: request a review first / notify the holder
    after), ``claim_rule`` (claims: notify the holder after / verify the claim: after filing,
    before approving).
    """

    name = "insurance"
    tools_spec = (
        ToolSpec(
            "find_holder",
            "Look up a policy holder by full name.",
            {"name": Param(STR, "Full name, e.g. 'Alice Chan'.")},
        ),
        ToolSpec(
            "get_policy",
            "Look up a holder's policy of one type.",
            {
                "holder_id": Param(STR, "Holder id, e.g. 'H-2'."),
                "type": Param(STR, "Policy type.", enum=tuple(COVERAGES)),
            },
        ),
        ToolSpec(
            "find_policy",
            "Look up a policy by its policy number.",
            {"number": Param(STR, "Policy number, e.g. 'PN-482'.")},
        ),
        ToolSpec(
            "get_open_claim",
            "Show the open claim of a policy.",
            {"policy_id": Param(STR, "Policy id, e.g. 'PL-5'.")},
        ),
        ToolSpec(
            "set_limit",
            "Change the limit of a coverage of a policy.",
            {
                "policy_id": Param(STR, "Policy id."),
                "coverage": Param(STR, "Coverage name, e.g. 'Dental'."),
                "limit": Param(STR, "Limit in dollars, e.g. '$500'."),
            },
            kind="modify",
        ),
        ToolSpec(
            "add_coverage",
            "Add a coverage to a policy.",
            {
                "policy_id": Param(STR, "Policy id."),
                "coverage": Param(STR, "Coverage name."),
                "limit": Param(STR, "Limit in dollars, e.g. '$500'."),
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
            {
                "policy_id": Param(STR, "Policy id."),
                "amount": Param(STR, "Amount in dollars, e.g. '$250'."),
            },
            kind="modify",
        ),
        ToolSpec(
            "approve_claim",
            "Approve an open claim.",
            {"claim_id": Param(STR, "Claim id, e.g. 'CL-3'.")},
            kind="modify",
        ),
        ToolSpec(
            "request_review",
            "Open an underwriting review of a policy.",
            {"policy_id": Param(STR, "Policy id.")},
            kind="modify",
        ),
        ToolSpec(
            "notify_holder",
            "Send a holder a notice about a change.",
            {"holder_id": Param(STR, "Holder id.")},
            kind="modify",
        ),
        ToolSpec(
            "verify_claim",
            "Mark a claim as verified.",
            {"claim_id": Param(STR, "Claim id.")},
            kind="modify",
        ),
    )
    templates = ("set_limit", "add_coverage", "file_claim", "approve_claim", "remove_coverage")
    conventions: ClassVar[dict[str, tuple[str, ...]]] = {
        "coverage_rule": ("review", "notify"),
        "claim_rule": ("notify", "verify"),
    }

    @classmethod
    def build_db(cls, seed: int) -> Db:
        rng = random.Random(f"insurance-db/{seed}")
        holders = {
            f"H-{i + 1}": {"name": n, "notices": 0} for i, n in enumerate(random_names(rng, 6))
        }
        policies: dict[str, dict[str, Any]] = {}
        claims: dict[str, dict[str, Any]] = {}
        numbers = iter(rng.sample(NUMBER_RANGE, 6 * 3))
        for hid in holders:
            for ptype in rng.sample(sorted(COVERAGES), rng.randint(1, 3)):
                pid = f"PL-{len(policies) + 1}"
                covs = rng.sample(COVERAGES[ptype], 3)
                policies[pid] = {
                    "holder_id": hid,
                    "number": f"PN-{next(numbers)}",
                    "type": ptype,
                    "coverages": {c: rng.randint(2, 19) * 50 for c in covs},
                    "review": "none",
                }
                for _ in range(rng.randint(0, 2)):
                    claims[f"CL-{len(claims) + 1}"] = {
                        "policy_id": pid,
                        "amount": rng.randint(10, 99) * 10,
                        "status": rng.choice(["open", "approved"]),
                        "verified": False,
                    }
        return {"holders": holders, "policies": policies, "claims": claims}

    # -- tools
    def tool_find_holder(self, name: str) -> dict[str, Any]:
        hid = find_id(self.db["holders"], "name", name)
        if hid is None:
            raise ToolError(f"no holder named '{name}'")
        return {"holder_id": hid}

    def tool_get_policy(self, holder_id: str, type: str) -> dict[str, Any]:
        get_record(self.db, "holders", holder_id, "holder")
        for pid, p in self.db["policies"].items():
            if p["holder_id"] == holder_id and p["type"] == type:
                return {"policy_id": pid, "number": p["number"]}
        raise ToolError(f"holder {holder_id} has no {type} policy")

    def tool_find_policy(self, number: str) -> dict[str, Any]:
        pid = find_id(self.db["policies"], "number", number)
        if pid is None:
            raise ToolError(f"no policy with number '{number}'")
        p = self.db["policies"][pid]
        return {"policy_id": pid, "holder_id": p["holder_id"], "type": p["type"]}

    def tool_get_open_claim(self, policy_id: str) -> dict[str, Any]:
        get_record(self.db, "policies", policy_id, "policy")
        for k, c in self.db["claims"].items():
            if c["policy_id"] == policy_id and c["status"] == "open":
                return {"claim_id": k, "amount": f"${c['amount']}"}
        raise ToolError(f"policy {policy_id} has no open claim")

    def _changeable(self, policy_id: str) -> dict[str, Any]:
        p = get_record(self.db, "policies", policy_id, "policy")
        if self.convention("coverage_rule") == "review" and p["review"] != "requested":
            raise ToolError(f"policy {policy_id} has no open review")
        return p

    def tool_set_limit(self, policy_id: str, coverage: str, limit: str) -> dict[str, Any]:
        p = get_record(self.db, "policies", policy_id, "policy")
        if coverage not in p["coverages"]:
            raise ToolError(f"policy {policy_id} has no {coverage} coverage")
        self._changeable(policy_id)["coverages"][coverage] = dollars(limit, "limit")
        return {"policy_id": policy_id, "coverage": coverage, "limit": limit}

    def tool_add_coverage(self, policy_id: str, coverage: str, limit: str) -> dict[str, Any]:
        p = get_record(self.db, "policies", policy_id, "policy")
        if coverage not in COVERAGES[p["type"]]:
            raise ToolError(f"coverage '{coverage}' is not offered for {p['type']} policies")
        if coverage in p["coverages"]:
            raise ToolError(f"policy {policy_id} already has {coverage} coverage")
        value = dollars(limit, "limit")
        self._changeable(policy_id)["coverages"][coverage] = value
        return {"policy_id": policy_id, "coverage": coverage, "limit": limit}

    def tool_remove_coverage(self, policy_id: str, coverage: str) -> dict[str, Any]:
        p = get_record(self.db, "policies", policy_id, "policy")
        if coverage not in p["coverages"]:
            raise ToolError(f"policy {policy_id} has no {coverage} coverage")
        del self._changeable(policy_id)["coverages"][coverage]
        return {"policy_id": policy_id, "removed": coverage}

    def tool_file_claim(self, policy_id: str, amount: str) -> dict[str, Any]:
        get_record(self.db, "policies", policy_id, "policy")
        value = dollars(amount, "amount")
        cid = self.new_id("claims", "CL")
        self.db["claims"][cid] = {
            "policy_id": policy_id,
            "amount": value,
            "status": "open",
            "verified": False,
        }
        return {"claim_id": cid, "status": "open"}

    def tool_approve_claim(self, claim_id: str) -> dict[str, Any]:
        c = get_record(self.db, "claims", claim_id, "claim")
        if c["status"] != "open":
            raise ToolError(f"claim {claim_id} is {c['status']}, not open")
        if self.convention("claim_rule") == "verify" and not c["verified"]:
            raise ToolError(f"claim {claim_id} is not verified")
        c["status"] = "approved"
        return {"claim_id": claim_id, "status": "approved"}

    def tool_request_review(self, policy_id: str) -> dict[str, Any]:
        get_record(self.db, "policies", policy_id, "policy")["review"] = "requested"
        return {"policy_id": policy_id, "review": "requested"}

    def tool_notify_holder(self, holder_id: str) -> dict[str, Any]:
        h = get_record(self.db, "holders", holder_id, "holder")
        h["notices"] += 1
        return {"holder_id": holder_id, "notices": h["notices"]}

    def tool_verify_claim(self, claim_id: str) -> dict[str, Any]:
        get_record(self.db, "claims", claim_id, "claim")["verified"] = True
        return {"claim_id": claim_id, "verified": True}

    # -- convention steps
    def _notify(self, hid: str) -> Step:
        n = self.db["holders"][hid]["notices"]
        return Step(
            ToolCall("notify_holder", {"holder_id": hid}),
            [eq("holders", hid, "notices", n + 1)],
            {"holders": {hid: ["notices"]}},
        )

    def _coverage_rule(self, pid: str, hid: str) -> tuple[str, Step]:
        if self.convention("coverage_rule") == "review":
            return "pre", Step(
                ToolCall("request_review", {"policy_id": pid}),
                [eq("policies", pid, "review", "requested")],
                {"policies": {pid: ["review"]}},
            )
        return "post", self._notify(hid)

    # -- templates
    def _pick_policy(self, rng: random.Random, ids: list[str] | None = None):
        pid = rng.choice(ids if ids is not None else sorted(self.db["policies"]))
        p = self.db["policies"][pid]
        hid = p["holder_id"]
        return pid, p, hid, self.db["holders"][hid]["name"]

    @staticmethod
    def _new_limit(rng: random.Random, old: int | None) -> int:
        limit = rng.randint(2, 19) * 50
        while limit == old:
            limit = rng.randint(2, 19) * 50
        return limit

    def gen_set_limit(self, rng: random.Random) -> Draft:
        pid, p, hid, _ = self._pick_policy(rng)
        cov = rng.choice(sorted(p["coverages"]))
        limit = self._new_limit(rng, p["coverages"][cov])
        main = Step(
            ToolCall("set_limit", {"policy_id": pid, "coverage": cov, "limit": f"${limit}"}),
            # The whole coverage map: the policy's other coverages must survive untouched.
            [eq("policies", pid, "coverages", {**p["coverages"], cov: limit})],
            {"policies": {pid: ["coverages"]}},
        )
        return draft(
            f"Set the {cov} limit of policy {p['number']} to ${limit}.",
            {"number": p["number"], "coverage": cov, "limit": limit},
            [ToolCall("find_policy", {"number": p["number"]})],
            [main],
            [self._coverage_rule(pid, hid)],
        )

    def gen_remove_coverage(self, rng: random.Random) -> Draft:
        pid, p, hid, _ = self._pick_policy(rng)
        cov = rng.choice(sorted(p["coverages"]))
        main = Step(
            ToolCall("remove_coverage", {"policy_id": pid, "coverage": cov}),
            [{"op": "absent", "table": "policies", "id": pid, "path": f"coverages.{cov}"}],
            {"policies": {pid: ["coverages"]}},
        )
        return draft(
            f"Remove the {cov} coverage from policy {p['number']}.",
            {"number": p["number"], "coverage": cov},
            [ToolCall("find_policy", {"number": p["number"]})],
            [main],
            [self._coverage_rule(pid, hid)],
        )

    def gen_add_coverage(self, rng: random.Random) -> Draft:
        pid, p, hid, name = self._pick_policy(rng)
        cov = rng.choice([c for c in COVERAGES[p["type"]] if c not in p["coverages"]])
        limit = self._new_limit(rng, None)
        main = Step(
            ToolCall("add_coverage", {"policy_id": pid, "coverage": cov, "limit": f"${limit}"}),
            [eq("policies", pid, "coverages", {**p["coverages"], cov: limit})],
            {"policies": {pid: ["coverages"]}},
        )
        return draft(
            f"Add {cov} coverage with a ${limit} limit to the {p['type']} policy of {name}.",
            {"name": name, "type": p["type"], "coverage": cov, "limit": limit},
            [
                ToolCall("find_holder", {"name": name}),
                ToolCall("get_policy", {"holder_id": hid, "type": p["type"]}),
            ],
            [main],
            [self._coverage_rule(pid, hid)],
        )

    def gen_file_claim(self, rng: random.Random) -> Draft:
        pid, p, hid, name = self._pick_policy(rng)
        amount = rng.randint(10, 99) * 10
        claim_id = self.new_id("claims", "CL")
        verify = self.convention("claim_rule") == "verify"
        where = {"policy_id": pid, "amount": amount, "status": "open", "verified": verify}
        main = Step(
            ToolCall("file_claim", {"policy_id": pid, "amount": f"${amount}"}),
            [{"op": "count_new", "table": "claims", "where": where, "count": 1}],
            {},
        )
        if verify:
            # Verifying the new claim is what makes the count_new check (verified: true) hold.
            rule = ("post", Step(ToolCall("verify_claim", {"claim_id": claim_id}), [], {}))
        else:
            rule = ("post", self._notify(hid))
        return draft(
            f"File a ${amount} claim on the {p['type']} policy of {name}.",
            {"name": name, "type": p["type"], "amount": amount},
            [
                ToolCall("find_holder", {"name": name}),
                ToolCall("get_policy", {"holder_id": hid, "type": p["type"]}),
            ],
            [main],
            [rule],
            new={"claims": 1},
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
        pid, p, hid, _ = self._pick_policy(rng, candidates)
        claim_id = open_by_policy[pid][0]
        main = Step(
            ToolCall("approve_claim", {"claim_id": claim_id}),
            [eq("claims", claim_id, "status", "approved")],
            {"claims": {claim_id: ["status"]}},
        )
        if self.convention("claim_rule") == "verify":
            rule = (
                "pre",
                Step(
                    ToolCall("verify_claim", {"claim_id": claim_id}),
                    [eq("claims", claim_id, "verified", True)],
                    {"claims": {claim_id: ["verified"]}},
                ),
            )
        else:
            rule = ("post", self._notify(hid))
        return draft(
            f"Approve the open claim on policy {p['number']}.",
            {"number": p["number"]},
            [
                ToolCall("find_policy", {"number": p["number"]}),
                ToolCall("get_open_claim", {"policy_id": pid}),
            ],
            [main],
            [rule],
        )
