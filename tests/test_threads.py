"""Threads and processes: the C core's own threads (attnx's pool, or the team
of torch's OpenMP runtime once attnx.torch is imported), many Python threads
at once, and a child made by fork() after the parent used attnx."""

import multiprocessing
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import attnx
from attnx import _attnx


def _inputs(B=2, H=4, Lq=130, Lk=300, D=40, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, Lq, D), dtype=np.float32),
            rng.standard_normal((B, H, Lk, D), dtype=np.float32),
            rng.standard_normal((B, H, Lk, D), dtype=np.float32))


@pytest.fixture
def restore_threads():
    yield
    attnx.set_num_threads(0)


def _set_runner(team):
    """attnx's calls on torch's OpenMP team (team=True) or on attnx's pool, and
    attnx.torch's thread policy to match when it is imported. Returns the
    team's library, or None."""
    from attnx import _attnx
    name = _attnx.use_openmp(team)
    at = sys.modules.get("attnx.torch")
    if at is not None:
        at.OPENMP = name
    return name


@pytest.fixture(params=["pool", "torch_team"])
def runner(request):
    """Each test twice: on attnx's own pool, and on torch's OpenMP team (what
    importing attnx.torch chooses); the process's choice comes back after."""
    at = sys.modules.get("attnx.torch")
    before = None if at is None else at.OPENMP
    from attnx import _attnx
    if request.param == "torch_team":
        pytest.importorskip("torch")
        import attnx.torch  # noqa: F401  (loads torch's libgomp)
        if _set_runner(True) is None:
            pytest.skip("torch loads no OpenMP runtime here")
    else:
        _set_runner(False)
    # this thread's NumPy calls on the team too, as attnx.torch's are
    was = _attnx.on_team(request.param == "torch_team")
    yield request.param
    _attnx.on_team(was)
    _set_runner(before is not None)


def _torch_runner(team):
    """attnx.torch imported, its calls on torch's team or on attnx's pool (and
    its policy for that case); the process's choice comes back after."""
    pytest.importorskip("torch")
    import attnx.torch as at
    before = at.OPENMP
    if _set_runner(team) is None and team:
        _set_runner(before is not None)
        pytest.skip("torch loads no OpenMP runtime here")
    yield
    _set_runner(before is not None)


@pytest.fixture
def on_pool():
    yield from _torch_runner(False)


@pytest.fixture
def on_team():
    yield from _torch_runner(True)


def test_set_and_get_num_threads(restore_threads):
    default = attnx.get_num_threads()
    assert default >= 1
    attnx.set_num_threads(3)
    assert attnx.get_num_threads() == 3
    attnx.set_num_threads(0)
    assert attnx.get_num_threads() == default


def test_num_threads_from_environment():
    code = "import attnx; print(attnx.get_num_threads())"
    for env, want in ({"ATTNX_NUM_THREADS": "3"}, "3"), ({"OMP_NUM_THREADS": "5"}, "5"), \
                     ({"ATTNX_NUM_THREADS": "2", "OMP_NUM_THREADS": "7"}, "2"):
        e = {k: v for k, v in os.environ.items() if k not in ("ATTNX_NUM_THREADS", "OMP_NUM_THREADS")}
        e.update(env)
        res = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                             check=True)
        assert res.stdout.strip() == want


@pytest.mark.parametrize("shape", [(2, 4, 130, 300, 40), (1, 1, 1, 5000, 64), (1, 2, 3, 2000, 17)])
def test_same_result_for_any_thread_count(shape, restore_threads, runner):
    """Each query block is computed by one thread in a fixed order, so the
    thread count cannot change a bit; decoding shapes split the keys across
    threads (split-K), which reorders sums: close, not identical."""
    B, H, Lq, Lk, D = shape
    q, k, v = _inputs(B, H, Lq, Lk, D)
    attnx.set_num_threads(1)
    one = attnx.scaled_dot_product_attention(q, k, v, is_causal="lower_right")
    ref = attnx.reference(q, k, v, is_causal="lower_right")
    for n in (2, 3, 8):
        attnx.set_num_threads(n)
        many = attnx.scaled_dot_product_attention(q, k, v, is_causal="lower_right")
        if Lq >= 64:
            np.testing.assert_array_equal(many, one)
        np.testing.assert_allclose(many, ref, atol=1e-5, rtol=5e-6)


def test_many_python_threads_at_once(restore_threads, runner):
    """Python threads started together by a Barrier, the GIL released in C:
    every result equals the serial one, also while the thread count changes."""
    cases = [_inputs(seed=s) for s in range(6)]
    serial = [attnx.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in cases]
    n = 12
    barrier = threading.Barrier(n)
    results, errors = {}, []

    def work(t):
        try:
            barrier.wait()
            for rep in range(5):
                idx = (t + rep) % len(cases)
                q, k, v = cases[idx]
                if t == 0:
                    attnx.set_num_threads(1 + rep % 3)
                out = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
                results[(t, rep)] = (idx, out)
        except BaseException as exc:   # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    assert len(results) == n * 5
    for idx, out in results.values():
        np.testing.assert_array_equal(out, serial[idx])


def test_gil_released_while_computing():
    """While one thread is inside a long attention call, another Python
    thread keeps running (it would be blocked if the GIL were held)."""
    q, k, v = _inputs(1, 8, 1024, 1024, 64)
    ticks = []
    done = threading.Event()

    def counter():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.0005)

    th = threading.Thread(target=counter)
    th.start()
    try:
        before = len(ticks)
        for _ in range(3):
            attnx.scaled_dot_product_attention(q, k, v)
        during = len(ticks) - before
    finally:
        done.set()
        th.join()
    assert during > 5


def _child(conn, q, k, v):
    conn.send(attnx.scaled_dot_product_attention(q, k, v, is_causal=True))
    conn.close()


@pytest.mark.skipif(sys.platform == "win32" or "fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork() here")
def test_child_after_fork(restore_threads, runner):
    """A child made by fork() after the parent ran multi-threaded calls
    computes normally: attnx's pool starts afresh there, and a child of a
    parent on torch's OpenMP team goes back to the pool (libgomp's team did
    not come along, and the child would wait for it)."""
    q, k, v = _inputs(1, 8, 256, 256, 64)
    attnx.set_num_threads(2)
    parent = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    ctx = multiprocessing.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_child, args=(b, q, k, v))
    p.start()
    assert a.poll(60), "the child did not answer within 60 s"
    child = a.recv()
    p.join(10)
    assert p.exitcode == 0
    np.testing.assert_array_equal(child, parent)


def _decode_inputs(Lk=4096):
    """One query against many keys: split across threads (split-K). The bits
    do not depend on the thread count (issue 56): ``_attnx.last_threads()``
    says which count a call took."""
    return _inputs(B=1, H=2, Lq=1, Lk=Lk, D=64, seed=3)


def test_a_context_sets_the_threads_of_its_calls(restore_threads):
    """attnx._functional.CALL_THREADS: the calls made in the context use that many
    threads, whatever set_num_threads says; 0 gives the process's count back."""
    from attnx._functional import CALL_THREADS
    q, k, v = _decode_inputs()
    attnx.set_num_threads(1)
    one = attnx.scaled_dot_product_attention(q, k, v)
    assert _attnx.last_threads() == 1
    attnx.set_num_threads(2)
    two = attnx.scaled_dot_product_attention(q, k, v)
    assert _attnx.last_threads() == 2
    np.testing.assert_array_equal(one, two)          # the same bits at every count
    token = CALL_THREADS.set(1)
    try:
        np.testing.assert_array_equal(attnx.scaled_dot_product_attention(q, k, v), one)
        assert _attnx.last_threads() == 1
        np.testing.assert_array_equal(attnx.scaled_dot_product_attention(q, k, v, is_causal=False,
                                                                         return_lse=True)[0], one)
        assert _attnx.last_threads() == 1
    finally:
        CALL_THREADS.reset(token)
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(q, k, v), two)
    assert _attnx.last_threads() == 2


def test_torch_runs_small_calls_on_one_thread(restore_threads, on_pool):
    """On attnx's pool, inside a torch program on several threads, attnx.torch computes a call of
    fewer than SMALL_FLOPS on the calling thread (torch's workers are still
    spinning), with and without autograd, and decoding that reads less than
    SMALL_DECODE_BYTES; a larger call keeps attnx's threads."""
    torch = pytest.importorskip("torch")
    import attnx.torch as at
    q, k, v = _decode_inputs()
    assert 4.0 * q.size * k.shape[2] < at.SMALL_FLOPS
    attnx.set_num_threads(2)
    one = attnx.scaled_dot_product_attention(q, k, v)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        np.testing.assert_array_equal(at.scaled_dot_product_attention(tq, tk, tv).numpy(), one)
        assert _attnx.last_threads() == 1
        tq.requires_grad_(True)
        np.testing.assert_array_equal(at.scaled_dot_product_attention(tq, tk, tv).detach().numpy(), one)
        assert _attnx.last_threads() == 1
        big = _decode_inputs(Lk=4 * 8192)             # 4·2·64·32768 = 16.8 MFLOP
        assert 4.0 * big[0].size * big[1].shape[2] > at.SMALL_FLOPS
        tb = [torch.from_numpy(x) for x in big]
        np.testing.assert_array_equal(at.scaled_dot_product_attention(*tb).numpy(),
                                      attnx.scaled_dot_product_attention(*big))
        assert _attnx.last_threads() == 2
        # decoding above SMALL_FLOPS that reads less than SMALL_DECODE_BYTES (GQA, 4 query
        # heads a key/value head): memory-bound, one thread too
        rng = np.random.default_rng(4)
        gq = rng.standard_normal((1, 8, 1, 64), dtype=np.float32)
        gk, gv = (rng.standard_normal((1, 2, 6000, 64), dtype=np.float32) for _ in range(2))
        assert 4.0 * gq.size * 6000 > at.SMALL_FLOPS and gk.nbytes + gv.nbytes < at.SMALL_DECODE_BYTES
        g_two = attnx.scaled_dot_product_attention(gq, gk, gv, enable_gqa=True)
        assert _attnx.last_threads() == 2
        got = at.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (gq, gk, gv)), enable_gqa=True)
        np.testing.assert_array_equal(got.numpy(), g_two)
        assert _attnx.last_threads() == 1
        torch.set_num_threads(1)                      # torch on one thread: attnx's own count
        np.testing.assert_array_equal(at.scaled_dot_product_attention(tq.detach(), tk, tv).numpy(), one)
        assert _attnx.last_threads() == 2
    finally:
        torch.set_num_threads(saved)


def _small_backward_inputs():
    """A backward of 5.2 MFLOP (10·q.size·Lk): above the core's own one-thread
    limit (5e6), below attnx.torch's SMALL_FLOPS; one head, so two threads
    split its keys and sum dQ partials, which shows in the last bits of dQ."""
    return _inputs(B=1, H=1, Lq=16, Lk=1024, D=32, seed=5)


def _grads(q, k, v):
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v)
    return vjp(out + 0.3)


def test_a_context_sets_the_threads_of_a_backward(restore_threads):
    from attnx._functional import CALL_THREADS
    q, k, v = _small_backward_inputs()
    attnx.set_num_threads(1)
    one = _grads(q, k, v)
    attnx.set_num_threads(2)
    two = _grads(q, k, v)
    assert not np.array_equal(one.query, two.query), "the test needs bits that depend on threads"
    token = CALL_THREADS.set(1)
    try:
        got = _grads(q, k, v)
    finally:
        CALL_THREADS.reset(token)
    for a, b in zip(got[:3], one[:3]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_grads(q, k, v).query, two.query)


def test_torch_runs_small_backward_calls_on_one_thread(restore_threads, on_pool):
    """On attnx's pool, attnx.torch's backward, as its forward: a small call on
    the calling thread while torch runs on several; torch on one thread:
    attnx's own count."""
    torch = pytest.importorskip("torch")
    import attnx.torch as at
    q, k, v = _small_backward_inputs()
    assert 10.0 * q.size * k.shape[2] < at.SMALL_FLOPS
    attnx.set_num_threads(1)
    one = _grads(q, k, v).query
    attnx.set_num_threads(2)
    two = _grads(q, k, v).query
    assert not np.array_equal(one, two)
    saved = torch.get_num_threads()

    def torch_dq():
        tq = torch.from_numpy(q).requires_grad_(True)
        out = at.scaled_dot_product_attention(tq, torch.from_numpy(k), torch.from_numpy(v))
        out.backward(out.detach() + 0.3)
        return tq.grad.numpy()

    try:
        torch.set_num_threads(2)
        np.testing.assert_array_equal(torch_dq(), one)
        torch.set_num_threads(1)
        np.testing.assert_array_equal(torch_dq(), two)
    finally:
        torch.set_num_threads(saved)


def test_torch_team_takes_every_call(restore_threads, on_team):
    """On torch's OpenMP team (attnx.torch's default where torch loads one),
    the calls the pool would keep on one thread take the process's count:
    the team's workers are the ones torch left spinning."""
    import torch
    import attnx.torch as at
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        q, k, v = _decode_inputs()
        attnx.set_num_threads(2)
        two = attnx.scaled_dot_product_attention(q, k, v)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        np.testing.assert_array_equal(at.scaled_dot_product_attention(tq, tk, tv).numpy(), two)
        assert _attnx.last_threads() == 2
        tq.requires_grad_(True)
        np.testing.assert_array_equal(at.scaled_dot_product_attention(tq, tk, tv).detach().numpy(), two)
        assert _attnx.last_threads() == 2
        bq, bk, bv = _small_backward_inputs()
        attnx.set_num_threads(1)
        g_one = _grads(bq, bk, bv).query
        attnx.set_num_threads(2)
        g_two = _grads(bq, bk, bv).query
        assert not np.array_equal(g_one, g_two)
        tq = torch.from_numpy(bq).requires_grad_(True)
        out = at.scaled_dot_product_attention(tq, torch.from_numpy(bk), torch.from_numpy(bv))
        out.backward(out.detach() + 0.3)
        np.testing.assert_array_equal(tq.grad.numpy(), g_two)
    finally:
        torch.set_num_threads(saved)


_COUNT_THREADS = """
import os, sys, numpy as np, torch, attnx
import attnx.torch as at
from attnx import _attnx
torch.set_num_threads(2)
attnx.set_num_threads(2)
if sys.argv[1] == "pool":
    _attnx.use_openmp(False)
x = torch.randn(256, 256)
for _ in range(3):
    x @ x                                     # torch's team of 2 exists
before = len(os.listdir("/proc/self/task"))
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, 512, 64), dtype=np.float32) for _ in range(3))
ref = attnx.reference(q, k, v)
tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
for _ in range(3):
    out = at.scaled_dot_product_attention(tq, tk, tv).numpy()
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
print(at.OPENMP is not None, len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_torch_team_runs_the_threads():
    """With attnx.torch imported, a 2-thread call through it starts no thread
    of attnx's own: its second thread is one of torch's OpenMP team; on the
    pool, a worker is started."""
    pytest.importorskip("torch")
    got = {}
    for mode in ("team", "pool"):
        res = subprocess.run([sys.executable, "-c", _COUNT_THREADS, mode], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        got[mode] = res.stdout.split()
    if got["team"][0] != "True":
        pytest.skip("torch loads no OpenMP runtime here")
    assert got["team"][1] == "0" and got["pool"][1] == "1", got


_PICK_RUNTIME = """
import ctypes, sys, numpy as np, torch, attnx
ctypes.CDLL(sys.argv[1])  # a second OpenMP runtime, loaded after torch's
from attnx import _attnx
name = _attnx.use_openmp(True, *sys.argv[2:])
_attnx.on_team(True)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, 256, 64), dtype=np.float32) for _ in range(3))
attnx.set_num_threads(2)
np.testing.assert_allclose(attnx.scaled_dot_product_attention(q, k, v), attnx.reference(q, k, v),
                           atol=1e-5, rtol=1e-5)
print(name)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dl_iterate_phdr")
def test_openmp_runtime_under_a_directory_first(tmp_path):
    """Two OpenMP runtimes in the process, torch's and a copy of it loaded
    after it: use_openmp(True, dir) takes the one under dir, the later one
    too; without dir, or with a dir that holds none, the first loaded. Each
    choice runs a call right. (Loaded before torch, the copy would be torch's
    libgomp.so.1: the loader matches the soname.)"""
    torch = pytest.importorskip("torch")
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    found = [os.path.join(r, f) for r, _, fs in os.walk(torch_dir) for f in fs
             if f.startswith("libgomp") and ".so" in f]
    if not found:
        pytest.skip("torch ships no libgomp here")
    copy = tmp_path / "libgomp-copy.so.1"
    shutil.copyfile(found[0], copy)

    def pick(*under):
        res = subprocess.run([sys.executable, "-c", _PICK_RUNTIME, str(copy), *under],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    assert pick(str(tmp_path) + os.sep) == str(copy)
    assert pick(torch_dir).startswith(torch_dir)
    assert pick().startswith(torch_dir)
    assert pick(str(tmp_path / "none") + os.sep).startswith(torch_dir)


# Issue 33's fork hangs. Each script forks once; the parent waits for the
# child at most 60 s, then kills it and prints "hung" (a hang fails the test,
# it does not stop the run), else the child's exit status.
_FORK_WAIT = """
def wait(pid):
    import time, signal
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("exit", os.waitstatus_to_exitcode(status))
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("hung")
"""

_CHILD_IMPORTS_ATTNX_TORCH = _FORK_WAIT + """
import os, numpy as np, torch, attnx
torch.set_num_threads(2)
attnx.set_num_threads(2)
q = np.random.default_rng(0).standard_normal((1, 4, 1024, 64), dtype=np.float32)
x = torch.randn(1024, 1024); x @ x            # torch's OpenMP team runs here
pid = os.fork()
if pid == 0:
    import attnx.torch as at                  # first imported in the child
    out = attnx.scaled_dot_product_attention(q, q, q)
    np.testing.assert_allclose(out, attnx.reference(q, q, q), atol=1e-5, rtol=1e-5)
    tq = torch.from_numpy(q)
    out = at.scaled_dot_product_attention(tq, tq, tq).numpy()
    np.testing.assert_allclose(out, attnx.reference(q, q, q), atol=1e-5, rtol=1e-5)
    os._exit(0)
wait(pid)
"""

_TORCH_CHILD_AFTER_ATTNX = _FORK_WAIT + """
import os, sys, numpy as np, torch, attnx
torch.set_num_threads(2)
attnx.set_num_threads(2)
if sys.argv[1] == "import":
    import attnx.torch                        # finds torch's libgomp
q = np.random.default_rng(0).standard_normal((1, 4, 1024, 64), dtype=np.float32)
for _ in range(3):
    attnx.scaled_dot_product_attention(q, q, q)   # NumPy calls, 2 threads
pid = os.fork()
if pid == 0:
    torch.ones(1 << 22).add_(1).sum()         # torch's first parallel op, in the child
    os._exit(0)
wait(pid)
"""


def _fork_script(script, *args):
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()[-2:] if "exit" in res.stdout else res.stdout.split()[-1:]


needs_fork_and_torch = pytest.mark.skipif(
    sys.platform == "win32" or "fork" not in multiprocessing.get_all_start_methods(),
    reason="no fork() here")


@needs_fork_and_torch
def test_fork_child_after_torch_op_imports_attnx_torch():
    """Issue 33, defect 1: after the parent ran a torch op (libgomp's team
    started), a fork child that imports attnx.torch for the first time runs
    its multi-threaded calls, NumPy's and torch's, on attnx's own pool: the
    parent's team did not come along, and a child that joins it waits
    forever (was: both calls hung)."""
    pytest.importorskip("torch")
    assert _fork_script(_CHILD_IMPORTS_ATTNX_TORCH) == ["exit", "0"]


_LAZY_IMPORT_IN_WORKER = _FORK_WAIT + """
import os, numpy as np, torch
torch.set_num_threads(2)
x = torch.randn(1024, 1024); x @ x            # torch's team runs; attnx not yet imported
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)                  # as a DataLoader worker does
    import attnx, attnx.torch as at           # imported lazily, in the child
    q = np.random.default_rng(0).standard_normal((1, 4, 1024, 64), dtype=np.float32)
    tq = torch.from_numpy(q)
    out = at.scaled_dot_product_attention(tq, tq, tq).numpy()
    np.testing.assert_allclose(out, attnx.reference(q, q, q), atol=1e-5, rtol=1e-5)
    os._exit(0)
wait(pid)
"""


@needs_fork_and_torch
def test_worker_importing_attnx_lazily_after_fork():
    """A DataLoader-like fork worker (torch.set_num_threads(1)) of a parent
    that ran torch ops but never imported attnx: attnx.torch's calls there
    take torch's thread count, so they never join the parent's dead libgomp
    team (the child cannot know it is one: attnx's fork handlers were not
    in the parent)."""
    pytest.importorskip("torch")
    assert _fork_script(_LAZY_IMPORT_IN_WORKER) == ["exit", "0"]


def test_attnx_torch_knows_a_fork_child_is_on_the_pool():
    """attnx.torch.OPENMP is None in a fork child (the core runs it on the
    pool there), so its small-call rule applies again."""
    pytest.importorskip("torch")
    script = ("import os, attnx.torch as at\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    os._exit(0 if at.OPENMP is None else 3)\n"
              "print(at.OPENMP is not None, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    team, child = res.stdout.split()
    if team != "True":
        pytest.skip("torch loads no OpenMP runtime here")
    assert child == "0"


@needs_fork_and_torch
@pytest.mark.parametrize("attnx_torch", ["import", "no-import"])
def test_torch_fork_child_after_attnx_numpy_calls(attnx_torch):
    """Issue 33, defect 2: attnx's NumPy calls never start libgomp's threads,
    with attnx.torch imported or not, so a fork child's first parallel torch
    op runs as it does in a process without attnx (was: with attnx.torch
    imported, the NumPy calls ran on torch's team, and the child hung)."""
    torch = pytest.importorskip("torch")
    if torch.get_num_threads() < 2 and (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: torch runs no parallel region")
    assert _fork_script(_TORCH_CHILD_AFTER_ATTNX, attnx_torch) == ["exit", "0"]
