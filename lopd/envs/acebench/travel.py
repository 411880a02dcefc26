"""ACEBench's travel-booking system: users with cash and bank balances, flights, reservations.

Written from ACEBench's specification (its ``travel`` scenario): the same public methods (the
tools, helpers such as ``update_balance`` included, since ACEBench exposes them), state, initial
data and state transitions, including the surprising ones its ground truth was made with:

* a task's ``initial_config`` is not read (every task starts from the same data);
* ``reserve_flight`` takes the first available flight with the number, charges the ticket plus
  50 per bag over the member's free allowance, takes a seat and appends reservation
  ``res_<n+1>``; a wrong password, an unknown flight or cabin fails on the missing field
  (an error result, nothing changed);
* ``modify_flight`` keeps origin and destination, prices a cabin change on the reservation's
  *original* flight, records the new cabin even when the balance cannot pay the difference, and
  records added bags whether or not their fee could be paid;
* ``cancel_reservation`` refunds to the cash balance (in full more than 24 hours before
  departure or when the airline cancelled, else less a 10% fee; the clock is 2024-07-14 06:00)
  and leaves the reservation in place.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

USERS = {
    "user1": ("Eve", "password123", 2000.0, 50000.0, "regular"),
    "user2": ("Frank", "password456", 8000.0, 8000.0, "silver"),
    "user3": ("Grace", "password789", 1000.0, 5000.0, "gold"),
}
# flight_no, origin, destination, departure, arrival, seats, economy, business
FLIGHTS = (
    ("CA1234", "Beijing", "Shanghai", "2024-07-15 08:00:00", "2024-07-15 10:30:00", 5, 1200, 3000),
    ("MU5678", "Shanghai", "Beijing", "2024-07-16 09:00:00", "2024-07-16 11:30:00", 3, 1900, 3000),
    ("CZ4321", "Shanghai", "Beijing", "2024-07-16 20:00:00", "2024-07-16 22:00:00", 8, 2500, 4000),
    ("CZ4352", "Shanghai", "Beijing", "2024-07-17 20:00:00", "2024-07-17 22:00:00", 8, 1600, 2500),
    ("MU3561", "Beijing", "Nanjing", "2024-07-18 08:00:00", "2024-07-18 10:00:00", 8, 1500, 4000),
    ("MU1566", "Beijing", "Nanjing", "2024-07-18 20:00:00", "2024-07-18 22:00:00", 8, 1500, 4000),
    ("CZ1765", "Nanjing", "Shenzhen", "2024-07-17 20:30:00", "2024-07-17 22:00:00", 8, 1500, 2500),
    ("CZ1765", "Nanjing", "Shenzhen", "2024-07-18 12:30:00", "2024-07-18 15:00:00", 8, 1500, 2500),
    ("MH1765", "Xiamen", "Chengdu", "2024-07-17 12:30:00", "2024-07-17 15:00:00", 8, 1500, 2500),
    ("MH2616", "Chengdu", "Xiamen", "2024-07-18 18:30:00", "2024-07-18 21:00:00", 8, 1500, 2500),
    ("MH2616", "Chengdu", "Fuzhou", "2024-07-16 18:30:00", "2024-07-16 21:00:00", 8, 1500, 2500),
)
# reservation_id, user_id, flight_no, payment, cabin, bags, origin, destination
RESERVATIONS = (
    ("res_1", "user1", "CA1234", "bank", "Economy Class", 1, "Beijing", "Shanghai"),
    ("res_2", "user1", "MU5678", "bank", "Business Class", 1, "Shanghai", "Beijing"),
    ("res_3", "user2", "MH1765", "bank", "Business Class", 1, "Xiamen", "Chengdu"),
    ("res_4", "user2", "MU2616", "bank", "Business Class", 1, "Chengdu", "Xiamen"),
)
FREE_BAGS = {
    "regular": {"Economy Class": 1, "Business Class": 2},
    "silver": {"Economy Class": 2, "Business Class": 3},
    "gold": {"Economy Class": 3, "Business Class": 3},
}
BAG_FEE = 50
NOW = datetime(2024, 7, 14, 6, 0, 0)
"""The system's clock for cancellations."""
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_FLIGHT_KEYS = (
    "flight_no",
    "origin",
    "destination",
    "depart_time",
    "arrival_time",
    "seats_available",
    "economy_price",
    "business_price",
)


class Travel:
    """Flight booking: search, book, change, cancel."""

    def __init__(self) -> None:
        self.users = {
            uid: {
                "user_name": name,
                "password": pw,
                "cash_balance": cash,
                "bank_balance": bank,
                "membership_level": level,
            }
            for uid, (name, pw, cash, bank, level) in USERS.items()
        }
        self.flights = []
        for row in FLIGHTS:
            flight = dict(zip(_FLIGHT_KEYS[:5], row[:5]))
            flight["status"] = "available"
            flight.update(zip(_FLIGHT_KEYS[5:], row[5:]))
            self.flights.append(flight)
        keys = (
            "reservation_id",
            "user_id",
            "flight_no",
            "payment_method",
            "cabin",
            "baggage",
            "origin",
            "destination",
        )
        self.reservations = [dict(zip(keys, row)) for row in RESERVATIONS]

    def _apply_config(self, config: dict[str, Any]) -> None:
        """ACEBench's travel scenario reads nothing from a task's ``initial_config``."""

    def _flight(self, flight_no: str) -> dict[str, Any] | None:
        return next((f for f in self.flights if f["flight_no"] == flight_no), None)

    def get_flight_details(self, origin: str | None = None, destination: str | None = None) -> Any:
        flights = self.flights
        if origin:
            flights = [f for f in flights if f["origin"] == origin]
        if destination:
            flights = [f for f in flights if f["destination"] == destination]
        if not flights:
            return "No direct flight matches."
        keys = (*_FLIGHT_KEYS[:5], "status", *_FLIGHT_KEYS[5:])
        return [{k: f[k] for k in keys} for f in flights]

    def get_user_details(self, user_id: str, password: str) -> dict[str, Any]:
        user = self.users.get(user_id)
        if user and user["password"] == password:
            return {k: v for k, v in user.items() if k != "password"}
        return {"status": "error", "message": "wrong user id or password"}

    def get_reservation_details(
        self, reservation_id: str | None = None, user_id: str | None = None
    ) -> Any:
        if reservation_id:
            found = [r for r in self.reservations if r["reservation_id"] == reservation_id]
        elif user_id:
            found = [r for r in self.reservations if r["user_id"] == user_id]
        else:
            return {"status": "error", "message": "give a reservation id or a user id"}
        return [{**r, "flight_info": self._flight(r["flight_no"])} for r in found]

    def authenticate_user(self, user_id: Any, password: Any) -> dict[str, Any]:
        user = self.users.get(user_id)
        if user and user["password"] == password:
            return user
        return {"status": "error", "message": "wrong user id or password"}

    def get_baggage_allowance(self, membership_level: Any, cabin_class: Any) -> int:
        return FREE_BAGS.get(membership_level, {}).get(cabin_class, 0)

    def find_transfer_flights(
        self, origin_city: Any, transfer_city: Any, destination_city: Any
    ) -> Any:
        first = [
            f
            for f in self.flights
            if f["origin"] == origin_city
            and f["destination"] == transfer_city
            and f["status"] == "available"
        ]
        second = [
            f
            for f in self.flights
            if f["origin"] == transfer_city
            and f["destination"] == destination_city
            and f["status"] == "available"
        ]
        pairs = [
            {"first_leg": a, "second_leg": b}
            for a in first
            for b in second
            if datetime.strptime(a["arrival_time"], TIME_FORMAT)
            < datetime.strptime(b["depart_time"], TIME_FORMAT)
        ]
        return pairs or "No connecting flight matches."

    def calculate_baggage_fee(
        self, membership_level: Any, cabin_class: Any, baggage_count: Any
    ) -> Any:
        free = FREE_BAGS[membership_level][cabin_class]
        return max(baggage_count - free, 0) * BAG_FEE

    def update_balance(self, user: Any, payment_method: Any, amount: Any) -> bool:
        for method in ("cash", "bank"):
            if payment_method == method:
                key = f"{method}_balance"
                if user[key] + amount < 0:
                    return False
                user[key] += amount
        return True

    def reserve_flight(
        self,
        user_id: Any,
        password: Any,
        flight_no: Any,
        cabin: Any,
        payment_method: Any,
        baggage_count: Any,
    ) -> Any:
        user = self.authenticate_user(user_id, password)
        flight = next(
            (f for f in self.flights if f["flight_no"] == flight_no and f["status"] == "available"),
            None,
        )
        price = flight["economy_price"] if cabin == "Economy Class" else flight["business_price"]
        total = price + self.calculate_baggage_fee(user["membership_level"], cabin, baggage_count)
        if payment_method not in ("cash", "bank"):
            return "Invalid payment method."
        account = self.users.get(user_id)
        key = f"{payment_method}_balance"
        if total > account[key]:
            return f"The {payment_method} balance is not enough; try another payment method."
        account[key] -= total
        flight["seats_available"] -= 1
        reservation_id = f"res_{len(self.reservations) + 1}"
        self.reservations.append(
            {
                "reservation_id": reservation_id,
                "user_id": user_id,
                "flight_no": flight_no,
                "payment_method": payment_method,
                "cabin": cabin,
                "baggage": baggage_count,
            }
        )
        return f"Booked: reservation {reservation_id}, {total} yuan in all (bags included)."

    def modify_flight(
        self,
        user_id: Any,
        reservation_id: Any,
        new_flight_no: Any = None,
        new_cabin: Any = None,
        add_baggage: Any = 0,
        new_payment_method: Any = None,
    ) -> str:
        reservation = next(
            (
                r
                for r in self.reservations
                if r["reservation_id"] == reservation_id and r["user_id"] == user_id
            ),
            None,
        )
        if not reservation:
            return "No such reservation for this user."
        current = self._flight(reservation["flight_no"])
        if not current:
            return "The reservation's flight is unknown."
        method = new_payment_method if new_payment_method else reservation["payment_method"]
        user = self.users[user_id]
        notes = []
        if new_flight_no and new_flight_no != reservation["flight_no"]:
            new = self._flight(new_flight_no)
            if not (
                new
                and new["origin"] == current["origin"]
                and new["destination"] == current["destination"]
            ):
                return "Flight change refused: unknown flight, or another route."
            reservation["flight_no"] = new_flight_no
            notes.append("Flight changed.")
        if new_cabin and new_cabin != reservation.get("cabin"):
            difference = self.calculate_price_difference(current, reservation["cabin"], new_cabin)
            reservation["cabin"] = new_cabin
            if difference > 0:
                if self.update_balance(user, method, -difference):
                    notes.append(f"Cabin changed; {difference} paid.")
                else:
                    notes.append("The balance cannot pay the cabin difference.")
            elif difference < 0:
                self.update_balance(user, method, -difference)
                notes.append(f"Cabin changed; {-difference} refunded.")
        if add_baggage > 0:
            free = self.get_baggage_allowance(user["membership_level"], reservation["cabin"])
            total = reservation.get("baggage", 0) + add_baggage
            fee = max(0, total - free) * BAG_FEE
            if fee > 0:
                if self.update_balance(user, method, -fee):
                    notes.append(f"Bags added; {fee} paid.")
                else:
                    notes.append("The balance cannot pay the bag fee.")
            reservation["baggage"] = total
        return " ".join(notes) or "Changed; nothing to pay."

    def cancel_reservation(self, user_id: Any, reservation_id: Any, reason: Any) -> str:
        user = self.users.get(user_id, None)
        if not user:
            return "Unknown user id."
        reservation = next(
            (
                r
                for r in self.reservations
                if r["reservation_id"] == reservation_id and r["user_id"] == user_id
            ),
            None,
        )
        if not reservation:
            return "No such reservation for this user."
        flight = self._flight(reservation["flight_no"])
        if not flight:
            return "The reservation's flight is unknown."
        departure = datetime.strptime(flight["depart_time"], TIME_FORMAT)
        if departure < NOW:
            return "The flight has left; it cannot be cancelled."
        price = (
            flight["economy_price"]
            if reservation["cabin"] == "Economy Class"
            else flight["business_price"]
        )
        if reason == "The airline has canceled the flight.":
            self.process_refund(user, price)
            return f"Cancelled by the airline: {price} refunded in full."
        if departure - NOW > timedelta(days=1):
            self.process_refund(user, price)
            return f"Cancelled more than 24 hours ahead: {price} refunded."
        fee = price * 0.1
        self.process_refund(user, price - fee)
        return f"Cancelled within 24 hours: a fee of {fee} kept, {price - fee} refunded."

    def process_refund(self, user: Any, amount: Any) -> None:
        user["cash_balance"] += amount
        if "user_name" not in user:  # ACEBench's refund names the account: a nameless one fails
            raise KeyError("user_name")

    def calculate_price_difference(self, flight: Any, old_cabin: Any, new_cabin: Any) -> Any:
        prices = {
            "Economy Class": flight["economy_price"],
            "Business Class": flight["business_price"],
        }
        return prices.get(new_cabin, 0) - prices.get(old_cabin, 0)
