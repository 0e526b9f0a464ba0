"""runtime.deadline.Worker: calls in order on one daemon thread, each within a wall-clock deadline."""
import sys
import threading
import time

import pytest

from basetrainer.runtime.deadline import CallFailed, DeadlineExceeded, Worker


@pytest.fixture
def forever():
    """An event the stuck calls wait on; set at the end, so that no thread outlives the test."""
    event = threading.Event()
    yield event
    event.set()


def test_calls_run_in_order_on_one_daemon_thread_and_answer():
    worker = Worker("w", deadline=5)
    seen = []
    for i in range(5):
        worker.post(f"post {i}", lambda i=i: seen.append((i, threading.current_thread().name)))
    assert worker.call("answer", lambda: 6 * 7) == 42
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4] and {name for _, name in seen} == {"w"}
    with pytest.raises(ZeroDivisionError):   # a call's own error reaches its caller
        worker.call("divide", lambda: 1 / 0)
    assert worker.call("after", lambda: "still taken") == "still taken"
    thread = [t for t in threading.enumerate() if t.name == "w"][0]
    assert thread.daemon
    worker.close()
    thread.join(5)
    assert not thread.is_alive()


def test_a_call_past_the_deadline_is_given_up_once_and_the_worker_takes_no_more(forever):
    worker = Worker("w", deadline=0.5)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"starting did not return within 0.5 s") as e:
        worker.call("starting", forever.wait)
    waited = time.monotonic() - started
    assert 0.5 <= waited < 0.5 + 1.0 and e.value.what == "starting" and e.value.deadline == 0.5
    ran = []
    with pytest.raises(DeadlineExceeded):
        worker.post("later", lambda: ran.append(1))
    with pytest.raises(DeadlineExceeded):
        worker.call("later", lambda: ran.append(1))
    forever.set()             # the stuck call returns at last: nothing queued runs after it
    time.sleep(0.2)
    assert ran == []


def test_a_posted_call_that_overruns_is_raised_to_the_next_caller_naming_it(forever):
    worker = Worker("w", deadline=0.5)
    worker.post("logging epoch 1", forever.wait)      # returns at once
    worker.post("logging epoch 2", lambda: None)      # queued behind it
    time.sleep(0.7)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="logging epoch 1 did not return within 0.5 s"):
        worker.post("logging epoch 3", lambda: None)
    assert time.monotonic() - started < 0.1           # it had overrun already: no wait


def test_a_call_behind_a_stuck_post_waits_at_most_the_rest_of_its_deadline(forever):
    worker = Worker("w", deadline=1.0)
    worker.post("logging epoch 1", forever.wait)
    time.sleep(0.4)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="logging epoch 1"):
        worker.call("ending the run", lambda: None)
    assert 0.4 <= time.monotonic() - started < 0.6 + 0.5


def test_a_failed_post_is_raised_once_as_callfailed_and_what_follows_is_dropped():
    worker = Worker("w", deadline=5)
    ran, gate = [], threading.Event()
    worker.post("gate", gate.wait)                    # both posts queue behind it
    worker.post("logging epoch 0", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    worker.post("logging epoch 1", lambda: ran.append(1))
    gate.set()
    with pytest.raises(CallFailed, match=r"logging epoch 0 failed \(OSError: \[Errno 28\] No space") as e:
        worker.call("ending the run", lambda: ran.append(2))
    assert isinstance(e.value.error, OSError) and e.value.__cause__ is e.value.error
    assert ran == []


def test_a_full_queue_waits_for_room_and_a_stuck_call_bounds_the_wait(forever):
    worker = Worker("w", deadline=0.5, capacity=2)
    worker.post("stuck", forever.wait)
    time.sleep(0.1)                                   # running: the queue is empty again
    worker.post("a", lambda: None)
    worker.post("b", lambda: None)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="stuck"):
        worker.post("c", lambda: None)                # no room until the stuck call's deadline
    assert 0.3 <= time.monotonic() - started < 0.4 + 0.5


def test_a_library_exit_in_a_call_is_its_error_not_the_callers_exit():
    worker = Worker("w", deadline=5)
    with pytest.raises(RuntimeError, match="SystemExit: 3"):
        worker.call("start", lambda: sys.exit(3))


def test_closing_an_idle_worker_ends_its_thread_before_close_returns():
    """No thread may be ending when the program next forks (a DataLoader starting its workers):
    on CPython < 3.11.10 the child can inherit a lock the ending thread holds (gh-112275)."""
    for _ in range(20):
        worker = Worker("idle", deadline=5)
        assert worker.call("a quick call", lambda: 7) == 7
        worker.close()
        assert not [t for t in threading.enumerate() if t.name == "idle"]
