"""ACEBench's phone platform: a device (wifi, login), messages, reminders, food delivery.

Written from ACEBench's specification (its ``phone_platform`` scenario): the same classes, public
methods (the tools; a call reaches every involved instance that has the method, so
``turn_on_wifi`` switches the wifi of each), state attributes, initial data and state
transitions, including where they are surprising, because ACEBench's ground-truth end states were
produced by them:

* every class reads only ``wifi`` and ``logged_in`` (and ``FoodPlatform`` its
  ``logged_in_users``) from a task's ``initial_config``, first from its own section and then from
  ``BaseApi``'s, which wins (an absent key means wifi off, logged in, nobody on the platform);
* the inbox starts full (6 of 6 messages), a sent message has no ``time``, and asking for the
  latest or earliest message after one was sent fails on that missing time;
* ``ReminderApi`` starts its ids at 4 (three reminders exist), and ``view_all_reminders`` and
  ``search_messages`` need no login;
* an order is refused when the user is not logged in to the platform, a product is unknown, a
  quantity is not a positive integer or the balance is short; otherwise the balance is debited.

Results are the dicts ACEBench returns (``status`` and ``message``, or the data asked for); the
wording of the messages is this project's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

Result = dict[str, Any]

PHONE_USERS = {
    "Eve": {"user_id": "USR100", "phone_number": "123-456-7890", "occupation": "Software Engineer"},
    "Frank": {"user_id": "USR101", "phone_number": "234-567-8901", "occupation": "Data Scientist"},
    "Grace": {"user_id": "USR102", "phone_number": "345-678-9012", "occupation": "Product Manager"},
    "Helen": {"user_id": "USR103", "phone_number": "456-789-0123", "occupation": "UX Designer"},
    "Isaac": {"user_id": "USR104", "phone_number": "567-890-1234", "occupation": "DevOps Engineer"},
    "Jack": {
        "user_id": "USR105",
        "phone_number": "678-901-2345",
        "occupation": "Marketing Specialist",
    },
}
INBOX = {
    1: (
        "USR100",
        "USR101",
        "Hey Frank, don't forget about our meeting on 2024-06-11 at 4 PM in Conference Room 1.",
        "2024-06-09",
    ),
    2: (
        "USR101",
        "USR102",
        'Can you help me order a "Margherita Pizza" delivery? The merchant is Domino\'s.',
        "2024-03-09",
    ),
    3: (
        "USR102",
        "USR103",
        "Please check the milk tea delivery options available from Heytea and purchase a cheaper "
        'milk tea for me. After making the purchase, remember to reply to me with "Already '
        'bought."',
        "2023-12-05",
    ),
    4: ("USR103", "USR102", "No problem Helen, I can assist you.", "2024-09-09"),
    5: ("USR104", "USR105", "Isaac, are you available for a call?", "2024-06-06"),
    6: ("USR105", "USR104", "Yes Jack, let's do it in 30 minutes.", "2024-01-15"),
}
REMINDERS = {
    1: (1001, "Doctor's Appointment", "Visit Dr. Smith for a checkup.", "2024-07-15 09:30"),
    2: (1002, "Team Meeting", "Monthly project review with the team.", "2024-07-17 11:00"),
    3: (
        1003,
        "To-do list",
        'First, help Frank place a food delivery order at "Hema Fresh," ordering two "Fresh Gift '
        'Packs." Then, send a message to Frank saying, "The price of the purchased goods is () '
        'yuan." Replace the parentheses with the actual amount, keeping one decimal place.',
        "2024-07-16 11:00",
    ),
}
FOOD_USERS = {
    "Eve": ("U100", "password123", 500.0),
    "Frank": ("U101", "password456", 300.0),
    "Grace": ("U102", "password789", 150.0),
    "Helen": ("U103", "password321", 800.0),
    "Isaac": ("U104", "password654", 400.0),
    "Jack": ("U105", "password654", 120.0),
}
MERCHANTS = {
    "Domino's": ("M100", "Pizza", [("Margherita Pizza", 68.0), ("Super Supreme Pizza", 88.0)]),
    "Rice Village Bibimbap": (
        "M101",
        "Bibimbap",
        [("Stone Pot Bibimbap", 35.0), ("Korean Beef Bibimbap", 45.0)],
    ),
    "Haidilao": ("M102", "Hotpot", [("Beef Rolls", 68.0), ("Seafood Platter", 88.0)]),
    "Heytea": (
        "M103",
        "Milk Tea",
        [("Cheese Milk Tea", 25.0), ("Four Seasons Spring Milk Tea", 22.0)],
    ),
    "Hema Fresh": (
        "M104",
        "Fresh Grocery",
        [("Organic Vegetable Pack", 15.0), ("Fresh Gift Pack", 99.0)],
    ),
    "Jiutian BBQ": ("M105", "BBQ", [("Korean Grilled Beef", 128.0), ("Grilled Pork Belly", 78.0)]),
}
CAPACITY = 6
"""Messages an inbox holds, and reminders a list holds."""


def _fail(message: str) -> Result:
    return {"status": False, "message": message}


def _ok(message: str) -> Result:
    return {"status": True, "message": message}


class BaseApi:
    """The device: wifi (off) and login (on)."""

    def __init__(self) -> None:
        self.wifi = False
        self.logged_in = True

    def _apply_config(self, config: dict[str, Any]) -> None:
        """Read a task's ``initial_config`` section (only these keys, as ACEBench)."""
        self.wifi = config.get("wifi", False)
        self.logged_in = config.get("logged_in", True)

    def turn_on_wifi(self) -> Result:
        self.wifi = True
        return _ok("Wi-Fi is on")

    def login_device(self) -> Result:
        self.logged_in = True
        return _ok("the device is logged in")


class MessageApi(BaseApi):
    """Text messages between six users; the inbox holds at most six."""

    def __init__(self) -> None:
        super().__init__()
        self.max_capacity = CAPACITY
        self.user_list = {name: dict(info) for name, info in PHONE_USERS.items()}
        self.inbox = {
            i: {"sender_id": s, "receiver_id": r, "message": m, "time": t}
            for i, (s, r, m, t) in INBOX.items()
        }
        self.message_id_counter = len(INBOX)

    def send_message(self, sender_name: str, receiver_name: str, message: str) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: no message can be sent")
        if not self.wifi:
            return _fail("Wi-Fi is off: no message can be sent")
        if len(self.inbox) >= self.max_capacity:
            return _fail("the inbox is full; ask the user which message to delete")
        if sender_name not in self.user_list or receiver_name not in self.user_list:
            return _fail("the sender or the receiver does not exist")
        self.message_id_counter += 1
        self.inbox[self.message_id_counter] = {
            "sender_id": self.user_list[sender_name]["user_id"],
            "receiver_id": self.user_list[receiver_name]["user_id"],
            "message": message,
        }
        return _ok(f"message sent to {receiver_name}")

    def delete_message(self, message_id: int) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: no message can be deleted")
        if message_id not in self.inbox:
            return _fail("no message has this id")
        del self.inbox[message_id]
        return _ok(f"message {message_id} deleted")

    def view_messages_between_users(self, sender_name: str, receiver_name: str) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: messages cannot be viewed")
        if sender_name not in self.user_list:
            return _fail("the sender does not exist")
        if receiver_name not in self.user_list:
            return _fail("the receiver does not exist")
        sender = self.user_list[sender_name]["user_id"]
        receiver = self.user_list[receiver_name]["user_id"]
        found = [
            {"id": i, "sender": sender_name, "receiver": receiver_name, "message": m["message"]}
            for i, m in self.inbox.items()
            if m["sender_id"] == sender and m["receiver_id"] == receiver
        ]
        if not found:
            return _fail("no message between them")
        return {"status": True, "messages": found}

    def search_messages(self, user_name: str, keyword: str) -> Result:
        if user_name not in self.user_list:
            return _fail("the user does not exist")
        uid = self.user_list[user_name]["user_id"]
        found = [
            {
                "id": i,
                "sender_id": m["sender_id"],
                "receiver_id": m["receiver_id"],
                "message": m["message"],
            }
            for i, m in self.inbox.items()
            if uid in (m["sender_id"], m["receiver_id"]) and keyword.lower() in m["message"].lower()
        ]
        if not found:
            return _fail("no message contains the keyword")
        return {"status": True, "messages": found}

    def get_all_message_times_with_ids(self) -> dict[Any, Any]:
        if not self.logged_in:
            return _fail("the device is not logged in: message times cannot be read")
        return {i: m["time"] for i, m in self.inbox.items()}

    def _dated(self, latest: bool) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: message ids cannot be read")
        if not self.inbox:
            return _fail("there are no messages")
        best_id, best_time = None, None
        for i, m in self.inbox.items():
            when = datetime.strptime(m["time"], "%Y-%m-%d")
            if best_time is None or (when > best_time if latest else when < best_time):
                best_id, best_time = i, when
        which = "latest" if latest else "earliest"
        return {
            "status": True,
            "message": f"the {which} message is {best_id}",
            "message_id": best_id,
        }

    def get_latest_message_id(self) -> Result:
        return self._dated(latest=True)

    def get_earliest_message_id(self) -> Result:
        return self._dated(latest=False)


class ReminderApi(BaseApi):
    """Reminders (at most six); its device flags come only from the task's config."""

    def __init__(self) -> None:
        # No BaseApi.__init__, as in ACEBench: wifi and logged_in exist once the config is read.
        self.max_capacity = CAPACITY
        self.reminder_list = {
            i: {
                "reminder_id": rid,
                "title": title,
                "description": desc,
                "time": t,
                "notified": False,
            }
            for i, (rid, title, desc, t) in REMINDERS.items()
        }
        self.reminder_id_counter = len(REMINDERS)

    def view_reminder_by_title(self, title: str) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: reminders cannot be viewed")
        for reminder in self.reminder_list.values():
            if reminder["title"] == title:
                return {"status": True, "reminder": reminder}
        return _fail(f"no reminder titled '{title}'")

    def add_reminder(self, title: str, description: str, time: Any) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: no reminder can be added")
        if len(self.reminder_list) >= self.max_capacity:
            return _fail("the reminder list is full")
        self.reminder_id_counter += 1
        rid = self.reminder_id_counter
        self.reminder_list[rid] = {
            "reminder_id": rid,
            "title": title,
            "description": description,
            "time": time,
            "notified": False,
        }
        return _ok(f"reminder '{title}' added")

    def delete_reminder(self, reminder_id: int) -> Result:
        if not self.logged_in:
            return _fail("the device is not logged in: no reminder can be deleted")
        if reminder_id not in self.reminder_list:
            return _fail("no reminder has this id")
        del self.reminder_list[reminder_id]
        return _ok(f"reminder {reminder_id} deleted")

    def view_all_reminders(self) -> Result:
        if not self.reminder_list:
            return _fail("there are no reminders")
        keys = ("title", "description", "time", "notified")
        return {
            "status": True,
            "reminders": [{k: r[k] for k in keys} for r in self.reminder_list.values()],
        }


class FoodPlatform(BaseApi):
    """A food-delivery platform: accounts with balances, merchants and their menus, orders."""

    def __init__(self) -> None:
        super().__init__()
        self.users = {
            name: {"user_id": uid, "password": pw, "balance": balance}
            for name, (uid, pw, balance) in FOOD_USERS.items()
        }
        self.merchant_list = {
            name: {
                "merchant_id": mid,
                "service_type": kind,
                "menu": [{"product": p, "price": price} for p, price in menu],
            }
            for name, (mid, kind, menu) in MERCHANTS.items()
        }
        self.logged_in_users: list[str] = []
        self.orders: list[dict[str, Any]] = []

    def _apply_config(self, config: dict[str, Any]) -> None:
        super()._apply_config(config)
        self.logged_in_users = config.get("logged_in_users", [])

    def login_food_platform(self, username: str, password: str) -> Result:
        if not self.wifi:
            return _fail("Wi-Fi is off: cannot log in")
        if username not in self.users:
            return _fail("the user does not exist")
        if self.users[username]["password"] != password:
            return _fail("wrong password")
        if username in self.logged_in_users:
            return _fail(f"{username} is already logged in")
        self.logged_in_users.append(username)
        return _ok(f"{username} is logged in")

    def view_logged_in_users(self) -> Result:
        if not self.logged_in_users:
            return _fail("nobody is logged in to the platform")
        return {"status": True, "logged_in_users": self.logged_in_users}

    def check_balance(self, user_name: str) -> float:
        if user_name in self.users:
            return self.users[user_name]["balance"]
        return 0.0

    def add_food_delivery_order(
        self, username: str, merchant_name: str, items: list[dict[str, Any]]
    ) -> Result:
        if username not in self.logged_in_users:
            return _fail(f"{username} is not logged in to the platform")
        if merchant_name not in self.merchant_list:
            return _fail("the merchant does not exist")
        total, lines = 0.0, []
        for item in items:
            product, quantity = item.get("product"), item.get("quantity", 1)
            if not isinstance(quantity, int) or quantity <= 0:
                return _fail(f"invalid quantity {quantity} for {product}")
            price = next(
                (
                    p["price"]
                    for p in self.merchant_list[merchant_name]["menu"]
                    if p["product"] == product
                ),
                None,
            )
            if price is None:
                return _fail(f"{product} is not on {merchant_name}'s menu")
            total += price * quantity
            lines.append({"product": product, "quantity": quantity, "price_per_unit": price})
        if total > self.users[username]["balance"]:
            return _fail("insufficient balance")
        self.users[username]["balance"] -= total
        self.orders.append(
            {
                "user_name": username,
                "merchant_name": merchant_name,
                "items": lines,
                "total_price": total,
            }
        )
        return _ok(f"order placed with {merchant_name}; total {total} yuan")

    def get_products(self, merchant_name: str) -> Any:
        merchant = self.merchant_list.get(merchant_name)
        if merchant:
            return merchant["menu"]
        return _fail(f"no merchant named '{merchant_name}'")

    def view_orders(self, user_name: str) -> Result:
        mine = [o for o in self.orders if o["user_name"] == user_name]
        if not mine:
            return _fail("the user has no orders")
        return {"status": True, "orders": mine}

    def search_orders(self, keyword: str) -> Result:
        k = keyword.lower()
        found = [
            o
            for o in self.orders
            if k in o["merchant_name"].lower()
            or any(k in line["product"].lower() for line in o.get("items", []))
        ]
        if not found:
            return _fail("no order matches")
        return {"status": True, "orders": found}
