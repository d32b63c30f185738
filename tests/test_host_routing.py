"""Per-thread routing of methods and module functions (hostreduce.host.patch)."""
from __future__ import annotations

import threading
import types

from hostreduce.host.patch import routed


class Base:
    def name(self, x: int) -> str:
        return f"base {x}"


class Child(Base):
    pass


def test_routes_only_inside_the_block_and_on_its_thread() -> None:
    seen_elsewhere = []
    with routed(Base, "name", lambda original, self, x: "routed " + original(self, x)):
        assert Child().name(1) == "routed base 1"
        with routed(Base, "name", lambda original, self, x: "inner"):
            assert Child().name(2) == "inner"
        assert Child().name(3) == "routed base 3"
        thread = threading.Thread(target=lambda: seen_elsewhere.append(Child().name(4)))
        thread.start()
        thread.join(30)
        assert not thread.is_alive()
    assert seen_elsewhere == ["base 4"]
    assert "name" not in vars(Child) and Base.name(Base(), 5) == "base 5"
    assert Base.__dict__["name"].__qualname__ == "Base.name"  # the original is back


def test_routes_module_functions() -> None:
    module = types.ModuleType("fake")
    module.double = lambda x: 2 * x
    original = module.double
    with routed(module, "double", lambda orig, x: orig(x) + 1):
        assert module.double(3) == 7
    assert module.double is original and module.double(3) == 6
