import pytest

from harness.registry import Registry, unknown_name_message


def test_registry_returns_what_was_registered_in_order():
    reg: Registry[type] = Registry("thing.name")

    @reg.register("beta")
    class Beta: ...

    @reg.register("alpha")
    class Alpha: ...

    assert reg.get("beta") is Beta and reg.get("alpha") is Alpha
    assert reg.names() == ["beta", "alpha"] and "alpha" in reg and "gamma" not in reg


def test_unknown_name_is_one_line_with_key_hint_and_allowed():
    reg: Registry[int] = Registry("policy.name")
    reg.register("entropy")(1)
    reg.register("uniform")(2)
    with pytest.raises(ValueError) as err:
        reg.get("entropi")
    message = str(err.value)
    assert "\n" not in message
    assert message == "policy.name: unknown 'entropi' (did you mean entropy?); allowed: entropy, uniform"


def test_registering_a_name_twice_fails():
    reg: Registry[int] = Registry("k")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(2)


def test_message_without_close_match_has_no_hint():
    assert unknown_name_message("k", "zzz", ["alpha"]) == "k: unknown 'zzz'; allowed: alpha"
