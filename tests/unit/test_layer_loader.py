"""LayerLoader's contracts (engine/layer_loader.py): layers in order, one ahead, errors re-raised by their layer's
`get`, and the loader thread's torch ops on one OpenMP thread."""

import threading

import pytest
import torch

from sglang_tiered.engine.layer_loader import LayerLoader


@pytest.mark.parametrize("overlap", [True, False])
def test_layers_come_in_order_from_first(overlap):
    with LayerLoader(lambda layer: layer * 10, 4, first=1, overlap=overlap) as loads:
        assert [loads.get(layer) for layer in (1, 2, 3)] == [10, 20, 30]


def test_a_layer_out_of_order_is_refused():
    with LayerLoader(lambda layer: layer, 3) as loads:
        loads.get(0)
        with pytest.raises(ValueError, match="expected 1"):
            loads.get(2)


def test_the_fetch_runs_one_layer_ahead_on_the_loader_thread():
    fetched: list[tuple[int, str]] = []
    second_fetched = threading.Event()

    def fetch(layer: int) -> int:
        fetched.append((layer, threading.current_thread().name))
        if layer == 2:
            second_fetched.set()
        return layer

    with LayerLoader(fetch, 5, name="test-load") as loads:
        loads.get(0)
        loads.get(1)  # hands out 1 and submits 2
        assert second_fetched.wait(5)
        assert [x[0] for x in fetched] == [0, 1, 2]
    assert all(name.startswith("test-load") for _, name in fetched)


def test_an_error_of_the_fetch_is_raised_by_its_layer():
    def fetch(layer: int) -> int:
        if layer == 1:
            raise OSError("page unreadable")
        return layer

    with LayerLoader(fetch, 3) as loads:
        assert loads.get(0) == 0
        with pytest.raises(OSError, match="page unreadable"):
            loads.get(1)


def test_the_loader_thread_runs_torch_on_one_thread_and_leaves_the_callers():
    before = torch.get_num_threads()
    with LayerLoader(lambda layer: torch.get_num_threads(), 2) as loads:
        assert [loads.get(0), loads.get(1)] == [1, 1]
    assert torch.get_num_threads() == before


def test_threads_started_after_a_loader_keep_the_callers_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with LayerLoader(lambda layer: layer, 2) as loads:
            loads.get(0)
        out: list[int] = []
        later = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert out == [2]
    finally:
        torch.set_num_threads(before)
