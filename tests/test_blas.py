"""The BLAS thread budget spent across columns (repsim.blas): set, shared and restored."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

from repsim.blas import blas_thread_split
from repsim.kernels.hsic import batch_hsic
from repsim.kernels.minibatch_cka import MinibatchCKA


def blas_threads() -> int:
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    if not libs:
        pytest.skip("no BLAS library under threadpoolctl's control")
    return max(lib.num_threads for lib in libs)


def test_split_hands_out_the_budget_and_restores_it():
    with threadpool_limits(limits=3, user_api="blas"):
        if blas_threads() != 3:
            pytest.skip("this BLAS does not take a thread count")
        with blas_thread_split() as k:
            assert k == 3 and blas_threads() == 1
            with blas_thread_split() as k2:  # nested: the same budget, still one BLAS thread
                assert k2 == 3 and blas_threads() == 1
            assert blas_threads() == 1
        assert blas_threads() == 3


def test_concurrent_users_share_one_setting():
    """Two threads inside splits at once see the process's count (2) and BLAS at 1 thread while they are
    inside; the count comes back when the last leaves — also when the last to leave is not the thread
    that set one thread and that thread is still alive (threadpoolctl >= 3.8 drops OpenBLAS settings
    from any thread but the one in control; this once left BLAS at one thread for good, in 1 run of
    10). In a process started at 2 BLAS threads: the suite runs at its pinned count, and a limit set
    from the main thread would hold the pool there."""
    import os
    import subprocess
    import sys

    code = """
import threading
from threadpoolctl import ThreadpoolController
import numpy
from repsim.blas import blas_thread_split

def blas_threads():
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    return max(lib.num_threads for lib in libs) if libs else 0

before = blas_threads()
if before != 2:
    print("skip", before); raise SystemExit
inside = threading.Barrier(3)
leave = [threading.Event(), threading.Event()]
left, end = [threading.Event(), threading.Event()], threading.Event()
seen = []

def user(i):
    with blas_thread_split() as k:
        seen.append(k)
        inside.wait(timeout=60)
        leave[i].wait(timeout=60)
    left[i].set()
    end.wait(timeout=60)  # alive after leaving, until the main thread has looked

threads = [threading.Thread(target=user, args=(i,)) for i in range(2)]
threads[0].start()
while not seen:  # the first user is the one that sets one thread
    threading.Event().wait(0.001)
threads[1].start()
try:
    inside.wait(timeout=60)  # both inside: one BLAS thread
    during = blas_threads()
    leave[0].set(); left[0].wait(timeout=60)  # the one that set it leaves first ...
    middle = blas_threads()
    leave[1].set(); left[1].wait(timeout=60)  # ... and the other restores
    after = blas_threads()
finally:
    for e in (*leave, end):
        e.set()
    for t in threads:
        t.join()
print(before, during, *seen, middle, after, blas_threads())
"""
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", MKL_NUM_THREADS="2")
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        if out.stdout.startswith("skip"):
            pytest.skip(f"this BLAS does not take a thread count from the environment ({out.stdout.strip()})")
        # before, during (one thread), each user's k, after the first left (still one), after the
        # last left (restored, while the first is alive), after both ended
        assert out.stdout.split() == ["2", "1", "2", "2", "1", "2", "2"], out.stdout + out.stderr[-2000:]


def test_no_split_while_another_thread_controls_blas():
    """While another thread holds a BLAS limit of 2, a split in this thread never gives k threads of
    k-threaded BLAS: either the split's one-thread setting takes (k = 2 threads of 1-threaded BLAS)
    or it does not (some OpenBLAS builds let one thread at a time resize the shared pool) and the
    split is 1, sequential. Which of the two depends on the BLAS build and on what else loaded one
    (torch, CuPy), so both are accepted; the other thread's limit holds again afterwards."""
    with threadpool_limits(limits=2, user_api="blas"):  # this thread now controls the pool
        if blas_threads() != 2:
            pytest.skip("this BLAS does not take a thread count")
        got = []

        def other():
            with blas_thread_split() as k:
                got.append((k, blas_threads()))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert blas_threads() == 2
    assert got in ([(1, 2)], [(2, 1)]), got


def test_columns_in_parallel_give_the_sequential_result():
    rng = np.random.default_rng(3)
    layers = [np.maximum(rng.standard_normal((90, p)).astype(np.float32) + 1, 0) for p in (5, 40, 300, 7, 64)]
    with threadpool_limits(limits=1, user_api="blas"):
        seq = batch_hsic(layers)
    with threadpool_limits(limits=2, user_api="blas"):
        if blas_threads() != 2:
            pytest.skip("this BLAS does not take a thread count")
        par = batch_hsic(layers)
        # an error names the first bad layer, as in the sequential loop
        bad = [x.copy() for x in layers]
        bad[3][0, 0] = np.nan
        bad[1][2, 0] = np.inf
        with pytest.raises(ValueError, match="layer 1 contains NaN"):
            MinibatchCKA(5).update(bad)
    np.testing.assert_allclose(par, seq, rtol=1e-13, atol=0)


def test_batches_in_concurrent_threads_share_the_buffer_cache_safely():
    """batch_hsic keeps one triangle buffer between batches (repsim.kernels._gram.BufferCache) and
    hands it to one caller at a time: batches run at once from several threads — held inside
    their column phase together by a barrier — give their serial results, before and after the
    cache is released (float64 layers, so that the Grams do not depend on how BLAS splits them)."""
    from repsim.kernels._gram import A_CACHE
    from repsim.kernels.hsic import release_buffers

    rng = np.random.default_rng(8)
    jobs = [[np.maximum(rng.standard_normal((60, p)) + 1, 0) for p in (6, 30, 80)] for _ in range(3)]
    want = [batch_hsic(layers) for layers in jobs]
    assert A_CACHE._buf is not None  # the last batch's buffer is kept ...
    release_buffers()
    assert A_CACHE._buf is None  # ... until released
    together = threading.Barrier(len(jobs))

    class Held(list):
        """The layers, read lazily; reading the last one waits until every job has got there."""

        def __getitem__(self, i):
            if i == len(self) - 1:
                together.wait(timeout=60)
            return list.__getitem__(self, i)

    got: dict[int, np.ndarray] = {}

    def run(i):
        got[i] = batch_hsic(Held(jobs[i]))

    for _ in range(2):  # the second round starts with a cached buffer
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, ref in enumerate(want):
            np.testing.assert_allclose(got[i], ref, rtol=1e-12, atol=0)


def test_split_also_limits_a_blas_loaded_after_its_first_use():
    """SciPy ships its own OpenBLAS beside NumPy's: a split entered after ``import scipy.linalg``
    must limit that one too, though the first split of the process saw only NumPy's."""
    import subprocess
    import sys

    code = """
import numpy as np
from threadpoolctl import ThreadpoolController, threadpool_limits
from repsim.blas import blas_thread_split
with blas_thread_split():
    pass
import scipy.linalg  # loads SciPy's BLAS
with threadpool_limits(limits=2, user_api="blas"):
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    if len(libs) < 2 or min(lib.num_threads for lib in libs) < 2:
        print("skip"); raise SystemExit
    with blas_thread_split() as k:
        inside = [lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers]
print(k, max(inside))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "skip":
        pytest.skip("one BLAS library here, or it takes no thread count")
    assert out.stdout.split() == ["2", "1"]


def test_row_products_split_over_threads_equal_one_product():
    """A Aᵀ as k column slabs on k threads with single-threaded BLAS (kernels._gram.row_products)
    equals the single product (to float64 rounding), for an A long enough to be split."""
    from repsim.kernels._gram import row_products

    rng = np.random.default_rng(5)
    A = rng.standard_normal((7, 50_003))
    want = A @ A.T
    with threadpool_limits(limits=2, user_api="blas"):
        if blas_threads() != 2:
            pytest.skip("this BLAS does not take a thread count")
        got = row_products(A)
        assert blas_threads() == 2  # the budget is handed back
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    with threadpool_limits(limits=1, user_api="blas"):
        np.testing.assert_allclose(row_products(A), want, rtol=1e-12, atol=1e-9)


def test_the_suite_pins_blas_threads_before_numpy_loads():
    """tests/threads_pin.py (``-p threads_pin``) exports one thread count before any plugin imports
    NumPy: inside a test, every BLAS library runs that many threads (1 unless OMP_NUM_THREADS or
    OPENBLAS_NUM_THREADS said otherwise), as do the subprocesses that inherit the environment."""
    import os
    import subprocess
    import sys

    want = int(os.environ["OPENBLAS_NUM_THREADS"])  # (not importing threads_pin: that would pin it now)
    assert os.environ["OMP_NUM_THREADS"] and os.environ["MKL_NUM_THREADS"]
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    assert libs, "no BLAS library under threadpoolctl's control"
    assert [lib.num_threads for lib in libs] == [want] * len(libs)
    code = ("import numpy; from threadpoolctl import ThreadpoolController as C; "
            "print(max(l.num_threads for l in C().select(user_api='blas').lib_controllers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == want
