"""Children of the preimported fork server: separate processes that see their parent's environment as it was
when each was started, with torch already imported and huggingface_hub not (its constants read the environment)."""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from hwr_tools.preimported import PRELOADED_MODULES, preimported_context

from .support import CHILD_TIMEOUT_S, reaped_children, recv_within

PROBE = "HWR_TEST_PREIMPORTED_PROBE"


def _report_environment(conn: Connection) -> None:
    """Reports what this child found at start, then what huggingface_hub read from its environment."""
    at_start = {name: name in sys.modules for name in ("torch", "host_weight_runtime.diffusion", "huggingface_hub")}
    import huggingface_hub.constants

    conn.send(
        {
            "pid": os.getpid(),
            "probe": os.environ.get(PROBE),
            "gone": os.environ.get("HWR_TEST_PREIMPORTED_GONE"),
            "at_start": at_start,
            "hub_cache": huggingface_hub.constants.HF_HUB_CACHE,
        }
    )
    conn.close()


def _wait_forever(conn: Connection) -> None:
    conn.send("waiting")
    conn.recv()  # never answered: the test kills this process here


def test_a_child_sees_the_environment_its_parent_had_when_it_started_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A variable set (or removed) just before start reaches the child as with spawn, though the fork server
    started earlier with another environment; huggingface_hub is imported in the child, from that environment."""
    context = preimported_context()
    monkeypatch.setenv("HWR_TEST_PREIMPORTED_GONE", "set before the first child")
    for value in ("first", "second"):
        monkeypatch.setenv(PROBE, value)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / f"hub-{value}"))
        parent_conn, child_conn = context.Pipe()
        with reaped_children() as children:
            child = context.Process(target=_report_environment, args=(child_conn,), daemon=True)
            children.append(child)
            child.start()
            child_conn.close()
            report = recv_within(parent_conn)
            child.join(CHILD_TIMEOUT_S)
        assert isinstance(report, dict)
        assert child.exitcode == 0 and report["pid"] not in (os.getpid(), None)
        assert report["probe"] == value
        assert report["gone"] == (None if value == "second" else "set before the first child")
        assert report["hub_cache"] == str(tmp_path / f"hub-{value}")
        assert report["at_start"] == {"torch": True, "host_weight_runtime.diffusion": True, "huggingface_hub": False}
        monkeypatch.delenv("HWR_TEST_PREIMPORTED_GONE", raising=False)
    assert "huggingface_hub" not in PRELOADED_MODULES and "diffusers" not in PRELOADED_MODULES


def test_a_killed_child_is_reported_killed() -> None:
    """Crash tests stay real: SIGKILL ends the child (and only it), and its exit code says so."""
    context = preimported_context()
    parent_conn, child_conn = context.Pipe()
    with reaped_children() as children:
        child = context.Process(target=_wait_forever, args=(child_conn,), daemon=True)
        children.append(child)
        child.start()
        child_conn.close()
        assert recv_within(parent_conn) == "waiting"
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
