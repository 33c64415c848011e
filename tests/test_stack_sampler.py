"""The stack sampler behind ``KOSMOS_SAMPLE_STACKS`` (tests/stack_sampler.py) shows where a
thread was held and when the fused launches were logged."""

import logging
import threading
import time

from stack_sampler import StackSampler, sample_file


def held_in_a_slow_call(seconds):
    time.sleep(seconds)


def test_sampler_shows_where_a_thread_was_held_and_the_launch_log(tmp_path):
    path = tmp_path / "samples.txt"
    with StackSampler(path):
        worker = threading.Thread(target=held_in_a_slow_call, args=(0.3,), name="rank-1-host")
        worker.start()
        logging.getLogger("kosmos_moe.fused").debug("launch forward rank 0 tokens 5")
        worker.join()
    lines = path.read_text().splitlines()
    held = [line for line in lines if "[rank-1-host]" in line and "held_in_a_slow_call" in line]
    assert held, lines
    assert any("[log MainThread] launch forward rank 0 tokens 5" in line for line in lines), lines
    # The logger is left as it was: no handler of the sampler stays attached.
    assert not any(h.__class__ is logging.Handler for h in logging.getLogger("kosmos_moe.fused").handlers)


def test_sample_files_of_different_tests_never_collide(tmp_path):
    ids = ["t.py::test_x[a/b]", "t.py::test_x[a_b]", "t.py::test_y[" + "z" * 400 + "]"]
    names = [sample_file(str(tmp_path), i) for i in ids]
    assert len(set(names)) == 3 and all(len(n.name) < 200 for n in names)
