"""engine/one_thread.py: the worker runs torch on one thread; the caller's count and the count threads started later
get (torch's process default) stay as they were."""

import threading

import pytest
import torch

from sglang_tiered.engine.one_thread import one_thread_pool


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _count_on_a_new_thread() -> int:
    out: list[int] = []
    worker = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    return out[0]


def test_the_worker_runs_on_one_thread_and_the_default_stays(two_threads):
    with one_thread_pool("test-one") as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        assert _count_on_a_new_thread() == 2  # torch.set_num_threads(1) alone on the worker would make this 1
        assert pool.submit(torch.get_num_threads).result() == 1  # the caller's re-set did not reach the worker


def test_a_bare_set_on_a_worker_does_change_the_default(two_threads):
    """The hazard one_thread_pool exists for (if torch stops sharing the count, the helper's re-set is moot)."""
    worker = threading.Thread(target=torch.set_num_threads, args=(1,))
    worker.start()
    worker.join()
    assert _count_on_a_new_thread() == 1


def test_every_worker_of_a_wider_pool_runs_on_one_thread(two_threads):
    with one_thread_pool("test-two", workers=2) as pool:
        gate = threading.Barrier(2)  # both tasks at once: they run on the two workers

        def count() -> tuple[str, int]:
            gate.wait(timeout=5)
            return threading.current_thread().name, torch.get_num_threads()

        seen = dict(job.result() for job in [pool.submit(count) for _ in range(2)])
        assert len(seen) == 2 and set(seen.values()) == {1}
        assert torch.get_num_threads() == 2 and _count_on_a_new_thread() == 2
