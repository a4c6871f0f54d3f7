"""worker_hook/settings.py: every variable the hook reads, with its default and parser, in one
table; each value is parsed when it is asked for (the docs' table: test_docs_tables.py)."""

from __future__ import annotations

import pytest

from vllm_hidden_state_proxy import protocol
from vllm_hidden_state_proxy.protocol import (
    ARENA_MIB_ENV,
    DEFAULT_RING_DIR,
    DEVICE_MIB_ENV,
    HOOK_ENABLED_ENV,
    LAYERS_ENV,
    MAX_RECORD_MIB_ENV,
    RING_DIR_ENV,
    RING_DIR_MODE_ENV,
    RING_LOCK_TIMEOUT_ENV,
    RING_SLOTS_ENV,
)
from vllm_hidden_state_proxy.worker_hook.settings import (
    HOOK_VARIABLES,
    RING_SLOTS,
    HookSettings,
    environment_table,
)


def test_the_defaults() -> None:
    settings = HookSettings({})
    assert settings.ring_dir == DEFAULT_RING_DIR
    assert settings.layers is None
    assert settings.ring_slots == RING_SLOTS.default == 1024
    assert settings.ring_modes == (0o700, 0o600)
    assert settings.ring_lock_timeout == 30.0
    assert settings.hook_mode == "auto"


def test_empty_values_are_the_defaults() -> None:
    empty = {variable.env: "" for variable in HOOK_VARIABLES if variable.env}
    settings = HookSettings(empty)
    assert (settings.ring_dir, settings.layers, settings.ring_slots) == (
        DEFAULT_RING_DIR,
        None,
        1024,
    )
    assert (settings.ring_modes, settings.ring_lock_timeout, settings.hook_mode) == (
        (0o700, 0o600),
        30.0,
        "auto",
    )


def test_set_values() -> None:
    settings = HookSettings(
        {
            RING_DIR_ENV: "/rings",
            LAYERS_ENV: "4, 8,-1",
            RING_SLOTS_ENV: "8",
            RING_DIR_MODE_ENV: "0750",
            RING_LOCK_TIMEOUT_ENV: "0.5",
            HOOK_ENABLED_ENV: "1",
        }
    )
    assert (settings.ring_dir, settings.layers, settings.ring_slots) == ("/rings", "4, 8,-1", 8)
    assert settings.ring_modes == (0o750, 0o640)
    assert (settings.ring_lock_timeout, settings.hook_mode) == (0.5, "on")


def test_this_process_environment_as_it_is_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = HookSettings()
    monkeypatch.setenv(RING_SLOTS_ENV, "16")
    assert settings.ring_slots == 16
    monkeypatch.delenv(RING_SLOTS_ENV)
    assert settings.ring_slots == 1024


@pytest.mark.parametrize(
    ("raw", "modes"),
    [
        ("0750", (0o750, 0o640)),
        ("0770", (0o770, 0o640)),  # files are never group-writable: the proxy refuses those
        ("0777", (0o770, 0o640)),  # nothing for others
    ],
)
def test_ring_modes(raw: str, modes: tuple[int, int]) -> None:
    assert HookSettings({RING_DIR_MODE_ENV: raw}).ring_modes == modes


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, "auto"),
        ("", "auto"),
        ("auto", "auto"),
        ("0", "off"),
        (" OFF ", "off"),
        ("false", "off"),
        ("no", "off"),
        ("1", "on"),
        ("On", "on"),
        ("true", "on"),
        ("yes", "on"),
        ("maybe", "auto"),  # an unknown word changes nothing
        ("  ", "auto"),
    ],
)
def test_hook_mode(value: str | None, mode: str) -> None:
    environ = {} if value is None else {HOOK_ENABLED_ENV: value}
    assert HookSettings(environ).hook_mode == mode


def test_a_malformed_value_fails_when_it_is_asked_for_and_names_its_variable() -> None:
    settings = HookSettings(
        {RING_DIR_MODE_ENV: "rw", RING_LOCK_TIMEOUT_ENV: "soon", RING_SLOTS_ENV: "many"}
    )
    assert settings.ring_dir == DEFAULT_RING_DIR  # the others still read
    with pytest.raises(ValueError, match=f"{RING_DIR_MODE_ENV}='rw' is not an octal mode"):
        _ = settings.ring_modes
    with pytest.raises(ValueError, match=f"{RING_LOCK_TIMEOUT_ENV}='soon' is not a number"):
        _ = settings.ring_lock_timeout
    with pytest.raises(ValueError, match="invalid literal for int"):
        _ = settings.ring_slots


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "-inf"])
def test_a_lock_timeout_must_be_finite_and_not_negative(raw: str) -> None:
    with pytest.raises(ValueError, match=RING_LOCK_TIMEOUT_ENV):
        _ = HookSettings({RING_LOCK_TIMEOUT_ENV: raw}).ring_lock_timeout
    assert HookSettings({RING_LOCK_TIMEOUT_ENV: "0"}).ring_lock_timeout == 0.0


@pytest.mark.parametrize("variable", [ARENA_MIB_ENV, MAX_RECORD_MIB_ENV])
def test_sizes_in_mib_are_integers_and_name_their_variable(variable: str) -> None:
    assert HookSettings({variable: "3"}).arena_bytes in (3 << 20, 256 << 20)
    settings = HookSettings({ARENA_MIB_ENV: "0", MAX_RECORD_MIB_ENV: "7"})
    assert (settings.arena_bytes, settings.max_record_bytes) == (0, 7 << 20)
    assert (HookSettings({}).arena_bytes, HookSettings({}).max_record_bytes) == (
        256 << 20,
        64 << 20,
    )
    for raw in ("-1", "1.5", "lots", str((1 << 20) + 1)):
        with pytest.raises(ValueError, match=variable):
            settings = HookSettings({variable: raw})
            _ = settings.arena_bytes if variable == ARENA_MIB_ENV else settings.max_record_bytes


def test_the_device_limit_is_in_mib_with_a_default_and_names_its_variable() -> None:
    assert HookSettings({}).device_bytes == 512 << 20
    assert HookSettings({DEVICE_MIB_ENV: "3"}).device_bytes == 3 << 20
    with pytest.raises(ValueError, match=DEVICE_MIB_ENV):
        _ = HookSettings({DEVICE_MIB_ENV: "lots"}).device_bytes


def test_the_table_names_every_hook_variable_of_the_protocol_once() -> None:
    names = [variable.env for variable in HOOK_VARIABLES]
    hook_names = {
        RING_DIR_ENV,
        LAYERS_ENV,
        RING_SLOTS_ENV,
        ARENA_MIB_ENV,
        MAX_RECORD_MIB_ENV,
        DEVICE_MIB_ENV,
        RING_DIR_MODE_ENV,
        RING_LOCK_TIMEOUT_ENV,
        HOOK_ENABLED_ENV,
    }
    assert len(names) == len(set(names)) and set(names) == hook_names
    assert all(variable.help and variable.flag is None for variable in HOOK_VARIABLES)
    assert all(name.startswith("HIDDEN_STATE_PROXY_") for name in hook_names)
    assert all(name in vars(protocol).values() for name in hook_names)


def test_the_environment_table_has_a_row_per_variable_and_vllms_own() -> None:
    lines = environment_table().splitlines()
    assert lines[:2] == ["| variable | default | meaning |", "|---|---|---|"]
    assert len(lines) == 2 + len(HOOK_VARIABLES) + 1
    assert lines[-1].startswith("| `VLLM_PLUGINS` | (all plugins) |")
    assert f"| `{RING_DIR_ENV}` | `{DEFAULT_RING_DIR}` |" in lines[2]
