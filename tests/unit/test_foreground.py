"""ForegroundGate: background writers wait while foreground work runs, at most max_wait_s, and not at all when the
gate is off. No SGLang."""

from __future__ import annotations

import threading
import time

from sglang_tiered.storage.foreground import ForegroundGate


def hold(gate: ForegroundGate, seconds: float, started: threading.Event) -> threading.Thread:
    def run():
        with gate.busy():
            started.set()
            time.sleep(seconds)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_writer_waits_for_the_forward_to_end():
    gate = ForegroundGate(enabled=True, max_wait_s=5.0)
    started = threading.Event()
    t = hold(gate, 0.3, started)
    started.wait()
    waited = gate.wait_idle()
    t.join()
    assert 0.2 <= waited < 1.0 and gate.waited_s == waited


def test_wait_is_bounded_and_idle_or_disabled_gates_do_not_wait():
    gate = ForegroundGate(enabled=True, max_wait_s=0.1)
    started = threading.Event()
    t = hold(gate, 0.5, started)
    started.wait()
    assert 0.08 <= gate.wait_idle() < 0.3  # delayed, never starved
    gate.enabled = False
    assert gate.wait_idle() == 0.0
    t.join()
    gate.enabled = True
    assert gate.wait_idle() < 0.01  # nothing running
